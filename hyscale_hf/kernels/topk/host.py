"""Host code of HyTopK's Triton path: launch config, scratch, chunking over CUDA streams, counters.

The kernels live in ``triton_kernels.py`` (the algorithm is described there) and, for the scan on
sm_90 with long inputs, in ``scan_gluon.py``. ``hytopk_triton`` is the launch; it is public so that
tests and tuning scripts can choose the tiling (``HyTopKConfig``), the candidate buffer and the
rows per launch, and time the scan alone or the scoring alone (``profile``).
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

import torch

from ..windows import query_windows
from .naive import NAN_MESSAGE, hytopk_reference, selected_lse

try:  # Triton is optional (CPU-only installs on other platforms); the torch path always works.
    import triton

    from . import triton_kernels as _kernels
except ImportError:  # pragma: no cover
    triton = None
    _kernels = None
try:  # host-side TMA descriptors (Triton >= 3.4); without them the scan loads keys through pointers
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None
try:  # the warp-specialised Hopper scan (Gluon); a Triton without Gluon's Hopper names runs the Triton scan
    from triton.experimental.gluon import language as _gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as _GluonTensorDescriptor

    from . import scan_gluon
except (ImportError, AttributeError):  # pragma: no cover
    scan_gluon = None

# Whether this build has the Triton kernels (the op's "triton" backend).
HAS_TRITON = _kernels is not None

# ----------------------------------------------------------------------------- Triton backend

# Global scratch for the per-row candidate buffers of one launch (about 8 * topk int64 keys per row).
# Longer inputs run in query chunks that reuse it, so extra memory stays O(B*S*topk) + this.
SCRATCH_BYTES = 1 << 30
# Largest K (= min(topk, T)) the Triton path takes; larger K use the (exact) torch path. The bound
# dates from the final selection's old in-register sort; the GPU tests go up to K = 2048.
MAX_TRITON_TOPK = 4096
# Scratch of the final per-row selection (bitmaps + word ranks of its persistent programs).
FINALIZE_SCRATCH_BYTES = 128 << 20
# The scan's SEG (key tiles per launch) when one launch covers whole windows (``one_launch``).
WHOLE_WINDOW = 1 << 30
# Rows per program of the pre-pass's short-row check (``hytopk_short_rows_kernel``).
SHORT_ROWS_BLOCK = 128
# Rows per step of the flagged-row list (``hytopk_flagged_rows_kernel``: one program a sequence).
FLAGGED_ROWS_BLOCK = 1024

_STATS: dict = {"calls": 0, "rows": 0}
_STATS_DEVICE: dict = {}  # device -> int64 [3]: rows refined, refinements, rows rescued (added without a sync)


def hytopk_stats() -> dict:
    """Counters of the Triton HyTopK since the last ``reset_hytopk_stats()`` (synchronises).

    ``rows``: query rows processed; ``rows_refined``: rows whose candidate buffer filled up and was
    refined in place (a new exact threshold from a radix select over the buffer, then compaction:
    repaired, never truncated), or, after the pre-pass, rescanned from the K-th key it held (the
    one-launch scan's second chance); ``refines``: total refinements; ``rows_rescued``: rows whose
    threshold pre-pass estimate lay above their K-th key, or that filled a slot in both one-launch
    passes, completed by rescoring their keys (exact, slower).
    """
    refined, refines, rescued = (sum(int(t[i]) for t in _STATS_DEVICE.values()) for i in range(3))
    return {
        "calls": _STATS["calls"], "rows": _STATS["rows"], "rows_refined": refined, "refines": refines,
        "rows_rescued": rescued,
    }  # fmt: skip


def reset_hytopk_stats() -> None:
    _STATS.update(calls=0, rows=0)
    _STATS_DEVICE.clear()


@dataclass(frozen=True)
class HyTopKConfig:
    """Tile shape of the scan kernel: BQ query rows x all heads (matmul N) by BN keys (matmul M)."""

    BQ: int
    BN: int
    num_warps: int = 8
    num_stages: int = 2
    CH: int = 1024  # buffer keys per step of the radix select / compaction
    maxnreg: int | None = None  # register cap per thread (more programs per SM)
    finalize_warps: int = 4  # warps of the per-row final selection
    # Register cap of the final selection (GPU only; None: ptxas's choice). Its sm_90 code needs 168
    # registers uncapped (3 programs of 4 warps an SM) and spills 8 B under 128 (4 programs).
    finalize_maxnreg: int | None = 128
    # The final selection reads a row's buffer through L1 (``.ca``), so its four passes over the row
    # can hit there instead of L2; False: L2 only (``.cg``), the A/B baseline.
    finalize_l1: bool = True
    refine_warps: int = 4  # warps of the per-row buffer refine
    # Radix select digit: 2**select_bits histogram buckets per level. H200, T = 128K, bits 8 / 7 / 6 /
    # 5 / 4: refines 24.3 / 22.6 / 24.0 / 24.7 / 29.5 ms, final selection 15.4 / 13.7 / 13.9 / 15.1 /
    # 17.1 ms (tl.histogram's cost grows with the bucket count, fewer buckets need more levels).
    # H100, 4 x 64 at 32K, indices + lse, bits 8 / 7 / 6 / 5 / 4: whole op back to back 6.69 /
    # 6.45-6.46 / 6.52 / 6.52 / 7.01 ms (``bench_hytopk.py --sweep-digits``).
    select_bits: int = 7
    # Key tiles of the scan through the copy engine (a TMA tensor descriptor) where the keys allow
    # it (GPU only): H200, T = 128K: scan 143-146 ms against 150-154 ms with pointer loads.
    tma: bool = True
    # Query chunks run in this many lanes (CUDA streams, each with its share of the scratch), so one
    # chunk's refines and final selection (memory-bound) overlap another chunk's scan (GPU only).
    lanes: int = 2
    # The warp-specialised Gluon scan on sm_90 (``scan_gluon``) where it applies, with this
    # many key tiles in its ring (H200, T = 128K: 4 stages 151.1 ms, 3 stages 154.5 ms).
    gluon_scan: bool = True
    gluon_stages: int = 4
    # Product columns (queries x heads) per selection warpgroup of the Gluon scan. None: the measured
    # default, GLUON_SCAN_COLUMNS for 32 or 64 heads from GLUON_SCAN_MIN_KEYS keys. A width set here
    # (64, 128 or 256) opts any H whose queries per warpgroup (width // H) are a multiple of 4 into the
    # Gluon scan at any length: small indexers then share each key tile among 2 * width // H queries
    # (the Triton scan's 8 wait on their tiles' copies). H100, 4 x 64 at 32K, indices + lse: 6.89 ms
    # of GPU time a call (CUDA graph replay) at 64 columns against 6.24 for the Triton scan
    # (``bench_hytopk.py --sweep-stages``, benchmarks/notes.md), so none is the default.
    gluon_columns: int | None = None
    # How many keys above K a refine keeps, as a share of the room a scan segment leaves in the buffer
    # (``(SC - SEG) * BN - K``). A large share stops the radix select after fewer levels but leaves a
    # lower threshold, so the scan appends (and later refines and the final selection read) more keys.
    # ``pick_config`` takes 0.1 for small indexers (measured there); 0.5 is the rule the H = 32 tiles
    # were tuned with (0.1 measured the same there).
    refine_slack: float = 0.5
    # Candidate buffer keys per row, in multiples of K (rounded up to a power of two). It also bounds
    # the query rows per chunk (SCRATCH_BYTES over the buffer), and so the scan's programs per launch.
    buffer_k: int = 8
    # Threshold pre-pass (``presample_plan``): each row's threshold starts at an estimate of its K-th
    # score from every ``presample``-th key instead of at the smallest key, so the scan appends about
    # K + z * sqrt(K * presample) keys a row instead of filling and refining its buffer; 0 turns it off.
    # H100, indices + lse, whole op, strides 0 / 8 / 16 / 32 in one run: 4 x 64 at 32K 9.37 / 7.97 /
    # 7.89 / 8.15 ms, 32 x 128 at 128K 154.7 / 158.7 / 144.2 / 139.1 ms (`--sweep-presample`).
    # ``presample_z`` is the estimate's margin in standard deviations of the sample count: a row whose
    # estimate still lies above its K-th key (none in that run at z = 5; at z = 4 one a call at 32K and
    # seven at 128K; most long rows at z = 0, which tests use) is rebuilt by ``hytopk_rescue_kernel``:
    # exact, but slow: 1.7 ms of rescue kernel for the one row at 32K, 42.8 ms for the seven at 128K.
    presample: int = 32
    presample_z: float = 5.0
    # The final selection copies the keys of the radix bucket that holds a row's K-th key (usually a few
    # dozen) to its scratch after the first level and runs the later levels over them, not the buffer
    # (``triton_kernels._exact_threshold``); False keeps every level on the buffer (the A/B baseline).
    finalize_copy: bool = True

    def __post_init__(self):
        # fewer than 8 buckets can leave a narrow range in one bucket: the select would not progress
        if not 3 <= self.select_bits <= 8:
            raise ValueError(f"HyTopKConfig.select_bits must be in [3, 8], got {self.select_bits}")
        if self.lanes < 1:
            raise ValueError(f"HyTopKConfig.lanes must be >= 1, got {self.lanes}")
        if self.gluon_stages < 1:
            raise ValueError(f"HyTopKConfig.gluon_stages must be >= 1, got {self.gluon_stages}")
        if self.gluon_columns not in (None, 64, 128, 256):
            raise ValueError(f"HyTopKConfig.gluon_columns must be None, 64, 128 or 256, got {self.gluon_columns}")
        if not 0.0 <= self.refine_slack <= 1.0:
            raise ValueError(f"HyTopKConfig.refine_slack must be in [0, 1], got {self.refine_slack}")
        if self.buffer_k < 2:
            raise ValueError(f"HyTopKConfig.buffer_k must be >= 2, got {self.buffer_k}")
        if self.presample == 1 or self.presample < 0:
            raise ValueError(f"HyTopKConfig.presample must be 0 (off) or >= 2, got {self.presample}")
        if not -10.0 <= self.presample_z <= 10.0:
            raise ValueError(f"HyTopKConfig.presample_z must be in [-10, 10], got {self.presample_z}")


def _interpreting(device: torch.device) -> bool:
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def padded_heads(H: int) -> int:
    """Heads the scan's columns hold: a power of two >= 2. Its column order pairs heads two by two
    (``hytopk_scan_kernel``), so one head is padded with a second of zero weight (masked out)."""
    return max(2, triton.next_power_of_2(H))


def pick_config(H: int, D: int, dtype: torch.dtype, device: torch.device) -> HyTopKConfig:
    hp = padded_heads(H)
    if _interpreting(device):  # tiny tiles: the interpreter runs every op in numpy
        return HyTopKConfig(BQ=max(2, 32 // hp), BN=16, num_warps=4, num_stages=1, CH=64)
    if dtype == torch.float32:  # ieee fp32 dot (exact products): no tensor-core speed anyway
        return HyTopKConfig(BQ=max(1, 64 // hp), BN=64, num_warps=4, num_stages=2)
    # Measured on an H200 (H = 32, D = 128, bf16, T = 32K and 128K): BN = 64 keys by BQ * H = 128
    # with 4 warps scored fastest (several programs per SM hide each other's epilogues).
    if hp >= 16:
        return HyTopKConfig(BQ=max(1, 128 // hp), BN=64, num_warps=4, num_stages=2)
    # Small indexers (converted dense models: 2 x 64, 4 x 64): 128 // hp queries per program leave a
    # chunk of ~4K rows only 32-64 programs for 132 SMs. 8 queries per program, H200, T = 32K / 128K,
    # whole op: H = 2, 10.8 / 88.2 ms against 13.7 / 113.2 ms with 64; H = 4, 9.7 / 89.7 ms against
    # 10.5 ms at 32K with 32 (`bench_hytopk.py --heads H --dim 64 --sweep 32768 131072`).
    # Refines keep a tenth of the buffer's room above K, not half: H100, H = 2, D = 64, whole op
    # 9.39 / 93.8 ms at 32K / 128K against 10.27 / 98.5 (`--sweep-refine`, same run); on a trained
    # SmolLM2 indexer's own inputs at 128K 72.7 / 87.3 / 89.4 ms against 74.4 / 89.2 / 93.5 (layers
    # 0 / 15 / 29, `bench_trained_selections.py`). No slack at all made the refines slower (more levels).
    return HyTopKConfig(BQ=8, BN=64, num_warps=4, num_stages=2, refine_slack=0.1)


# Product columns (queries x heads) per selection warpgroup of the Gluon scan.
GLUON_SCAN_COLUMNS = 256
# Keys per sequence from which the Gluon scan runs: one program per SM of 16 queries leaves SMs idle
# at the end of each launch, which long windows amortise. H200, H = 32, same runs, scan kernel time:
# 8K 0.69 against 0.56 ms for the Triton scan, 32K 10.3 against 9.4-10.0, 64K 41.4-43.5 against
# 44.3, 128K whole op 151.1 against 162.3 ms (benchmarks/notes.md).
GLUON_SCAN_MIN_KEYS = 65536


def gluon_columns(cfg: HyTopKConfig) -> int:
    """Product columns per selection warpgroup of the Gluon scan (``HyTopKConfig.gluon_columns``)."""
    return GLUON_SCAN_COLUMNS if cfg.gluon_columns is None else cfg.gluon_columns


def _gluon_scan_applies(q, k, cfg: HyTopKConfig, interp: bool, cu_seqlens) -> bool:
    """The Gluon scan (``scan_gluon``) takes sm_90 with bf16/fp16 keys through TMA and the shapes of
    ``gluon_scan_shape_ok``; ``HyTopKConfig.gluon_scan = False`` turns it off (the Triton scan then runs)."""
    if scan_gluon is None or interp or not cfg.gluon_scan or not q.is_cuda:
        return False
    n_seqs = 1 if cu_seqlens is None else cu_seqlens.numel() - 1
    return (
        torch.cuda.get_device_capability(q.device) == (9, 0) and q.dtype in (torch.bfloat16, torch.float16)
        and cfg.tma and cfg.BN == 64 and gluon_scan_shape_ok(cfg, q.shape[2], q.shape[3], k.shape[1] / n_seqs)
        and k.data_ptr() % 16 == 0
    )  # fmt: skip


def gluon_scan_shape_ok(cfg: HyTopKConfig, H: int, D: int, keys_per_seq: float) -> bool:
    """The shape half of ``_gluon_scan_applies``: D a power of two in [16, 256]; by default H 32 or 64
    (BQ = 256 / H queries per warpgroup: its column order needs a multiple of 4, and more queries
    would need more registers for their row state) with on average at least ``GLUON_SCAN_MIN_KEYS``
    keys per sequence; with ``gluon_columns`` set, any power of two H >= 2 (heads pair two by two in
    the column order) that divides it into a multiple of 4 queries, at any length."""
    if D not in (16, 32, 64, 128, 256):
        return False
    if cfg.gluon_columns is None:
        return H in (32, 64) and keys_per_seq >= GLUON_SCAN_MIN_KEYS
    return H >= 2 and H & (H - 1) == 0 and cfg.gluon_columns % (4 * H) == 0


# Programs of the persistent final selection that fit on a device at once, per (device, compile
# key): measured from the first launch's compiled kernel. Until then (the first call), 6 per SM.
_FINALIZE_FIT: dict = {}


def _finalize_programs(device: torch.device, key: tuple) -> int:
    """Grid of the persistent final selection: as many programs as fit on the device at once (4 on
    the interpreter, which still walks several rows per program). A grid larger than what fits runs
    as a second, partial wave: on an H100 (4 x 64 indexer, T = 32K) 792 programs of 128 registers
    ran as 1.5 waves (Nsight Compute), each program's rows after the first wave's."""
    if device.type != "cuda":
        return 4
    fit = _FINALIZE_FIT.get((device.index, key))
    return fit if fit is not None else 6 * torch.cuda.get_device_properties(device).multi_processor_count


def _launch_options(interp: bool, num_warps: int, maxnreg: int | None = None, **others) -> dict:
    """A Triton launch's compile options: none on the interpreter (it compiles nothing), else the warps,
    ``others`` and the register cap where one is set."""
    if interp:
        return {}
    return {"num_warps": num_warps, **others, **({"maxnreg": maxnreg} if maxnreg else {})}


def _resident_programs(kernel, device: torch.device) -> int:
    """Programs of a compiled Triton kernel that fit on ``device`` at once: registers (allocated per
    warp in units of 256), shared memory (plus the 1 KiB the driver reserves per block) and warps."""
    props = torch.cuda.get_device_properties(device)
    warps = kernel.metadata.num_warps
    kernel._init_handles()  # loads the binary: n_regs is known from then on
    regs_per_warp = -(-kernel.n_regs * 32 // 256) * 256
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // max(1, regs_per_warp * warps)
    smem = kernel.metadata.shared + 1024
    by_smem = props.shared_memory_per_multiprocessor // smem
    by_warps = props.max_threads_per_multi_processor // (32 * warps)
    return props.multi_processor_count * max(1, min(by_regs, by_smem, by_warps, 32))


def slot_capacity(K: int, BN: int, buffer_k: int, cap: int | None = None) -> int:
    """SC, the entries of each of a row's BN candidate slots, for ``cap`` keys a row; by default
    ``buffer_k`` times K rounded up to a power of two, and never under ``cdiv(K, BN) + 2``.

    buffer_k = 8 (8 * K keys) rather than 4 for H = 32: longer segments (fewer scan and refine launches)
    and fewer refines (H200, T = 128K: 192K against 340K per call) outweigh the final selection's larger
    buffers and the halved chunks: 159.2 against 162.4 ms in `bench_hytopk.py --sweep 131072` (16 * K
    was slower, 170.9 ms: benchmarks/notes.md)."""
    if cap is None:
        k_pow2 = triton.next_power_of_2(K)
        cap = max(buffer_k * k_pow2, k_pow2 + 4 * BN)
    return max(triton.cdiv(cap, BN), triton.cdiv(K, BN) + 2)


def presample_plan(T: int, K: int, row_keys: int, stride: int, z: float) -> tuple[int, int]:
    """(KS, r) of the threshold pre-pass, or (0, 0) where it does not apply.

    The pre-pass scores every KS-th key of each row's window (one scan launch into the row's own
    buffer, which holds them all: ``T / KS <= row_keys``) and takes the r-th largest of those samples
    as the row's starting threshold. Of a row's samples about K / KS lie in its top K, whatever the
    row's length, so r = K / KS + z * sqrt(K / KS) lies above that count by z standard deviations (of
    a binomial count, at most sqrt(K / KS)) and the estimate is below the K-th key unless the samples
    are that unlucky; the scan then appends about r * KS keys a row. Rows with at most r samples keep
    every key, as without the pre-pass. It applies when K / KS >= 8 (fewer samples in the top K make
    the margin larger than the count) and some row has more than r samples.
    """
    if stride == 0 or K == 0:
        return 0, 0
    ks = max(stride, -(-T // row_keys))
    m = K / ks
    r = math.ceil(m + z * math.sqrt(m))
    if m < 8 or r < 1 or T // ks <= r:
        return 0, 0
    return ks, r


def lane_rows(SC: int, BN: int, B: int, lanes: int, PR: int) -> int:
    """Most query rows per chunk that one lane's share of ``SCRATCH_BYTES`` holds (each row: BN slots
    of SC int64 keys and BN int32 fill counts), a multiple of PR (rows per scan program), at least PR."""
    return max(PR, SCRATCH_BYTES // lanes // ((8 * SC + 4) * BN * B) // PR * PR)


def equal_chunk_rows(S: int, limit: int, PR: int) -> int:
    """Rows per chunk when S query rows go in equal chunks of at most about ``limit`` rows (rounded up
    to PR): a short last chunk would leave SMs idle on its long rows."""
    return min(S, triton.cdiv(triton.cdiv(S, triton.cdiv(S, limit)), PR) * PR)


def chunk_tiles(start: torch.Tensor, T: int, BQ: int, BN: int, R: int) -> list[int]:
    """Key tiles the longest block walks, per chunk of R query rows (one scan launch per SEG tiles).

    Chunk c holds rows [c * R, (c + 1) * R); its blocks are BQ consecutive rows from the chunk's
    start. A block walks the BN-key tiles from its earliest live window start to its latest window
    end (query i of S sees keys ``start[i] <= s <= T - S + i``), as the scan kernel computes it.
    """
    B, S = start.shape
    dev = start.device
    i = torch.arange(S, device=dev)
    per_chunk = triton.cdiv(R, BQ)
    block = ((i // R) * per_chunk + (i % R) // BQ).expand(B, S)
    end = (T - S + i).expand(B, S)
    lo = start.to(torch.int64)
    live = lo <= end
    n_blocks = triton.cdiv(S, R) * per_chunk
    b_lo = torch.full((B, n_blocks), T, dtype=torch.int64, device=dev)
    b_hi = torch.full((B, n_blocks), -1, dtype=torch.int64, device=dev)
    b_lo.scatter_reduce_(1, block, torch.where(live, lo, T), "amin")
    b_hi.scatter_reduce_(1, block, torch.where(live, end, -1), "amax")
    tiles = torch.where(b_hi >= b_lo, b_hi // BN - b_lo // BN + 1, 0)
    return tiles.view(B, -1, per_chunk).amax(dim=(0, 2)).tolist()


@dataclass
class _LaneScratch:
    """Per-lane scratch of one call: a chunk's candidate buffers, the final selection's bitmaps, the
    rows the rescue must rebuild (before that, the rows the one-launch scan rescans, with their count
    a sequence in ``n_listed``)."""

    buf: torch.Tensor
    cnt: torch.Tensor
    dbg_rows: torch.Tensor
    fin_bitmap: torch.Tensor
    fin_words: torch.Tensor
    short_rows: torch.Tensor
    n_listed: torch.Tensor


def _lane_scratch(B, R, row_keys, BN, n_fin, n_words, dev, score_only) -> _LaneScratch:
    cnt = torch.empty(B, R, BN, dtype=torch.int32, device=dev)  # slot fill counts
    return _LaneScratch(
        buf=torch.empty(B, R, row_keys, dtype=torch.int64, device=dev),
        cnt=cnt,
        dbg_rows=torch.empty(B, R, dtype=torch.float32, device=dev) if score_only else cnt,
        fin_bitmap=torch.zeros(n_fin, n_words, dtype=torch.int32, device=dev),
        fin_words=torch.empty(n_fin, n_words, dtype=torch.int64, device=dev),
        short_rows=torch.empty(B * R, dtype=torch.int32, device=dev),
        n_listed=torch.empty(B, dtype=torch.int32, device=dev),
    )


@dataclass
class _RowState:
    """Every chunk's row state for one call, chunk c at index c: per row the threshold (mono, index)
    and the smallest and largest mono stored (the radix selects' bounds), its refine count and its NaN
    flag, and the call's counters (rows refined, refines, rows rescued). 16-24 bytes a query row,
    so it is set up once a call rather than once a chunk: a small indexer's call is issued by the
    host about as fast as the GPU runs it, and each chunk's fills and sums were host launches."""

    th: torch.Tensor
    refine: torch.Tensor
    nan_rows: torch.Tensor | None
    stats: torch.Tensor


def _row_state(n_chunks, B, R, dev, check_nan) -> _RowState:
    th = torch.empty(n_chunks, B, R, 4, dtype=torch.int32, device=dev)
    # tau = the smallest key (keep everything until the first refine); nothing stored: an empty
    # range. Filled on the device: a tensor built from a Python list would be a host-to-device copy,
    # which PyTorch follows with a stream sync (a host stall per call).
    th[..., 0::3] = -(2**31)  # tau mono, largest stored mono
    th[..., 1:3] = 2**31 - 1  # tau index, smallest stored mono
    return _RowState(
        th=th,
        refine=torch.zeros(n_chunks, B, R, dtype=torch.int32, device=dev),
        nan_rows=torch.zeros(n_chunks, B, R, dtype=torch.int32, device=dev) if check_nan else None,
        stats=torch.zeros(3, dtype=torch.int64, device=dev),
    )


_SIDE_STREAMS: dict = {}


def _side_stream(dev: torch.device, lane: int):
    """Lane ``lane``'s stream on ``dev`` (created once, reused by every call)."""
    key = (dev.index if dev.index is not None else torch.cuda.current_device(), lane)
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device=key[0])
    return _SIDE_STREAMS[key]


