"""HyTopK Triton kernel vs the exact torch reference (Triton's CPU interpreter when there is no GPU).

Tiny shapes: the interpreter runs every Triton op in numpy. ``SMALL`` forces a candidate buffer of
a few dozen slots and 8-key chunks, so rows overflow it and take the refine path (radix select +
in-place compaction) many times, on every adversarial pattern.
"""


import pytest
import torch

from hyscale_hf.kernels import hytopk
from hyscale_hf.kernels.topk import HyTopKConfig, host, hytopk_stats, hytopk_triton, reset_hytopk_stats
from hyscale_hf.kernels.topk.naive import hytopk_reference
from tests.support.hytopk_cases import adversarial_inputs, assert_same, assert_valid_topk, int_inputs

triton = pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
# 16-key tiles, slots only ceil(K / 16) + 2 deep: rows longer than 3 tiles get refined (often)
SMALL = {"config": HyTopKConfig(BQ=2, BN=16, CH=8), "cap": 1}


def run_both(q, k, w, topk, *, small=False, **kw):
    extra = SMALL if small else {}
    got = hytopk_triton(q, k, w, topk, **kw, **extra)
    ref = hytopk_reference(q, k, w, topk, **kw)
    return got, ref


@pytest.mark.parametrize("small,T", [(False, 32), (True, 64)], ids=["cap", "tinycap"])
def test_random_integer_inputs_bitwise(small, T):
    q, k, w = int_inputs(2, T, T, 8, 16, device=DEV, seed=1)
    reset_hytopk_stats()
    got, ref = run_both(q, k, w, 6, small=small)
    assert_same(got, ref, "random int")
    stats = hytopk_stats()
    assert stats["rows"] == 2 * T
    if small:  # rows of 4 tiles against 3-deep slots must have been refined
        assert stats["rows_refined"] > 0 and stats["refines"] >= stats["rows_refined"]
    else:
        assert stats["rows_refined"] == 0


@pytest.mark.parametrize("small,T", [(False, 24), pytest.param(True, 56, marks=pytest.mark.slow)], ids=["cap", "tinycap"])
def test_adversarial_rows_bitwise(small, T):
    """Zero plateaus (> K ties), all-zero and -0.0 rows, monotone rows, one huge bucket, shared strong keys;
    rows shorter than K and exactly K come from causality (query i sees i + 1 keys)."""
    q, k, w = adversarial_inputs(T, T, 4, 16, device=DEV, seed=2)
    got, ref = run_both(q, k, w, 8, small=small)
    assert_same(got, ref, "adversarial")
    # the plateau really is a plateau and the tie rule picked the lowest indices
    assert int((ref[1][0, -1] == 0).sum()) > 0


def test_all_negative_scores_tiny_buffer_bitwise():
    """Every score below zero (ReLU off, q . k < 0, w > 0) with a tiny buffer: every key the radix
    selects see has a negative mono, so their lower bound (the smallest score the scan stored, row
    state th[..., 2]) must go below zero; a bound clamped at 0 leaves every key out of the select."""
    g = torch.Generator().manual_seed(4)
    T, H, D = 64, 4, 16
    q = -torch.randint(1, 4, (1, T, H, D), generator=g).to(torch.bfloat16)
    k = torch.randint(1, 4, (1, T, D), generator=g).to(torch.bfloat16)
    w = torch.randint(1, 5, (1, T, H), generator=g).float() / 8
    reset_hytopk_stats()
    got, ref = run_both(q.to(DEV), k.to(DEV), w.to(DEV), 8, small=True, relu=False)
    assert bool((ref[1] < 0).all())
    assert_same(got, ref, "all scores negative")
    assert hytopk_stats()["rows_refined"] > 0


@pytest.mark.parametrize("bits", [pytest.param(3, marks=pytest.mark.slow), 8])
def test_radix_digit_widths_bitwise(bits):
    """8 or 256 buckets per radix level (default 128): more or fewer levels per select, same exact sets."""
    q, k, w = adversarial_inputs(40, 40, 4, 16, device=DEV, seed=2)
    small = {"config": HyTopKConfig(BQ=2, BN=16, CH=8, select_bits=bits), "cap": 1}
    got = hytopk_triton(q, k, w, 8, **small)
    assert_same(got, hytopk_reference(q, k, w, 8), f"{2**bits} buckets")


