"""Dense families (llama, qwen2, qwen3, mistral, glm4) patched with a lightning indexer.

The oracle (docs/design.md section 9): with topk >= sequence length every selection keeps all visible keys,
so the patched model must match the unpatched one. With a small topk, selections matter, and the
tests check what must still hold exactly: decode/chunked prefill over the cache equal a full forward,
packed and padded rows equal the same sequences run alone, a save/load round trip reproduces outputs.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from transformers import DynamicCache, LlamaModel

from hyscale_hf import is_patched, patch_model, unpatch_model
from hyscale_hf.state import patch_state

from ._dense_tiny import FAMILIES, INDEXER, PAD, VARIANTS, tiny_model, tokens

COVERED_MODEL_TYPES = FAMILIES
ALL = list(VARIANTS)
CACHE_KW = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"
ATOL = 2e-5


def _close(a, b, atol=ATOL):
    assert a.shape == b.shape
    assert torch.allclose(a, b, atol=atol, rtol=1e-4), f"max abs diff {(a - b).abs().max().item():.3g}"


def _patched(variant, topk, **kw):
    model = tiny_model(variant).eval()
    patch_model(model, topk=topk, **INDEXER, **kw)
    return model


def _indexer_params(model):
    return {n: p for n, p in model.named_parameters() if ".indexer." in n}


def _left_pad_positions(mask):
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)


# ----------------------------------------------------------------------------- equivalence with topk >= T


@pytest.mark.parametrize("variant", ALL)
@pytest.mark.parametrize("warmup", [False, True], ids=["sparse", "dense_warmup"])
def test_train_step_matches_unpatched_when_topk_covers(variant, warmup):
    ref = tiny_model(variant).train()
    pat = copy.deepcopy(ref)
    patch_model(pat, topk=64, dense_warmup=warmup, **INDEXER)
    ids = tokens(2, 12)
    # Right padding in row 1, as a training collator makes it.
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    # Default use_cache (True), as the Trainer calls it: the forward fills a cache it then drops.
    out_r = ref(ids, attention_mask=mask, labels=labels)
    out_p = pat(ids, attention_mask=mask, labels=labels)
    out_r.loss.backward()
    out_p.loss.backward()
    _close(out_p.logits, out_r.logits)
    _close(out_p.loss, out_r.loss)
    pat_params = dict(pat.named_parameters())
    for name, p in ref.named_parameters():
        _close(pat_params[name].grad, p.grad)
    # The indexer learns from its KL loss (recorded for logging), and only from it.
    grads = [p.grad for p in _indexer_params(pat).values()]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)
    assert patch_state(pat).pop_indexer_loss() is not None


@pytest.mark.parametrize("variant", ["llama", "glm4"])
def test_lm_loss_never_reaches_the_indexer(variant):
    pat = _patched(variant, topk=4, indexer_loss_coef=0.0).train()
    ids = tokens(2, 10)
    pat(ids, labels=ids, use_cache=False).loss.backward()
    assert all(p.grad is None for p in _indexer_params(pat).values())
    assert pat.lm_head.weight.grad is not None


@pytest.mark.parametrize("variant", ALL)
def test_generate_matches_unpatched_when_topk_covers(variant):
    ref = tiny_model(variant).eval()
    pat = copy.deepcopy(ref)
    patch_model(pat, topk=64, **INDEXER)
    ids = tokens(2, 8)
    mask = torch.ones_like(ids)
    ids[0, :3], mask[0, :3] = PAD, 0  # left padding, as for batched generation
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=PAD)
    assert torch.equal(pat.generate(ids, **kw), ref.generate(ids, **kw))


def test_beam_search_matches_unpatched_when_topk_covers():
    ref = tiny_model("llama").eval()
    pat = copy.deepcopy(ref)
    patch_model(pat, topk=64, **INDEXER)
    ids = tokens(2, 6)
    kw = dict(max_new_tokens=5, num_beams=3, do_sample=False, pad_token_id=PAD, attention_mask=torch.ones_like(ids))
    assert torch.equal(pat.generate(ids, **kw), ref.generate(ids, **kw))


@pytest.mark.parametrize("variant", ALL)
def test_packed_matches_unpatched_when_topk_covers(variant):
    ref = tiny_model(variant).eval()
    pat = copy.deepcopy(ref)
    patch_model(pat, topk=64, **INDEXER)
    ids = torch.cat([tokens(1, 7, seed=1), tokens(1, 6, seed=2)], dim=1)
    pos = torch.cat([torch.arange(7), torch.arange(6)])[None]
    _close(pat(ids, position_ids=pos, use_cache=False).logits, ref(ids, position_ids=pos, use_cache=False).logits)


# ----------------------------------------------------------------------------- patch / unpatch / save / load


@pytest.mark.parametrize("variant", FAMILIES)
def test_unpatch_restores_bit_identical_outputs(variant):
    model = tiny_model(variant).eval()
    ids = tokens(2, 10)
    names_before = set(model.state_dict())
    with torch.no_grad():
        before = model(ids).logits
    patch_model(model, topk=3, **INDEXER)
    assert model.config._attn_implementation == "sdpa"  # the user's choice; ATTN_IMPLEMENTATION only during calls
    with torch.no_grad():
        during = model(ids).logits
    assert not torch.allclose(during, before)  # topk 3 < 10 keys: the selection changes the output
    unpatch_model(model)
    with torch.no_grad():
        after = model(ids).logits
    assert torch.equal(after, before)
    assert set(model.state_dict()) == names_before
    assert model.config._attn_implementation == "sdpa"
    assert "hyscale_indexer" not in model.config.__dict__
    assert not any("forward" in vars(m) for m in model.modules())
    patch_model(model, topk=3, **INDEXER)  # patchable again
    assert is_patched(model)


@pytest.mark.parametrize("variant", FAMILIES)
def test_save_load_round_trip(variant, tmp_path):
    model = _patched(variant, topk=3)
    with torch.no_grad():  # stand-in for trained indexers: not what a fresh patch would build
        for p in _indexer_params(model).values():
            p.add_(0.3 * torch.randn_like(p))
    ids = tokens(2, 10)
    with torch.no_grad():
        expected = model(ids).logits
    model.save_pretrained(tmp_path)

    loaded = type(model).from_pretrained(tmp_path).eval()
    assert not is_patched(loaded)
    patch_model(loaded)  # sizes, topk and relu come from the saved record
    cfg = patch_state(loaded).config
    assert (cfg.topk, cfg.index_n_heads, cfg.index_head_dim, cfg.relu) == (3, 2, 8, True)
    saved = _indexer_params(model)
    restored = _indexer_params(loaded)
    assert saved.keys() == restored.keys()
    for name, p in saved.items():
        assert torch.equal(restored[name], p), name
    with torch.no_grad():
        _close(loaded(ids).logits, expected, atol=1e-6)


def test_saved_record_without_indexer_weights_is_an_error(tmp_path):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path)  # unpatched: no indexer tensors in the checkpoint
    loaded = type(model).from_pretrained(tmp_path)
    loaded.config.hyscale_indexer = {"kind": "dense", "index_n_heads": 2, "index_head_dim": 8, "topk": 3}
    with pytest.raises(ValueError, match="cannot restore the saved hyscale_hf indexers"):
        patch_model(loaded)
    assert not is_patched(loaded) and not any(".indexer." in n for n in loaded.state_dict())
    with pytest.raises(ValueError, match="differs from the saved indexer"):
        patch_model(loaded, index_n_heads=4)


# ----------------------------------------------------------------------------- small topk: exactness that must hold


@pytest.mark.parametrize("variant", ALL)
def test_generate_cache_matches_full_forward(variant):
    model = _patched(variant, topk=3)
    ids = tokens(2, 7)
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = PAD, 0
    new = 6
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         pad_token_id=PAD, return_dict_in_generate=True, output_logits=True)
    full_mask = torch.cat([mask, torch.ones(2, new, dtype=mask.dtype)], dim=1)
    with torch.no_grad():
        full = model(out.sequences, attention_mask=full_mask, position_ids=_left_pad_positions(full_mask),
                     use_cache=False).logits
    for step, logits in enumerate(out.logits):
        _close(logits, full[:, ids.shape[1] - 1 + step])


@pytest.mark.parametrize("variant", ["llama", "mistral_sw", "qwen2_sw"])
def test_chunked_prefill_and_crop_match_full_forward(variant):
    model = _patched(variant, topk=3)
    ids = tokens(1, 12)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = DynamicCache(config=model.config)
        chunks = [model(ids[:, a:b], **{CACHE_KW: cache}, use_cache=True).logits for a, b in ((0, 5), (5, 6), (6, 12))]
        _close(torch.cat(chunks, dim=1), full)
        if not variant.endswith("_sw"):  # sliding layers cannot be cropped once past their window
            cache.crop(-4)
            again = model(ids[:, 8:], **{CACHE_KW: cache}, use_cache=True).logits
            _close(again, full[:, 8:])


@pytest.mark.parametrize("variant", ALL)
def test_packed_sequences_never_select_across_boundaries(variant):
    model = _patched(variant, topk=3)
    a, b = tokens(1, 7, seed=1), tokens(1, 6, seed=2)
    with torch.no_grad():
        la, lb = model(a).logits, model(b).logits
        packed = torch.cat([a, b], dim=1)
        pos = torch.cat([torch.arange(7), torch.arange(6)])[None]
        by_positions = model(packed, position_ids=pos).logits
        cu = torch.tensor([0, 7, 13], dtype=torch.int32)
        by_cu = model(packed, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7,
                      max_length_k=7).logits
        # Two packed rows (window_start per query instead of cu_seqlens).
        rows = torch.cat([packed, torch.cat([b, a], dim=1)])
        rows_pos = torch.cat([pos, torch.cat([torch.arange(6), torch.arange(7)])[None]])
        two_rows = model(rows, position_ids=rows_pos).logits
    for logits in (by_positions, by_cu, two_rows[:1]):
        _close(logits[:, :7], la)
        _close(logits[:, 7:], lb)
    _close(two_rows[1:, :6], lb)
    _close(two_rows[1:, 6:], la)


@pytest.mark.parametrize("variant", FAMILIES)
def test_left_and_right_padding_match_unpadded_rows(variant):
    model = _patched(variant, topk=3)
    a, b = tokens(1, 8, seed=1), tokens(1, 5, seed=2)
    pad = torch.full((1, 3), PAD)
    with torch.no_grad():
        la, lb = model(a).logits, model(b).logits
        right_mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
        right = model(torch.cat([a, torch.cat([b, pad], 1)]), attention_mask=right_mask).logits
        left_mask = right_mask.flip(1)
        left = model(torch.cat([a, torch.cat([pad, b], 1)]), attention_mask=left_mask,
                     position_ids=_left_pad_positions(left_mask)).logits
    _close(right[:1], la)
    _close(right[1:, :5], lb)
    _close(left[:1], la)
    _close(left[1:, 3:], lb)


@pytest.mark.parametrize("variant", FAMILIES)
def test_a_mask_with_holes_selects_as_the_sequence_without_them(variant):
    """Zeros anywhere in a row (generate() appends ones after a right-padded prompt): with topk < T the
    real tokens select exactly as the row's real tokens run alone (same positions)."""
    model = _patched(variant, topk=3)
    ids = tokens(2, 10, seed=4)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 0, 1, 1], [0, 1, 1, 1, 0, 1, 1, 1, 1, 0]])
    with torch.no_grad():
        holed = model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0)).logits
        for row in range(2):
            real = mask[row].bool()
            alone = model(ids[row : row + 1, real]).logits
            _close(holed[row : row + 1, real], alone)


