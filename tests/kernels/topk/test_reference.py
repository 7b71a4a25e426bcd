"""The reference HyTopK (backend="torch") against a brute-force full sort, on the contract of docs/design.md section 2."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyscale_hf.kernels import hytopk
from hyscale_hf.kernels.topk.naive import hytopk_reference, indexer_scores, select_topk
from hyscale_hf.kernels.windows import SCORE_CHUNK_BYTES, query_chunk, query_windows
from tests.support.topk_cases import ADVERSARIAL_KINDS, adversarial_inputs, brute_force_topk, integer_inputs


def expected(q, k, w, topk, relu=True, cu_seqlens=None, window_start=None):
    scores = indexer_scores(q, k, w, relu=relu, cu_seqlens=cu_seqlens, window_start=window_start)
    B, S, T = scores.shape
    start, end = query_windows(B, S, T, cu_seqlens=cu_seqlens, window_start=window_start)
    out = torch.empty(B, S, topk, dtype=torch.int32)
    for b in range(B):
        for i in range(S):
            vis = [(int(start[b, i]) <= s <= int(end[b, i])) for s in range(T)]
            out[b, i] = torch.tensor(brute_force_topk(scores[b, i].tolist(), vis, topk))
    return out, scores


def check(q, k, w, topk, **kw):
    idx, sel = hytopk(q, k, w, topk, return_scores=True, backend="torch", **kw)
    want, scores = expected(q, k, w, topk, relu=kw.get("relu", True), cu_seqlens=kw.get("cu_seqlens"),
                            window_start=kw.get("window_start"))
    assert idx.dtype == torch.int32 and idx.shape == want.shape
    assert torch.equal(idx, want)
    # selected scores are aligned with the indices, -inf in padded slots
    gathered = scores.gather(-1, idx.clamp_min(0).long()).masked_fill(idx < 0, float("-inf"))
    assert torch.equal(sel, gathered)
    return idx


@pytest.mark.parametrize("kind", ADVERSARIAL_KINDS)
@pytest.mark.parametrize("relu", [True, False])
def test_adversarial_rows(kind, relu):
    g = torch.Generator().manual_seed(1)
    q, k, w = adversarial_inputs(kind, 2, 24, 24, 3, 4, generator=g)
    check(q, k, w, 5, relu=relu)


def test_more_zero_ties_than_k_pick_lowest_indices():
    q, k, w = adversarial_inputs("all_zero", 1, 20, 20, 2, 4)
    idx = check(q, k, w, 4)
    assert idx[0, -1].tolist() == [0, 1, 2, 3]  # all 0.0: the lowest indices win


def test_negative_zero_equals_positive_zero():
    # key 0 scores -0.0, key 1 scores +0.0, key 2 scores +0.0: with K = 2 the tie rule keeps {0, 1}
    q = torch.ones(1, 1, 1, 1)
    k = torch.tensor([[[0.0], [0.0], [0.0]]])
    w_neg = torch.tensor([[[-1.0]]])
    scores = torch.tensor([[[-0.0, 0.0, 0.0]]])
    vis = torch.ones(1, 1, 3, dtype=torch.bool)
    idx, _ = select_topk(scores, vis, 2)
    assert idx.tolist() == [[[0, 1]]]
    idx = hytopk(q, k, w_neg, 2, relu=False, backend="torch")  # scores are all -0.0 here
    assert idx.tolist() == [[[0, 1]]]


@pytest.mark.parametrize("topk", [1, 3, 8, 9, 12, 40])
def test_short_rows_exact_k_and_padding(topk):
    # T = 8 keys, S = 8 queries: query i sees i + 1 keys, so rows are shorter than, equal to and
    # longer than K; rows with fewer visible keys than K are -1 padded at the end
    g = torch.Generator().manual_seed(2)
    q, k, w = integer_inputs(1, 8, 8, 2, 4, generator=g)
    idx = check(q, k, w, topk)
    for i in range(8):
        row = idx[0, i].tolist()
        n = min(topk, i + 1)
        assert all(x >= 0 for x in row[:n]) and all(x == -1 for x in row[n:])
        assert row[:n] == sorted(row[:n])


def test_topk_at_least_t_returns_every_visible_key():
    g = torch.Generator().manual_seed(3)
    q, k, w = integer_inputs(2, 6, 10, 2, 4, generator=g)
    idx = hytopk(q, k, w, 16, backend="torch")
    for i in range(6):
        pos = 10 - 6 + i
        assert idx[0, i].tolist() == list(range(pos + 1)) + [-1] * (16 - pos - 1)


def test_fewer_queries_than_keys_sit_at_the_end():
    g = torch.Generator().manual_seed(4)
    q, k, w = integer_inputs(2, 5, 17, 3, 4, generator=g)
    idx = check(q, k, w, 6)
    assert int(idx[:, 0].max()) <= 17 - 5  # first query sits at position T - S


def test_packed_sequences_never_cross_a_boundary():
    g = torch.Generator().manual_seed(5)
    q, k, w = integer_inputs(1, 20, 20, 2, 4, generator=g)
    cu = torch.tensor([0, 7, 8, 15, 20], dtype=torch.int32)
    idx = check(q, k, w, 5, cu_seqlens=cu)
    for i in range(20):
        seq = int(torch.searchsorted(cu[1:], torch.tensor(i), right=True))
        chosen = [x for x in idx[0, i].tolist() if x >= 0]
        assert chosen and all(cu[seq] <= x <= i for x in chosen)


def test_window_start_hides_left_padding():
    g = torch.Generator().manual_seed(6)
    q, k, w = integer_inputs(2, 9, 9, 2, 4, generator=g)
    ws = torch.tensor([0, 4])
    idx = check(q, k, w, 3, window_start=ws)
    assert all(x == -1 for x in idx[1, :4].flatten().tolist())  # pad queries see nothing
    assert int(idx[1][idx[1] >= 0].min()) >= 4


def test_nan_ranks_below_minus_inf_and_check_nan_raises():
    scores = torch.tensor([[[float("nan"), float("-inf"), 1.0, float("nan")]]])
    vis = torch.tensor([[[True, True, True, False]]])
    idx, sel = select_topk(scores, vis, 3)
    assert idx.tolist() == [[[0, 1, 2]]]  # NaN selected last, the masked NaN never
    idx, _ = select_topk(scores, vis, 2)
    assert idx.tolist() == [[[1, 2]]]
    q = torch.ones(1, 2, 1, 1)
    k = torch.tensor([[[float("nan")], [1.0]]])
    w = torch.ones(1, 2, 1)
    assert hytopk(q, k, w, 1, backend="torch")[0, 1].tolist() == [1]
    with pytest.raises(ValueError, match="NaN"):
        hytopk(q, k, w, 1, backend="torch", check_nan=True)


def test_half_precision_inputs_score_in_fp32():
    g = torch.Generator().manual_seed(7)
    q, k, w = integer_inputs(1, 12, 12, 2, 8, generator=g)
    want = hytopk(q, k, w, 4, backend="torch")
    for dt in (torch.float16, torch.bfloat16):
        assert torch.equal(hytopk(q.to(dt), k.to(dt), w, 4, backend="torch"), want)


def test_chunking_does_not_change_the_result():
    g = torch.Generator().manual_seed(8)
    q, k, w = integer_inputs(2, 30, 40, 3, 4, generator=g)
    full = hytopk_reference(q, k, w, 7, chunk_size=30)
    for chunk in (1, 4, 7):
        assert torch.equal(hytopk_reference(q, k, w, 7, chunk_size=chunk)[0], full[0])


@settings(max_examples=60, deadline=None)
@given(
    B=st.integers(1, 2), S=st.integers(1, 12), extra=st.integers(0, 6), H=st.integers(1, 3),
    D=st.sampled_from([1, 2, 4]), topk=st.integers(1, 20), relu=st.booleans(), seed=st.integers(0, 2**16),
)
def test_property_matches_brute_force_sort(B, S, extra, H, D, topk, relu, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, w = integer_inputs(B, S, S + extra, H, D, lo=-2, hi=3, generator=g)
    check(q, k, w, topk, relu=relu)


def test_custom_op_is_visible_to_the_dispatcher_and_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert hasattr(torch.ops.hyscale, "hytopk")
    with FakeTensorMode():
        q = torch.empty(2, 5, 3, 4)
        k = torch.empty(2, 9, 4)
        w = torch.empty(2, 5, 3)
        idx, sc, lse = torch.ops.hyscale.hytopk(q, k, w, 6, None, None, True, False, "torch")
        lse_on = torch.ops.hyscale.hytopk(q, k, w, 6, None, None, True, False, "torch", False, True)[2]
    assert idx.shape == (2, 5, 6) and idx.dtype == torch.int32 and sc.dtype == torch.float32
    assert lse.shape == (2, 0) and lse_on.shape == (2, 5) and lse_on.dtype == torch.float32


def test_query_chunks_are_larger_on_cuda_where_launch_overhead_dominates():
    # The chunked torch paths size their chunks by device: CPU-sized chunks made the GPU dense
    # warm-up launch-bound. torch.device("cuda") is only inspected, so this runs without a GPU.
    cpu = query_chunk(2, 8, 8192, None, torch.device("cpu"))
    gpu = query_chunk(2, 8, 8192, None, torch.device("cuda"))
    assert cpu == SCORE_CHUNK_BYTES // (4 * 2 * 8 * 8192) == 64
    assert gpu == 16 * cpu
    assert query_chunk(2, 8, 8192, 5, torch.device("cuda")) == 5  # an explicit chunk wins
