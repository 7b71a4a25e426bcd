"""The given-target indexer KL over the attention's query tiles (``indexer_kl/tiled.py``) against the
per-query Triton kernels and the torch reference (CPU interpreter in CI): loss and gradients."""

from __future__ import annotations

import pytest
import torch

from hyscale_hf.benchmarking.inputs import causal_indices
from hyscale_hf.kernels.checks import triton_usable
from hyscale_hf.kernels.indexer_kl import indexer_kl_loss_given_target
from hyscale_hf.kernels.indexer_kl import tiled as tiled_module
from hyscale_hf.kernels.sparse_attn.host import KeyLists, token_lists, union_tiles

pytestmark = pytest.mark.skipif(not triton_usable(torch.device("cpu")), reason="needs TRITON_INTERPRET=1")


@pytest.fixture
def tiled_calls(monkeypatch):
    """How many times the tiled forward ran (the per-query path is the comparison)."""
    calls = []
    real = tiled_module.indexer_kl_forward_tiled
    monkeypatch.setattr("hyscale_hf.kernels.indexer_kl.op.indexer_kl_forward_tiled",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _case(*, B=2, S=21, T=40, H=2, D=16, K=12, tile_q=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    iq = torch.randn(B, S, H, D, generator=g).to(dtype)
    ik = torch.randn(B, T, D, generator=g).to(dtype)
    iw = torch.rand(B, S, H, generator=g) + 0.2
    idx = causal_indices(B, S, T, K, generator=g, local=5, sinks=2, empty_rows=(1,))
    target = torch.where(idx >= 0, torch.rand(idx.shape, generator=g) + 0.05, torch.zeros(()))
    return (iq, ik, iw), idx, target, union_tiles(idx, tile_q, T, unique=True)


def _loss_and_grads(index, idx, target, *, backend="triton", reduction="none", **kw):
    leaves = [t.clone().requires_grad_() for t in index]
    out = indexer_kl_loss_given_target(*leaves, idx, target, reduction=reduction, backend=backend, **kw)
    weight = torch.rand(out.shape, generator=torch.Generator().manual_seed(9)) + 0.5
    (out * weight).sum().backward()
    return [out.detach()] + [t.grad for t in leaves]


def _assert_close(got, want, tol=1e-5):
    for name, a, b in zip(("kl", "index_q", "index_k", "index_w"), got, want):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("tile_q,H,relu", [(8, 2, True), (3, 3, True), (5, 2, False)],
                         ids=["8q-2h", "3q-3h", "5q-relu-off"])
def test_tiles_give_the_per_query_loss_and_gradients(tile_q, H, relu, tiled_calls):
    """Tiles of 3-8 queries (S = 21: a short last tile), heads padded (H = 3), ReLU on and off."""
    index, idx, target, tiles = _case(tile_q=tile_q, H=H)
    got = _loss_and_grads(index, idx, target, tiles=tiles, relu=relu)
    assert len(tiled_calls) == 1
    _assert_close(got, _loss_and_grads(index, idx, target, relu=relu))
    _assert_close(got, _loss_and_grads(index, idx, target, relu=relu, backend="torch"))
    assert got[0][:, 1].abs().max() == 0  # the query without keys


def test_a_query_masked_after_the_tiles_were_built_drops_out(tiled_calls):
    """The model masks padding queries to -1 after the attention built its tiles: their bits still
    say they selected keys, but their loss and gradients must be 0, as on the per-query path."""
    index, idx, target, tiles = _case(seed=1)
    masked = idx.clone()
    masked[0, 6] = -1
    got = _loss_and_grads(index, masked, target, tiles=tiles)
    assert tiled_calls
    _assert_close(got, _loss_and_grads(index, masked, target))
    kl, dq, _, dw = got
    assert kl[0, 6] == 0 and dq[0, 6].abs().max() == 0 and dw[0, 6].abs().max() == 0 and kl[0, 5] > 0


def test_half_precision_inputs(tiled_calls):
    index, idx, target, tiles = _case(seed=2, dtype=torch.float16)
    got = _loss_and_grads(index, idx, target, tiles=tiles)
    assert tiled_calls
    _assert_close(got, _loss_and_grads(index, idx, target), tol=2e-3)


def test_tiles_a_program_cannot_hold_take_the_per_query_path(tiled_calls):
    assert tiled_module.tile_shape(64, 32, 128) is None  # 2048 rows x 128 dims
    assert tiled_module.tile_shape(4, 2, 16) is None  # 8 rows: below a tensor-core product's 16
    assert tiled_module.tile_shape(42, 2, 64) == (64, 2, 64)  # SmolLM2: 42-query tiles, 2 x 64 indexer
    index, idx, target, _ = _case(seed=3, H=32, tile_q=64)
    got = _loss_and_grads(index, idx, target, tiles=union_tiles(idx, 64, 40, unique=True))
    assert not tiled_calls
    _assert_close(got, _loss_and_grads(index, idx, target))


def test_on_cuda_the_tiles_take_only_narrow_unions():
    """The per-call rule (``takes_tiles``): on CUDA the tiles run where the mean union holds at most
    ``CUDA_MAX_UNION_SHARE`` of a tile's pairs (tile_q x K), else and without a known mean the per-query
    kernels; elsewhere wherever a program holds the tile."""
    _, idx, _, tiles = _case(tile_q=8, H=2)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    K = idx.shape[2]
    assert tiles.mean_union == pytest.approx(float(tiles.num.float().mean()))
    share = tiles.mean_union / (8 * K)
    rule = tiled_module.CUDA_MAX_UNION_SHARE
    assert tiled_module.takes_tiles(tiles, 2, 16, K, cpu)
    assert tiled_module.takes_tiles(tiles, 2, 16, K, cuda) == (share <= rule)
    narrow = tiles._replace(mean_union=rule * 8 * K)
    assert tiled_module.takes_tiles(narrow, 2, 16, K, cuda)
    assert not tiled_module.takes_tiles(narrow._replace(mean_union=rule * 8 * K + 1), 2, 16, K, cuda)
    assert not tiled_module.takes_tiles(narrow._replace(mean_union=-1.0), 2, 16, K, cuda)  # not known
    assert not tiled_module.takes_tiles(narrow, 32, 128, K, cpu)  # 256 rows x 128 dims: no program holds it
    # the one pass takes the tiles up to its own, wider share
    one = tiled_module.CUDA_MAX_UNION_SHARE_ONE_PASS
    assert one > rule
    wider = tiles._replace(mean_union=one * 8 * K)
    assert tiled_module.takes_tiles(wider, 2, 16, K, cuda, one_pass=True)
    assert not tiled_module.takes_tiles(wider, 2, 16, K, cuda)
    assert not tiled_module.takes_tiles(wider._replace(mean_union=one * 8 * K + 1), 2, 16, K, cuda, one_pass=True)


def test_the_switch_takes_the_tiles_at_any_union(monkeypatch):
    """``TILES_AT_ANY_UNION`` (benchmarks, GPU tests) turns both union rules off, not the program's size."""
    _, idx, _, tiles = _case(tile_q=8, H=2)
    cuda, K = torch.device("cuda"), idx.shape[2]
    wide = tiles._replace(mean_union=8.0 * K)  # every pair its own key
    unknown = tiles._replace(mean_union=-1.0)
    assert not tiled_module.takes_tiles(wide, 2, 16, K, cuda)
    monkeypatch.setattr(tiled_module, "TILES_AT_ANY_UNION", True)
    for lists in (wide, unknown):
        assert tiled_module.takes_tiles(lists, 2, 16, K, cuda)
        assert tiled_module.takes_tiles(lists, 2, 16, K, cuda, one_pass=True)
    assert not tiled_module.takes_tiles(wide, 32, 128, K, cuda)  # 256 rows x 128 dims: still no program holds it


def test_bad_tiles_are_named():
    index, idx, target, tiles = _case()
    with pytest.raises(TypeError, match="tiles must be a sparse_attn KeyLists"):
        indexer_kl_loss_given_target(*index, idx, target, tiles=(tiles.idx, tiles.num, tiles.bits))
    with pytest.raises(ValueError, match="tiles must be query tiles"):
        indexer_kl_loss_given_target(*index, idx, target, tiles=token_lists(idx))
    with pytest.raises(ValueError, match="tiles of 4 queries"):
        indexer_kl_loss_given_target(*index, idx, target,
                                     tiles=KeyLists(tiles.idx[:, :-1], tiles.num[:, :-1], tiles.bits, 4))
    unsorted = idx.flip(-1)
    with pytest.raises(ValueError, match="with tiles every row"):
        indexer_kl_loss_given_target(*index, unsorted, target, tiles=tiles)
