"""IndexShare in dense conversions (``HyScaleConfig.index_share``): an indexer on every n-th layer, the layers
between attending over its selection."""

from __future__ import annotations

import collections
import copy

import pytest
import torch

from hyscale_hf import patch_model, reset_selection_stats, sample_topk_recall, selection_stats
from hyscale_hf.state import patch_state

from ._dense_tiny import INDEXER, tiny_model, tokens
from .tiny_models import build

ATOL = 2e-5


def _patched(layers: int, share: int, topk: int = 3, variant: str = "llama", **kw):
    model = tiny_model(variant)
    if layers != model.config.num_hidden_layers:  # rebuild with more layers (the same seed)
        torch.manual_seed(0)
        model.config.num_hidden_layers = layers
        model = type(model)(model.config).float()
    patch_model(model.eval(), topk=topk, index_share=share, **INDEXER, **kw)
    return model


def _support(attn: torch.Tensor) -> torch.Tensor:
    """Which keys each query attends to: [B, S, T] (True where any head gives it weight)."""
    return (attn > 0).any(dim=1)


def test_indexers_sit_on_every_nth_layer_and_the_record_says_so():
    model = _patched(layers=5, share=2)
    assert [hasattr(layer.self_attn, "indexer") for layer in model.model.layers] == [True, False, True, False, True]
    assert model.config.hyscale_indexer["index_share"] == 2
    assert patch_state(model).config.index_share == 2


def test_shared_layers_attend_over_their_source_selection():
    model = _patched(layers=4, share=2)
    ids = tokens(2, 12)
    with torch.no_grad():
        attns = model(ids, output_attentions=True).attentions
    sup = [_support(a) for a in attns]
    assert torch.equal(sup[1], sup[0]) and torch.equal(sup[3], sup[2])
    assert not torch.equal(sup[2], sup[0])  # a second indexer, its own selection
    assert int(sup[0][0, -1].sum()) == 3  # top-3 of 12 visible keys
    assert not patch_state(model).shared_selections  # the groups' last layers dropped them


@pytest.mark.parametrize("share", [1, 2, 3])
def test_gradient_checkpointing_replays_shared_selections_and_matches_plain_backward(share):
    plain = _patched(layers=4, share=share, verify_replay=True).train()
    ckpt = copy.deepcopy(plain)
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = tokens(2, 10)
    plain(ids, labels=ids, use_cache=False).loss.backward()
    reset_selection_stats()
    ckpt(ids, labels=ids, use_cache=False).loss.backward()
    stats = selection_stats()
    sources = len(range(0, 4, share))
    assert (stats["indexer_forward"], stats["shared_forward"]) == (sources, 4 - sources)
    assert stats["replayed_selections"] == stats["verified_selections"] == 4  # the verify rerun matched each
    grads = dict(ckpt.named_parameters())
    for name, p in plain.named_parameters():
        assert torch.allclose(grads[name].grad, p.grad, atol=ATOL, rtol=1e-4), name
    assert not patch_state(ckpt).shared_selections  # nothing outlives the step


def test_two_forwards_then_two_backwards_each_replay_their_own_selection():
    # The second forward overwrites the source's holder entry and its backward drops it; the first
    # call's recompute still gets its own forward's copy from the replay.
    plain = _patched(layers=2, share=2).train()
    ckpt = copy.deepcopy(plain)
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    a, b = tokens(1, 10, seed=1), tokens(1, 10, seed=2)
    for model in (plain, ckpt):
        la = model(a, labels=a, use_cache=False).loss
        lb = model(b, labels=b, use_cache=False).loss
        lb.backward()
        la.backward()
    grads = dict(ckpt.named_parameters())
    for name, p in plain.named_parameters():
        assert torch.allclose(grads[name].grad, p.grad, atol=ATOL, rtol=1e-4), name


def test_shared_layers_attend_over_the_source_tensor_itself(monkeypatch):
    # No copy per shared layer, in forward or in the checkpoint recompute: the replay keeps one selection a group.
    from hyscale_hf.model_patches import _dsa_step

    model = _patched(layers=3, share=3).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ptrs, original = [], _dsa_step._selection

    def recording(*args, **kwargs):
        indices, attended, index_lse = original(*args, **kwargs)
        ptrs.append(indices.data_ptr())
        return indices, attended, index_lse

    monkeypatch.setattr(_dsa_step, "_selection", recording)
    ids = tokens(1, 10)
    model(ids, labels=ids, use_cache=False).loss.backward()
    assert len(ptrs) == 6 and len(set(ptrs)) == 1  # 3 layers, forward and recompute