@pytest.mark.parametrize("variant", ALL)
def test_a_random_mask_matches_unpatched_when_topk_covers(variant):
    """Every query with a visible key (padding queries too: they attend to the real keys before them)."""
    ref = tiny_model(variant).eval()
    pat = copy.deepcopy(ref)
    patch_model(pat, topk=64, **INDEXER)
    ids = tokens(3, 11, seed=5)
    mask = (torch.rand(3, 11, generator=torch.Generator().manual_seed(0)) > 0.35).long()
    mask[:, 4] = 1  # every query from 4 on has a visible key
    with torch.no_grad():
        _close(pat(ids, attention_mask=mask).logits[:, 4:], ref(ids, attention_mask=mask).logits[:, 4:])


def test_resolved_settings_are_written_back():
    model = tiny_model("llama")
    patch_model(model)  # dense defaults: the indexer is sized from the attention (floors: 2 heads x 16)
    cfg = patch_state(model).config
    assert (cfg.topk, cfg.index_n_heads, cfg.index_head_dim, cfg.relu) == (2048, 2, 16, True)
    indexer = model.model.layers[0].self_attn.indexer
    assert (indexer.n_heads, indexer.head_dim, indexer.rope_dim) == (2, 16, 8)  # rope capped by head_dim 8
    assert model.config.hyscale_indexer["rope_dim"] == 8


