"""HyTopK's scan for Hopper (sm_90) in Gluon, with warp specialisation. The contract is
``_hytopk_scan_kernel``'s in ``triton_kernels.py`` (whose docstrings describe the slotted buffers,
thresholds and row state); the host launch (``host.py``) picks this kernel where it applies.

Why a second kernel: the Triton scan runs one warpgroup per program (BQ * H = 128 product
columns, three programs per SM), each streaming its own copy of every key tile and waiting for
each product before selecting from it. Here one program per SM holds two groups of BQ queries,
BQ * H = 256 product columns each, in three partitions:

- a load warp streams the key tiles of the walk through a ring of STAGES slots (TMA), once for
  both groups;
- two selection warpgroups, one per group, each multiply every key tile by their queries (an
  m64n256 product: two accumulators would not fit the registers) and select from the scores; while
  one selects, the other's product runs on the tensor cores.

Barriers: "ready" per slot (load warp -> selection warpgroups, with the copy's byte count) and
"free" per slot (both selection warpgroups -> load warp, once their product of that tile is done).
On an H200 (H = 32, D = 128, T = 128K, scoring alone, same run) this took 105.8 ms against 128.0
for the Triton scan; the same structure with 128 columns and two products in flight per
warpgroup took 133.7 ms (benchmarks/notes.md).

The selection arithmetic is the Triton kernel's. The fp32 scores can differ from the Triton
kernel's in the last bits (the compiler may fuse the head sum's multiplies and adds differently),
so with continuous inputs a near-tie can go the other way; each kernel is exact and deterministic
for its own scores, and integer inputs (exact sums) give identical results. Gluon does not run
under the CPU interpreter: the CPU suite builds this kernel for sm_90 and checks its resources;
the GPU tests compare it with the reference and with the Triton scan.
"""

from __future__ import annotations

import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma

from ..gluon_hopper import sync_partition as _sync_partition
from ..gluon_hopper import tma_load as _tma_load

_I32_MIN = gl.constexpr(-(2**31))
_I32_MAX = gl.constexpr(2**31 - 1)
_NAN_MONO = gl.constexpr(-(2**31) + 1)  # as in triton_kernels


@gluon.jit
def _tile_at(it, n_local, first, last):
    """The it-th tile of a block's walk: the n_local tiles next to the diagonal first, then the rest
    of the window ascending (the Triton kernel's order)."""
    if it < n_local:
        t = last - it
    else:
        t = first + (it - n_local)
    return t