@pytest.mark.parametrize("layers,share", [(3, 3), (4, 2)], ids=["one-group", "two-groups"])
def test_a_group_builds_its_query_tiles_once_a_step(layers, share, monkeypatch):
    # Triton path (the interpreter on CPU): a group's layers, forward and recompute, take one tile build
    # (the forward's build is kept for the recompute, after the other groups' forwards too); the same
    # loss and gradients as building them per call.
    pytest.importorskip("triton")
    from hyscale_hf.kernels.sparse_attn import host

    monkeypatch.setattr(host._TileReuse, "builds", collections.OrderedDict())
    plain = _patched(layers=layers, share=share, backend="triton").train()
    plain.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    reused = copy.deepcopy(plain)
    ids = tokens(1, 12)
    builds, original = [], host.union_tiles
    monkeypatch.setattr(host, "union_tiles", lambda *a, **kw: builds.append(1) or original(*a, **kw))
    reused_loss = reused(ids, labels=ids, use_cache=False).loss
    reused_loss.backward()
    groups = layers // share
    assert len(builds) == groups
    monkeypatch.setattr(host, "_query_tiles", lambda i, t, n, u: host.union_tiles(i, t, n, unique=u))  # (counted)
    plain_loss = plain(ids, labels=ids, use_cache=False).loss
    plain_loss.backward()
    assert len(builds) == groups + 2 * layers and torch.equal(reused_loss, plain_loss)
    grads = dict(reused.named_parameters())
    for name, p in plain.named_parameters():
        assert torch.equal(grads[name].grad, p.grad), name


def test_generate_with_a_cache_matches_the_full_forward():
    model = _patched(layers=3, share=2)
    ids = tokens(2, 7)
    new = 5
    out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        full = model(out.sequences, use_cache=False).logits
    for step, logits in enumerate(out.logits):
        assert torch.allclose(logits, full[:, ids.shape[1] - 1 + step], atol=ATOL, rtol=1e-4)


def test_recall_samples_every_layer_with_its_source_selection():
    model = _patched(layers=4, share=2)
    ids = tokens(2, 12)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding: the shared layers' recall in compacted order too
    with sample_topk_recall(model) as probe, torch.no_grad():
        model(ids, attention_mask=mask)
    assert probe.calls == 4
    recalls = [float(r.mean()) for r, _ in probe.per_layer]
    assert all(0 < r <= 1 for r in recalls) and len(set(recalls)) > 1
    assert not patch_state(model).shared_selections


def test_dense_warmup_runs_shared_layers_dense():
    model = _patched(layers=2, share=2, topk=3, dense_warmup=True)
    ids = tokens(1, 9)
    with torch.no_grad():
        attns = model(ids, output_attentions=True).attentions
    assert torch.equal(_support(attns[1])[0], torch.ones(9, 9, dtype=torch.bool).tril())  # every visible key


def test_save_load_keeps_the_layout_and_refuses_another(tmp_path):
    model = _patched(layers=3, share=2)
    ids = tokens(1, 9)
    with torch.no_grad():
        expected = model(ids).logits
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path).eval()
    patch_model(loaded)
    assert patch_state(loaded).config.index_share == 2
    assert [hasattr(layer.self_attn, "indexer") for layer in loaded.model.layers] == [True, False, True]
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, expected, atol=1e-6)
    again = type(model).from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="index_share=1 differs from the saved indexers' index_share=2"):
        patch_model(again, index_share=1)


def test_a_record_from_before_the_option_means_every_layer(tmp_path):
    model = _patched(layers=2, share=1)
    del model.config.hyscale_indexer["index_share"]  # as records written before index_share existed
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="index_share=2 differs from the saved indexers' index_share=1"):
        patch_model(type(model).from_pretrained(tmp_path), index_share=2)


def test_bad_settings_are_refused_before_patching():
    with pytest.raises(ValueError, match="index_share must be a positive int"):
        _patched(layers=2, share=0)
    with pytest.raises(ValueError, match="index_share > 1 needs selection_replay=True"):
        _patched(layers=2, share=2, selection_replay=False)
    for windowed in ("mistral_sw", "qwen2_sw"):
        with pytest.raises(ValueError, match="sliding window"):
            _patched(layers=2, share=2, variant=windowed)
    _patched(layers=2, share=2, variant="qwen2")  # full attention in every layer


def test_dsa_models_refuse_the_option():
    model, _ = build("deepseek_v32")
    with pytest.raises(ValueError, match="index_share=2 applies to dense models"):
        patch_model(model, index_share=2)
