"""MLA-absorbed sparse attention backward, dS and dK/dV part, for Hopper (sm_90), in Gluon.

Host dispatch: ``host.sparse_attention_bwd`` (the shapes it takes are those of the Gluon forward,
``mla_forward_gluon.py``, with v's gradient merged into k's). It replaces the Triton kernel
``sparse_attn_bwd_dkv_kernel`` and keeps its contract: ``scale * dS`` (q's dtype) goes to the dS
buffer that the Triton dQ kernel reads, and each (query, key) pair's contribution
``scale * dS^T Q + P^T dO`` (dV merged into the first 512 columns) is added to the fp32 key-row
accumulator with fp32 atomics, or, in the deterministic backward, stored to the pair's own fp32
scratch row, which the host sums per key in a fixed order.

Why a second kernel: the Triton kernel's 64 heads x 576 + 512 dims leave shared memory for blocks of
16 keys only, its products run one after another with 16-wide tensor-core tiles, and its
contributions are formed transposed (key dims as the matmul M side), so its atomics are scalar. Here
one program (one query token, 64 heads) runs three warpgroups:

- the default partition loads Q and dO once, gathers the selected K rows of each 64-key block
  (``cp.async``) into one slot, runs S = Q K^T and dP = dO V^T (v = k[..., :512]), and as soon as
  those products are done (nothing else reads K) starts the next block's gather; it then forms
  P = exp2(S * scale * log2 e - lse) and dS = P * (dP - delta), and hands P and ``scale * dS``
  (bf16/fp16) to the other two through shared memory, from where one TMA store also writes that
  dS tile to the dS buffer (``ds_desc``: [64 heads, 64 slots], 128-byte rows). Stored from the
  accumulator's registers, each warp's store covered 16 bytes of 8 rows: Nsight Compute (H100,
  32K) counted 7.9 of each 32-byte sector used, 9% of the kernel's L2 sectors wasted;
- two contribution warpgroups each own 256 of the 512 value columns: C = (scale dS)^T Q[:, cols] +
  P^T dO[:, cols], a [64 keys, 256] fp32 tile whose rows are key rows. The accumulator layout gives
  each thread pairs of adjacent columns; a conversion within each warp (shuffles, no shared memory)
  gives it 4, so each atomic adds 16 bytes. The second also owns the 64 rope columns
  ((scale dS)^T Q_rope). With ``psum`` the first also forms each key's P summed over the heads (the
  indexer KL's target, ``HeadProbs``) as a small product P^T [1 0 ... 0] from the P tile it reads
  anyway (so from P in q's dtype, as the dV product uses it), off the softmax warpgroup's path.

So a block's gather and S / dP overlap the previous block's contributions and atomics (H200: fp32
atomics into key rows move about 3.7 TB/s, and every pair adds 2.3 KB; storing the same bytes to
scratch instead, the deterministic backward, took as long on an H100: benchmarks/notes.md).
Barriers: "PdS ready" (default -> both) and "PdS free" (both -> default: P and dS may be
overwritten). Shared memory: Q 72 KB, dO 64 KB, the K slot 72 KB, P and dS 16 KB: 224 KB of the
227 KB a program may use, so one program per SM.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..gluon_hopper import sync_partition as _sync_partition
from ..gluon_hopper import tma_store as _tma_store
from .mla_gather_gluon import BLOCK, D_ROPE, D_V, block_keys, copy_rows, gather_block

# dS goes out by TMA, whose global address must be 16-byte aligned (else an illegal instruction):
# 8 bf16 / fp16 slots for the rows' pitch and for each tile's first column (key passes: key_passes' align)
SLOT_ALIGN = 8
HEADS = gl.constexpr(64)  # heads per program: the M side of S and dP, the K side of the contributions
HALF_V = gl.constexpr(256)  # value columns per contribution warpgroup
PSUM_N = gl.constexpr(8)  # N of the head sums' product (wgmma's smallest)

# mbarrier slots
_PDS_READY = gl.constexpr(0)
_PDS_FREE = gl.constexpr(1)  # both contribution warpgroups arrive
_N_BARRIERS = gl.constexpr(2)


@gluon.jit
def _softmax_partition(
    q_base, s_qh, do_base, s_doh, o_base, s_oh, lse_base, s_lh, dlse_base, s_dlh, ds_desc, ds_row, ds_col,
    k_base, s_kt, idx_base, count, n_blocks, sm_scale, qk_scale, delta_base, s_deh,
    q_smem, q_rope_smem, do_smem, kv_smem, rope_smem, p_smem, ds_smem, bars, HAS_DLSE: gl.constexpr,
    PASSES: gl.constexpr,
):  # fmt: skip
    MMA: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK, 16]
    )
    ROW: gl.constexpr = gl.SliceLayout(1, MMA)
    KEY: gl.constexpr = gl.SliceLayout(0, MMA)
    COPY: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # 16-byte pieces of [64, 64]
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, COPY))
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, COPY))
    q_rows = q_base + rows[:, None].to(gl.int64) * s_qh
    heads = gl.arange(0, HEADS, layout=ROW)
    if PASSES:  # delta comes from the chunk's buffer; a row without keys in this pass loads nothing
        if n_blocks > 0:
            copy_rows(q_smem, q_rope_smem, q_rows, cols, True)
            copy_rows(do_smem, do_smem, do_base + rows[:, None].to(gl.int64) * s_doh, cols, False)
            async_copy.commit_group()
            gather_block(k_base, s_kt, block_keys(idx_base, count, 0, rows), kv_smem, rope_smem, cols)
        delta = gl.load(delta_base + heads * s_deh)
    else:
        copy_rows(q_smem, q_rope_smem, q_rows, cols, True)
        copy_rows(do_smem, do_smem, do_base + rows[:, None].to(gl.int64) * s_doh, cols, False)
        async_copy.commit_group()
        if n_blocks > 0:
            gather_block(k_base, s_kt, block_keys(idx_base, count, 0, rows), kv_smem, rope_smem, cols)

        # delta = rowsum(dO * O) - dlse: d(loss)/d(logit) = p * (dp - delta). dO is read back from
        # its shared-memory copy, 64 columns at a time (a [64, 512] register tile would not fit).
        if n_blocks > 0:  # Q and dO are in shared memory (block 0's gather may still run)
            async_copy.wait_group(1)
        else:
            async_copy.wait_group(0)
        _sync_partition()
        delta = gl.zeros([HEADS], gl.float32, gl.SliceLayout(1, COPY))
        o_rows = o_base + rows[:, None].to(gl.int64) * s_oh
        for c in gl.static_range(D_V // 64):
            d_o = do_smem.slice(c * 64, 64, dim=1).load(COPY).to(gl.float32)
            o = gl.load(o_rows + (c * 64 + cols)[None, :]).to(gl.float32)
            delta += gl.sum(d_o * o, axis=1)
        delta = gl.convert_layout(delta, ROW)
        if HAS_DLSE:
            delta -= gl.load(dlse_base + heads * s_dlh)
    lse = gl.load(lse_base + heads * s_lh)
    lse2 = gl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)  # a row without keys: p = 0

    zero = gl.zeros([HEADS, BLOCK], gl.float32, MMA)
    offs = gl.arange(0, BLOCK, layout=KEY)
    for j in range(n_blocks):
        # the next block's key ids, loaded before this block's products so that their latency is
        # hidden and the next gather can start as soon as the products have read the K slot
        kid_next_rows = block_keys(idx_base, count, j + 1, rows)
        async_copy.wait_group(0)  # block j is in shared memory
        fence_async_shared()  # ... and visible to the tensor cores
        _sync_partition()
        s = warpgroup_mma(q_smem, kv_smem.permute((1, 0)), zero, use_acc=False, is_async=True)
        s = warpgroup_mma(q_rope_smem, rope_smem.permute((1, 0)), s, is_async=True)
        dp = warpgroup_mma(do_smem, kv_smem.permute((1, 0)), zero, use_acc=False, is_async=True)
        s, dp = warpgroup_mma_wait(0, deps=[s, dp])
        _sync_partition()  # every warp's products have read the K slot
        if j + 1 < n_blocks:  # the next gather runs beside this block's softmax and contributions
            gather_block(k_base, s_kt, kid_next_rows, kv_smem, rope_smem, cols)
        kid = block_keys(idx_base, count, j, offs)  # in L1: read for this block's gather (a [64] tile of
        # key ids in this layout held across the products would make the partition spill)
        p = gl.where((kid >= 0)[None, :], gl.exp2(s * qk_scale - lse2[:, None]), 0.0)
        ds = ((p * (dp - delta[:, None])) * sm_scale).to(ds_smem.dtype)
        if j > 0:  # the contributions of block j - 1 are formed, and its dS store read its tile
            mbarrier.wait(bars.index(_PDS_FREE), (j - 1) & 1)
            tma.store_wait(0)
        p_smem.store(p.to(p_smem.dtype))
        ds_smem.store(ds)
        fence_async_shared()
        _sync_partition()
        mbarrier.arrive(bars.index(_PDS_READY), count=1)
        # slots past the walk's end (to the block's end, clipped at ds's width) get dS = 0: p is 0
        # there. With key passes those are the gap before the next group and that group's slots,
        # which the next pass's launch writes afterwards.
        _tma_store(ds_desc, [ds_row, ds_col + j * BLOCK], ds_smem)
    async_copy.wait_group(0)  # no copy may outlive the program
    tma.store_wait(0)


@gluon.jit
def _contribution_partition(
    n_blocks, count, idx_base, acc_base, s_at, q_smem, q_rope_smem, do_smem, p_smem, ds_smem, bars,
    ones_smem, psum_base, psum_atomic, perm_base, use_perm, use_scratch,
    COL0: gl.constexpr, WITH_ROPE: gl.constexpr, WITH_PSUM: gl.constexpr,
):  # fmt: skip
    MMA: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF_V, 16]
    )
    ROPE: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D_ROPE, 16]
    )
    # the accumulators are overwritten each block (use_acc=False): the previous block's tile is the
    # operand, so no second [64, 256] fp32 tile (128 registers a thread) stays live as a zero
    c = gl.zeros([BLOCK, HALF_V], gl.float32, MMA)
    # the atomics' layout: each thread 4 adjacent columns of 2 rows (16-byte vector atomics); each warp
    # keeps the accumulator's 16 rows, so the conversion moves values within warps only (shuffles)
    RED: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [8, 0], [0, 16], [0, 32], [0, 64], [0, 128]],
        lane_bases=[[0, 8], [0, 4], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]],
        block_bases=[],
        shape=[BLOCK, HALF_V],
    )
    keys_red = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, RED))
    cols = COL0 + gl.arange(0, HALF_V, layout=gl.SliceLayout(0, RED))
    if WITH_ROPE:
        r = gl.zeros([BLOCK, D_ROPE], gl.float32, ROPE)
        cols_r = D_V + gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, ROPE))
        keys_rope = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, ROPE))
    if WITH_PSUM:  # the head sums P^T 1 as a [keys, 8] product whose column 0 is the ones column
        SUMS: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, PSUM_N, 16]
        )
        sums = gl.zeros([BLOCK, PSUM_N], gl.float32, SUMS)
        keys_sum = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, SUMS))
    kid = block_keys(idx_base, count, 0, keys_red)
    for j in range(n_blocks):
        kid_next = block_keys(idx_base, count, j + 1, keys_red)  # its latency hidden by the wait and products
        mbarrier.wait(bars.index(_PDS_READY), j & 1)
        ds_t = ds_smem.permute((1, 0))  # [keys, heads]
        c = warpgroup_mma(ds_t, q_smem.slice(COL0, HALF_V, dim=1), c, use_acc=False, is_async=True)
        c = warpgroup_mma(p_smem.permute((1, 0)), do_smem.slice(COL0, HALF_V, dim=1), c, is_async=True)
        if WITH_PSUM:
            sums = warpgroup_mma(p_smem.permute((1, 0)), ones_smem, sums, use_acc=False, is_async=True)
            c, sums = warpgroup_mma_wait(0, deps=[c, sums])
        else:
            c = warpgroup_mma_wait(0, deps=[c])
        c_red = gl.convert_layout(c, RED)
        # the row a pair's contribution goes to: its key's accumulator row, or (scratch) its slot's own
        row = gl.where(use_scratch, j * BLOCK + keys_red, gl.where(kid >= 0, kid, 0))
        dst = acc_base + row.to(gl.int64)[:, None] * s_at
        if WITH_ROPE:  # the rope tile only after the value tile's atomics: both live would spill
            _add_or_store(dst + cols[None, :], c_red, (kid >= 0)[:, None], use_scratch)
            r = warpgroup_mma(ds_t, q_rope_smem, r, use_acc=False)
            _sync_partition()
            mbarrier.arrive(bars.index(_PDS_FREE), count=1)
            kid_r = gl.convert_layout(kid, gl.SliceLayout(1, ROPE))
            row_r = gl.where(use_scratch, j * BLOCK + keys_rope, gl.where(kid_r >= 0, kid_r, 0))
            dst_r = acc_base + row_r.to(gl.int64)[:, None] * s_at
            _add_or_store(dst_r + cols_r[None, :], r, (kid_r >= 0)[:, None], use_scratch)
        else:
            _sync_partition()
            mbarrier.arrive(bars.index(_PDS_FREE), count=1)
            if WITH_PSUM:
                head_sum = gl.sum(sums, axis=1)  # within each row's lanes: the other columns are 0
                slot = j * BLOCK + keys_sum
                if use_perm:  # a pass walks regrouped slots: the sums go to the original ones (-1: none)
                    slot_out = gl.load(perm_base + slot, mask=slot < count, other=-1)
                    out = slot_out >= 0
                else:
                    slot_out = slot
                    out = slot < count
                if psum_atomic:
                    gl.atomic_add(psum_base + slot_out, head_sum, mask=out, sem="relaxed")
                else:
                    gl.store(psum_base + slot_out, head_sum, mask=out)
            _add_or_store(dst + cols[None, :], c_red, (kid >= 0)[:, None], use_scratch)
        kid = kid_next


@gluon.jit
def _add_or_store(ptrs, values, mask, use_scratch):
    """Contributions into key rows by fp32 atomics, or stored to the pairs' own scratch rows."""
    if use_scratch:
        gl.store(ptrs, values, mask=mask)
    else:
        gl.atomic_add(ptrs, values, mask=mask, sem="relaxed")