@pytest.mark.parametrize("heads, head_dim, expected", [
    (9, 64, (2, 64)),  # SmolLM2-135M: budget 144
    (32, 128, (8, 128)),  # Llama-3-8B: budget 1024
    (14, 64, (3, 64)),  # Qwen2-0.5B: budget 224
    (4, 8, (2, 16)),  # tiny: the floors (2 heads of 16) exceed the budget of 8
])
def test_default_indexer_costs_at_most_a_quarter_of_the_attention_per_pair(heads, head_dim, expected):
    from hyscale_hf.model_patches._dense_common import default_indexer_shape

    shape = default_indexer_shape(heads, head_dim)
    assert shape == expected
    if heads * head_dim >= 4 * 2 * 16:  # above the floors the rule holds
        assert shape[0] * shape[1] <= heads * head_dim / 4


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_matches_plain_backward(reentrant):
    # Selection replay (on by default) refuses reentrant checkpointing; without replay it runs.
    plain = _patched("qwen3", topk=3, selection_replay=not reentrant).train()
    ckpt = copy.deepcopy(plain)
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ids = tokens(2, 10)
    for model in (plain, ckpt):
        model(ids, labels=ids, use_cache=False).loss.backward()
    grads = dict(ckpt.named_parameters())
    for name, p in plain.named_parameters():
        _close(grads[name].grad, p.grad)
    if not reentrant:  # (reentrant checkpointing runs the forward without grad: no loss is logged there)
        # The recompute in backward does not log the indexer loss a second time.
        assert len(patch_state(ckpt).indexer_losses) == ckpt.config.num_hidden_layers