def hytopk_triton(
    q, k, w, topk, *, cu_seqlens=None, window_start=None, relu=True, check_nan=False, return_scores=True,
    return_lse=False, config: HyTopKConfig | None = None, cap: int | None = None, chunk_rows: int | None = None,
    profile: str | None = None,
):  # fmt: skip
    """Host launch of the Triton HyTopK: (indices int32 [B, S, topk], scores fp32 [B, S, topk], lse fp32
    [B, S]).

    Inputs and outputs as in ``hytopk`` (which checks them; this function does not). ``scores`` is
    ``[B, S, 0]`` when ``return_scores`` is False, ``lse`` ``[B, 0]`` when ``return_lse`` is False.

    Tuning (tests and ``scripts/bench_hytopk.py``; the defaults are what ``hytopk`` runs):
        config: tile shape and kernel variants (``HyTopKConfig``); default ``pick_config(...)``.
        cap: candidate buffer keys per row (slots x depth); small values force many refinements.
        chunk_rows: query rows per launch (default: as many as ``SCRATCH_BYTES`` holds, in equal chunks).
        profile: ``None`` (the whole op), ``"scan"`` (stop before the final per-row selection; returns
            the buffer fill counts of the last chunk) or ``"scoring"`` (score only, nothing appended;
            returns the per-row sums of visible scores, fp32 [B, S]): where the time goes.
    """
    if profile not in (None, "scan", "scoring"):
        raise ValueError(f"profile must be None, 'scan' or 'scoring', got {profile!r}")
    score_only, scan_only = profile == "scoring", profile == "scan"
    B, S, H, D = q.shape
    T = k.shape[1]
    K = min(topk, T)
    n_lse = S if return_lse else 0
    if B * S == 0 and profile is None:  # nothing to score (T = 0 implies S = 0): no launch
        n_out = topk if return_scores else 0
        return (
            torch.full((B, S, topk), -1, dtype=torch.int32, device=q.device),
            torch.full((B, S, n_out), float("-inf"), dtype=torch.float32, device=q.device),
            torch.full((B, n_lse), float("-inf"), dtype=torch.float32, device=q.device),
        )
    if torch.float64 in (q.dtype, k.dtype, w.dtype) or K > MAX_TRITON_TOPK:
        # fp64, or a K above MAX_TRITON_TOPK: the torch path gives the same exact answer.
        idx, sc = hytopk_reference(
            q, k, w, topk, cu_seqlens=cu_seqlens, window_start=window_start, relu=relu, check_nan=check_nan
        )
        return idx, (sc if return_scores else sc[..., :0]), selected_lse(sc, return_lse)
    if q.dtype != k.dtype:  # mixed half types: fp32 holds both exactly
        q, k = q.float(), k.float()
    cfg = config or pick_config(H, D, q.dtype, q.device)
    interp = _interpreting(q.device)
    HP, DP = padded_heads(H), max(16, triton.next_power_of_2(D))
    BQ = BQ_TRITON = max(cfg.BQ, triton.cdiv(16, HP))  # tl.dot needs N = BQ * HP >= 16
    BN = cfg.BN
    use_gluon = _gluon_scan_applies(q, k, cfg, interp, cu_seqlens)
    if use_gluon:  # two groups of BQ queries per program, BQ * H product columns each (256 by default)
        BQ = gluon_columns(cfg) // H
    PR = 2 * BQ if use_gluon else BQ  # query rows per scan program
    # Slotted candidate buffer per row: BN slots (key offset j of every tile appends to slot j) of
    # SC entries. A segment of SEG tiles adds <= SEG per slot; rows with a slot fuller than
    # SC - SEG are refined first and keep at most K + slack keys, spread evenly: <= SC - SEG per slot.
    k_slots = triton.cdiv(K, BN)
    SC = slot_capacity(K, BN, cfg.buffer_k, cap)
    seg = max(1, (SC - k_slots) // 3)
    slack = max(0, int(((SC - seg) * BN - K) * cfg.refine_slack))
    OB = max(1, cfg.CH // BN)  # slot entries per step of the radix select / compaction
    KS, rank = (0, 0) if score_only else presample_plan(T, K, SC * BN, cfg.presample, cfg.presample_z)
    # After the pre-pass no threshold needs to rise, so the Triton scan takes each chunk's whole windows
    # in one launch with no refines between segments: fewer launches, and one tail per chunk instead of
    # one per segment. A row that fills a slot anyway (ties at a ReLU zero can put most of a window
    # above the estimate) gets a second launch from the K-th key it holds, then the rescue if it fills
    # a slot again (the scan's ``STOP_FULL``). Its refine count (statistics) is that second chance.
    one_launch = bool(KS) and not use_gluon
    dev = q.device
    # Query chunks of at most R rows share the candidate scratch. On a GPU the chunks take turns over
    # cfg.lanes lanes (the current stream and side streams, each with its share of the scratch), so
    # one chunk's refines and final selection (memory-bound) run beside another's scan (matmul-bound).
    lanes = cfg.lanes if dev.type == "cuda" else 1
    if chunk_rows is None:  # equal chunks: a short last one would leave SMs idle on its long rows
        R = equal_chunk_rows(S, lane_rows(SC, BN, B, lanes, PR), PR)
    else:
        R = min(S, chunk_rows)
    chunk_starts = range(0, S, R)
    lanes = min(lanes, len(chunk_starts))

    start, _ = query_windows(B, S, T, cu_seqlens=cu_seqlens, window_start=window_start, device=q.device)
    start = start.clamp(0, T).to(torch.int32)
    q = q.contiguous()
    k = k.contiguous()
    w = w.to(torch.float32).contiguous()
    dbg = torch.zeros(B, S, dtype=torch.float32, device=dev) if score_only else None
    n_out = topk if return_scores else 0
    if topk > K:  # columns no row can fill
        indices = torch.full((B, S, topk), -1, dtype=torch.int32, device=dev)
        scores = torch.full((B, S, n_out), float("-inf"), dtype=torch.float32, device=dev)
    else:
        indices = torch.empty(B, S, topk, dtype=torch.int32, device=dev)
        scores = torch.empty(B, S, n_out, dtype=torch.float32, device=dev)
    lse = torch.empty(B, n_lse, dtype=torch.float32, device=dev)
    # Final-selection scratch: each of its n_fin (persistent) programs owns a zeroed bitmap of the key
    # indices and a word table (12 bytes per 32 keys); FINALIZE_SCRATCH_BYTES bounds them at long T.
    n_words = triton.cdiv(T, 32)
    block_w = 128 if interp else 1024  # bitmap words per step of the final selection's rank pass
    fin_key = (SC, BN, OB, cfg.select_bits, block_w, return_scores, return_lse, cfg.finalize_warps,
               cfg.finalize_maxnreg, cfg.finalize_l1)  # fmt: skip
    n_fin = max(1, min(_finalize_programs(dev, fin_key), FINALIZE_SCRATCH_BYTES // lanes // (12 * n_words)))
    lane_state = [_lane_scratch(B, R, SC * BN, BN, n_fin, n_words, dev, score_only) for _ in range(lanes)]
    rs = _row_state(len(chunk_starts), B, R, dev, check_nan)
    # TMA needs a 16-byte aligned base and row pitch and a box of at most 256 per dimension; the
    # descriptor's [1, BN, DP] box is zero-filled past T and D, as the pointer path's masks are
    use_tma = (
        cfg.tma and not interp and TensorDescriptor is not None and DP <= 256
        and k.data_ptr() % 16 == 0 and (D * k.element_size()) % 16 == 0
    )  # fmt: skip
    if use_gluon:  # the keys as [B * T, D] rows, a [BN, D] box per tile
        layout = _gl.NVMMASharedLayout.get_default_for([BN, D], _gl.bfloat16 if k.dtype == torch.bfloat16 else _gl.float16)
        k_desc = _GluonTensorDescriptor.from_tensor(k.view(B * T, D), [BN, D], layout)
    else:
        k_desc = TensorDescriptor(k, list(k.shape), list(k.stride()), [1, BN, DP]) if use_tma else k
    if KS:  # the pre-pass's samples: key j at position j * KS (its scan takes Triton's tiles, never Gluon's)
        k_s = k[:, ::KS].contiguous()
        # rescue programs (persistent): two per SM take the listed rows; each chunk's count of short rows
        n_rescue = 4 if dev.type != "cuda" else 2 * torch.cuda.get_device_properties(dev).multi_processor_count
        n_redo = max(1, n_rescue // B)  # the second chance's programs a sequence (persistent over its list)
        n_short = torch.zeros(len(chunk_starts), dtype=torch.int32, device=dev)
        ks_desc = TensorDescriptor(k_s, list(k_s.shape), list(k_s.stride()), [1, BN, DP]) if use_tma else k_s
    launch = _launch_options(interp, cfg.num_warps, cfg.maxnreg, num_stages=cfg.num_stages)  # the scan
    small = _launch_options(interp, cfg.refine_warps)  # the per-row kernels
    fin_launch = _launch_options(interp, cfg.finalize_warps, cfg.finalize_maxnreg)
    if cu_seqlens is None and window_start is None:  # windows [0, T - S + i]: known without a sync
        tiles = [(T - S + min(S, i0 + R) - 1) // BN + 1 for i0 in chunk_starts]
    else:  # one sync: how many scan launches each chunk needs
        tiles = chunk_tiles(start, T, PR, BN, R)
    streams = [None]
    if lanes > 1:  # side streams start after everything above (inputs, outputs, scratch)
        streams = [torch.cuda.current_stream(dev)] + [_side_stream(dev, i) for i in range(1, lanes)]
        for st in streams[1:]:
            st.wait_stream(streams[0])
    for c, (i0, n_tiles) in enumerate(zip(chunk_starts, tiles)):
        rc = min(R, S - i0)
        ls = lane_state[c % lanes]
        buf, cnt, dbg_rows = ls.buf, ls.cnt, ls.dbg_rows
        th, refine = rs.th[c], rs.refine[c]
        nan_rows = rs.nan_rows[c] if check_nan else cnt
        with torch.cuda.stream(streams[c % lanes]) if lanes > 1 else contextlib.nullcontext():
            cnt.zero_()
            if KS:
                # Threshold pre-pass: the samples go into the (empty) buffers in one launch (a tile adds at
                # most one key per slot and T / KS <= SC * BN: no slot overflows), then a refine with K = rank
                # sets each row's tau to its rank-th sample, every key of that score passing, and empties the
                # buffers and stored ranges again.
                _kernels.hytopk_scan_kernel[(triton.cdiv(rc, BQ_TRITON), B)](
                    q, k_s, ks_desc, w, start, buf, cnt, th, nan_rows, dbg_rows, refine, ls.short_rows, ls.n_listed,
                    S, T, i0, rc, 0, 0, KS, k_s.shape[1],
                    *q.stride(), *k_s.stride(), *w.stride(), *start.stride(),
                    H=H, HP=HP, D=D, DP=DP, BQ=BQ_TRITON, BN=BN, SC=SC, SEG=SC,
                    RELU=relu, CHECK_NAN=False, IEEE=q.dtype == torch.float32,
                    UPCAST=interp and q.dtype != torch.float32, SCORE_ONLY=False, TMA=use_tma,
                    ASM_STORE=not interp, STOP_FULL=0, **launch,
                )  # fmt: skip
                _kernels.hytopk_refine_kernel[(rc, B)](
                    buf, cnt, th, refine, rc, rank, 0, 0, NS=BN, SC=SC, OB=OB, LOG_NB=cfg.select_bits,
                    ASM_STORE=not interp, PRESAMPLE=True, **small,
                )  # fmt: skip
            if score_only:
                dbg_rows.zero_()
            for seg0 in range(0, n_tiles, max(1, n_tiles) if one_launch else seg):
                # A slot gains at most one key per tile, so none can be fuller than SC - seg before
                # seg0 > SC - seg tiles were scanned: no refine launch needed until then.
                if not score_only and seg0 > SC - seg:
                    _kernels.hytopk_refine_kernel[(rc, B)](
                        buf, cnt, th, refine, rc, K, slack, SC - seg, NS=BN, SC=SC, OB=OB, LOG_NB=cfg.select_bits,
                        ASM_STORE=not interp, PRESAMPLE=False, **small,
                    )  # fmt: skip
                if use_gluon:
                    scan_gluon.hytopk_scan_ws_kernel[(triton.cdiv(rc, PR), B)](
                        q, k_desc, w, start, buf, cnt, th, nan_rows, dbg_rows,
                        S, T, i0, rc, seg0, SC - seg,
                        q.stride(0), q.stride(1), q.stride(2), *w.stride(), *start.stride(),
                        H=H, BQ=BQ, SC=SC, SEG=seg, STAGES=cfg.gluon_stages,
                        RELU=relu, CHECK_NAN=check_nan, SCORE_ONLY=score_only, num_warps=4,
                    )  # fmt: skip
                else:
                    # one launch: a first pass flags rows that fill a slot; they are listed (in the
                    # short-row list's scratch, free until the rescue), their threshold raised to the
                    # K-th key they hold and their buffers emptied, and a second pass rescans them
                    for stop_full in (1, 2) if one_launch else (0,):
                        if stop_full == 2:
                            _kernels.hytopk_flagged_rows_kernel[(B,)](
                                refine, ls.short_rows, ls.n_listed, rc, BR=FLAGGED_ROWS_BLOCK, **small
                            )
                            _kernels.hytopk_redo_kernel[(min(rc, n_redo), B)](
                                buf, cnt, th, ls.short_rows, ls.n_listed, rc, K,
                                NS=BN, SC=SC, OB=OB, LOG_NB=cfg.select_bits, **small,
                            )  # fmt: skip
                        _kernels.hytopk_scan_kernel[(triton.cdiv(rc, BQ), B)](
                            q, k, k_desc, w, start, buf, cnt, th, nan_rows, dbg_rows, refine, ls.short_rows, ls.n_listed,
                            S, T, i0, rc, seg0, SC - seg, 1, T,
                            *q.stride(), *k.stride(), *w.stride(), *start.stride(),
                            H=H, HP=HP, D=D, DP=DP, BQ=BQ, BN=BN, SC=SC, SEG=WHOLE_WINDOW if one_launch else seg,
                            RELU=relu, CHECK_NAN=check_nan, IEEE=q.dtype == torch.float32,
                            UPCAST=interp and q.dtype != torch.float32, SCORE_ONLY=score_only, TMA=use_tma,
                            ASM_STORE=not interp, STOP_FULL=stop_full,
                            **launch,
                        )  # fmt: skip
            if KS:  # rows whose estimate lay above their K-th key (rare): listed, then rebuilt from their keys
                _kernels.hytopk_short_rows_kernel[(triton.cdiv(B * rc, SHORT_ROWS_BLOCK),)](
                    cnt, start, ls.short_rows, n_short[c:], rs.stats[2:], S, T, i0, rc, K, B * rc, *start.stride(),
                    NS=BN, BR=SHORT_ROWS_BLOCK, **small,
                )  # fmt: skip
                _kernels.hytopk_rescue_kernel[(n_rescue,)](
                    q, k, w, start, buf, cnt, th, ls.short_rows, n_short[c:], S, T, i0, rc, K,
                    *q.stride(), *k.stride(), *w.stride(), *start.stride(),
                    H=H, HR=max(16, HP), D=D, DP=DP, NS=BN, SC=SC, BK=BN, LOG_NB=cfg.select_bits,
                    RELU=relu, IEEE=q.dtype == torch.float32, UPCAST=interp and q.dtype != torch.float32,
                    ASM_STORE=not interp, **small,
                )  # fmt: skip
            if score_only:
                dbg[:, i0 : i0 + rc] = dbg_rows[:, :rc]
            if score_only or scan_only:
                continue
            fin = _kernels.hytopk_finalize_kernel[(min(B * rc, n_fin),)](
                buf, cnt, th, ls.fin_bitmap, ls.fin_words, indices, scores, lse, i0, rc, S, K, K, B * rc, n_words,
                n_words if cfg.finalize_copy else 0,
                indices.stride(0), indices.stride(1), scores.stride(0), scores.stride(1),
                NS=BN, SC=SC, OB=OB, LOG_NB=cfg.select_bits, BLOCK_W=block_w,
                WRITE_SCORES=return_scores, WRITE_LSE=return_lse, ASM_STORE=not interp, L1_BUF=cfg.finalize_l1,
                **fin_launch,
            )  # fmt: skip
            if not interp and (dev.index, fin_key) not in _FINALIZE_FIT:
                _FINALIZE_FIT[(dev.index, fin_key)] = _resident_programs(fin, dev)
    for st in streams[1:]:
        streams[0].wait_stream(st)
    if score_only or scan_only:
        return dbg if score_only else lane_state[(len(chunk_starts) - 1) % lanes].cnt
    counters = _STATS_DEVICE.get(dev)
    if counters is None:  # (not setdefault: its default would be allocated on every call)
        counters = _STATS_DEVICE[dev] = torch.zeros(3, dtype=torch.int64, device=dev)
    # rows past S in the last chunk's region were never scanned: their counts and flags stay 0
    rs.stats[:2] += torch.stack([(rs.refine > 0).sum(), rs.refine.sum()])
    counters += rs.stats
    _STATS["calls"] += 1
    _STATS["rows"] += B * S
    if check_nan and bool(rs.nan_rows.any()):  # one host sync
        raise ValueError(NAN_MESSAGE)
    return indices, scores, lse