@gluon.jit
def _per_query(x, BQ: gl.constexpr, H: gl.constexpr, SUM: gl.constexpr):
    """[BN, BQ * H] accumulator-shaped values -> [BN, BQ] per (key, query): the sum over heads
    (``SUM``) or the max. Column c = ((gq * H / 2 + gh) * 4 + l) * 2 + e holds query gq * 4 + l and
    head gh * 2 + e (the Triton kernel's order): a thread holds all heads of its query."""
    BN: gl.constexpr = x.shape[0]
    x5 = gl.reshape(x, (BN, BQ // 4, H // 2, 4, 2))
    if SUM:
        r = gl.sum(gl.sum(x5, axis=4), axis=2)
    else:
        r = gl.max(gl.max(x5, axis=4), axis=2)
    return gl.reshape(r, (BN, BQ))


@gluon.jit
def _load_partition(k_desc, k_smem, bars, b, T, SEG0, n, n_local, first, last):
    STAGES: gl.constexpr = k_smem.shape[0]
    BN: gl.constexpr = k_smem.shape[1]
    NBYTES: gl.constexpr = k_smem.shape[1] * k_smem.shape[2] * 2
    for j in range(n):
        s = j % STAGES
        # slot s is free once both selection warpgroups released the tile STAGES before (a fresh
        # barrier passes the wait for parity 1: the first round needs no release)
        mbarrier.wait(bars.index(STAGES + s), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(bars.index(s), NBYTES)
        tile = _tile_at(SEG0 + j, n_local, first, last)
        _tma_load(k_desc, [b * T + tile * BN, 0], bars.index(s), k_smem.index(s))


@gluon.jit
def _select_partition(
    g, q_ptr, s_qb, s_qs, s_qh, q_smem, k_smem, bars, w_ptr, start_ptr, buf_ptr, cnt_ptr, th_ptr, nan_ptr, dbg_ptr,
    b, blk, S, T, I0, R, SEG0, n, n_local, first, last, s_wb, s_ws, s_wh, s_sb, s_ss,
    H: gl.constexpr, BQ: gl.constexpr, SC: gl.constexpr,
    RELU: gl.constexpr, CHECK_NAN: gl.constexpr, SCORE_ONLY: gl.constexpr,
):  # fmt: skip
    """Query group g (rows blk * 2 * BQ + g * BQ + [0, BQ)) of the program: scores every tile of the
    walk and appends its rows' keys >= tau to their slotted buffers (``_hytopk_scan_kernel``). The
    per-row state is held per (key offset, query) in the scores' layout (a few registers)."""
    STAGES: gl.constexpr = k_smem.shape[0]
    BN: gl.constexpr = k_smem.shape[1]
    DP: gl.constexpr = k_smem.shape[2]
    N: gl.constexpr = BQ * H
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16])
    COL: gl.constexpr = gl.SliceLayout(0, MMA)
    r0 = blk * (2 * BQ) + g * BQ

    # the group's queries as N rows of (query, head) in the accumulator's column order, stored
    # K-contiguous (the product reads them transposed); loaded here, not before the partitions
    # split, so both groups load at once while the load warp already fetches the first key tiles
    QLD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    d = gl.arange(0, DP, layout=gl.SliceLayout(0, QLD))
    for part in gl.static_range(N // 64):  # 64 rows at a time: fewer registers
        cq = part * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, QLD))
        r_q = r0 + (cq // (4 * H)) * 4 + (cq // 2) % 4
        q_rows = q_ptr + b * s_qb + (I0 + r_q).to(gl.int64) * s_qs + (((cq // 8) % (H // 2)) * 2 + cq % 2) * s_qh
        ok = (r_q < R) & ((cq * 0 + n) > 0)
        q_part = gl.load(q_rows[:, None] + d[None, :], mask=ok[:, None], other=0.0)
        q_smem.index(g).slice(part * 64, 64, dim=0).store(q_part)
    fence_async_shared()
    _sync_partition()  # every warp's rows are in shared memory before the first product

    cols = gl.arange(0, N, layout=COL)
    c_q = (cols // (4 * H)) * 4 + (cols // 2) % 4
    c_h = ((cols // 8) % (H // 2)) * 2 + cols % 2
    w_rows = w_ptr + b * s_wb + (I0 + r0 + c_q).to(gl.int64) * s_ws + c_h * s_wh
    wv = gl.load(w_rows, mask=r0 + c_q < R, other=0.0)

    # [BN, BQ] tensors in the layout of the per-(key, query) scores: reduce [BN, N] index tensors
    # the way the scores are reduced, so selection and stores need no layout conversion
    zero_i = gl.zeros([BN, N], gl.int32, MMA)
    jj = _per_query(gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))[:, None] + zero_i, BQ, H, False)
    rq = _per_query(c_q[None, :] + zero_i, BQ, H, False)
    r_loc = r0 + rq
    row_ok = r_loc < R
    qi = I0 + r_loc
    start = gl.load(start_ptr + b * s_sb + qi * s_ss, mask=row_ok, other=0)
    end = gl.where(row_ok, T - S + qi, -1)  # inclusive; query i sits at key position T - S + i
    row_on = row_ok & ((rq * 0 + n) > 0)
    row_base = (b * R + r_loc).to(gl.int64)
    buf_at = buf_ptr + row_base * (SC * BN) + jj  # slot jj of each row; + fill * BN
    th_mono = gl.load(th_ptr + row_base * 4, mask=row_on, other=0)
    th_idx = gl.load(th_ptr + row_base * 4 + 1, mask=row_on, other=0)
    cnt_at = cnt_ptr + row_base * BN + jj
    fill = gl.load(cnt_at, mask=row_on, other=0)
    mono_lo = rq * 0 + _I32_MAX
    mono_hi = rq * 0 + _I32_MIN
    nan_seen = rq * 0
    score_sum = jj.to(gl.float32) * 0.0

    q_op = q_smem.index(g).permute((1, 0))
    zero = gl.zeros([BN, N], gl.float32, MMA)
    if n > 0:
        for j in range(0, n):
            mbarrier.wait(bars.index(j % STAGES), (j // STAGES) & 1)
            cur = warpgroup_mma(k_smem.index(j % STAGES), q_op, zero, use_acc=False)
            _sync_partition()  # every warp's part of tile j's product is done: its slot may refill
            mbarrier.arrive(bars.index(STAGES + j % STAGES), count=1)

            if RELU:  # NaN stays NaN, as in the Triton scan; non-finite sums become NaN below
                cur = gl.maximum(cur, 0.0, propagate_nan=tl.PropagateNan.ALL)
            sc = _per_query(cur * wv[None, :], BQ, H, True)
            offs_n = _tile_at(SEG0 + j, n_local, first, last) * BN + jj
            vis = (offs_n >= start) & (offs_n <= end)
            if SCORE_ONLY:
                score_sum += gl.where(vis, sc, 0.0)
            else:
                # mono: order-preserving int32 image of the score (-0.0 as +0.0, NaN just above masked)
                bits = sc.to(gl.int32, bitcast=True)
                bits = gl.where(bits == _I32_MIN, 0, bits)
                mono = gl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
                finite = gl.abs(sc) < float("inf")  # non-finite scores rank as NaN
                mono = gl.where(finite, mono, _NAN_MONO)
                if CHECK_NAN:
                    nan_seen = gl.maximum(nan_seen, (vis & ~finite).to(gl.int32))
                above = (mono > th_mono) | ((mono == th_mono) & (offs_n <= th_idx))
                keep = vis & above
                key = ((mono.to(gl.int64) + 1) << 32) - 1 - offs_n.to(gl.int64)
                gl.store(buf_at + fill * BN, key, mask=keep)
                fill += keep.to(gl.int32)
                mono_lo = gl.minimum(mono_lo, mono)
                mono_hi = gl.maximum(mono_hi, mono)

    gl.store(cnt_at, fill, mask=row_on)
    # per row ([BQ]): the row's state lives in every key offset's copy; take it from the reductions
    row_at = gl.max(row_base, axis=0)
    on1 = gl.max(row_on.to(gl.int32), axis=0) > 0
    if not SCORE_ONLY:
        rng = th_ptr + row_at * 4 + 2
        gl.store(rng, gl.minimum(gl.load(rng, mask=on1, other=0), gl.min(mono_lo, axis=0)), mask=on1)
        rng += 1
        gl.store(rng, gl.maximum(gl.load(rng, mask=on1, other=0), gl.max(mono_hi, axis=0)), mask=on1)
    if CHECK_NAN:
        at = nan_ptr + row_at
        gl.store(at, gl.maximum(gl.load(at, mask=on1, other=0), gl.max(nan_seen, axis=0)), mask=on1)
    if SCORE_ONLY:
        at = dbg_ptr + row_at
        gl.store(at, gl.load(at, mask=on1, other=0.0) + gl.sum(score_sum, axis=0), mask=on1)


@gluon.jit
def hytopk_scan_ws_kernel(
    q_ptr, k_desc, w_ptr, start_ptr, buf_ptr, cnt_ptr, th_ptr, nan_ptr, dbg_ptr,
    S, T, I0, R, SEG0, LOCAL_TILES,
    s_qb, s_qs, s_qh, s_wb, s_ws, s_wh, s_sb, s_ss,
    H: gl.constexpr, BQ: gl.constexpr, SC: gl.constexpr, SEG: gl.constexpr, STAGES: gl.constexpr,
    RELU: gl.constexpr, CHECK_NAN: gl.constexpr, SCORE_ONLY: gl.constexpr,
):  # fmt: skip
    """Tiles [SEG0, SEG0 + SEG) of the key windows of 2 * BQ query rows (queries I0 + [0, R) of
    batch program_id(1)); see ``_hytopk_scan_kernel``. ``k_desc``: the keys as [B * T, D] with a
    [BN, D] box (a tile past its sequence reads the next one's keys, which the window mask hides;
    past the end, zeros). H and D are powers of two, q has unit inner stride."""
    BN: gl.constexpr = k_desc.block_type.shape[0]
    DP: gl.constexpr = k_desc.block_type.shape[1]
    N: gl.constexpr = BQ * H
    PR: gl.constexpr = 2 * BQ  # rows per program
    b = gl.program_id(1)
    blk = gl.cdiv(R, PR) - 1 - gl.program_id(0)  # longest (latest) rows first: better tail balance

    # the walk covers the union of the program's row windows (the Triton kernel's block walk)
    ROWS: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    rq = gl.arange(0, PR, layout=ROWS)
    r_loc = blk * PR + rq
    row_ok = r_loc < R
    qi = I0 + r_loc
    start = gl.load(start_ptr + b * s_sb + qi * s_ss, mask=row_ok, other=0)
    end = gl.where(row_ok, T - S + qi, -1)
    live = row_ok & (start <= end)
    lo = gl.min(gl.where(live, start, T), axis=0)
    hi = gl.max(gl.where(live, end, -1), axis=0)
    first = lo // BN
    last = hi // BN
    n_tiles = gl.where(hi >= lo, last - first + 1, 0)
    n_local = gl.minimum(n_tiles, LOCAL_TILES)
    n = gl.minimum(SEG0 + SEG, n_tiles) - SEG0  # tiles this launch scores (<= 0: none)

    q_smem = gl.allocate_shared_memory(k_desc.dtype, [2, N, DP], k_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BN, DP], k_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)  # ready: the copy's bytes arrived
        mbarrier.init(bars.index(STAGES + s), count=2)  # free: both selection warpgroups are done
    fence_async_shared()  # the barriers, before the async proxy uses them

    gl.warp_specialize(
        [
            (_select_partition, (0, q_ptr, s_qb, s_qs, s_qh, q_smem, k_smem, bars, w_ptr, start_ptr, buf_ptr, cnt_ptr, th_ptr, nan_ptr,
                                 dbg_ptr, b, blk, S, T, I0, R, SEG0, n, n_local, first, last,
                                 s_wb, s_ws, s_wh, s_sb, s_ss, H, BQ, SC, RELU, CHECK_NAN, SCORE_ONLY)),
            (_select_partition, (1, q_ptr, s_qb, s_qs, s_qh, q_smem, k_smem, bars, w_ptr, start_ptr, buf_ptr, cnt_ptr, th_ptr, nan_ptr,
                                 dbg_ptr, b, blk, S, T, I0, R, SEG0, n, n_local, first, last,
                                 s_wb, s_ws, s_wh, s_sb, s_ss, H, BQ, SC, RELU, CHECK_NAN, SCORE_ONLY)),
            (_load_partition, (k_desc, k_smem, bars, b, T, SEG0, n, n_local, first, last)),
        ],
        [4, 1],
        [240, 24],
    )  # fmt: skip