def test_bf16_forward_backward_runs():
    model = tiny_model("llama").to(torch.bfloat16).train()
    patch_model(model, topk=4, **INDEXER)
    assert model.model.layers[0].self_attn.indexer.wq.weight.dtype == torch.bfloat16
    ids = tokens(2, 10)
    loss = model(ids, labels=ids, use_cache=False).loss
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in _indexer_params(model).values())


def test_deepcopy_of_a_patched_model_is_an_independent_patched_model():
    model = _patched("mistral_sw", topk=3)
    twin = copy.deepcopy(model)  # e.g. a frozen reference model for RL fine-tuning
    ids = tokens(2, 9)
    with torch.no_grad():
        expected = model(ids).logits
        _close(twin(ids).logits, expected, atol=0)
        for p in _indexer_params(twin).values():  # the twin's own weights are the ones it uses
            p.zero_()
        assert not torch.allclose(twin(ids).logits, expected)
    unpatch_model(twin)
    assert is_patched(model) and not is_patched(twin)
    assert not any(".indexer." in n for n in twin.state_dict())
    with torch.no_grad():
        _close(model(ids).logits, expected, atol=0)


@pytest.mark.parametrize("variant", ALL)
def test_a_static_cache_generates_as_a_dynamic_one(variant):
    """Full-attention layers take a static cache (topk < T, left padding); a static sliding-window layer
    (a rolling buffer) is refused clearly."""
    model = _patched(variant, topk=3)
    ids = tokens(2, 6)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    with torch.no_grad():
        if variant.endswith("_sw"):
            with pytest.raises(TypeError, match="static caches of full-attention layers"):
                model.generate(ids, cache_implementation="static", **kwargs)
            return
        assert torch.equal(model.generate(ids, cache_implementation="static", **kwargs), model.generate(ids, **kwargs))


def test_peft_wrapped_model_patches_and_trains_the_indexer():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_model("qwen2"), peft.LoraConfig(target_modules=["q_proj", "v_proj"], r=4))
    patch_model(model, topk=3, **INDEXER)  # looks through the PEFT wrapper
    assert is_patched(model)
    ids = tokens(2, 8)
    model.train()
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    indexer = _indexer_params(model)
    assert indexer and all(p.requires_grad and p.grad is not None for p in indexer.values())
    unpatch_model(model)
    assert not _indexer_params(model)


def test_save_load_round_trip_sharded(tmp_path):
    model = _patched("glm4", topk=3)
    with torch.no_grad():
        for p in _indexer_params(model).values():
            p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    loaded = patch_model(type(model).from_pretrained(tmp_path))
    restored = _indexer_params(loaded)
    for name, p in _indexer_params(model).items():
        assert torch.equal(restored[name], p), name
