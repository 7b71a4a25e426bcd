"""Sequence tiling (``tile_tokens``) and activation offload (``offload_activations``) on patched models:
a checkpointed training step of a tiny GLM-5 (full, IndexShare shared, full indexer layers; MoE) and a
tiny Llama (indexer added) gives the loss and gradients of the untiled step (fp32)."""

from __future__ import annotations

import pytest
import torch

import hyscale_hf
from hyscale_hf import patch_model, patched_config
from hyscale_hf.kernels import sparse_attn
from hyscale_hf.offload import HostOffload
from hyscale_hf.state import in_backward, patch_state
from tests.support.saved import saved_bytes
from tests.test_replay_models import B, T, _build, _grads, _ids

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

MODELS = ["glm_moe_dsa", "llama"]
TILE = 7  # T = 24 -> tiles of 7, 7, 7, 3


def _patched(model_type, checkpointing=True, **config):
    model, options = _build(model_type)
    patch_model(model, **options, **config)
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    if config.get("offload_activations"):  # CPU tensors take the offload path too (plain copies)
        patch_state(model).offloader = HostOffload(min_bytes=0, devices=("cpu",))
    return model


def _step(model, **inputs):
    ids = _ids()
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, **inputs)
    out.loss.backward()
    return out.loss.detach(), patch_state(model).pop_indexer_loss(), _grads(model)


def _assert_close_grads(got, want):
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=2e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("model_type", MODELS)
@pytest.mark.parametrize("offload", [False, True])
def test_tiled_checkpointed_step_equals_the_untiled_one(model_type, offload):
    loss, kl, grads = _step(_patched(model_type))
    hyscale_hf.reset_selection_stats()
    model = _patched(model_type, tile_tokens=TILE, offload_activations=offload)
    got_loss, got_kl, got_grads = _step(model)
    torch.testing.assert_close(got_loss, loss, rtol=1e-6, atol=0)
    assert got_kl == pytest.approx(kl, rel=1e-5)
    _assert_close_grads(got_grads, grads)
    stats = hyscale_hf.selection_stats()
    assert stats["indexer_recompute"] == 0 and stats["replayed_selections"] > 0  # replay unchanged
    if offload:
        off = patch_state(model).offloader.stats
        # layer inputs, replayed selections (one per full or shared indexer layer) and the indexer-loss
        # gradients of the tiled MLA layers (their KL runs a tile at a time in forward; a GQA layer's
        # runs in backward from its attention's target, so nothing is held for it but the lse of its
        # selection, kept with it)
        assert off["offloaded_input"] > 0
        assert (off.get("offloaded_stash", 0) > 0) == (model_type != "llama")
        lse_kept = stats["indexer_forward"] if model_type == "llama" else 0
        assert off["offloaded_selection"] == stats["replayed_selections"] + lse_kept
        assert off["prefetched"] > 0


@pytest.mark.parametrize("model_type", MODELS)
def test_offloaded_selections_replay_under_verify_mode(model_type):
    """Verify mode reruns each replayed selection and compares it with the one the offload kept."""
    loss, _, grads = _step(_patched(model_type))
    model = _patched(model_type, offload_activations=True, verify_replay=True)
    hyscale_hf.reset_selection_stats()
    got_loss, _, got_grads = _step(model)
    stats = hyscale_hf.selection_stats()
    assert stats["verified_selections"] == stats["replayed_selections"] > 0
    # each full indexer layer's selection keeps its lse beside it (the deferred KL's one pass)
    assert (patch_state(model).offloader.stats["offloaded_selection"]
            == stats["replayed_selections"] + stats["indexer_forward"])
    torch.testing.assert_close(got_loss, loss, rtol=0, atol=0)
    for name in grads:
        assert torch.equal(got_grads[name], grads[name]), name  # untiled: the same bits


@pytest.mark.parametrize("model_type", MODELS)
def test_tiled_step_without_checkpointing_equals_the_untiled_one(model_type):
    loss, kl, grads = _step(_patched(model_type, checkpointing=False))
    got_loss, got_kl, got_grads = _step(_patched(model_type, checkpointing=False, tile_tokens=TILE))
    torch.testing.assert_close(got_loss, loss, rtol=1e-6, atol=0)
    assert got_kl == pytest.approx(kl, rel=1e-5)
    _assert_close_grads(got_grads, grads)


@pytest.mark.parametrize("model_type", MODELS)
def test_padding_and_packing_tile_like_untiled(model_type):
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, :5] = 0  # left padding
    mask[1, 10:13] = 0  # a hole
    positions = torch.cat([torch.arange(9), torch.arange(T - 9)])[None].expand(B, T)  # two packed sequences
    for inputs in ({"attention_mask": mask}, {"position_ids": positions}):
        loss, kl, grads = _step(_patched(model_type), **inputs)
        got_loss, got_kl, got_grads = _step(_patched(model_type, tile_tokens=TILE), **inputs)
        torch.testing.assert_close(got_loss, loss, rtol=1e-6, atol=0)
        assert got_kl == pytest.approx(kl, rel=1e-5)
        _assert_close_grads(got_grads, grads)


