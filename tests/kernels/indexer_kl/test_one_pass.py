"""The given-target indexer KL in one pass (``indexer_kl_loss_given_target(..., index_lse=...)``): the
indexer's log-sum-exp over each query's selection given, the backward kernels give the loss and the
gradients at once (per-query and tiled, CPU interpreter in CI), against the two-pass path and the torch
reference with the same lse."""

from __future__ import annotations

import pytest
import torch

from hyscale_hf.kernels import hytopk
from hyscale_hf.kernels.checks import triton_usable
from hyscale_hf.kernels.indexer_kl import indexer_kl_loss_given_target
from hyscale_hf.kernels.indexer_kl import op as op_module
from hyscale_hf.kernels.indexer_kl.naive import selected_index_logits
from hyscale_hf.kernels.sparse_attn.host import union_tiles
from tests.kernels.indexer_kl.test_tiled import _case as tiled_case

needs_interpreter = pytest.mark.skipif(not triton_usable(torch.device("cpu")), reason="needs TRITON_INTERPRET=1")


def _case(**kwargs):
    """``test_tiled``'s inputs (B = 2, S = 21, T = 40, 2 x 16 indexer, K = 12, query 1 without keys)."""
    index, idx, target, _ = tiled_case(**kwargs)
    return index, idx, target


def _selection_lse(index, idx, relu=True):
    """Each query's log-sum-exp of its selected logits (-inf without a key), in float64."""
    logits = selected_index_logits(*(t.double() for t in index), idx, relu)
    return torch.logsumexp(logits.masked_fill(idx < 0, float("-inf")), dim=-1).float()


def _loss_and_grads(index, idx, target, *, upstream=1.0, **kw):
    leaves = [t.clone().requires_grad_() for t in index]
    loss = indexer_kl_loss_given_target(*leaves, idx, target, **kw)
    (loss * upstream).backward()
    return [loss.detach()] + [t.grad for t in leaves]


def _assert_close(got, want, tol=1e-5):
    for name, a, b in zip(("loss", "index_q", "index_k", "index_w"), got, want):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.fixture
def forward_calls(monkeypatch):
    """The forward kernels' launches (per-query and tiled): the one pass must run neither."""
    calls = []
    for name in ("indexer_kl_forward_triton", "indexer_kl_forward_tiled"):
        real = getattr(op_module, name)
        monkeypatch.setattr(op_module, name, lambda *a, real=real, **k: calls.append(1) or real(*a, **k))
    return calls


@needs_interpreter
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("tile_q", [None, 8], ids=["per-query", "tiles"])
@pytest.mark.parametrize("relu", [True, False])
def test_one_pass_is_the_two_pass_loss_and_gradients(reduction, tile_q, relu, forward_calls):
    index, idx, target = _case(seed=1)
    tiles = None if tile_q is None else union_tiles(idx, tile_q, 40, unique=True)
    lse = _selection_lse(index, idx, relu)
    got = _loss_and_grads(index, idx, target, index_lse=lse, reduction=reduction, relu=relu, tiles=tiles,
                          backend="triton", upstream=1.7)
    assert not forward_calls
    want = _loss_and_grads(index, idx, target, reduction=reduction, relu=relu, tiles=tiles, backend="triton",
                           upstream=1.7)
    assert forward_calls
    _assert_close(got, want)
    _assert_close(got, _loss_and_grads(index, idx, target, reduction=reduction, relu=relu, backend="torch",
                                       upstream=1.7))


@needs_interpreter
@pytest.mark.parametrize("tile_q", [None, 8], ids=["per-query", "tiles"])
def test_the_given_lse_is_what_the_kernels_use(tile_q):
    """An lse off the logits' own: the kernels take it for the loss and the gradient, as the reference
    with the same lse does (``kl_rows``), so the value and gradients move with it."""
    index, idx, target = _case(seed=2)
    tiles = None if tile_q is None else union_tiles(idx, tile_q, 40, unique=True)
    exact = _selection_lse(index, idx)
    shift = torch.rand(exact.shape, generator=torch.Generator().manual_seed(4)) * 0.5
    lse = torch.where(torch.isfinite(exact), exact + shift, exact)
    got = _loss_and_grads(index, idx, target, index_lse=lse, tiles=tiles, backend="triton")
    _assert_close(got, _loss_and_grads(index, idx, target, index_lse=lse, backend="torch"))
    on_exact = _loss_and_grads(index, idx, target, index_lse=exact, tiles=tiles, backend="triton")
    assert not torch.allclose(got[0], on_exact[0]) and not torch.allclose(got[1], on_exact[1])


@needs_interpreter
def test_half_precision_and_a_masked_query():
    """fp16 inputs; a query masked to -1 (and the query without keys, lse -inf): no loss, no gradient,
    no NaN."""
    index, idx, target = _case(seed=3, dtype=torch.float16)
    lse = _selection_lse(index, idx)
    masked = idx.clone()
    masked[0, 6] = -1
    got = _loss_and_grads(index, masked, target, index_lse=lse, reduction="sum", backend="triton")
    want = _loss_and_grads(index, masked, target, reduction="sum", backend="triton")
    _assert_close(got, want, tol=2e-3)
    _, dq, _, dw = got
    assert dq[0, 6].abs().max() == 0 and dw[0, 6].abs().max() == 0 and dq[:, 1].abs().max() == 0
    assert all(bool(torch.isfinite(t).all()) for t in got)


@needs_interpreter
def test_with_hytopks_own_selection_and_lse():
    """The way the patched models run it: the selection and its lse from one hytopk call."""
    g = torch.Generator().manual_seed(5)
    iq, ik = torch.randn(1, 24, 2, 16, generator=g), torch.randn(1, 24, 16, generator=g)
    iw = torch.rand(1, 24, 2, generator=g)
    idx, lse = hytopk(iq, ik, iw, 8, return_lse=True, backend="triton")
    target = torch.where(idx >= 0, torch.rand(idx.shape, generator=g) + 0.05, torch.zeros(()))
    tiles = union_tiles(idx, 8, 24, unique=True)
    got = _loss_and_grads((iq, ik, iw), idx, target, index_lse=lse, tiles=tiles, backend="triton")
    _assert_close(got, _loss_and_grads((iq, ik, iw), idx, target, backend="torch"))


@pytest.mark.parametrize("change, match", [
    (lambda a: a.update(reduction="none"), "index_lse needs reduction"),
    (lambda a: a.update(index_lse=a["index_lse"][:, :-1]), "index_lse"),
    (lambda a: a.update(index_lse=a["index_lse"][..., None]), "index_lse"),
])
def test_bad_index_lse_is_named(change, match):
    index, idx, target = _case()
    args = dict(index_lse=_selection_lse(index, idx), reduction="mean")
    change(args)
    with pytest.raises(ValueError, match=match):
        indexer_kl_loss_given_target(*index, idx, target, **args)
