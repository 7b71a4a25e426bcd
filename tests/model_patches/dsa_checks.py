"""End-to-end checks shared by the DSA family tests (each ``test_<family>.py`` runs them).

The oracle is the unpatched Transformers model (eager attention, fp32): with topk >= T every key is
selected, so patched and unpatched must agree; with topk < T both select by the same score, so
they must agree whenever their selections agree (checked explicitly, so a tie can never hide).
"""

from __future__ import annotations

import copy
import inspect

import torch

import hyscale_hf
from hyscale_hf.model_patches import _dsa_step
from hyscale_hf.state import patch_state

from .tiny_models import VOCAB, build

ATOL = 2e-5
GRAD_RTOL = 2e-4


def patched_copy(ref: torch.nn.Module, **options) -> torch.nn.Module:
    model = copy.deepcopy(ref)
    hyscale_hf.patch_model(model, backend="torch", **options)
    return model


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=g)


def assert_close(a: torch.Tensor, b: torch.Tensor, atol: float = ATOL, what: str = "") -> None:
    err = (a - b).abs().max().item()
    assert err <= atol, f"{what}: max abs diff {err} > {atol}"


def padded_labels(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Labels that only score predictions made at real positions of real tokens (a padded query has
    no visible key in a patched model: its output differs from the unpatched one by design)."""
    predicted_from_real = torch.ones_like(mask, dtype=torch.bool)
    predicted_from_real[:, 1:] = mask[:, :-1].bool()
    return x.masked_fill(~(mask.bool() & predicted_from_real), -100)


def is_indexer_param(name: str) -> bool:
    return ".indexer." in name


def assert_grads_close(ref: torch.nn.Module, pat: torch.nn.Module) -> None:
    """Every non-indexer gradient of ``pat`` matches ``ref`` (relative to the tensor's max)."""
    ref_params = dict(ref.named_parameters())
    checked = 0
    for name, p in pat.named_parameters():
        if is_indexer_param(name):
            continue
        a, b = ref_params[name].grad, p.grad
        assert (a is None) == (b is None), f"{name}: gradient presence differs"
        if a is None:
            continue
        scale = a.abs().max().item() + 1e-8
        err = (a - b).abs().max().item()
        # A learned RoPE frequency (Mistral Large 4's LeRoPE alpha) sums position-weighted terms that
        # largely cancel, so fp32 rounding of the absorbed vs expanded attention shows up ~10x larger.
        rtol = 10 * GRAD_RTOL if name.endswith("rotary_emb.alpha") else GRAD_RTOL
        assert err <= rtol * scale + 1e-7, f"{name}: grad diff {err} vs scale {scale}"
        checked += 1
    assert checked > 10


def indexer_params(model: torch.nn.Module):
    return [(n, p) for n, p in model.named_parameters() if is_indexer_param(n)]


# ----------------------------------------------------------------------------- checks


def check_matches_unpatched_full_topk(model_type: str) -> None:
    """topk >= T: loss, logits and all non-indexer gradients equal the unpatched model's (training mode)."""
    ref, _ = build(model_type, index_topk=64)
    pat = patched_copy(ref)
    ref.train()
    pat.train()
    x = tokens(2, 20)
    out_ref, out_pat = ref(x, labels=x), pat(x, labels=x)
    assert_close(out_ref.logits, out_pat.logits, what="logits")
    assert_close(out_ref.loss, out_pat.loss, what="loss")
    out_ref.loss.backward()
    out_pat.loss.backward()
    assert_grads_close(ref, pat)
    # The indexer trains from its KL loss only: the unpatched model gives it nothing.
    for (name, p_ref), (_, p_pat) in zip(indexer_params(ref), indexer_params(pat)):
        assert p_ref.grad is None, name
        if name.endswith("weight") and ("wq_b" in name or "wk" in name or "weights_proj" in name):
            assert p_pat.grad is not None and p_pat.grad.abs().sum() > 0 and torch.isfinite(p_pat.grad).all(), name
    assert patch_state(pat).pop_indexer_loss() > 0


def _capture_ref_selections(model):
    """Forward hooks on the unpatched indexers: {layer_idx: int32 [B, S, topk]} per forward."""
    captured, handles = {}, []
    for module in model.modules():
        if type(module).__name__.endswith("Indexer"):
            handles.append(module.register_forward_hook(
                lambda m, args, kwargs, out: captured.__setitem__(m.layer_idx, out), with_kwargs=True))
    return captured, handles


def _capture_patched_selections(monkeypatch):
    captured = []
    original = _dsa_step.hytopk

    def recording(*args, **kwargs):
        out = original(*args, **kwargs)
        captured.append(out[0] if isinstance(out, tuple) else out)  # (indices, lse) when the KL wants the lse
        return out

    monkeypatch.setattr(_dsa_step, "hytopk", recording)
    return captured


def assert_same_selections(ref_sel: torch.Tensor, ours: torch.Tensor, window_start=None) -> None:
    """Per query, the unpatched top-k (restricted to visible keys) equals our selected set."""
    B, S, _ = ours.shape
    for b in range(B):
        lo = 0 if window_start is None else int(window_start[b])
        for i in range(lo, S):
            theirs = {int(s) for s in ref_sel[b, i] if lo <= int(s) <= i}
            mine = {int(s) for s in ours[b, i] if int(s) >= 0}
            assert theirs == mine, f"row {b} query {i}: unpatched selected {sorted(theirs)}, patched {sorted(mine)}"


def check_matches_unpatched_sparse(model_type: str, monkeypatch, topk: int = 5, length: int = 24) -> None:
    """topk < T: identical selections, then identical logits, loss and gradients (with left padding)."""
    ref, _ = build(model_type, index_topk=topk)
    pat = patched_copy(ref)
    ref.train()
    pat.train()
    x = tokens(2, length)
    mask = torch.ones_like(x)
    mask[1, :4] = 0
    ref_sel, handles = _capture_ref_selections(ref)
    ours = _capture_patched_selections(monkeypatch)
    labels = padded_labels(x, mask)
    out_ref, out_pat = ref(x, attention_mask=mask, labels=labels), pat(x, attention_mask=mask, labels=labels)
    for h in handles:
        h.remove()
    full_layers = sorted(ref_sel)
    assert len(full_layers) == len(ours) > 0
    for layer, sel in zip(full_layers, ours):
        assert sel.shape[-1] == topk
        assert_same_selections(ref_sel[layer], sel, window_start=torch.tensor([0, 4]))
    real = mask.bool()
    assert_close(out_ref.logits[real], out_pat.logits[real], what="logits")
    assert_close(out_ref.loss, out_pat.loss, what="loss")
    out_ref.loss.backward()
    out_pat.loss.backward()
    assert_grads_close(ref, pat)


def first_attention_and_layer(model: torch.nn.Module):
    """The first MLA attention module (it has ``kv_b_proj``) and the decoder layer holding it."""
    attn = next(m for m in model.modules() if hasattr(m, "kv_b_proj"))
    layer = next(m for m in model.modules() if getattr(m, "self_attn", None) is attn)
    return attn, layer


def check_unpatch_restores(model_type: str) -> None:
    """unpatch_model gives bit-identical outputs and removes every instance attribute it added."""
    model, _ = build(model_type, index_topk=4)
    attn, layer = first_attention_and_layer(model)
    attn_cls, layer_cls = type(attn), type(layer)
    class_forwards = (attn_cls.forward, layer_cls.forward)
    impl = attn.config._attn_implementation
    x = tokens(2, 12)
    with torch.no_grad():
        before = model(x).logits
        hyscale_hf.patch_model(model, backend="torch")
        assert hyscale_hf.is_patched(model)
        assert (attn_cls.forward, layer_cls.forward) == class_forwards  # only instances are patched
        assert "forward" in vars(attn) and attn.config._attn_implementation == impl  # ATTN_IMPLEMENTATION only in calls
        model(x)
        hyscale_hf.unpatch_model(model)
        after = model(x).logits
    assert not hyscale_hf.is_patched(model)
    assert torch.equal(before, after)
    assert attn.config._attn_implementation == impl
    for module in model.modules():
        assert "forward" not in vars(module) and "_hyscale_state" not in vars(module), type(module).__name__


def check_save_load(model_type: str, tmp_path) -> None:
    """A patched model saves a plain checkpoint; reloading and patching gives the same logits."""
    model, _ = build(model_type, index_topk=4)
    hyscale_hf.patch_model(model, backend="torch")
    x = tokens(1, 14)
    with torch.no_grad():
        expected = model(x).logits
    model.save_pretrained(tmp_path)
    config_text = (tmp_path / "config.json").read_text()
    assert _dsa_step.ATTN_IMPLEMENTATION not in config_text
    loaded = type(model).from_pretrained(tmp_path, attn_implementation="eager", dtype=torch.float32).eval()
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    hyscale_hf.patch_model(loaded, backend="torch")
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, expected)


def check_generate(model_type: str, topk: int = 4) -> None:
    """Greedy generate() with a KV cache and left padding gives the unpatched model's tokens; a second
    call (new cache) gives the same tokens again (no state leaks between calls)."""
    ref, _ = build(model_type, index_topk=topk)
    pat = patched_copy(ref)
    x = tokens(2, 10, seed=3)
    mask = torch.ones_like(x)
    mask[0, :3] = 0
    x[0, :3] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = ref.generate(x, **kwargs)
    first = pat.generate(x, **kwargs)
    second = pat.generate(x, **kwargs)
    assert torch.equal(first, expected), (first[:, 10:], expected[:, 10:])
    assert torch.equal(second, expected)


def check_chunked_prefill(model_type: str, topk: int = 4) -> None:
    """Prefill in two chunks and decode one token over the cache = one full forward (cached keys are
    read by both the attention and the indexer)."""
    from transformers import DynamicCache

    model, _ = build(model_type, index_topk=topk)
    hyscale_hf.patch_model(model, backend="torch")
    x = tokens(2, 17, seed=4)
    # Transformers 5.17 names the cache ``past_key_values``; later versions ``cache``.
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        full = model(x, use_cache=False).logits
        cache = DynamicCache(config=model.config)
        a = model(x[:, :9], use_cache=True, **{key: cache}).logits
        b = model(x[:, 9:16], use_cache=True, **{key: cache}).logits
        c = model(x[:, 16:], use_cache=True, **{key: cache}).logits
    assert_close(torch.cat([a, b, c], dim=1), full, what="chunked prefill + decode")


def check_packed_sequences(model_type: str) -> None:
    """Packed batches (position_ids resets, or cu_seq_lens_* kwargs) equal the sequences run alone."""
    ref, _ = build(model_type, index_topk=5)
    pat = patched_copy(ref)
    a, b = tokens(1, 9, seed=5), tokens(1, 13, seed=6)
    packed = torch.cat([a, b], dim=1)
    pos = torch.cat([torch.arange(9), torch.arange(13)])[None]
    cu = torch.tensor([0, 9, 22], dtype=torch.int32)
    with torch.no_grad():
        alone = torch.cat([ref(a).logits, ref(b).logits], dim=1)
        by_positions = pat(packed, position_ids=pos).logits
        by_cu = pat(packed, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=13,
                    max_length_k=13, use_cache=False).logits
    assert_close(by_positions, alone, what="position_ids resets")
    assert_close(by_cu, alone, what="cu_seq_lens")


def check_right_padding(model_type: str) -> None:
    """Right padding: real tokens match the unpatched model (topk < T)."""
    ref, _ = build(model_type, index_topk=5)
    pat = patched_copy(ref)
    x = tokens(2, 16, seed=7)
    mask = torch.ones_like(x)
    mask[0, 11:] = 0
    with torch.no_grad():
        out_ref = ref(x, attention_mask=mask).logits
        out_pat = pat(x, attention_mask=mask).logits
    assert_close(out_ref[mask.bool()], out_pat[mask.bool()], what="right padding")


def check_mask_with_holes(model_type: str) -> None:
    """A padding mask of any pattern (zeros after a right-padded prompt, holes): with topk < T the real
    queries select the unpatched top-k among their visible keys, so their logits match; with topk >= T
    every query that has a visible key matches (padding queries attend to the real keys before them)."""
    x = tokens(3, 16, seed=9)
    mask = torch.ones_like(x)
    mask[0, 5:8] = 0  # a hole
    mask[1, 10:13] = 0  # a right-padded prompt, then generated tokens
    mask[2, ::3] = 0  # many holes
    mask[2, 1] = 1
    real = mask.bool()
    for topk, where in ((5, real), (64, torch.arange(16) >= 1)):
        ref, _ = build(model_type, index_topk=topk)
        pat = patched_copy(ref)
        with torch.no_grad():
            out_ref = ref(x, attention_mask=mask).logits
            out_pat = pat(x, attention_mask=mask).logits
        where = where.expand_as(mask)
        assert_close(out_ref[where], out_pat[where], what=f"mask with holes, topk={topk}")


def check_indexer_isolation(model_type: str) -> None:
    """The LM loss never reaches the indexer, the indexer loss never reaches the rest of the model."""
    ref, _ = build(model_type, index_topk=5)
    no_loss = patched_copy(ref, indexer_loss_coef=0.0)
    with_loss = patched_copy(ref, indexer_loss_coef=0.5)
    x = tokens(2, 16, seed=8)
    for model in (no_loss, with_loss):
        model.train()
        model(x, labels=x).loss.backward()
    for (name, p0), (_, p1) in zip(no_loss.named_parameters(), with_loss.named_parameters()):
        if is_indexer_param(name):
            assert p0.grad is None or p0.grad.abs().sum() == 0, f"LM loss reached {name}"
        else:
            assert (p0.grad is None) == (p1.grad is None), name
            if p0.grad is not None:
                assert torch.equal(p0.grad, p1.grad), f"indexer loss reached {name}"
    grads = [p.grad for n, p in indexer_params(with_loss) if "wk" in n or "wq_b" in n]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)


