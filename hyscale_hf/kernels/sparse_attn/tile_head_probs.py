"""The indexer KL's target over GQA query tiles: head-summed probabilities without atomics.

``HeadProbs`` wants ``P[b, s, j] = sum_h exp(scale * q[b, s, h] . k[idx[b, s, j], g(h)] - lse[b, s, h])``
on each query's index slots. The tiled backward kernel can add it as it recomputes P, but its rows are
(query, head) pairs, so every head of every query adds its own fp32 atomic at the key's rank (the
heads of one query sit in rows that do not reshape to a power-of-two axis at GQA groups such as 3).
On a trained SmolLM2 layer at 32K those atomics cost more than the whole backward (H100: fwd + bwd
9.4 ms, 15.0 ms with the sums; ``scripts/bench_trained_selections.py``).

Here one program owns one query tile and every head: its rows are the tile's queries, and for each
block of the tile's union it runs every head's ``[queries, keys]`` product (heads unrolled; each KV
head's key rows gathered once), summing the exponentials in registers. Each (query, slot) is then
written once by one program: a plain store, no atomics, and a fixed summation order (the same bits on
every run, so the deterministic backward takes it too). The products are the attention's Q K^T again
(about half a forward's work). On a GPU the queries come through TMA, once per program; unrolled
heads keep every head's query tile live, hence ``host.TILE_PROBS_MAX_WIDTH``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

try:  # host-side TMA descriptors (Triton >= 3.4); without them q loads through pointers
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

from .triton_kernels import _member

_LOG2E = 1.4426950408889634


@triton.jit
def tile_head_probs_kernel(
    Q, Q_DESC, K, IDX, NUM, BITS, LSE, PSUM,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_ib, stride_ip, stride_ik, stride_bits,
    stride_lb, stride_ls, stride_lh,
    stride_pb, stride_ps, stride_pk,
    num_queries, num_tiles, tile_q, qk_scale,
    HKV: tl.constexpr, GROUP: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """PSUM[b, t, rank] = sum over heads of P for tile program_id(0)'s queries t; grid (tiles, B).

    The union slot u of query t lands at t's rank of u: the count of t's membership bits before u
    (t's index row is sorted ascending, so that is the key's position in it). Slots t did not select
    are not written (the caller passes zeros)."""
    p = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    m = tl.arange(0, BLOCK_M)
    row_t = p * tile_q + m
    q0 = (p * tile_q).to(tl.int32)  # the tile's first query (TMA coordinates are 32-bit)
    rmask = (m < tile_q) & (row_t < num_queries)
    bits_rows = BITS + ((b * num_tiles + p) * tile_q + m) * stride_bits
    count = tl.load(NUM + b * num_tiles + p)
    idx_row = IDX + b * stride_ib + p * stride_ip
    q_rows = Q + b * stride_qb + row_t * stride_qs
    lse_rows = LSE + b * stride_lb + row_t * stride_ls
    offs_d1 = tl.arange(0, D1)
    if D2 > 0:
        offs_d2 = D1 + tl.arange(0, D2)
    out_rows = PSUM + b * stride_pb + row_t * stride_ps
    seen = tl.zeros([BLOCK_M], tl.int32)  # each query's selected keys before this block
    for start in range(0, count, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        kid = tl.load(idx_row + offs_n * stride_ik, mask=offs_n < count, other=-1)
        valid = kid >= 0
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for g in tl.static_range(HKV):
            k_rows = K + b * stride_kb + g * stride_kh + kid.to(tl.int64)[:, None] * stride_kt
            k1 = tl.load(k_rows + offs_d1[None, :] * stride_kd, mask=valid[:, None], other=0.0)
            if D2 > 0:
                k2 = tl.load(k_rows + offs_d2[None, :] * stride_kd, mask=valid[:, None], other=0.0)
            for h in tl.static_range(GROUP):
                head = g * GROUP + h
                # The tile's query rows (rows past tile_q belong to the next tile: masked below). Through
                # TMA on a GPU, once per program (the compiler hoists them out of the key loop); pointer
                # tiles of every unrolled head would hold 64-bit addresses at once (ptxas spilled KBs).
                if TMA:
                    q1 = Q_DESC.load([b, q0, head, 0]).reshape(BLOCK_M, D1)
                else:
                    q1 = tl.load(q_rows[:, None] + head * stride_qh + offs_d1[None, :] * stride_qd,
                                 mask=rmask[:, None], other=0.0)
                s = tl.dot(q1, tl.trans(k1), input_precision=DOT_PREC)
                if D2 > 0:  # (never with TMA: _q_descriptor)
                    q2 = tl.load(q_rows[:, None] + head * stride_qh + offs_d2[None, :] * stride_qd,
                                 mask=rmask[:, None], other=0.0)
                    s = tl.dot(q2, tl.trans(k2), s, input_precision=DOT_PREC)
                lse = tl.load(lse_rows + head * stride_lh, mask=rmask, other=0.0)
                lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)  # a row without keys
                # Membership is applied once, after the heads (fewer live registers in this loop). A
                # selected key's exponent is <= 0 up to rounding (its p <= 1); an unselected key's may be
                # anything, so it is capped to keep the sum finite until the mask drops it.
                acc += tl.exp2(tl.minimum(s * qk_scale - lse2[:, None], 8.0))
        live = _member(valid[None, :] & rmask[:, None], bits_rows, rmask, start, True, BLOCK_M, BLOCK_N)
        acc = tl.where(live, acc, 0.0)
        taken = live.to(tl.int32)
        slot = seen[:, None] + tl.cumsum(taken, axis=1) - 1
        seen += tl.sum(taken, axis=1)
        tl.store(out_rows[:, None] + slot.to(tl.int64) * stride_pk, acc, mask=live)


def _q_descriptor(q: torch.Tensor, block_m: int, d1: int, d2: int):
    """A TMA descriptor of q [B, S, Hq, d1] with a [1, block_m, 1, d1] box, or None where TMA does not
    apply: the CPU, no descriptor support in this Triton, a key dim with a tail (d2 > 0: the pointer
    loads take both parts), unaligned rows."""
    if TensorDescriptor is None or not q.is_cuda or d2 or d1 > 256 or q.stride(3) != 1:
        return None
    size = q.element_size()
    if q.data_ptr() % 16 or any((st * size) % 16 for st in q.stride()[:3]):
        return None
    return TensorDescriptor(q, list(q.shape), list(q.stride()), [1, block_m, 1, d1])


def tile_head_probs(q, k, lists, lse, scale: float, psum, d1: int, d2: int, cfg: dict, dot_prec: str) -> None:
    """Fill ``psum`` [B, S, K] fp32 (zeros) with the head-summed probabilities over the query tiles of
    ``lists`` (``host.KeyLists`` with ``tile_q`` > 0); q [B, S, Hq, d1 + d2], k [B, T, Hkv, d1 + d2],
    lse [B, S, Hq] fp32 (natural log). ``cfg``: ``BLOCK_N``, ``num_warps``, ``num_stages``."""
    B, S, Hq, _ = q.shape
    Hkv = k.shape[2]
    n_tiles = lists.idx.shape[1]
    if S == 0 or n_tiles == 0:
        return
    block_m = max(16, triton.next_power_of_2(lists.tile_q))
    q_desc = _q_descriptor(q, block_m, d1, d2)
    tile_head_probs_kernel[(n_tiles, B)](
        q, q if q_desc is None else q_desc, k, lists.idx, lists.num, lists.bits, lse, psum,
        *q.stride(), *k.stride(), *lists.idx.stride(), lists.bits.stride(0), *lse.stride(), *psum.stride(),
        S, n_tiles, lists.tile_q, scale * _LOG2E,
        HKV=Hkv, GROUP=Hq // Hkv, D1=d1, D2=d2, BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"], DOT_PREC=dot_prec,
        TMA=q_desc is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