# warp_specialize hands its partitions runtime values only, so the column half (a constexpr of the
# shared-memory slice) and the head sums are fixed by one small entry function each
@gluon.jit
def _contribution_low(n_blocks, count, idx_base, acc_base, s_at, q_smem, q_rope_smem, do_smem, p_smem, ds_smem,
                      bars, ones_smem, psum_base, psum_atomic, perm_base, use_perm,
                      use_scratch):  # fmt: skip
    _contribution_partition(n_blocks, count, idx_base, acc_base, s_at, q_smem, q_rope_smem, do_smem, p_smem,
                            ds_smem, bars, ones_smem, psum_base, psum_atomic, perm_base, use_perm, use_scratch,
                            0, False, False)  # fmt: skip


@gluon.jit
def _contribution_low_psum(n_blocks, count, idx_base, acc_base, s_at, q_smem, q_rope_smem, do_smem, p_smem,
                           ds_smem, bars, ones_smem, psum_base, psum_atomic, perm_base, use_perm,
                           use_scratch):  # fmt: skip
    _contribution_partition(n_blocks, count, idx_base, acc_base, s_at, q_smem, q_rope_smem, do_smem, p_smem,
                            ds_smem, bars, ones_smem, psum_base, psum_atomic, perm_base, use_perm, use_scratch,
                            0, False, True)  # fmt: skip


