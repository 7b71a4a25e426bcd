"""HyTopK's GPU kernels (Triton, and the Gluon scan on sm_90) at real sizes (H = 32, D = 128,
topk = 2048, T up to 16K).

Exactness: integer-valued inputs (q, k small integers, w multiples of 1/8) make every product and
partial sum exact in fp32, so the kernel's summation order cannot matter and the result must equal
the reference bit for bit; these inputs are also full of exact ties, which exercises the tie rule.
Continuous bf16 inputs sum in a different order than the reference, so for them we check that the
kernel's set is a valid exact top-k of the reference scores up to a tolerance of a few fp32 ulps
at the boundary (``assert_valid_topk``), and that repeated runs are bit-identical.
"""

import dataclasses

import pytest
import torch

from hyscale_hf.kernels import hytopk
from hyscale_hf.kernels.topk import host, hytopk_stats, hytopk_triton, pick_config, reset_hytopk_stats
from hyscale_hf.kernels.topk.naive import hytopk_reference
from tests.support.hytopk_cases import adversarial_inputs, assert_same, assert_valid_topk, int_inputs

pytestmark = pytest.mark.gpu
K = 2048


def ref_topk(q, k, w, topk, **kw):
    return hytopk_reference(q, k, w, topk, chunk_size=256, **kw)


@pytest.fixture(params=["default", "gluon"], ids=["default-scan", "gluon-scan"])
def scan(request, monkeypatch):
    """Runs a test with the scan ``hytopk`` picks at its size, and with the Gluon scan (sm_90) forced
    at every size (it runs from 64K keys per sequence by default; skipped where it cannot run)."""
    if request.param == "gluon":
        if host.scan_gluon is None or torch.cuda.get_device_capability() != (9, 0):
            pytest.skip("the Gluon scan is sm_90 only")
        monkeypatch.setattr(host, "GLUON_SCAN_MIN_KEYS", 0)
    return request.param


@pytest.mark.parametrize("T", [4096, 16384])
def test_random_integer_inputs_exact(T, scan):
    q, k, w = int_inputs(1, T, T, 32, 128, device="cuda", seed=T, qk_range=2)
    reset_hytopk_stats()
    got = hytopk(q, k, w, K, return_scores=True)  # backend="auto" picks Triton on CUDA
    assert_same(got, ref_topk(q, k, w, K), f"int T={T}")
    stats = hytopk_stats()
    print(f"T={T} stats {stats}")
    assert stats["calls"] == 1 and stats["rows"] == T