@pytest.mark.parametrize("copy", [True, False], ids=["bucket-copy", "buffer-levels"])
def test_final_selection_bucket_copy_bitwise(copy):
    """The final selection's later radix levels over a copy of the K-th key's bucket (the default; a
    bucket larger than the scratch's T / 32 keys stays on the buffer, as every row does without the
    copy): the same exact sets on adversarial rows (plateaus put many keys in one bucket) and on
    random integer rows (few keys a bucket)."""
    cfg = HyTopKConfig(BQ=4, BN=16, CH=8, finalize_copy=copy)
    for q, k, w in (adversarial_inputs(16, 96, 4, 16, device=DEV, seed=3), int_inputs(1, 16, 256, 4, 16, device=DEV, seed=5)):
        assert_same(hytopk_triton(q, k, w, 12, config=cfg), hytopk_reference(q, k, w, 12), f"copy={copy}")


@pytest.mark.parametrize("slack,relu", [(0.0, True), (1.0, False)])
def test_refine_slack_bitwise(slack, relu):
    """A refine keeping exactly K keys or all the room allows: the same exact sets (adversarial rows of
    97-112 keys, 7 tiles against 7-deep slots, so every row is refined)."""
    q, k, w = adversarial_inputs(16, 112, 4, 16, device=DEV, seed=2)
    reset_hytopk_stats()
    got = hytopk_triton(q, k, w, 8, relu=relu, config=HyTopKConfig(BQ=4, BN=16, CH=8, refine_slack=slack), cap=7 * 16)
    assert_same(got, hytopk_reference(q, k, w, 8, relu=relu), f"slack={slack} relu={relu}")
    assert hytopk_stats()["rows_refined"] == q.shape[0] * q.shape[1]


@pytest.mark.parametrize("slack", [-0.1, 1.5])
def test_refine_slack_out_of_range_is_rejected(slack):
    with pytest.raises(ValueError, match="refine_slack"):
        HyTopKConfig(BQ=2, BN=16, refine_slack=slack)


@pytest.mark.parametrize("bits", [2, 9])
def test_radix_digit_width_out_of_range_is_rejected(bits):
    with pytest.raises(ValueError, match="select_bits"):
        HyTopKConfig(BQ=2, BN=16, select_bits=bits)


def test_buffer_k_below_two_is_rejected():
    with pytest.raises(ValueError, match="buffer_k"):
        HyTopKConfig(BQ=2, BN=16, buffer_k=1)


@pytest.mark.parametrize("buffer_k", [2, 8])
def test_buffer_k_sizes_the_candidate_buffer(buffer_k):
    """The config's buffer size (no ``cap``): a 2 * K buffer refines rows an 8 * K one never does,
    and both return the exact sets."""
    q, k, w = adversarial_inputs(8, 320, 4, 16, device=DEV, seed=3)  # 20 key tiles; K = 64: 4 slots deep
    reset_hytopk_stats()
    got = hytopk_triton(q, k, w, 64, config=HyTopKConfig(BQ=4, BN=16, CH=8, buffer_k=buffer_k))
    assert_same(got, hytopk_reference(q, k, w, 64), f"buffer_k={buffer_k}")
    refined = hytopk_stats()["rows_refined"]
    assert (refined > 0) if buffer_k == 2 else (refined == 0), refined


def test_zero_lanes_is_rejected():
    with pytest.raises(ValueError, match="lanes"):
        HyTopKConfig(BQ=2, BN=16, lanes=0)


def test_zero_gluon_stages_is_rejected():
    with pytest.raises(ValueError, match="gluon_stages"):
        HyTopKConfig(BQ=2, BN=16, gluon_stages=0)


@pytest.mark.parametrize(
    "dtype,H,D",
    [(torch.float16, 16, 16), (torch.float32, 3, 24), (torch.bfloat16, 64, 16), (torch.bfloat16, 8, 64)],
    ids=["fp16-H16", "fp32-H3-D24", "bf16-H64", "bf16-D64"],
)
def test_dtypes_heads_dims(dtype, H, D):
    q, k, w = int_inputs(1, 24, 24, H, D, dtype=dtype, device=DEV, seed=3)
    got, ref = run_both(q, k, w, 5, small=True)
    assert_same(got, ref, f"{dtype} H={H} D={D}")