@gluon.jit
def _contribution_high(n_blocks, count, idx_base, acc_base, s_at, q_smem, q_rope_smem, do_smem, p_smem, ds_smem,
                       bars, ones_smem, psum_base, psum_atomic, perm_base, use_perm,
                       use_scratch):  # fmt: skip
    _contribution_partition(n_blocks, count, idx_base, acc_base, s_at, q_smem, q_rope_smem, do_smem, p_smem,
                            ds_smem, bars, ones_smem, psum_base, psum_atomic, perm_base, use_perm, use_scratch,
                            HALF_V, True, False)  # fmt: skip


@gluon.jit
def mla_backward_dkv_kernel(
    q_ptr, k_ptr, idx_ptr, num_ptr, o_ptr, do_ptr, lse_ptr, dlse_ptr, ds_desc, acc_ptr,
    s_qb, s_qs, s_qh, s_kb, s_kt, s_ib, s_is, s_nb, s_ob, s_os, s_oh, s_dob, s_dos, s_doh,
    s_lb, s_ls, s_lh, s_dlb, s_dls, s_dlh, ds_rows, s_ab, s_at, s_ah, scratch_slots, psum_ptr, s_pb, s_ps,
    off_ptr, s_fb, s_fs, pass_idx, perm_ptr, delta_ptr, s_eb, s_es, s_eh,
    t_offset, num_head_blocks, sm_scale, qk_scale, HAS_DLSE: gl.constexpr, PSUM: gl.constexpr,
    PASSES: gl.constexpr,
):  # fmt: skip
    """Query token t = t_offset + program_id(0), heads 64 * hb + [0, 64) of batch b (program_id(1)
    = b * num_head_blocks + hb): dS of its first num[b, t] index slots to ds[b, program_id(0)]
    (``ds_desc``: ds as [B * ds_rows * H, W], a [64, 64] box, one TMA store a block) and the pairs'
    contributions into acc[b, key]; with PSUM (1: store, 2: atomic add, for several head blocks) also
    the slots' head-summed P to psum[b, t]. With scratch_slots > 0 (the deterministic backward) each
    pair's contribution is stored, not added, to its own row acc[b, program_id(0) * scratch_slots +
    slot] at head block hb (stride s_ah).

    With PASSES, idx is the chunk's regrouped slots (``key_passes``: row program_id(0), the same
    strides as perm) and the program walks pass ``pass_idx``'s slots [off[.., p], off[.., p + 1])
    (each group 8-slot aligned, so that the TMA stores' columns are 16-byte aligned; the last pass
    ends at the walk's end over -1 slots): their dS to the same slots of ds, their head sums to psum
    at the original slots (perm), and delta (rowsum(dO * O) - dlse) read from delta[b,
    program_id(0)] instead of computed."""
    t_local = gl.program_id(0).to(gl.int64)
    t = t_offset + t_local
    hb = gl.program_id(1) % num_head_blocks
    b = (gl.program_id(1) // num_head_blocks).to(gl.int64)
    h0 = (hb * HEADS).to(gl.int64)
    ds_row = ((b * ds_rows + t_local) * (num_head_blocks * HEADS) + h0).to(gl.int32)  # the heads' first row
    ds_col = 0
    if PASSES:
        lo = gl.load(off_ptr + b * s_fb + t_local * s_fs + pass_idx)
        # to the next group (its -1 gap included) or, in the last pass, to the walk's end: dS zeros
        # over the -1 slots up to where the dQ kernel reads, as one pass writes them up to the extent
        count = gl.load(off_ptr + b * s_fb + t_local * s_fs + pass_idx + 1) - lo
        idx_base = idx_ptr + b * s_ib + t_local * s_is + lo
        perm_base = perm_ptr + b * s_ib + t_local * s_is + lo
        ds_col = lo
    else:
        count = gl.load(num_ptr + b * s_nb + t)
        idx_base = idx_ptr + b * s_ib + t * s_is
        perm_base = idx_base  # unread
    n_blocks = gl.cdiv(count, BLOCK)

    dt: gl.constexpr = q_ptr.dtype.element_ty
    MMA_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_smem = gl.allocate_shared_memory(dt, [HEADS, D_V], MMA_SMEM)
    q_rope_smem = gl.allocate_shared_memory(dt, [HEADS, D_ROPE], MMA_SMEM)
    do_smem = gl.allocate_shared_memory(dt, [HEADS, D_V], MMA_SMEM)
    kv_smem = gl.allocate_shared_memory(dt, [BLOCK, D_V], MMA_SMEM)
    rope_smem = gl.allocate_shared_memory(dt, [BLOCK, D_ROPE], MMA_SMEM)
    p_smem = gl.allocate_shared_memory(dt, [HEADS, BLOCK], MMA_SMEM)
    ds_smem = gl.allocate_shared_memory(dt, [HEADS, BLOCK], ds_desc.layout)  # the TMA store's source
    # the head sums' B operand: [heads, 8] with ones in column 0 (1 KB; 16-byte rows, no swizzle)
    ONES_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    ones_smem = gl.allocate_shared_memory(dt, [HEADS, PSUM_N], ONES_SMEM)
    if PSUM != 0:
        ONES: gl.constexpr = gl.BlockedLayout([1, PSUM_N], [32, 1], [4, 1], [1, 0])
        ones_col = gl.arange(0, PSUM_N, layout=gl.SliceLayout(0, ONES))
        ones = gl.zeros([HEADS, PSUM_N], gl.float32, ONES) + gl.where(ones_col == 0, 1.0, 0.0)[None, :]
        ones_smem.store(ones.to(dt))
    bars = gl.allocate_shared_memory(gl.int64, [_N_BARRIERS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bars.index(_PDS_READY), count=1)
    mbarrier.init(bars.index(_PDS_FREE), count=2)
    fence_async_shared()

    # scratch: the program's pairs own rows t_local * scratch_slots + slot, head block hb's columns
    acc_base = acc_ptr + b * s_ab + hb * s_ah + t_local * scratch_slots * s_at
    contribution_args = (n_blocks, count, idx_base, acc_base, s_at, q_smem, q_rope_smem, do_smem, p_smem, ds_smem,
                         bars, ones_smem, psum_ptr + b * s_pb + t * s_ps, PSUM == 2, perm_base, pass_idx >= 0,
                         scratch_slots > 0)  # fmt: skip
    gl.warp_specialize(
        [
            (_softmax_partition, (
                q_ptr + b * s_qb + t * s_qs + h0 * s_qh, s_qh, do_ptr + b * s_dob + t * s_dos + h0 * s_doh, s_doh,
                o_ptr + b * s_ob + t * s_os + h0 * s_oh, s_oh, lse_ptr + b * s_lb + t * s_ls + h0 * s_lh, s_lh,
                dlse_ptr + b * s_dlb + t * s_dls + h0 * s_dlh, s_dlh, ds_desc, ds_row, ds_col, k_ptr + b * s_kb, s_kt,
                idx_base, count, n_blocks, sm_scale, qk_scale, delta_ptr + b * s_eb + t_local * s_es + h0 * s_eh, s_eh,
                q_smem, q_rope_smem, do_smem, kv_smem, rope_smem, p_smem, ds_smem, bars, HAS_DLSE, PASSES)),
            (_contribution_low_psum if PSUM != 0 else _contribution_low, contribution_args),
            (_contribution_high, contribution_args),
        ],
        [4, 4],
        [152, 176],
    )  # fmt: skip


def mla_backward_dkv(
    q: torch.Tensor,
    k: torch.Tensor,
    idx: torch.Tensor,
    num: torch.Tensor,
    o: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    ds: torch.Tensor,
    acc: torch.Tensor,
    t_offset: int,
    count: int,
    scale: float,
    qk_scale: float,
    psum: torch.Tensor | None = None,
    key_pass: tuple | None = None,
    scratch: bool = False,
) -> None:
    """dS and the dK/dV contributions of query tokens [t_offset, t_offset + count).

    q [B, S, H, 576] (H a multiple of 64), k [B, T, 1, 576] with v = k[..., :512], idx [B, S, L] int32
    (-1 = no key), num [B, S] int32 (each row's extent), o / do [B, S, H, 512], lse (and dlse, or None)
    fp32 [B, S, H]; writes ``scale * dS`` to ds [B, >= count, H, W] (contiguous, q's dtype, W >= L a
    multiple of ``SLOT_ALIGN``: the walked blocks' slot columns, zeros past a row's extent to its last
    block's end) and adds into acc fp32 [B, T, 1, 576]. The caller checks what ``host`` checks for the
    Gluon forward (sm_90, dtypes, unit inner strides, 16-byte aligned rows) and that o / do have them too.
    ``psum`` (fp32 [B, S, L], zeros): each slot's P (rounded to q's dtype, as the dV product reads it)
    summed over the heads is stored there, or added with several head blocks (slots past a row's extent
    stay 0): the indexer KL's target for one [64 keys, 8] product per block.

    ``scratch``: acc is instead fp32 [B, count * L, H // 64, 576] (L = idx.shape[2]) and each (query,
    slot, head block)'s contribution is stored to acc[b, (t - t_offset) * L + slot, head block], not
    added (``host._reduce_scratch`` then sums each key's rows in a fixed order: the deterministic
    backward). Rows of -1 slots are left unwritten. One pass only.

    ``key_pass = (p, perm, off, delta)`` walks only pass p of the chunk's regrouped slots: idx is then
    ``key_passes``' idx_p of these rows with ``align=SLOT_ALIGN`` (ds as wide), perm / off its other
    outputs, and delta fp32 [B, count, H] the rows' rowsum(dO * O) - dlse (``row_delta``). dS goes to
    ds in the regrouped slot order, the last pass writing zeros over the -1 slots up to the walk's
    end: the dQ kernel then reads the regrouped slots up to off[..., P] as it reads one pass's up to num.
    """
    B, _, H, _ = q.shape
    if B * count == 0:
        return
    nhb = H // HEADS.value
    has_dlse = dlse is not None
    dl = dlse if has_dlse else lse  # any fp32 [B, S, H] tensor; unread without HAS_DLSE
    mode = 0 if psum is None else (1 if nhb == 1 else 2)
    ps = lse if psum is None else psum  # unread without PSUM
    if key_pass is None:
        pass_idx, perm, off, delta = -1, idx, num[:, :, None], lse  # unread
    else:
        pass_idx, perm, off, delta = key_pass
        if perm.stride() != idx.stride():
            raise ValueError("key_pass: perm must have idx's strides (both from key_passes)")
    L = idx.shape[2]
    if scratch:
        if key_pass is not None:
            raise ValueError("scratch: the deterministic backward walks one pass (key_pass must be None)")
        if tuple(acc.shape) != (B, count * L, nhb, acc.shape[3]) or acc.stride(3) != 1:
            raise ValueError(f"scratch: acc must be [B, count * L, H // 64, C] = [{B}, {count * L}, {nhb}, C] with "
                             f"unit column stride, got {tuple(acc.shape)}")
        if mode == 2 and nhb > 2:  # fp32 adds of two head blocks onto 0 are exact in either order
            raise ValueError("scratch: the head sums of more than 2 head blocks would add in no fixed order")
    s_ah, scratch_slots = (acc.stride(2), L) if scratch else (0, 0)
    W = ds.shape[3]
    if not ds.is_contiguous() or W % SLOT_ALIGN or W < idx.shape[2] or ds.data_ptr() % 16:
        raise ValueError(f"ds must be contiguous, at least idx's {idx.shape[2]} slots wide in a multiple of "
                         f"{SLOT_ALIGN} (TMA stores), got {tuple(ds.shape)}")
    ds_layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)  # ds_smem's
    ds_desc = TensorDescriptor.from_tensor(ds.view(-1, W), [HEADS.value, BLOCK.value], ds_layout)
    mla_backward_dkv_kernel[(count, B * nhb)](
        q, k, idx, num, o, do, lse, dl, ds_desc, acc,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), idx.stride(0), idx.stride(1),
        num.stride(0), o.stride(0), o.stride(1), o.stride(2), do.stride(0), do.stride(1), do.stride(2),
        lse.stride(0), lse.stride(1), lse.stride(2), dl.stride(0), dl.stride(1), dl.stride(2),
        ds.shape[1], acc.stride(0), acc.stride(1), s_ah, scratch_slots, ps, ps.stride(0), ps.stride(1),
        off, off.stride(0), off.stride(1), pass_idx, perm, delta, delta.stride(0), delta.stride(1), delta.stride(2),
        t_offset, nhb, scale, qk_scale, HAS_DLSE=has_dlse, PSUM=mode, PASSES=key_pass is not None, num_warps=4,
    )  # fmt: skip
