"""MLA-absorbed sparse attention forward for Hopper (sm_90), in Gluon with warp specialisation.

Host dispatch: ``host.forward_plan`` (which shapes take this kernel, and the
Triton kernel for everything else). It gives the same results as the Triton forward: the same
blocks of 64 keys in the same order, the same fp32 online softmax and bf16/fp16 P (on an H200 the
outputs and log-sum-exps came out bitwise equal).

Why a second kernel: with 64 heads (the matmul M side) and a 576 + 512 wide row, the Triton
forward needs 8 warps to hold the [64, 512] fp32 output, so both warpgroups split every product
along N (32 keys each for Q K^T) and every step waits for the one before it: gather, Q K^T,
softmax, P through shared memory, P V. On an H200 that ran at 275-290 TFLOP/s. Here one program
(one query token, 64 heads) runs three warpgroups that each own one job:

- the softmax warpgroup (the default partition) gathers the selected K rows of the next block
  (``cp.async``, into a ring of two blocks; their key ids loaded a block ahead: ``mla_gather_gluon``)
  while the tensor cores run this block's Q K^T
  (m64n64, Q and K from shared memory), then runs the online softmax and hands P (bf16/fp16) and
  the rows' rescale factors to the other two through shared memory;
- two P V warpgroups each own half of the output columns ([64, 256] fp32 accumulators) and
  multiply P by their half of the block's V, the first 512 dims of the same K rows.

So the next block's Q K^T and gather overlap this block's P V. Barriers (mbarriers in shared
memory): "K ready" per ring slot (softmax -> P V), "P ready" (softmax -> P V) and "P free" (both
P V warpgroups -> softmax: P, the rescale factors and the older ring slot may be reused), and
"final" (the row sums, for the output's normalisation). Shared memory: Q 72 KB, the ring 144 KB,
P 8 KB: 224 KB of the 227 KB a program may use, so one program per SM.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..gluon_hopper import sync_partition as _sync_partition
from .mla_gather_gluon import BLOCK, D_ROPE, D_V, block_keys, copy_rows, gather_block

HEADS = gl.constexpr(64)  # heads per program: the matmul M side
HALF_V = gl.constexpr(256)  # output columns per P V warpgroup

# mbarrier slots
_K_READY = gl.constexpr(0)  # + ring slot (2)
_P_READY = gl.constexpr(2)
_P_FREE = gl.constexpr(3)  # both P V warpgroups arrive
_FINAL = gl.constexpr(4)
_N_BARRIERS = gl.constexpr(5)


@gluon.jit
def _softmax_partition(
    q_base, s_qh, k_base, s_kt, idx_base, count, n_blocks, lse_base, s_lh, qk_scale,
    q_smem, q_rope_smem, kv_smem, rope_smem, p_smem, alpha_smem, l_smem, bars,
):  # fmt: skip
    MMA: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK, 16]
    )
    ROW: gl.constexpr = gl.SliceLayout(1, MMA)
    KEY: gl.constexpr = gl.SliceLayout(0, MMA)
    COPY: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # 16-byte pieces of [64, 64]
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, COPY))
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, COPY))
    copy_rows(q_smem, q_rope_smem, q_base + rows[:, None].to(gl.int64) * s_qh, cols, True)
    async_copy.commit_group()
    if n_blocks > 0:
        gather_block(k_base, s_kt, block_keys(idx_base, count, 0, rows), kv_smem.index(0), rope_smem.index(0), cols)

    m_i = gl.full([HEADS], float("-inf"), gl.float32, ROW)  # running max, log2 units
    l_i = gl.zeros([HEADS], gl.float32, ROW)
    zero = gl.zeros([HEADS, BLOCK], gl.float32, MMA)
    offs = gl.arange(0, BLOCK, layout=KEY)
    for j in range(n_blocks):
        s = j % 2
        # the next block's key ids, loaded before this block's products so that the next gather can
        # issue its copies as soon as the ring slot is free (``mla_gather_gluon``)
        kid_next_rows = block_keys(idx_base, count, j + 1, rows)
        async_copy.wait_group(0)  # block j (and, the first time, q) is in shared memory
        fence_async_shared()  # ... and visible to the tensor cores
        _sync_partition()
        mbarrier.arrive(bars.index(_K_READY + s), count=1)
        acc = warpgroup_mma(q_smem, kv_smem.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
        acc = warpgroup_mma(q_rope_smem, rope_smem.index(s).permute((1, 0)), acc, is_async=True)
        if j > 0:  # P V of block j - 1 is done: P, the rescale factors and its ring slot are free
            mbarrier.wait(bars.index(_P_FREE), (j - 1) & 1)
        if j + 1 < n_blocks:  # the next block's gather runs beside this block's products
            gather_block(k_base, s_kt, kid_next_rows, kv_smem.index(1 - s), rope_smem.index(1 - s), cols)
        acc = warpgroup_mma_wait(0, deps=[acc])
        kid = block_keys(idx_base, count, j, offs)  # in L1: the gather read these ids a block ago
        sc = gl.where(kid[None, :] >= 0, acc * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sc, axis=1))
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)  # no valid key yet: keep p = 0
        alpha = gl.exp2(m_i - m_ref)
        p = gl.exp2(sc - m_ref[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        p_smem.store(p.to(p_smem.dtype))
        alpha_smem.store(alpha)
        fence_async_shared()
        _sync_partition()
        mbarrier.arrive(bars.index(_P_READY), count=1)
        m_i = m_new
    async_copy.wait_group(0)  # a row without keys never waited for q's copy: none may outlive the program
    no_key = l_i == 0  # as in the Triton forward: a NaN l (NaN or +inf logits) gives a NaN lse
    l_safe = gl.where(no_key, 1.0, l_i)
    lse = gl.where(no_key, float("-inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)
    gl.store(lse_base + gl.arange(0, HEADS, layout=ROW) * s_lh, lse)
    l_smem.store(l_safe)
    _sync_partition()
    mbarrier.arrive(bars.index(_FINAL), count=1)


@gluon.jit
def _pv_partition(n_blocks, o_base, s_oh, kv_smem, p_smem, alpha_smem, l_smem, bars, COL0: gl.constexpr):
    MMA: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF_V, 16]
    )
    ROW: gl.constexpr = gl.SliceLayout(1, MMA)
    o = gl.zeros([HEADS, HALF_V], gl.float32, MMA)
    for j in range(n_blocks):
        s = j % 2
        mbarrier.wait(bars.index(_P_READY), j & 1)
        mbarrier.wait(bars.index(_K_READY + s), (j // 2) & 1)
        o = o * alpha_smem.load(ROW)[:, None]
        o = warpgroup_mma(p_smem, kv_smem.index(s).slice(COL0, HALF_V, dim=1), o)
        _sync_partition()
        mbarrier.arrive(bars.index(_P_FREE), count=1)
    mbarrier.wait(bars.index(_FINAL), 0)
    o = o / l_smem.load(ROW)[:, None]
    rows = gl.arange(0, HEADS, layout=ROW)
    cols = COL0 + gl.arange(0, HALF_V, layout=gl.SliceLayout(0, MMA))
    gl.store(o_base + rows[:, None] * s_oh + cols[None, :], o.to(o_base.dtype.element_ty))


# warp_specialize hands its partitions runtime values only, so the column half (a constexpr of the
# shared-memory slice) is fixed by one small entry function per half
@gluon.jit
def _pv_low_partition(n_blocks, o_base, s_oh, kv_smem, p_smem, alpha_smem, l_smem, bars):
    _pv_partition(n_blocks, o_base, s_oh, kv_smem, p_smem, alpha_smem, l_smem, bars, 0)


@gluon.jit
def _pv_high_partition(n_blocks, o_base, s_oh, kv_smem, p_smem, alpha_smem, l_smem, bars):
    _pv_partition(n_blocks, o_base, s_oh, kv_smem, p_smem, alpha_smem, l_smem, bars, HALF_V)


@gluon.jit
def mla_forward_kernel(
    q_ptr, k_ptr, idx_ptr, num_ptr, o_ptr, lse_ptr,
    s_qb, s_qs, s_qh, s_kb, s_kt, s_ib, s_is, s_nb, s_ob, s_os, s_oh, s_lb, s_ls, s_lh,
    num_head_blocks, qk_scale,
):  # fmt: skip
    """o and lse of query token program_id(0), heads 64 * hb + [0, 64) of batch b (program_id(1) =
    b * num_head_blocks + hb), over the first num[b, t] slots of its index row."""
    t = gl.program_id(0).to(gl.int64)
    hb = gl.program_id(1) % num_head_blocks
    b = (gl.program_id(1) // num_head_blocks).to(gl.int64)
    count = gl.load(num_ptr + b * s_nb + t)
    n_blocks = gl.cdiv(count, BLOCK)
    h0 = (hb * HEADS).to(gl.int64)
    q_base = q_ptr + b * s_qb + t * s_qs + h0 * s_qh
    k_base = k_ptr + b * s_kb
    idx_base = idx_ptr + b * s_ib + t * s_is
    o_base = o_ptr + b * s_ob + t * s_os + h0 * s_oh
    lse_base = lse_ptr + b * s_lb + t * s_ls + h0 * s_lh

    dt: gl.constexpr = q_ptr.dtype.element_ty
    MMA_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    VEC_SMEM: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    q_smem = gl.allocate_shared_memory(dt, [HEADS, D_V], MMA_SMEM)
    q_rope_smem = gl.allocate_shared_memory(dt, [HEADS, D_ROPE], MMA_SMEM)
    kv_smem = gl.allocate_shared_memory(dt, [2, BLOCK, D_V], MMA_SMEM)
    rope_smem = gl.allocate_shared_memory(dt, [2, BLOCK, D_ROPE], MMA_SMEM)
    p_smem = gl.allocate_shared_memory(dt, [HEADS, BLOCK], MMA_SMEM)
    alpha_smem = gl.allocate_shared_memory(gl.float32, [HEADS], VEC_SMEM)
    l_smem = gl.allocate_shared_memory(gl.float32, [HEADS], VEC_SMEM)
    bars = gl.allocate_shared_memory(gl.int64, [_N_BARRIERS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(2):
        mbarrier.init(bars.index(_K_READY + s), count=1)
    mbarrier.init(bars.index(_P_READY), count=1)
    mbarrier.init(bars.index(_P_FREE), count=2)
    mbarrier.init(bars.index(_FINAL), count=1)
    fence_async_shared()

    pv_args = (n_blocks, o_base, s_oh, kv_smem, p_smem, alpha_smem, l_smem, bars)
    gl.warp_specialize(
        [
            (_softmax_partition, (q_base, s_qh, k_base, s_kt, idx_base, count, n_blocks, lse_base, s_lh, qk_scale,
                                  q_smem, q_rope_smem, kv_smem, rope_smem, p_smem, alpha_smem, l_smem, bars)),
            (_pv_low_partition, pv_args),
            (_pv_high_partition, pv_args),
        ],
        [4, 4],
        [168, 168],
    )  # fmt: skip


def mla_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    idx: torch.Tensor,
    num: torch.Tensor,
    qk_scale: float,
    o: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Writes o [B, S, H, 512] and fp32 lse [B, S, H] of MLA-absorbed sparse attention.

    q [B, S, H, 576] (H a multiple of 64), k [B, T, 1, 576] with v = k[..., :512], idx [B, S, L]
    int32 (-1 = no key), num [B, S] int32: how many slots of each index row to walk; qk_scale is
    the softmax scale times log2(e). The caller checks the shapes, dtypes (bf16 or fp16), unit
    inner strides and 16-byte alignment (``cp.async`` moves 16-byte pieces).
    """
    B, S, H, _ = q.shape
    if B * S == 0:
        return
    nhb = H // HEADS.value
    mla_forward_kernel[(S, B * nhb)](
        q, k, idx, num, o, lse,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), idx.stride(0), idx.stride(1),
        num.stride(0), o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1), lse.stride(2),
        nhb, qk_scale, num_warps=4,
    )  # fmt: skip
