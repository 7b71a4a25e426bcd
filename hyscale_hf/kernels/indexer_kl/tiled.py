"""The sparse-stage indexer KL with its target given, over the attention's query tiles.

The per-query kernels (``triton_kernels.py``) gather every query's K selected index keys and add each
(query, key) pair's ``d index_k`` row with fp32 atomics: O(S * K) gathers and atomics, while the
attention that produced the target walked query tiles over the sorted union of their keys
(``sparse_attn.host.union_tiles``), which is far smaller where neighbouring queries agree (a trained
indexer's selections on real text: a 42-query tile's union is 5-7% of its pairs). These kernels walk
the same tiles: a program owns a tile of ``tile_q`` queries and all their indexer heads, gathers each
union key once, scores it for every query of the tile with one tensor-core product and keeps the
pairs whose membership bit is set (``sparse_attn``'s ``_member``). A pair's target sits in the query's
index row at the key's rank among the keys the query selected (rows ascending, as ``hytopk`` returns
them and as the attention's backward placed it); the rank is the count of membership bits before it.
``d index_k`` of a union key is summed over the tile in registers before one atomic add.

Rows of a program: query m of the tile and indexer head h at row ``m * HP + h`` (HP = heads padded to a
power of two; the tile's queries padded to TQP, a power of two), so the head sum of the logits is a
reshape. The math is the per-query kernels' (``triton_kernels.py`` derives it). A query whose index
row starts with -1 has no key: its loss and gradients are 0, whatever the tile's bits say (a caller
masks a query out by its indices).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..sparse_attn.triton_kernels import _member
from ..triton_math import lse_step_rows, lse_value
from .triton_kernels import _kl_value, _plogp

# On CUDA the tiled kernels run where a tile's union holds at most this share of its pairs (mean union
# over tile_q x K): on an H200 they beat the per-query kernels only below about 7% (2.0-2.1x at 3%,
# 0.27-0.45x at 17-33%: bench_indexer_loss.py --tiles); on an H100, a trained SmolLM2 indexer's layers
# at 4.4 / 4.7 / 5.7% took 7.0 / 7.5 / 8.9 ms tiled against 10.0 / 10.0 / 9.9 ms per query at 32K
# (bench_trained_selections.py, 2026-12-06). Those layers hold 4-11%, so the choice is per call.
# Under the interpreter (tests) they run wherever a program holds the tile.
CUDA_MAX_UNION_SHARE = 0.07
# The same for the one pass (the selection's lse given: ``index_lse``), which saves more over tiles
# than per query (1.37-1.42x against 1.11-1.15x), so the tiles win up to wider unions. H100, 2 x 64
# indexer, T = 32K, one pass, tiled against per query: 6.84 against 8.73 ms at a union of 7.3% of the
# pairs, 8.78 against 8.76 at 9.6%, 10.04 against 8.85 at 11% (forward + backward: 9.49 against 9.80
# at 7.3%, 12.13 against 9.77 at 9.6%): ``bench_indexer_loss.py --tiles --far-shares ...``, 2026-12-06.
CUDA_MAX_UNION_SHARE_ONE_PASS = 0.09
# True: the tiles wherever a program holds them, whatever the union (both rules above off): benchmarks
# and GPU tests set it to time or check the tiles on selections the rules would send per query.
TILES_AT_ANY_UNION = False

# Largest rows x head dims a program holds (its q, dq and per-block products live in registers):
# 128 rows of 128 dims or 256 rows of 64.
MAX_TILE_ELEMENTS = 256 * 64
# Union keys per step: a multiple of 32 (whole membership words). 32, not 64: each [rows, BLOCK_N] fp32
# block a step holds costs a thread rows * BLOCK_N / threads registers, and at 64 the backward spilled
# (sm_90 ptxas, 2 x 64 indexer, 42-query tiles: 255 registers and 100 B spilled with 8 warps, against
# 229 and none at 32; the forward 209 against 115: scripts/compile_sm90.py tiled_kl).
BLOCK_N = 32


def tile_shape(tile_q: int, H: int, D: int) -> tuple[int, int, int] | None:
    """``(TQP, HP, BLOCK_D)`` of a program, or None where the tile's rows do not fit one program
    (``takes_tiles`` also weighs the union on CUDA)."""
    tqp, hp, bd = triton.next_power_of_2(max(1, tile_q)), triton.next_power_of_2(max(1, H)), max(16, triton.next_power_of_2(D))
    if tqp * hp < 16 or tqp * hp * bd > MAX_TILE_ELEMENTS:
        return None
    return tqp, hp, bd


def takes_tiles(tiles, H: int, D: int, K: int, device: torch.device, one_pass: bool = False) -> bool:
    """Whether the tiled kernels run over ``tiles`` (a ``sparse_attn`` ``KeyLists``) for K slots a query:
    a program holds the tile, and on CUDA its union is small enough (``CUDA_MAX_UNION_SHARE``, or
    ``CUDA_MAX_UNION_SHARE_ONE_PASS`` for the one pass; lists without their mean union take the
    per-query kernels there) unless ``TILES_AT_ANY_UNION``."""
    if tile_shape(tiles.tile_q, H, D) is None:
        return False
    if device.type != "cuda" or TILES_AT_ANY_UNION:
        return True
    share = CUDA_MAX_UNION_SHARE_ONE_PASS if one_pass else CUDA_MAX_UNION_SHARE
    return 0 <= tiles.mean_union <= share * tiles.tile_q * K


@triton.jit
def _tile_setup(IQ, IW, IDX, NUM, UNION, BITS, S, H, D, tile_q, n_tiles, max_u, n_words,
                s_iq_b, s_iq_s, s_iq_h, s_iw_b, s_iw_s, s_idx_b, s_idx_s,
                TQP: tl.constexpr, HP: tl.constexpr, BLOCK_D: tl.constexpr):
    """Tile program_id(0) of batch program_id(1): its queries (``tq`` [TQP], which exist, which have a
    key), its rows' q [TQP * HP, BLOCK_D] and w [TQP * HP] with their (query, head) masks, and its union
    (key count, row of keys, each query's row of membership words)."""
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    qm = tl.arange(0, TQP)
    tq = p * tile_q + qm
    qmask = (qm < tile_q) & (tq < S)
    first = tl.load(IDX + b * s_idx_b + tq.to(tl.int64) * s_idx_s, mask=qmask, other=-1)
    has_key = qmask & (first >= 0)
    rows = tl.arange(0, TQP * HP)
    t = (p * tile_q + rows // HP).to(tl.int64)
    h = rows % HP
    rmask = ((rows // HP) < tile_q) & (t < S) & (h < H)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = tl.load(IQ + b * s_iq_b + t[:, None] * s_iq_s + h[:, None] * s_iq_h + d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    w = tl.load(IW + b * s_iw_b + t * s_iw_s + h, mask=rmask, other=0.0)
    tile = b * n_tiles + p
    count = tl.load(NUM + tile)
    union_row = UNION + tile * max_u
    bits_rows = BITS + (tile * tile_q + qm) * n_words
    return b, tq, qmask, has_key, t, h, rmask, d, dmask, q, w, count, union_row, bits_rows


@triton.jit
def _union_block(IK, UNION, BITS, P, q, w, b, start, count, union_row, bits_rows, tq, has_key, seen, d, dmask,
                 s_ik_b, s_ik_t, s_p_b, s_p_s,
                 RELU: tl.constexpr, TQP: tl.constexpr, HP: tl.constexpr, BLOCK_N: tl.constexpr,
                 PRECISION: tl.constexpr):
    """Union keys ``[start, start + BLOCK_N)`` of a tile: their rows of index_k, the per-row products qk,
    the per-query logits [TQP, BLOCK_N], which (query, key) pairs are selected, their target P and the
    updated count of each query's selected keys so far."""
    offs_n = start + tl.arange(0, BLOCK_N)
    kid = tl.load(union_row + offs_n, mask=offs_n < count, other=-1)
    valid = kid >= 0
    safe = tl.where(valid, kid, 0).to(tl.int64)
    kt = tl.load(IK + b * s_ik_b + safe[:, None] * s_ik_t + d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
    qk = tl.dot(q, tl.trans(kt), input_precision=PRECISION)  # [TQP * HP, BLOCK_N]
    r = qk
    if RELU:
        r = tl.maximum(qk, 0.0)
    logit = tl.sum(tl.reshape(r * w[:, None], [TQP, HP, BLOCK_N]), axis=1)  # head sum: [TQP, BLOCK_N]
    live = _member(valid[None, :] & has_key[:, None], bits_rows, has_key, start, True, TQP, BLOCK_N)
    taken = live.to(tl.int32)
    slot = seen[:, None] + tl.cumsum(taken, axis=1) - 1  # the key's rank among the query's keys
    p_un = tl.load(P + b * s_p_b + tq.to(tl.int64)[:, None] * s_p_s + slot, mask=live, other=0.0)
    return kid, valid, safe, kt, qk, r, logit, live, p_un, seen + tl.sum(taken, axis=1)


@triton.jit
def indexer_kl_fwd_tiled_kernel(
    IQ, IK, IW, IDX, UNION, NUM, BITS, P, KL, Z, LSEI,
    S, H, D, tile_q, n_tiles, max_u, n_words,
    s_iq_b, s_iq_s, s_iq_h, s_ik_b, s_ik_t, s_iw_b, s_iw_s, s_idx_b, s_idx_s, s_p_b, s_p_s,
    RELU: tl.constexpr, TQP: tl.constexpr, HP: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """Per-query KL, Z and lseI of tile program_id(0) of batch program_id(1) (``indexer_kl_fwd_kernel``
    with ``P_GIVEN``, over the tile's union)."""
    b, tq, qmask, has_key, t, h, rmask, d, dmask, q, w, count, union_row, bits_rows = _tile_setup(
        IQ, IW, IDX, NUM, UNION, BITS, S, H, D, tile_q, n_tiles, max_u, n_words,
        s_iq_b, s_iq_s, s_iq_h, s_iw_b, s_iw_s, s_idx_b, s_idx_s, TQP, HP, BLOCK_D,
    )  # fmt: skip
    m_i = tl.full([TQP], float("-inf"), tl.float32)  # running max of I over the selected keys
    l_i = tl.zeros([TQP], tl.float32)
    z = tl.zeros([TQP], tl.float32)
    a = tl.zeros([TQP], tl.float32)
    c = tl.zeros([TQP], tl.float32)
    seen = tl.zeros([TQP], tl.int32)
    for start in range(0, count, BLOCK_N):
        _, _, _, _, _, _, logit, live, p_un, seen = _union_block(
            IK, UNION, BITS, P, q, w, b, start, count, union_row, bits_rows, tq, has_key, seen, d, dmask,
            s_ik_b, s_ik_t, s_p_b, s_p_s, RELU, TQP, HP, BLOCK_N, PRECISION,
        )  # fmt: skip
        # Summed through a select, not straight from the load: Triton 3.6's thread-locality pass rewrites
        # a loop's `acc += sum(load)` and asserts when the accumulator has several uses after the loop.
        z += tl.sum(tl.where(live, p_un, 0.0), axis=1)
        a += tl.sum(_plogp(p_un), axis=1)
        c += tl.sum(tl.where(live, p_un * logit, 0.0), axis=1)
        masked = tl.where(live, logit, float("-inf"))
        m_i, l_i = lse_step_rows(m_i, l_i, masked, False)
    lse_i = lse_value(m_i, l_i, 0.0, False)
    out = b * S + tq
    tl.store(KL + out, _kl_value(a, c, z, lse_i), mask=qmask)
    tl.store(Z + out, z, mask=qmask)
    tl.store(LSEI + out, lse_i, mask=qmask)


@triton.jit
def _tile_target_mass(IDX, P, b, tq, qmask, K, s_idx_b, s_idx_s, s_p_b, s_p_s, TQP: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    """Z [TQP] of a tile's queries: each one's target summed over its slots that hold a key."""
    z = tl.zeros([TQP, BLOCK_K], tl.float32)
    rows = tq.to(tl.int64)[:, None]
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        m = qmask[:, None] & (offs_k < K)[None, :]
        idx = tl.load(IDX + b * s_idx_b + rows * s_idx_s + offs_k[None, :], mask=m, other=-1)
        z += tl.load(P + b * s_p_b + rows * s_p_s + offs_k[None, :], mask=m & (idx >= 0), other=0.0)
    return tl.sum(z, axis=1)


@triton.jit
def indexer_kl_bwd_tiled_kernel(
    IQ, IK, IW, IDX, UNION, NUM, BITS, P, Z, LSEI, GKL, DQ, DW, DK, KL,
    S, T, H, D, K, tile_q, n_tiles, max_u, n_words,
    s_iq_b, s_iq_s, s_iq_h, s_ik_b, s_ik_t, s_iw_b, s_iw_s, s_idx_b, s_idx_s, s_p_b, s_p_s, s_g_b, s_g_s,
    RELU: tl.constexpr, ONE_PASS: tl.constexpr, TQP: tl.constexpr, HP: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dq, dw of a tile's rows and its union keys' d index_k (one fp32 atomic add per key and tile):
    ``indexer_kl_bwd_kernel``'s gradients over the tile's union; with ``ONE_PASS`` also the per-query KL
    from a given lseI (that kernel's ``ONE_PASS``)."""
    b, tq, qmask, has_key, t, h, rmask, d, dmask, q, w, count, union_row, bits_rows = _tile_setup(
        IQ, IW, IDX, NUM, UNION, BITS, S, H, D, tile_q, n_tiles, max_u, n_words,
        s_iq_b, s_iq_s, s_iq_h, s_iw_b, s_iw_s, s_idx_b, s_idx_s, TQP, HP, BLOCK_D,
    )  # fmt: skip
    g = tl.load(GKL + b * s_g_b + tq * s_g_s, mask=qmask, other=0.0).to(tl.float32)
    if ONE_PASS:
        z = _tile_target_mass(IDX, P, b, tq, qmask, K, s_idx_b, s_idx_s, s_p_b, s_p_s, TQP, 64)
    else:
        z = tl.load(Z + b * S + tq, mask=qmask, other=0.0)
    lse_i = tl.load(LSEI + b * S + tq, mask=qmask, other=0.0)
    if ONE_PASS:  # a query without keys has the selection's -inf: its terms are all masked out
        lse_i = tl.where(lse_i == float("-inf"), 0.0, lse_i)
    g_soft = tl.where(z > 0, g, 0.0)  # sum_s p = 1, or 0 when the target is empty
    g_p = g / tl.where(z > 0, z, 1.0)
    dq = tl.zeros([TQP * HP, BLOCK_D], tl.float32)
    dw = tl.zeros([TQP * HP], tl.float32)
    a = tl.zeros([TQP], tl.float32)  # ONE_PASS: sum P log P and sum P I per query
    c = tl.zeros([TQP], tl.float32)
    seen = tl.zeros([TQP], tl.int32)
    for start in range(0, count, BLOCK_N):
        kid, valid, safe, kt, qk, r, logit, live, p_un, seen = _union_block(
            IK, UNION, BITS, P, q, w, b, start, count, union_row, bits_rows, tq, has_key, seen, d, dmask,
            s_ik_b, s_ik_t, s_p_b, s_p_s, RELU, TQP, HP, BLOCK_N, PRECISION,
        )  # fmt: skip
        d_i = tl.where(live, g_soft[:, None] * tl.exp(logit - lse_i[:, None]) - g_p[:, None] * p_un, 0.0)
        if ONE_PASS:  # (summed through selects: see the forward's note on Triton 3.6)
            a += tl.sum(_plogp(p_un), axis=1)
            c += tl.sum(tl.where(live, p_un * logit, 0.0), axis=1)
        d_rows = tl.reshape(tl.broadcast_to(d_i[:, None, :], [TQP, HP, BLOCK_N]), [TQP * HP, BLOCK_N])
        dw += tl.sum(r * d_rows, axis=1)
        dqk = w[:, None] * d_rows
        if RELU:
            dqk = tl.where(qk >= 0, dqk, 0.0)  # torch.clamp_min passes the gradient at exactly 0
        dqk_in = dqk.to(kt.dtype)
        dq = tl.dot(dqk_in, kt, dq, input_precision=PRECISION)
        dkt = tl.dot(tl.trans(dqk_in), q, input_precision=PRECISION)  # [BLOCK_N, BLOCK_D], summed over the tile
        tl.atomic_add(DK + (b * T + safe[:, None]) * D + d[None, :], dkt, mask=valid[:, None] & dmask[None, :],
                      sem="relaxed")
    rows_out = (b * S + t) * H + h
    tl.store(DQ + rows_out[:, None] * D + d[None, :], dq.to(DQ.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])
    tl.store(DW + rows_out, dw, mask=rmask)
    if ONE_PASS:
        tl.store(KL + b * S + tq, _kl_value(a, c, z, lse_i), mask=qmask)


def _tile_args(tiles):
    """union, num, bits (contiguous), tile_q, tiles per sequence, union width, membership words per query."""
    union, num, bits = tiles.idx.contiguous(), tiles.num.contiguous(), tiles.bits.contiguous()
    return union, num, bits, tiles.tile_q, union.shape[1], union.shape[2], bits.shape[1]


def _launch(tqp: int, hp: int, bd: int, device: torch.device, backward: bool) -> dict:
    """Warps of a tile program on CUDA: 8 from 128 rows, or for the backward (dq beside three
    [rows, BLOCK_N] blocks) from 128 x 64 row dims, else 4; the interpreter takes none. sm_90 ptxas,
    BLOCK_N 32: with 4 warps the backward spills at 128 x 64 (260 B) and 64 x 128 (192 B), not at
    64 x 64; at 128 rows the forward holds 115 registers with 8 warps against 207 with 4."""
    if device.type != "cuda":
        return {}
    return {"num_warps": 8 if tqp * hp >= 128 or (backward and tqp * hp * bd >= 128 * 64) else 4}


def indexer_kl_forward_tiled(index_q, index_k, index_w, indices, target, tiles, relu: bool, precision: str):
    """``(kl, z, lse_i)`` fp32 [B, S] of the given-target loss over ``tiles`` (``sparse_attn.host.KeyLists``
    with ``tile_q >= 1``); inputs as ``op.indexer_kl_forward_triton`` prepares them."""
    B, S, H, D = index_q.shape
    tqp, hp, bd = tile_shape(tiles.tile_q, H, D)
    union, num, bits, tile_q, n_tiles, max_u, n_words = _tile_args(tiles)
    kl, z, lse_i = (torch.empty(B, S, dtype=torch.float32, device=index_q.device) for _ in range(3))
    indexer_kl_fwd_tiled_kernel[(n_tiles, B)](
        index_q, index_k, index_w, indices, union, num, bits, target, kl, z, lse_i,
        S, H, D, tile_q, n_tiles, max_u, n_words,
        *index_q.stride()[:3], *index_k.stride()[:2], *index_w.stride()[:2], *indices.stride()[:2],
        *target.stride()[:2],
        RELU=relu, TQP=tqp, HP=hp, BLOCK_D=bd, BLOCK_N=BLOCK_N, PRECISION=precision, **_launch(tqp, hp, bd, index_q.device, False),
    )  # fmt: skip
    return kl, z, lse_i


def indexer_kl_backward_tiled(grad_kl, index_q, index_k, index_w, indices, target, z, lse_i, tiles, relu: bool,
                              precision: str, dq, dw, dk, kl=None):
    """Fills ``dq`` [B, S, H, D], ``dw`` [B, S, H] fp32 and adds into ``dk`` [B, T, D] fp32 (zeros). With ``kl``
    (fp32 [B, S], filled with the per-query loss) the one pass: ``z`` is unread (None) and ``lse_i`` is the
    given log-sum-exp of the selected logits."""
    B, S, H, D = index_q.shape
    T, K = index_k.shape[1], indices.shape[2]
    tqp, hp, bd = tile_shape(tiles.tile_q, H, D)
    union, num, bits, tile_q, n_tiles, max_u, n_words = _tile_args(tiles)
    one_pass = kl is not None
    indexer_kl_bwd_tiled_kernel[(n_tiles, B)](
        index_q, index_k, index_w, indices, union, num, bits, target, lse_i if one_pass else z, lse_i, grad_kl,
        dq, dw, dk, kl if one_pass else lse_i,
        S, T, H, D, K, tile_q, n_tiles, max_u, n_words,
        *index_q.stride()[:3], *index_k.stride()[:2], *index_w.stride()[:2], *indices.stride()[:2],
        *target.stride()[:2], *grad_kl.stride(),
        RELU=relu, ONE_PASS=one_pass, TQP=tqp, HP=hp, BLOCK_D=bd, BLOCK_N=BLOCK_N, PRECISION=precision,
        **_launch(tqp, hp, bd, index_q.device, True),
    )  # fmt: skip
