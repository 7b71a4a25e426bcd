"""hytopk on degenerate and extreme inputs, on both backends (the Triton kernels under Triton's CPU
interpreter when there is no GPU): one head, empty batches, windows past the query, non-finite
scores, topk out of range, gradients of the returned scores (docs/design.md sections 2 and 4)."""

import pytest
import torch

from hyscale_hf.kernels import hytopk
from hyscale_hf.kernels.topk.naive import hytopk_reference
from tests.support.hytopk_cases import assert_same, int_inputs
from tests.support.topk_cases import brute_force_topk

triton = pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["torch", "triton"]
NAN, INF = float("nan"), float("inf")


def both(q, k, w, topk, backend, **kw):
    return hytopk(q, k, w, topk, return_scores=True, backend=backend, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T,topk", [(5, 3), (40, 7)])
def test_one_indexer_head_matches_the_reference(backend, T, topk):
    # The scan pairs heads two by two (columns 2j, 2j + 1 of a query); one head is padded with a
    # zero-weight second head, which must not change a single bit.
    q, k, w = int_inputs(2, T, T, 1, 16, device=DEV, seed=T)
    assert_same(both(q, k, w, topk, backend), hytopk_reference(q, k, w, topk), "H = 1")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("B,S,T", [(0, 4, 8), (1, 0, 8), (1, 0, 0), (0, 0, 0), (2, 0, 3)])
def test_empty_batch_queries_or_keys_return_empty_outputs(backend, B, S, T):
    q, k, w = int_inputs(B, S, T, 2, 16, device=DEV)
    idx, sc = both(q, k, w, 5, backend)
    assert idx.shape == sc.shape == (B, S, 5) and idx.dtype == torch.int32 and sc.dtype == torch.float32
    assert idx.device == q.device
    assert hytopk(q, k, w, 5, backend=backend).shape == (B, S, 5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_heads_or_zero_width_heads_are_value_errors(backend):
    q, k, w = int_inputs(1, 4, 6, 2, 16, device=DEV)
    with pytest.raises(ValueError, match=r"q must have H >= 1 heads"):
        hytopk(q[:, :, :0], k, w[..., :0], 3, backend=backend)
    with pytest.raises(ValueError, match=r"q must have D >= 1"):
        hytopk(q[..., :0], k[..., :0], w, 3, backend=backend)


WINDOW_STARTS = {  # B = 2, S = 6, T = 9: query i sits at key position 3 + i
    "all-past-T": [12, 10],  # every window starts past every query (12 > T): no key anywhere
    "some-past-B": [12, 4],
    "some-past-BS": [[0, 12, 5, 9, 100, 2], [9, 9, 9, 9, 9, 9]],
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(WINDOW_STARTS))
def test_window_start_past_the_query_leaves_the_row_empty(backend, case):
    # window_start > T - S + i (even > T) means no visible key: the row is all -1 / -inf.
    B, S, T = 2, 6, 9
    q, k, w = int_inputs(B, S, T, 2, 16, device=DEV, seed=3)
    ws = torch.tensor(WINDOW_STARTS[case]).to(DEV)
    idx, sc = both(q, k, w, 4, backend, window_start=ws)
    scores = torch.einsum("bshd,btd->bsht", q.float(), k.float()).clamp_min(0).mul(w[..., None]).sum(2).cpu()
    start = (ws[:, None].expand(B, S) if ws.dim() == 1 else ws).cpu()
    for b in range(B):
        for i in range(S):
            vis = [int(start[b, i]) <= s <= T - S + i for s in range(T)]
            assert idx[b, i].tolist() == brute_force_topk(scores[b, i].tolist(), vis, 4), (b, i)
    empty = idx.cpu() < 0
    assert bool((sc.cpu()[empty] == -INF).all())
    assert bool(empty[0].all()) or case == "some-past-BS"


def overflow_inputs(dtype):
    """Key 0's dot product overflows fp32 in the middle of its sum (8 products of 9e38, then 8 of
    -9e38): summed in one order it is inf, in another NaN (or finite). Key 1 scores 9.6e20, key 2 0."""
    q = torch.full((1, 2, 2, 16), 3e19)
    k = torch.ones(1, 3, 16)
    k[0, 0, :8], k[0, 0, 8:] = 3e19, -3e19
    k[0, 2] = 0.0
    return q.to(dtype).to(DEV), k.to(dtype).to(DEV), torch.ones(1, 2, 2, device=DEV)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_dot_product_that_overflows_scores_nan_and_ranks_last(backend, dtype):
    q, k, w = overflow_inputs(dtype)
    idx, sc = both(q, k, w, 2, backend)
    assert idx[0, 1].tolist() == [1, 2]  # finite scores (9.6e20 and 0) first; the overflow below them
    idx, sc = both(q, k, w, 3, backend)
    assert idx[0, 1].tolist() == [0, 1, 2] and torch.isnan(sc[0, 1, 0])
    assert 9e20 < sc[0, 1, 1] < 1e21 and sc[0, 1, 2] == 0
    with pytest.raises(ValueError, match="non-finite"):
        hytopk(q, k, w, 2, check_nan=True, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("relu", [True, False])
def test_infinite_scores_and_inputs_rank_like_nan(backend, relu):
    # +inf / -inf head products, inf * 0 in w, a NaN input, an overflowing dot: every score that is not
    # finite counts as NaN, below every finite score, lower index first. A -inf product passes ReLU as
    # its exact value, 0 (so with ReLU key 1 is a finite 0, without it a non-finite -inf).
    D = 16
    q = torch.ones(1, 1, 2, D)
    k = torch.zeros(1, 7, D)
    k[0, 0, 0] = INF  # dot +inf in both heads
    k[0, 1, 0] = -INF  # dot -inf in both heads
    k[0, 2, 0] = 2.0  # finite: 2 * (w0 + w1)
    k[0, 3, 0] = NAN
    k[0, 4, 0] = 1e30  # 1e30 * w = 1.5e30: finite
    k[0, 5, 0] = -1.0  # relu: 0, else negative
    k[0, 6, 0] = 3e38
    k[0, 6, 1] = 3e38  # 6e38: overflows the dot
    w = torch.tensor([[[1.0, 0.5]]])
    q, k, w = q.to(DEV), k.to(DEV), w.to(DEV)
    idx, sc = both(q, k, w, 7, backend, relu=relu)
    assert idx[0, 0].tolist() == list(range(7)) and int(torch.isnan(sc).sum()) == (3 if relu else 4)
    # finite scores 1.5e30 (key 4), 3 (key 2), then 0 for keys 1 and 5 (relu) or -1.5 (key 5)
    idx3, sc3 = both(q, k, w, 3, backend, relu=relu)
    assert idx3[0, 0].tolist() == ([1, 2, 4] if relu else [2, 4, 5])
    assert bool(torch.isfinite(sc3).all())
    # without ReLU three scores are finite: the fourth key is the NaN class's lowest index
    idx4, sc4 = both(q, k, w, 4, backend, relu=relu)
    assert idx4[0, 0].tolist() == ([1, 2, 4, 5] if relu else [0, 2, 4, 5])
    assert bool(torch.isfinite(sc4).all()) if relu else bool(torch.isnan(sc4[0, 0, 0]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_returned_scores_carry_no_gradient(backend):
    q, k, w = int_inputs(1, 6, 6, 2, 16, device=DEV, dtype=torch.float32)
    q.requires_grad_()
    k.requires_grad_()
    w.requires_grad_()
    idx, sc = both(q, k, w, 3, backend)
    assert not idx.requires_grad and not sc.requires_grad
    loss = sc.clamp_min(0).sum() + (q.sum() + k.sum() + w.sum())  # a graph that also holds the scores
    loss.backward()
    assert torch.equal(q.grad, torch.ones_like(q))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("topk", [2**31, 2**40])
def test_topk_beyond_int32_is_refused_before_any_allocation(backend, topk):
    q, k, w = int_inputs(1, 4, 6, 2, 16, device=DEV)
    with pytest.raises(ValueError, match=r"topk must be <= 2\*\*31 - 1"):
        hytopk(q, k, w, topk, backend=backend)


def test_more_keys_than_int32_indices_hold_is_refused():
    # meta tensors: the check reads shapes only, so it can be tested without 2**31 keys of memory
    q = torch.empty(1, 1, 1, 1, device="meta")
    k = torch.empty(1, 2**31 + 1, 1, device="meta")
    w = torch.empty(1, 1, 1, device="meta")
    with pytest.raises(ValueError, match=r"k must have T <= 2\*\*31 keys"):
        hytopk(q, k, w, 4)


def test_meta_inputs_with_cu_seqlens_give_meta_outputs():
    q = torch.empty(1, 6, 2, 8, device="meta")
    k = torch.empty(1, 6, 8, device="meta")
    w = torch.empty(1, 6, 2, device="meta")
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    idx = hytopk(q, k, w, 3, cu_seqlens=cu)
    assert idx.device.type == "meta" and idx.shape == (1, 6, 3)