def check_dense_warmup(model_type: str) -> None:
    """dense_warmup=True attends over all visible keys (= unpatched with topk >= T, padded or not) and
    trains the indexer on the dense KL loss."""
    ref, _ = build(model_type, index_topk=64)
    pat = patched_copy(ref, dense_warmup=True, topk=2)
    ref.train()
    pat.train()
    x = tokens(2, 18, seed=9)
    mask = torch.ones_like(x)
    mask[1, :5] = 0
    for m in (None, mask):  # no mask: SDPA path; left padding: chunked path
        labels = x if m is None else padded_labels(x, m)
        out_ref = ref(x, attention_mask=m, labels=labels)
        out_pat = pat(x, attention_mask=m, labels=labels)
        real = torch.ones_like(x, dtype=torch.bool) if m is None else m.bool()
        assert_close(out_ref.logits[real], out_pat.logits[real], what="dense warm-up logits")
        pat.zero_grad()
        out_pat.loss.backward()
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for _, p in indexer_params(pat))
    assert patch_state(pat).pop_indexer_loss() > 0


def check_right_padding_full_topk(model_type: str) -> None:
    """Right padding with topk >= T, in both stages: every position equals the unpatched model (padding
    queries see the real keys only, as under the unpatched mask), and the indexer loss counts only the
    real queries: it equals the loss of the row without its padding."""
    ref, _ = build(model_type, index_topk=64)
    x = tokens(1, 16, seed=7)
    mask = torch.ones_like(x)
    mask[0, 13:] = 0  # fewer padding tokens than dots3's window of 5: each padding query keeps a real key
    for warmup in (False, True):
        pat = patched_copy(ref, dense_warmup=warmup)
        with torch.no_grad():
            assert_close(ref(x, attention_mask=mask).logits, pat(x, attention_mask=mask).logits,
                         what=f"right padding, dense_warmup={warmup}")
        pat.train()
        # a training step: the sparse stage records the loss in backward (_deferred_target)
        pat(x, attention_mask=mask, labels=padded_labels(x, mask)).loss.backward()
        padded = patch_state(pat).pop_indexer_loss()
        pat(x[:, :13], labels=x[:, :13]).loss.backward()
        alone = patch_state(pat).pop_indexer_loss()
        assert abs(padded - alone) <= 1e-5 * max(1.0, abs(alone)), (warmup, padded, alone)


def check_deepcopy_is_independent(model_type: str) -> None:
    """A deep copy of a patched model is an independent patched model: unpatching the copy restores the
    copy and leaves the original patched (the undo is an object copied with the model)."""
    model, _ = build(model_type, index_topk=4)
    hyscale_hf.patch_model(model, backend="torch")
    twin = copy.deepcopy(model)
    x = tokens(2, 12)
    with torch.no_grad():
        expected = model(x).logits
        assert torch.equal(twin(x).logits, expected)
    hyscale_hf.unpatch_model(twin)
    assert hyscale_hf.is_patched(model) and not hyscale_hf.is_patched(twin)
    assert not any("forward" in vars(m) or "_hyscale_state" in vars(m) for m in twin.modules())
    with torch.no_grad():
        assert torch.equal(model(x).logits, expected)