def test_the_mlps_and_the_mla_query_side_run_in_tiles(monkeypatch):
    model = _patched("glm_moe_dsa", tile_tokens=TILE)
    seen = {"mlp": [], "norm": [], "attention": [], "attention_in_backward": 0, "mlp_in_backward": 0}
    tiles = -(-T // TILE)
    for layer in model.model.layers:
        for key, module in (("mlp", layer.mlp), ("norm", layer.input_layernorm), ("norm", layer.self_attn.q_a_layernorm)):
            tiled = module.forward  # the tiled forward, around the module's own (or lean) forward
            inner = tiled._inner()

            def counting(x, inner=inner, key=key):
                seen[key].append(x.shape[1])
                seen["mlp_in_backward"] += key == "mlp" and in_backward()
                return inner(x)

            tiled.previous = counting
    original = sparse_attn.mla.mla_sparse_attention

    def counting_attention(q_nope, *args, **kwargs):
        seen["attention"].append(q_nope.shape[1])
        seen["attention_in_backward"] += in_backward()
        return original(q_nope, *args, **kwargs)

    monkeypatch.setattr("hyscale_hf.model_patches._dsa_step.mla_sparse_attention", counting_attention)
    _step(model)
    assert seen["mlp"] and max(seen["mlp"]) <= TILE
    assert seen["norm"] and max(seen["norm"]) <= TILE
    assert seen["attention"] and max(seen["attention"]) <= TILE
    # Backward: the layer's recompute runs every tile, then each tile's own recompute runs but the
    # last one's (it ran without a checkpoint of its own, its saved tensors are the recompute's).
    in_forward = len(seen["attention"]) - seen["attention_in_backward"]
    layers = in_forward // tiles
    assert in_forward == layers * tiles and layers > 0
    assert seen["attention_in_backward"] == layers * (2 * tiles - 1)
    # The MLP ends its layer: the layer's recompute stops before it, so each tile runs once in backward.
    assert seen["mlp_in_backward"] * 2 == len(seen["mlp"])


def test_live_tile_tokens_and_the_dense_warm_up():
    """tile_tokens read at each forward; the warm-up's attention is not tiled (it chunks queries itself),
    its MLPs are; either way the step equals the untiled one."""
    ref = _patched("glm_moe_dsa", dense_warmup=True)
    loss, kl, grads = _step(ref)
    model = _patched("glm_moe_dsa", dense_warmup=True)
    patched_config(model).tile_tokens = TILE
    got_loss, got_kl, got_grads = _step(model)
    torch.testing.assert_close(got_loss, loss, rtol=1e-6, atol=0)
    assert got_kl == pytest.approx(kl, rel=1e-5)
    _assert_close_grads(got_grads, grads)


@pytest.mark.parametrize("model_type", MODELS)
def test_eval_forward_with_tiles_gives_the_same_logits(model_type):
    ref = _patched(model_type, checkpointing=False).eval()
    model = _patched(model_type, checkpointing=False, tile_tokens=TILE).eval()
    # fp32 logits of order 1: a token tile's matmuls have fewer rows, and the CPU BLAS may block them
    # differently (on some machines a few elements move by 3e-6)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=_ids()).logits, ref(input_ids=_ids()).logits,
                                   rtol=1e-5, atol=1e-5)


def test_unpatch_removes_the_tiled_mlp_forwards():
    model = _patched("llama", checkpointing=False, tile_tokens=TILE)
    hyscale_hf.unpatch_model(model)
    assert all("forward" not in layer.mlp.__dict__ for layer in model.model.layers)


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", MODELS)
def test_cuda_step_with_tiles_and_offload_equals_the_plain_one(model_type):
    """The stream path of the offload (side-stream copies, prefetch) on a patched model (torch backend:
    the tiny dims are for the references)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")

    def run(**config):
        model, options = _build(model_type)
        patch_model(model.cuda(), **options, backend="torch", **config)
        model.gradient_checkpointing_enable({"use_reentrant": False})
        if config.get("offload_activations"):
            patch_state(model).offloader = HostOffload(min_bytes=0)
        ids = _ids().cuda()
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), _grads(model), patch_state(model)

    loss, grads, _ = run()
    got_loss, got_grads, state = run(tile_tokens=TILE, offload_activations=True)
    torch.testing.assert_close(got_loss, loss, rtol=1e-5, atol=0)
    _assert_close_grads(got_grads, grads)
    assert state.offloader.stats["offloaded"] > 0 and state.offloader.stats["prefetched"] > 0


def _kept_bytes(model) -> int:
    """Bytes of the distinct non-parameter storages autograd keeps for backward after one forward."""
    ids = _ids()
    with saved_bytes(model) as storages:
        loss = model(input_ids=ids, labels=ids).loss
    del loss
    return sum(storages.values())


@pytest.mark.parametrize("model_type", MODELS)
def test_tiling_keeps_less_for_backward(model_type):
    """Without layer checkpointing, what a forward keeps for backward is the activations; with tiles, the
    tiled modules keep only their inputs. (The modules' own forwards: the lean ones keep little already.)"""
    untiled = _kept_bytes(_patched(model_type, checkpointing=False, lean_activations=False))
    tiled = _kept_bytes(_patched(model_type, checkpointing=False, lean_activations=False, tile_tokens=TILE))
    assert tiled < 0.75 * untiled, (tiled, untiled)


def test_recall_is_sampled_on_the_last_tile():
    """Under tiling the recall probe sees the last tile's queries against the keys they can see; under a
    padding mask it takes no sample and says so once. (A forward with a KV cache is not tiled.)"""
    from hyscale_hf.training import measure_topk_recall, sample_topk_recall

    model = _patched("glm_moe_dsa", checkpointing=False, tile_tokens=TILE)
    ids = _ids()
    recall, best = measure_topk_recall(model, {"input_ids": ids, "use_cache": False}, return_best=True)
    assert 0.0 < recall <= best <= 1.0 + 1e-6
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with pytest.warns(UserWarning, match="recall is not sampled"), sample_topk_recall(model) as probe:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, use_cache=False)
    assert probe.calls == 0