def test_relu_off_negative_scores():
    q, k, w = int_inputs(1, 32, 32, 4, 16, device=DEV, seed=4)
    got, ref = run_both(q, k, w, 7, relu=False, small=True)
    assert_same(got, ref, "relu off")
    assert bool((ref[1][ref[0] >= 0] < 0).any()), "test needs negative selected scores"


def test_packed_sequences_and_window_start():
    q, k, w = int_inputs(1, 40, 40, 4, 16, device=DEV, seed=5)
    cu = torch.tensor([0, 9, 9, 30, 40], dtype=torch.int32, device=DEV)  # with an empty sequence
    got, ref = run_both(q, k, w, 6, cu_seqlens=cu, small=True)
    assert_same(got, ref, "cu_seqlens")
    q, k, w = int_inputs(2, 32, 32, 4, 16, device=DEV, seed=6)
    for ws in (
        torch.tensor([3, 17], device=DEV),
        torch.randint(-2, 34, (2, 32), device=DEV),  # per query, incl. empty and negative windows
    ):
        got, ref = run_both(q, k, w, 6, window_start=ws, small=True)
        assert_same(got, ref, f"window_start {tuple(ws.shape)}")


def test_fewer_queries_than_keys_and_topk_at_least_T():
    q, k, w = int_inputs(2, 10, 48, 4, 16, device=DEV, seed=7)  # chunked prefill / decode: S < T
    got, ref = run_both(q, k, w, 6, small=True)
    assert_same(got, ref, "S < T")
    q, k, w = int_inputs(1, 20, 20, 4, 16, device=DEV, seed=8)
    for topk in (20, 33):  # K == T and K > T: every visible key, then -1 / -inf padding
        got, ref = run_both(q, k, w, topk)
        assert_same(got, ref, f"topk={topk}")
        assert bool((got[0][0, -1, :20] == torch.arange(20, device=DEV)).all())