def test_lse_of_the_selection_at_32k():
    """return_lse at a real size (several query chunks on two lanes, a small indexer): each row's
    log-sum-exp of its selected scores, as the indexer KL's one pass takes it."""
    g = torch.Generator().manual_seed(3)
    T = 32768
    q = torch.randn(1, T, 4, 64, generator=g).to("cuda", torch.bfloat16)
    k = torch.randn(1, T, 64, generator=g).to("cuda", torch.bfloat16)
    w = torch.rand(1, T, 4, generator=g).cuda()
    idx, sc, lse = hytopk(q, k, w, K, return_scores=True, return_lse=True, backend="triton")
    assert torch.equal(idx, hytopk(q, k, w, K, backend="triton"))
    want = torch.logsumexp(sc.double(), dim=-1).float()
    torch.testing.assert_close(lse, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("T", [4096, 16384])
def test_adversarial_and_realistic_rows_exact(T, scan):
    """ReLU zero plateaus far larger than topk, monotone rows, one huge bucket of ties, many queries
    sharing a few strong keys (``adversarial_inputs``); every batch is its own pattern."""
    q, k, w = adversarial_inputs(T, T, 32, 128, device="cuda", seed=T, n_strong=40)
    got = hytopk(q, k, w, K, return_scores=True, backend="triton")
    assert_same(got, ref_topk(q, k, w, K), f"adversarial T={T}")


def test_continuous_bf16_valid_and_deterministic(scan):
    T = 16384
    g = torch.Generator(device="cuda").manual_seed(0)
    q = (torch.randn(1, T, 32, 128, device="cuda", generator=g) / 128**0.5).bfloat16()
    k = torch.randn(1, T, 128, device="cuda", generator=g).bfloat16()
    w = torch.rand(1, T, 32, device="cuda", generator=g) / 32
    runs = [hytopk(q, k, w, K, return_scores=True, backend="triton") for _ in range(3)]
    for idx, sc in runs[1:]:
        assert torch.equal(idx, runs[0][0]) and torch.equal(sc.view(torch.int32), runs[0][1].view(torch.int32))
    # scores are O(1); fp32 summation-order differences are ~1e-7 relative
    assert_valid_topk(*runs[0], q, k, w, K, tol=1e-5)


def test_recency_biased_scores_valid():
    """Realistic shape: a strong local window plus attention-sink keys over random scores."""
    T = 16384
    g = torch.Generator(device="cuda").manual_seed(1)
    q = (torch.randn(1, T, 32, 128, device="cuda", generator=g) / 128**0.5)
    k = torch.randn(1, T, 128, device="cuda", generator=g)
    pos = torch.arange(T, device="cuda", dtype=torch.float32)
    k[0, :, -1] = (pos / T) * 4  # later keys score higher for queries with q[..., -1] > 0 ...
    q[0, :, :, -1] = 1.0
    k[0, :4, -2] = 6.0  # ... and four sinks score high for everyone
    q[0, :, :, -2] = 1.0
    q, k = q.bfloat16(), k.bfloat16()
    w = torch.rand(1, T, 32, device="cuda", generator=g) / 32
    idx, sc = hytopk(q, k, w, K, return_scores=True, backend="triton")
    assert_valid_topk(idx, sc, q, k, w, K, tol=1e-5)


def test_packed_window_and_chunked_prefill_exact():
    T = 4096
    q, k, w = int_inputs(1, T, T, 32, 128, device="cuda", seed=5, qk_range=2)
    cu = torch.tensor([0, 1000, 1000, 3500, T], dtype=torch.int32, device="cuda")
    got = hytopk(q, k, w, K, cu_seqlens=cu, return_scores=True, backend="triton")
    assert_same(got, ref_topk(q, k, w, K, cu_seqlens=cu), "cu_seqlens")
    q, k, w = int_inputs(2, 512, T, 32, 128, device="cuda", seed=6, qk_range=2)  # S < T
    ws = torch.tensor([0, 777], device="cuda")
    got = hytopk(q, k, w, K, window_start=ws, return_scores=True, backend="triton")
    assert_same(got, ref_topk(q, k, w, K, window_start=ws), "S < T, window_start")


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointer-loads"])
def test_key_tiles_past_the_end_exact(tma):
    """Key tiles that run past T (T not a multiple of the tile) and past D (D = 96 in a 128-wide
    tile), two sequences: the TMA box and the pointer loads must both read zeros there."""
    T, D = 3000, 96
    q, k, w = int_inputs(2, T, T, 32, D, device="cuda", seed=9, qk_range=2)
    cfg = dataclasses.replace(pick_config(32, D, q.dtype, q.device), tma=tma)
    got = hytopk_triton(q, k, w, 512, config=cfg)
    assert_same(got, ref_topk(q, k, w, 512), f"T={T} D={D} tma={tma}")


def test_unaligned_keys_take_pointer_loads():
    """Keys whose base is not 16-byte aligned cannot go through TMA: the same exact result."""
    T = 1024
    q, k, w = int_inputs(1, T, T, 16, 64, device="cuda", seed=10, qk_range=2)
    k_odd = torch.empty(1, T * 64 + 1, dtype=k.dtype, device="cuda")[:, 1:].view(1, T, 64)
    k_odd.copy_(k)
    assert k_odd.data_ptr() % 16 != 0
    got = hytopk(q, k_odd, w, 256, return_scores=True, backend="triton")
    assert_same(got, ref_topk(q, k, w, 256), "unaligned k")


@pytest.mark.parametrize(
    "dtype,H,D,relu",
    [(torch.float16, 16, 64, True), (torch.float32, 64, 64, True), (torch.bfloat16, 8, 128, False),
     (torch.bfloat16, 2, 64, True), (torch.bfloat16, 4, 32, True)],
    ids=["fp16-H16-D64", "fp32-H64-D64", "bf16-H8-relu-off", "bf16-H2-D64", "bf16-H4-D32"],
)
def test_dtypes_heads_relu_exact(dtype, H, D, relu):
    T = 2048
    q, k, w = int_inputs(1, T, T, H, D, dtype=dtype, device="cuda", seed=7, qk_range=2)
    got = hytopk(q, k, w, 256, relu=relu, return_scores=True, backend="triton")
    assert_same(got, ref_topk(q, k, w, 256, relu=relu), f"{dtype} H={H} D={D} relu={relu}")


def test_nan_check_and_buffer_refine_counted():
    T = 4096
    q, k, w = int_inputs(1, T, T, 32, 128, device="cuda", seed=8, qk_range=2)
    k[0, 100] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        hytopk(q, k, w, K, check_nan=True, backend="triton")
    got = hytopk(q, k, w, K, return_scores=True, backend="triton")
    assert_same(got, ref_topk(q, k, w, K), "nan unchecked")
    # a small buffer (K + 256 keys) forces refines on every row with more visible keys than that
    # (without the threshold pre-pass, which would start most rows above most keys); the answer must
    # not change, and the refines are counted
    reset_hytopk_stats()
    no_presample = dataclasses.replace(pick_config(32, 128, q.dtype, q.device), presample=0)
    small = hytopk_triton(q, k, w, K, cap=K + 256, config=no_presample)
    assert_same(small, got, "small buffer")
    stats = hytopk_stats()
    assert stats["rows_refined"] >= 1024 and stats["refines"] > stats["rows_refined"]


def test_no_host_sync_without_packed_sequences():
    """Without cu_seqlens / window_start / check_nan the launch needs nothing from the GPU, so a call
    must not stall the host (a sync per indexer layer would starve the GPU while the host catches up)."""
    q, k, w = int_inputs(1, 4096, 4096, 32, 128, device="cuda", seed=5)
    hytopk(q, k, w, 2048, backend="triton")  # compile and allocate first
    torch.cuda.set_sync_debug_mode("error")
    try:
        hytopk(q, k, w, 2048, backend="triton")
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_chunks_over_lanes_exact_counted_and_sync_free():
    """Many query chunks spread over 1 or 3 lanes (CUDA streams), with a small buffer that forces
    refines in every chunk, and a NaN only the last chunk's rows see: the same exact sets, the
    same refine counts, the NaN found, and no host sync inside the call."""
    T = 4096
    q, k, w = int_inputs(1, T, T, 32, 128, device="cuda", seed=11, qk_range=2)
    ref = ref_topk(q, k, w, K)
    base = pick_config(32, 128, q.dtype, q.device)
    counts = []
    for lanes in (1, 3):
        cfg = dataclasses.replace(base, lanes=lanes, presample=0)  # every row fills its buffer
        reset_hytopk_stats()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = hytopk_triton(q, k, w, K, config=cfg, cap=K + 256, chunk_rows=600)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert_same(got, ref, f"lanes={lanes}")
        stats = hytopk_stats()
        assert stats["rows_refined"] >= 1024
        counts.append((stats["rows_refined"], stats["refines"]))
    assert counts[0] == counts[1]
    k_nan = k.clone()
    k_nan[0, T - 10] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        hytopk_triton(q, k_nan, w, K, config=dataclasses.replace(base, lanes=3), chunk_rows=600, check_nan=True)


@pytest.mark.parametrize("H,D", [(32, 128), (4, 64)])
def test_presample_rescues_exact_and_sync_free(H, D):
    """The threshold pre-pass with no margin (``presample_z = 0``: many long rows' estimates lie above
    their K-th key) rescues rows in every chunk, over two lanes, without a host sync, and
    returns the exact sets; the default margin rescues none of these rows."""
    T = 8192
    q, k, w = int_inputs(1, T, T, H, D, device="cuda", seed=13, qk_range=2)
    ref = ref_topk(q, k, w, K)
    base = pick_config(H, D, q.dtype, q.device)
    for z, rescues in ((0.0, True), (base.presample_z, False)):
        cfg = dataclasses.replace(base, presample_z=z)
        hytopk_triton(q, k, w, K, config=cfg, chunk_rows=1000)  # compile first
        reset_hytopk_stats()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = hytopk_triton(q, k, w, K, config=cfg, chunk_rows=1000, return_lse=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert_same(got, ref, f"presample z={z}")
        rescued = hytopk_stats()["rows_rescued"]
        assert (rescued > 100) if rescues else (rescued == 0), (z, rescued)


def test_presample_continuous_inputs_valid():
    """Continuous bf16 scores of a small indexer at 32K (no ties): the pre-pass's estimate lies below
    every row's K-th key and the sets are valid top-K sets, as without it."""
    g = torch.Generator().manual_seed(14)
    T = 32768
    # scores O(1), as in test_continuous_bf16_valid_and_deterministic: the tolerance is a few ulps there
    q = (torch.randn(1, T, 4, 64, generator=g) / 8).to("cuda", torch.bfloat16)
    k = torch.randn(1, T, 64, generator=g).to("cuda", torch.bfloat16)
    w = torch.rand(1, T, 4, generator=g).cuda() / 4
    reset_hytopk_stats()
    idx, sc, _ = hytopk_triton(q, k, w, K)
    assert hytopk_stats()["rows_rescued"] == 0
    # the last 512 rows, the longest (the reference is slow): as the last queries of the sequence
    # they see the same windows (query i of S sits at key T - S + i)
    assert_valid_topk(idx[:, -512:], sc[:, -512:], q[:, -512:], k, w[:, -512:], K, tol=1e-5)


class _LaunchCounter:
    """Stands in for a jitted kernel: counts ``kernel[grid](...)`` launches and forwards them."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.skipif(
    host.scan_gluon is None or not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="the Gluon scan is sm_90 only",
)
@pytest.mark.parametrize(
    "dtype,H,D,relu,columns",
    [(torch.bfloat16, 32, 128, True, None), (torch.float16, 64, 64, True, None), (torch.bfloat16, 32, 64, False, None),
     (torch.bfloat16, 4, 64, True, 64)],
    ids=["bf16-H32-D128", "fp16-H64-D64", "bf16-H32-D64-relu-off", "bf16-H4-D64-64cols"],
)  # fmt: skip
def test_gluon_scan_exact_like_the_triton_scan(monkeypatch, dtype, H, D, relu, columns):
    """The warp-specialised scan (sm_90) against the reference and the Triton scan: two sequences,
    the second one's windows starting late, a chunk size that is no multiple of the program's rows,
    a small buffer that forces refines, a NaN key, and the scoring-only sums. ``columns``: a small
    indexer opted in with ``HyTopKConfig.gluon_columns``."""
    T = 4096
    monkeypatch.setattr(host, "GLUON_SCAN_MIN_KEYS", 0)  # it runs from 64K keys by default
    q, k, w = int_inputs(2, T, T, H, D, dtype=dtype, device="cuda", seed=12, qk_range=2)
    k[1, 3000] = float("nan")
    ws = torch.tensor([0, 700], device="cuda")
    cfg = dataclasses.replace(pick_config(H, D, dtype, q.device), gluon_columns=columns)
    kw = dict(relu=relu, window_start=ws, cap=K + 256, chunk_rows=1500)
    counter = _LaunchCounter(host.scan_gluon.hytopk_scan_ws_kernel)
    monkeypatch.setattr(host.scan_gluon, "hytopk_scan_ws_kernel", counter)
    got = hytopk_triton(q, k, w, K, config=cfg, **kw)
    assert counter.launches > 0
    ref = ref_topk(q, k, w, K, relu=relu, window_start=ws)
    assert_same(got, ref, f"gluon scan {dtype} H={H} D={D} relu={relu}")
    with pytest.raises(ValueError, match="NaN"):
        hytopk_triton(q, k, w, K, config=cfg, check_nan=True, **kw)
    triton_cfg = dataclasses.replace(cfg, gluon_scan=False)
    launches = counter.launches
    assert_same(hytopk_triton(q, k, w, K, config=triton_cfg, **kw), ref, "triton scan")
    assert counter.launches == launches
    sums = hytopk_triton(q, k, w, K, config=cfg, profile="scoring", **kw)
    sums_triton = hytopk_triton(q, k, w, K, config=triton_cfg, profile="scoring", **kw)
    # integer inputs: every partial sum is exact (rows that see the NaN key sum to NaN in both)
    torch.testing.assert_close(sums, sums_triton, rtol=0, atol=0, equal_nan=True)