def test_nan_scores():
    q, k, w = int_inputs(1, 24, 24, 4, 16, device=DEV, seed=9)
    k[0, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        hytopk_triton(q, k, w, 4, check_nan=True)
    for relu in (True, False):  # unchecked: NaN ranks below every finite score (and -inf), above masked
        got, ref = run_both(q, k, w, 8, relu=relu, small=True)
        assert_same(got, ref, f"nan relu={relu}")
    assert bool(torch.isnan(got[1][0, 5]).any()), "a row with few keys must keep the NaN key"


def test_continuous_inputs_valid_topk():
    g = torch.Generator().manual_seed(10)
    q = torch.randn(1, 32, 8, 16, generator=g).to(DEV)
    k = torch.randn(1, 32, 16, generator=g).to(DEV)
    w = torch.rand(1, 32, 8, generator=g).to(DEV)
    idx, sc, _ = hytopk_triton(q, k, w, 5, **SMALL)
    assert_valid_topk(idx, sc, q, k, w, 5, tol=1e-5)


def test_public_api_determinism_and_return_scores():
    q, k, w = int_inputs(1, 24, 24, 4, 16, device=DEV, seed=11)
    a = hytopk(q, k, w, 6, return_scores=True, backend="triton")
    b = hytopk(q, k, w, 6, return_scores=True, backend="triton")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    only_idx = hytopk(q, k, w, 6, backend="triton")
    assert torch.equal(only_idx, a[0])
    idx, scores, lse = torch.ops.hyscale.hytopk(q, k, w, 6, None, None, True, False, "triton", False)
    assert torch.equal(idx, a[0]) and scores.shape == (1, 24, 0) and lse.shape == (1, 0)
    assert_same(a, hytopk_reference(q, k, w, 6), "public api")
    idx_l, lse = hytopk(q, k, w, 6, return_lse=True, backend="triton")
    idx_s, sc_s, lse_s = hytopk(q, k, w, 6, return_scores=True, return_lse=True, backend="triton")
    assert torch.equal(idx_l, a[0]) and torch.equal(idx_s, a[0]) and torch.equal(sc_s, a[1])
    assert lse.shape == (1, 24) and torch.equal(lse, lse_s)


@pytest.mark.parametrize("backend,return_scores,return_lse", [("triton", False, True), ("torch", True, False),
                                                              ("torch", False, True)])
def test_custom_op_schema_and_fake(backend, return_scores, return_lse):
    """The dispatcher-visible op (selection replay, torch.compile) is consistent with its fake."""
    q, k, w = int_inputs(1, 12, 12, 4, 16, device=DEV, seed=12)
    args = (q, k, w, 5, None, None, True, False, backend, return_scores, return_lse)
    torch.library.opcheck(torch.ops.hyscale.hytopk.default, args)


def _assert_lse_of_selection(lse, scores, what):
    """``lse`` is each row's log-sum-exp of its selected scores (-inf for no key, NaN with a NaN score)."""
    want = torch.logsumexp(scores.double(), dim=-1).float()
    torch.testing.assert_close(lse, want, rtol=1e-6, atol=1e-6, equal_nan=True, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("relu", [True, False])
def test_lse_of_the_selection(relu):
    """return_lse: the finalize's log-sum-exp of the kept scores equals the reference's logsumexp of the
    selected scores: rows refined many times (tiny buffer), several query chunks, rows with fewer than K
    keys, rows without a key (window_start past the query) and continuous scores of both signs."""
    g = torch.Generator().manual_seed(21)
    q = torch.randn(2, 40, 4, 16, generator=g).to(DEV)
    k = torch.randn(2, 56, 16, generator=g).to(DEV)
    w = torch.randn(2, 40, 4, generator=g).to(DEV)
    ws = torch.randint(0, 30, (2, 40), generator=g)
    ws[0, :3] = 10**6  # past every key: no visible key, lse -inf
    ws = ws.to(DEV)
    idx, sc, lse = hytopk_triton(q, k, w, 12, relu=relu, window_start=ws, return_lse=True, chunk_rows=16, **SMALL)
    assert lse.shape == (2, 40) and lse.dtype == torch.float32
    assert bool((lse[0, :3] == float("-inf")).all())
    _assert_lse_of_selection(lse, sc, f"relu={relu}")
    ref_idx, ref_sc = hytopk_reference(q, k, w, 12, relu=relu, window_start=ws)
    ref_lse = hytopk(q, k, w, 12, relu=relu, window_start=ws, return_lse=True, backend="torch")[1]
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    no_lse = hytopk_triton(q, k, w, 12, relu=relu, window_start=ws, chunk_rows=16, **SMALL)
    assert torch.equal(no_lse[0], idx) and no_lse[2].shape == (2, 0)


def test_lse_with_nan_scores():
    q, k, w = int_inputs(1, 24, 24, 4, 16, device=DEV, seed=9)
    k[0, 5] = float("nan")
    idx, sc, lse = hytopk_triton(q, k, w, 8, return_lse=True, **SMALL)
    has_nan = torch.isnan(sc).any(-1)
    assert bool(has_nan.any()) and bool((~has_nan).any())
    assert bool(torch.isnan(lse[has_nan]).all()) and bool(torch.isfinite(lse[~has_nan]).all())
    _assert_lse_of_selection(lse, sc, "nan")


@pytest.mark.parametrize("S,T,BQ,BN,R", [(37, 37, 4, 16, 8), (20, 50, 2, 16, 6), (64, 64, 8, 64, 64), (5, 300, 4, 16, 4)])
def test_chunk_tiles_counts_the_longest_block_walk(S, T, BQ, BN, R):
    """Scan launches per chunk = the tiles its longest block walks (brute force below); without
    cu_seqlens / window_start the host uses a no-sync formula, which must agree on causal windows."""
    g = torch.Generator().manual_seed(S + T)
    for start in (torch.zeros(2, S, dtype=torch.int32), torch.randint(0, T, (2, S), generator=g, dtype=torch.int32)):
        want = []
        for i0 in range(0, S, R):
            best = 0
            for b0 in range(i0, min(S, i0 + R), BQ):
                for b in range(2):  # a block of batch row b: BQ rows of the chunk
                    win = [(int(start[b, i]), T - S + i) for i in range(b0, min(S, i0 + R, b0 + BQ))]
                    win = [(lo, hi) for lo, hi in win if lo <= hi]
                    if win:
                        best = max(best, max(hi for _, hi in win) // BN - min(lo for lo, _ in win) // BN + 1)
            want.append(best)
        assert host.chunk_tiles(start, T, BQ, BN, R) == want
        if not bool(start.any()):
            assert want == [(T - S + min(S, i0 + R) - 1) // BN + 1 for i0 in range(0, S, R)]


def test_score_only_sums_each_rows_visible_scores():
    """The benchmarks' scoring-only knob: per-row sums of the visible indexer scores, B = 2, several chunks."""
    q, k, w = int_inputs(2, 24, 40, 4, 16, seed=3, device=DEV)
    got = hytopk_triton(q, k, w, 8, profile="scoring", chunk_rows=8)
    scores = torch.einsum("bshd,btd->bsht", q.double(), k.double()).relu().mul(w.double()[..., None]).sum(2)
    visible = torch.arange(40)[None, :] <= (40 - 24 + torch.arange(24))[:, None]
    want = scores.cpu().masked_fill(~visible, 0).sum(-1)
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-6, atol=1e-6)


class _FakeCompiled:  # the parts of a compiled Triton kernel that _resident_programs reads
    def __init__(self, n_regs, num_warps, shared):
        self.n_regs, self.metadata = n_regs, type("M", (), {"num_warps": num_warps, "shared": shared})()

    def _init_handles(self):
        pass


@pytest.mark.parametrize(
    "n_regs, warps, shared, per_sm",
    [
        (128, 4, 4096, 4),  # the final selection on an H100: Nsight Compute's "Block Limit Registers" 4
        (144, 4, 4096, 3),  # with the lse: 144 registers round to 4608 a warp
        (94, 4, 20496, 5),  # the small-indexer scan: Nsight Compute says 5 (registers)
        (32, 4, 120_000, 1),  # shared memory bounds it
        (16, 4, 0, 16),  # warps bound it: 2048 threads an SM
    ],
)
def test_resident_programs_counts_what_fits_on_an_sm(monkeypatch, n_regs, warps, shared, per_sm):
    props = type("P", (), dict(multi_processor_count=132, max_threads_per_multi_processor=2048,
                               shared_memory_per_multiprocessor=233472))()  # fmt: skip
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    assert host._resident_programs(_FakeCompiled(n_regs, warps, shared), torch.device("cuda", 0)) == 132 * per_sm


def test_finalize_programs_before_and_after_the_first_launch(monkeypatch):
    props = type("P", (), dict(multi_processor_count=132))()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(host, "_FINALIZE_FIT", {})
    dev, key = torch.device("cuda", 0), ("a config",)
    assert host._finalize_programs(dev, key) == 6 * 132  # not launched yet
    host._FINALIZE_FIT[(0, key)] = 528
    assert host._finalize_programs(dev, key) == 528
    assert host._finalize_programs(dev, ("another",)) == 6 * 132
    assert host._finalize_programs(torch.device("cpu"), key) == 4


def test_gluon_columns_are_validated_and_opt_small_indexers_in():
    with pytest.raises(ValueError, match="gluon_columns"):
        HyTopKConfig(BQ=2, BN=16, gluon_columns=96)
    default, narrow = HyTopKConfig(BQ=8, BN=64), HyTopKConfig(BQ=8, BN=64, gluon_columns=64)
    # the default: 32 or 64 heads from 64K keys a sequence, as measured
    assert host.gluon_scan_shape_ok(default, 32, 128, 65536) and not host.gluon_scan_shape_ok(default, 32, 128, 32768)
    assert not host.gluon_scan_shape_ok(default, 4, 64, 131072)
    # a width set: any power-of-two H >= 2 with a multiple of 4 queries a warpgroup, at any length
    assert host.gluon_scan_shape_ok(narrow, 4, 64, 8192) and host.gluon_scan_shape_ok(narrow, 2, 64, 8192)
    assert host.gluon_scan_shape_ok(narrow, 16, 64, 8192)
    assert not host.gluon_scan_shape_ok(narrow, 32, 64, 8192)  # 2 queries a warpgroup
    assert not host.gluon_scan_shape_ok(narrow, 3, 64, 8192) and not host.gluon_scan_shape_ok(narrow, 1, 64, 8192)
    assert not host.gluon_scan_shape_ok(narrow, 4, 48, 8192)  # D not a power of two
    assert host.gluon_columns(default) == host.GLUON_SCAN_COLUMNS and host.gluon_columns(narrow) == 64
