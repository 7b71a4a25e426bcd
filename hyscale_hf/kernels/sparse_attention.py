"""Sparse attention: each query attends only to its selected keys (GQA/MHA and MLA absorbed).

Layout (docs/design.md section 3): Triton kernels, host launch functions, the autograd wrapper, the public
function. The torch path is ``reference.sparse_attention_reference`` (autograd through gathers).

Kernel design (docs/design.md section 6). A program owns a block of "rows" (query, head pairs) that share
one key list, gathers the listed key rows ``BLOCK_N`` at a time and runs an online softmax:

- MLA absorbed (wide rows, Dqk + Dv > 512): one program per query token and up to 64 of its heads
  (all heads share the one latent row, so the heads are the matmul M side). The key dim is split
  into a power-of-two part and a power-of-two tail (576 = 512 + 64: Triton tiles are powers of
  two); when ``v`` is the first ``Dv`` dims of ``k`` the gathered key tile doubles as the value tile.
  On sm_90 (Hopper) the forward of the GLM-5 / DeepSeek-V3.2 shape (576 = 512 + 64, v = k[..., :512],
  heads in blocks of 64, bf16/fp16) runs a warp-specialised Gluon kernel instead
  (``mla_forward_gluon``): its gather, Q K^T and P V overlap, where this Triton kernel runs them one
  after another (H200, T = 128K: 389 against 276 TFLOP/s in one run; BENCHMARKS.md). Same blocks,
  same results.
- GQA/MHA: query tiles. A tile of ``128 // G`` consecutive queries times the G heads of one KV head
  forms 128 rows over the sorted union of the tile's selected keys, with a per-query bitmask of
  membership (``_union_tiles``: Triton kernels in ``_tile_unions.py``, no sort). Neighbouring
  queries share most keys (local window, sinks, keys many queries attend to), so a shared key row
  is read once per tile and its dK/dV contribution is summed over the tile in registers before one
  atomic add. Where unions are wide (little sharing) the forward runs per token instead (rows = the
  G heads padded to 16).

Backward recomputes P from the forward's log-sum-exp. GQA: one fused kernel keeps dQ in
registers and forms each listed key's dK/dV contribution with tensor-core products. MLA: the
[64, 576] fp32 dQ accumulator does not fit beside the rest, so the backward is split: one kernel
stores ``scale * dS`` (per query chunk) and forms the dK/dV contributions transposed, a second one
computes dQ = dS @ K by column slabs. Contributions reach the fp32 ``[B, T, Hkv, Dk (+Dv)]``
accumulator one of two ways:

- fast (default): fp32 atomic adds (vectorised ``red.v4``); the summation order varies by run;
- deterministic: each chunk of programs writes its contributions to a scratch buffer, the chunk's
  (program, key) pairs are sorted by key (stable, so in program order within a key), and one
  program per key sums them in that fixed order. Bit-identical results across runs, no atomics,
  slower (scratch traffic, one sort per chunk). ``deterministic=True`` or
  ``torch.use_deterministic_algorithms(True)``.

When ``v`` is a view of the first ``Dv`` dims of ``k`` that autograd knows about (``v = k[..., :512]``),
dV is added into the same accumulator rows as dK (one buffer, half the atomics on those dims) and the
whole gradient is returned for ``k``; autograd's view machinery then routes it to the shared storage.
"""

from typing import NamedTuple

import torch

from . import reference
from ._checks import check_dim, check_indices, check_same_device, check_tensor, resolve_backend

try:  # Triton is a Linux x86-64 dependency; elsewhere only the torch reference exists.
    import triton
    import triton.language as tl

    from . import _tile_unions
except ImportError:  # pragma: no cover
    triton = None
try:  # Gluon (Triton's explicit-layout dialect) with its Hopper ops: the MLA forward on sm_90
    from . import mla_forward_gluon
except (ImportError, AttributeError):  # pragma: no cover  (a Triton without them, or other names)
    mla_forward_gluon = None

_LOG2E = 1.4426950408889634

# ----------------------------------------------------------------------------- Triton kernels

if triton is not None:

    @triton.jit
    def _program_rows(
        NUM, BITS, pid0, g, hb, b, num_queries, num_idx, group, num_tiles, tile_q, stride_bits,
        TILED: tl.constexpr, BLOCK_H: tl.constexpr,
    ):  # fmt: skip
        """The (query, head) rows of one program, how far it walks its key list and the list's length.

        Per token (TILED False): program pid0 is query token pid0; rows are BLOCK_H heads of KV head g
        (head block hb); it walks the row's extent (``_row_extent_kernel``) and masks slots by the
        row length ``num_idx`` (a launch argument: Triton knows its divisibility and vectorises
        the masked loads, which a bound read from memory would prevent). Tiled: program pid0 is a
        tile of tile_q consecutive queries; rows are (query m, head h) pairs, row = m * group + h,
        all over one key list (the tile's union, walked and masked by its length).
        """
        rows = tl.arange(0, BLOCK_H)
        count = tl.load(NUM + b * num_tiles + pid0)
        if TILED:
            row_m = rows // group
            row_t = pid0 * tile_q + row_m
            row_h = (g * group + rows % group).to(tl.int64)
            rmask = (rows < tile_q * group) & (row_t < num_queries)
            bits_rows = BITS + ((b * num_tiles + pid0) * tile_q + row_m) * stride_bits
            length = count
        else:
            row_t = pid0 + tl.zeros([BLOCK_H], tl.int64)
            row_h, rmask = _block_heads(hb, g, group, BLOCK_H)
            bits_rows = BITS
            length = num_idx
        return row_t, row_h, rmask, count, length, bits_rows

    @triton.jit
    def _row_extent_kernel(
        IDX, NUM, num_rows, num_idx, GRAIN: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr
    ):  # fmt: skip
        """NUM[r] = 1 + the last slot of index row r that holds a key (0 when none), rounded up to a
        multiple of GRAIN and capped at num_idx.

        Per-token kernels stop their key loop there: causal selections pad the rows of the first
        topk queries with -1 (query t sees t + 1 keys), and without the bound those rows would run
        masked tiles for the whole padding (12% of all slots at T = 8K, K = 2048). GRAIN, a
        multiple of every BLOCK_N, makes kernels with different BLOCK_N walk the same slots (the
        split backward's dQ kernel reads exactly the dS slots its dK/dV kernel wrote).
        """
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < num_rows
        ext = tl.zeros([BLOCK_R], tl.int32)
        for k0 in range(0, num_idx, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            m = rmask[:, None] & (offs[None, :] < num_idx)
            kid = tl.load(IDX + rows.to(tl.int64)[:, None] * num_idx + offs[None, :], mask=m, other=-1)
            ext = tl.maximum(ext, tl.max(tl.where(kid >= 0, offs[None, :] + 1, 0), axis=1))
        ext = tl.minimum((ext + GRAIN - 1) // GRAIN * GRAIN, num_idx)
        tl.store(NUM + rows, ext, mask=rmask)

    @triton.jit
    def _head_block(num_head_blocks, num_kv_heads):
        """(head block, KV head, batch) of this program: grid axis 1 is laid out as B * Hkv * NHB."""
        pid = tl.program_id(1)
        hb = pid % num_head_blocks
        g = (pid // num_head_blocks) % num_kv_heads
        b = (pid // (num_head_blocks * num_kv_heads)).to(tl.int64)
        return hb, g, b

    @triton.jit
    def _block_heads(hb, g, group, BLOCK_H: tl.constexpr):
        """Query heads of head block hb of KV head g (int64) and which of the BLOCK_H exist."""
        offs_hg = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        return (g * group + offs_hg).to(tl.int64), offs_hg < group

    @triton.jit
    def _load_rows(rows, cols, stride_d, rmask):
        """Tile [rows, cols] of a [..., D] tensor: ``rows`` row base pointers, ``cols`` column offsets."""
        return tl.load(rows[:, None] + cols[None, :] * stride_d, mask=rmask[:, None], other=0.0)

    @triton.jit
    def _load_q(Q, b, row_t, row_h, rmask, stride_qb, stride_qs, stride_qh, stride_qd,
                D1: tl.constexpr, D2: tl.constexpr):
        """The rows' q: columns [0, D1) and, when D2 > 0, the tail [D1, D1 + D2) (else q1 again, unused)."""
        q_rows = Q + b * stride_qb + row_t * stride_qs + row_h * stride_qh
        q1 = _load_rows(q_rows, tl.arange(0, D1), stride_qd, rmask)
        q2 = q1
        if D2 > 0:
            q2 = _load_rows(q_rows, D1 + tl.arange(0, D2), stride_qd, rmask)
        return q1, q2

    @triton.jit
    def _backward_rows(
        DO, OUT, LSE, DLSE, b, row_t, row_h, rmask, offs_v,
        stride_dob, stride_dos, stride_doh, stride_dod, stride_ob, stride_os, stride_oh, stride_od,
        stride_lb, stride_ls, stride_lh, stride_dlb, stride_dls, stride_dlh, HAS_DLSE: tl.constexpr,
    ):  # fmt: skip
        """What the backward needs per row besides q: dO, delta and the lse in log2 units.

        delta = rowsum(dO * O) - dlse, so d(loss)/d(logit_j) = p_j * (dp_j - delta). A row without
        keys has lse = -inf and p = 0 everywhere; its lse2 is 0 so exp2's argument stays finite.
        """
        do = _load_rows(DO + b * stride_dob + row_t * stride_dos + row_h * stride_doh, offs_v, stride_dod, rmask)
        o = _load_rows(OUT + b * stride_ob + row_t * stride_os + row_h * stride_oh, offs_v, stride_od, rmask)
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
        if HAS_DLSE:
            delta -= tl.load(DLSE + b * stride_dlb + row_t * stride_dls + row_h * stride_dlh, mask=rmask, other=0.0)
        lse = tl.load(LSE + b * stride_lb + row_t * stride_ls + row_h * stride_lh, mask=rmask, other=0.0)
        return do, delta, tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)

    @triton.jit
    def _member(live, bits_rows, rmask, start, TILED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
        """Tiled: keep (row, key) only where the row's query selected that union key (bit set).

        Union slots [start, start + BLOCK_N) are BLOCK_N // 32 whole words of each row's bitmask
        (start is a multiple of BLOCK_N, itself a multiple of 32): load the words, expand the bits.
        """
        if TILED:
            W: tl.constexpr = BLOCK_N // 32
            words = tl.load(bits_rows[:, None] + (start // 32 + tl.arange(0, W))[None, :], mask=rmask[:, None], other=0)
            bit = (words[:, :, None] >> tl.arange(0, 32)[None, None, :]) & 1
            live = live & (tl.reshape(bit, [BLOCK_H, BLOCK_N]) != 0)
        return live

    @triton.jit
    def _sparse_attn_fwd_kernel(
        Q, K, V, IDX, NUM, BITS, OUT, LSE,
        stride_qb, stride_qs, stride_qh, stride_qd,
        stride_kb, stride_kt, stride_kh, stride_kd,
        stride_vb, stride_vt, stride_vh, stride_vd,
        stride_ib, stride_is, stride_ik, stride_bits,
        stride_ob, stride_os, stride_oh, stride_od,
        stride_lb, stride_ls, stride_lh,
        num_queries, num_idx, num_kv_heads, group, num_head_blocks, num_tiles, tile_q,
        qk_scale,
        D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr, V_FROM_K: tl.constexpr,
        TILED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
    ):  # fmt: skip
        """o and lse of one program's rows (see _program_rows); grid (S or tiles, B * Hkv * NHB)."""
        pid0 = tl.program_id(0).to(tl.int64)
        hb, g, b = _head_block(num_head_blocks, num_kv_heads)
        row_t, row_h, rmask, count, length, bits_rows = _program_rows(
            NUM, BITS, pid0, g, hb, b, num_queries, num_idx, group, num_tiles, tile_q, stride_bits, TILED, BLOCK_H
        )
        offs_d1 = tl.arange(0, D1)
        offs_v = tl.arange(0, DV)
        q1, q2 = _load_q(Q, b, row_t, row_h, rmask, stride_qb, stride_qs, stride_qh, stride_qd, D1, D2)
        if D2 > 0:
            offs_d2 = D1 + tl.arange(0, D2)
        k_base = K + b * stride_kb + g * stride_kh
        v_base = V + b * stride_vb + g * stride_vh
        idx_row = IDX + b * stride_ib + pid0 * stride_is

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max, in log2 units
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, DV], tl.float32)
        for start in range(0, count, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            kid = tl.load(idx_row + offs_n * stride_ik, mask=offs_n < length, other=-1)
            valid = kid >= 0
            k_rows = k_base + kid.to(tl.int64)[:, None] * stride_kt
            k1 = tl.load(k_rows + offs_d1[None, :] * stride_kd, mask=valid[:, None], other=0.0)
            s = tl.dot(q1, tl.trans(k1), input_precision=DOT_PREC)
            if D2 > 0:
                k2 = tl.load(k_rows + offs_d2[None, :] * stride_kd, mask=valid[:, None], other=0.0)
                s = tl.dot(q2, tl.trans(k2), s, input_precision=DOT_PREC)
            live = _member(valid[None, :] & rmask[:, None], bits_rows, rmask, start, TILED, BLOCK_H, BLOCK_N)
            s = tl.where(live, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid key yet: keep p = 0
            alpha = tl.exp2(m_i - m_ref)
            p = tl.exp2(s - m_ref[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if V_FROM_K:
                vt = k1
            else:
                v_rows = v_base + kid.to(tl.int64)[:, None] * stride_vt
                vt = tl.load(v_rows + offs_v[None, :] * stride_vd, mask=valid[:, None], other=0.0)
            acc = tl.dot(p.to(vt.dtype), vt, acc * alpha[:, None], input_precision=DOT_PREC)
            m_i = m_new

        has_key = l_i > 0
        l_safe = tl.where(has_key, l_i, 1.0)
        out = acc / l_safe[:, None]
        lse = tl.where(has_key, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        o_rows = OUT + b * stride_ob + row_t * stride_os + row_h * stride_oh
        tl.store(o_rows[:, None] + offs_v[None, :] * stride_od, out.to(OUT.dtype.element_ty), mask=rmask[:, None])
        tl.store(LSE + b * stride_lb + row_t * stride_ls + row_h * stride_lh, lse, mask=rmask)

    @triton.jit
    def _sparse_attn_bwd_kernel(
        Q, K, V, IDX, NUM, BITS, OUT, DO, LSE, DLSE, DQ, DKV,
        stride_qb, stride_qs, stride_qh, stride_qd,
        stride_kb, stride_kt, stride_kh, stride_kd,
        stride_vb, stride_vt, stride_vh, stride_vd,
        stride_ib, stride_is, stride_ik, stride_bits,
        stride_ob, stride_os, stride_oh, stride_od,
        stride_dob, stride_dos, stride_doh, stride_dod,
        stride_lb, stride_ls, stride_lh,
        stride_dlb, stride_dls, stride_dlh,
        stride_dqb, stride_dqs, stride_dqh, stride_dqd,
        stride_ab, stride_at, stride_ah,
        t_offset, chunk_len, num_queries, num_idx, num_kv_heads, group, num_head_blocks, num_tiles, tile_q,
        sm_scale, qk_scale,
        D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr, V_FROM_K: tl.constexpr,
        MERGE_DV: tl.constexpr, HAS_DLSE: tl.constexpr, SCRATCH: tl.constexpr, TILED: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
    ):  # fmt: skip
        """dQ of one program's rows and the dK/dV contributions of its (rows, key list) pairs.

        Grid (chunk_len, B * Hkv * NHB); the program is token (or tile) ``t_offset + program_id(0)``.
        A key-list slot j's contribution (summed over the program's rows) goes to DKV row
        ``(b, key)`` by fp32 atomics, or with ``SCRATCH`` to scratch row
        ``(b * chunk_len + program_id(0)) * num_idx + j`` (head slot g * NHB + hb).
        Columns: ``[0, D1 + D2)`` dK, then ``[D1 + D2, D1 + D2 + DV)`` dV unless ``MERGE_DV`` adds
        dV into the first DV (= D1) columns.
        """
        t_local = tl.program_id(0).to(tl.int64)
        pid0 = t_offset + t_local
        hb, g, b = _head_block(num_head_blocks, num_kv_heads)
        row_t, row_h, rmask, count, length, bits_rows = _program_rows(
            NUM, BITS, pid0, g, hb, b, num_queries, num_idx, group, num_tiles, tile_q, stride_bits, TILED, BLOCK_H
        )
        offs_d1 = tl.arange(0, D1)
        offs_v = tl.arange(0, DV)
        q1, q2 = _load_q(Q, b, row_t, row_h, rmask, stride_qb, stride_qs, stride_qh, stride_qd, D1, D2)
        if D2 > 0:
            offs_d2 = D1 + tl.arange(0, D2)
        do, delta, lse2 = _backward_rows(
            DO, OUT, LSE, DLSE, b, row_t, row_h, rmask, offs_v,
            stride_dob, stride_dos, stride_doh, stride_dod, stride_ob, stride_os, stride_oh, stride_od,
            stride_lb, stride_ls, stride_lh, stride_dlb, stride_dls, stride_dlh, HAS_DLSE,
        )  # fmt: skip

        k_base = K + b * stride_kb + g * stride_kh
        v_base = V + b * stride_vb + g * stride_vh
        idx_row = IDX + b * stride_ib + pid0 * stride_is
        if SCRATCH:
            pair_base = DKV + (g * num_head_blocks + hb) * stride_ah
            pair0 = (b * chunk_len + t_local) * num_idx
        else:
            key_base = DKV + b * stride_ab + g * stride_ah

        dq1 = tl.zeros([BLOCK_H, D1], tl.float32)
        if D2 > 0:
            dq2 = tl.zeros([BLOCK_H, D2], tl.float32)
        for start in range(0, count, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            kid = tl.load(idx_row + offs_n * stride_ik, mask=offs_n < length, other=-1)
            valid = kid >= 0
            k_rows = k_base + kid.to(tl.int64)[:, None] * stride_kt
            k1 = tl.load(k_rows + offs_d1[None, :] * stride_kd, mask=valid[:, None], other=0.0)
            s = tl.dot(q1, tl.trans(k1), input_precision=DOT_PREC)
            if D2 > 0:
                k2 = tl.load(k_rows + offs_d2[None, :] * stride_kd, mask=valid[:, None], other=0.0)
                s = tl.dot(q2, tl.trans(k2), s, input_precision=DOT_PREC)
            if V_FROM_K:
                vt = k1
            else:
                v_rows = v_base + kid.to(tl.int64)[:, None] * stride_vt
                vt = tl.load(v_rows + offs_v[None, :] * stride_vd, mask=valid[:, None], other=0.0)
            live = _member(valid[None, :] & rmask[:, None], bits_rows, rmask, start, TILED, BLOCK_H, BLOCK_N)
            p = tl.where(live, tl.exp2(s * qk_scale - lse2[:, None]), 0.0)
            dp = tl.dot(do, tl.trans(vt), input_precision=DOT_PREC)
            ds = p * (dp - delta[:, None])
            ds_lp = ds.to(k1.dtype)
            dq1 = tl.dot(ds_lp, k1, dq1, input_precision=DOT_PREC)
            dk1 = tl.dot(tl.trans(ds_lp), q1, input_precision=DOT_PREC) * sm_scale
            dv = tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=DOT_PREC)
            if MERGE_DV:
                dk1 += dv
            if SCRATCH:
                dst = pair_base + (pair0 + offs_n)[:, None] * stride_at
            else:
                dst = key_base + kid.to(tl.int64)[:, None] * stride_at
            wmask = valid[:, None]
            if SCRATCH:
                tl.store(dst + offs_d1[None, :], dk1, mask=wmask)
            else:
                tl.atomic_add(dst + offs_d1[None, :], dk1, mask=wmask, sem="relaxed")
            if D2 > 0:
                dq2 = tl.dot(ds_lp, k2, dq2, input_precision=DOT_PREC)
                dk2 = tl.dot(tl.trans(ds_lp), q2, input_precision=DOT_PREC) * sm_scale
                if SCRATCH:
                    tl.store(dst + offs_d2[None, :], dk2, mask=wmask)
                else:
                    tl.atomic_add(dst + offs_d2[None, :], dk2, mask=wmask, sem="relaxed")
            if not MERGE_DV:
                if SCRATCH:
                    tl.store(dst + (D1 + D2 + offs_v)[None, :], dv, mask=wmask)
                else:
                    tl.atomic_add(dst + (D1 + D2 + offs_v)[None, :], dv, mask=wmask, sem="relaxed")

        dq_rows = DQ + b * stride_dqb + row_t * stride_dqs + row_h * stride_dqh
        out1 = (dq1 * sm_scale).to(DQ.dtype.element_ty)
        tl.store(dq_rows[:, None] + offs_d1[None, :] * stride_dqd, out1, mask=rmask[:, None])
        if D2 > 0:
            out2 = (dq2 * sm_scale).to(DQ.dtype.element_ty)
            tl.store(dq_rows[:, None] + offs_d2[None, :] * stride_dqd, out2, mask=rmask[:, None])

    @triton.jit
    def _sparse_attn_bwd_dkv_kernel(
        Q, K, V, IDX, NUM, OUT, DO, LSE, DLSE, DS, DKV,
        stride_qb, stride_qs, stride_qh, stride_qd,
        stride_kb, stride_kt, stride_kh, stride_kd,
        stride_vb, stride_vt, stride_vh, stride_vd,
        stride_ib, stride_is, stride_ik,
        stride_ob, stride_os, stride_oh, stride_od,
        stride_dob, stride_dos, stride_doh, stride_dod,
        stride_lb, stride_ls, stride_lh,
        stride_dlb, stride_dls, stride_dlh,
        stride_dsb, stride_dss, stride_dsh,
        stride_ab, stride_at, stride_ah,
        t_offset, chunk_len, num_queries, num_idx, num_kv_heads, group, num_head_blocks,
        sm_scale, qk_scale,
        D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr, V_FROM_K: tl.constexpr,
        MERGE_DV: tl.constexpr, HAS_DLSE: tl.constexpr, SCRATCH: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
    ):  # fmt: skip
        """Split backward, part 1 (wide rows, MLA): dS to a buffer and the pairs' dK/dV contributions.

        Same programs and destinations as ``_sparse_attn_bwd_kernel`` but without the dQ
        accumulator ([64, 576] fp32 does not fit next to the rest in registers): it stores
        ``scale * dS`` (q's dtype) to ``DS[b, token - t_offset, head, slot]`` for the dQ kernel, and
        forms the contributions transposed (``Q^T dS``: key dims as the matmul M side), which keeps
        one shared-memory copy of Q and dO.
        """
        t_local = tl.program_id(0).to(tl.int64)
        t = t_offset + t_local
        hb, g, b = _head_block(num_head_blocks, num_kv_heads)

        heads, hmask = _block_heads(hb, g, group, BLOCK_H)
        offs_d1 = tl.arange(0, D1)
        offs_v = tl.arange(0, DV)

        q1, q2 = _load_q(Q, b, t, heads, hmask, stride_qb, stride_qs, stride_qh, stride_qd, D1, D2)
        if D2 > 0:
            offs_d2 = D1 + tl.arange(0, D2)
        do, delta, lse2 = _backward_rows(
            DO, OUT, LSE, DLSE, b, t, heads, hmask, offs_v,
            stride_dob, stride_dos, stride_doh, stride_dod, stride_ob, stride_os, stride_oh, stride_od,
            stride_lb, stride_ls, stride_lh, stride_dlb, stride_dls, stride_dlh, HAS_DLSE,
        )  # fmt: skip

        k_base = K + b * stride_kb + g * stride_kh
        v_base = V + b * stride_vb + g * stride_vh
        idx_row = IDX + b * stride_ib + t * stride_is
        ds_rows = DS + b * stride_dsb + t_local * stride_dss + heads[:, None] * stride_dsh
        if SCRATCH:
            pair_base = DKV + (g * num_head_blocks + hb) * stride_ah
            pair0 = (b * chunk_len + t_local) * num_idx
        else:
            key_base = DKV + b * stride_ab + g * stride_ah

        count = tl.load(NUM + b * num_queries + t)  # the row's extent (_program_rows says why)
        for start in range(0, count, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            in_row = offs_n < num_idx
            kid = tl.load(idx_row + offs_n * stride_ik, mask=in_row, other=-1)
            valid = kid >= 0
            k_rows = k_base + kid.to(tl.int64)[:, None] * stride_kt
            k1 = tl.load(k_rows + offs_d1[None, :] * stride_kd, mask=valid[:, None], other=0.0)
            s = tl.dot(q1, tl.trans(k1), input_precision=DOT_PREC)
            if D2 > 0:
                k2 = tl.load(k_rows + offs_d2[None, :] * stride_kd, mask=valid[:, None], other=0.0)
                s = tl.dot(q2, tl.trans(k2), s, input_precision=DOT_PREC)
            if V_FROM_K:
                vt = k1
            else:
                v_rows = v_base + kid.to(tl.int64)[:, None] * stride_vt
                vt = tl.load(v_rows + offs_v[None, :] * stride_vd, mask=valid[:, None], other=0.0)
            live = valid[None, :] & hmask[:, None]
            p = tl.where(live, tl.exp2(s * qk_scale - lse2[:, None]), 0.0)
            dp = tl.dot(do, tl.trans(vt), input_precision=DOT_PREC)
            ds = ((p * (dp - delta[:, None])) * sm_scale).to(q1.dtype)
            tl.store(ds_rows + offs_n[None, :], ds, mask=hmask[:, None] & in_row[None, :])
            pt = p.to(do.dtype)
            # Contributions transposed: [key dims, keys]; element (d, n) goes to row kid[n], column d.
            if SCRATCH:
                cols = pair_base + (pair0 + offs_n)[None, :] * stride_at
            else:
                cols = key_base + kid.to(tl.int64)[None, :] * stride_at
            wmask = valid[None, :]
            c1 = tl.dot(tl.trans(q1), ds, input_precision=DOT_PREC)
            if MERGE_DV:
                c1 = tl.dot(tl.trans(do), pt, c1, input_precision=DOT_PREC)
            if SCRATCH:
                tl.store(cols + offs_d1[:, None], c1, mask=wmask)
            else:
                tl.atomic_add(cols + offs_d1[:, None], c1, mask=wmask, sem="relaxed")
            if D2 > 0:
                c2 = tl.dot(tl.trans(q2), ds, input_precision=DOT_PREC)
                if SCRATCH:
                    tl.store(cols + offs_d2[:, None], c2, mask=wmask)
                else:
                    tl.atomic_add(cols + offs_d2[:, None], c2, mask=wmask, sem="relaxed")
            if not MERGE_DV:
                cv = tl.dot(tl.trans(do), pt, input_precision=DOT_PREC)
                if SCRATCH:
                    tl.store(cols + (D1 + D2 + offs_v)[:, None], cv, mask=wmask)
                else:
                    tl.atomic_add(cols + (D1 + D2 + offs_v)[:, None], cv, mask=wmask, sem="relaxed")

    @triton.jit
    def _sparse_attn_bwd_dq_kernel(
        DS, K, IDX, NUM, DQ,
        stride_dsb, stride_dss, stride_dsh,
        stride_kb, stride_kt, stride_kh, stride_kd,
        stride_ib, stride_is, stride_ik,
        stride_dqb, stride_dqs, stride_dqh, stride_dqd,
        t_offset, num_queries, num_idx, num_kv_heads, group, num_head_blocks,
        D1: tl.constexpr, D2: tl.constexpr, SLAB: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
    ):  # fmt: skip
        """Split backward, part 2: dQ[:, SLAB columns] = dS @ K[selected, columns] for one token.

        Grid (chunk_len, B * Hkv * NHB, D1 // SLAB); the last column slab also owns the D2 tail.
        """
        t_local = tl.program_id(0).to(tl.int64)
        t = t_offset + t_local
        j = tl.program_id(2)
        hb, g, b = _head_block(num_head_blocks, num_kv_heads)

        heads, hmask = _block_heads(hb, g, group, BLOCK_H)
        offs_c = j * SLAB + tl.arange(0, SLAB)
        # Vector forms of "this program owns the D2 tail" (masks need tensors, not a scalar bool).
        last_n = (tl.zeros([BLOCK_N], tl.int32) + j) == D1 // SLAB - 1
        last_h = (tl.zeros([BLOCK_H], tl.int32) + j) == D1 // SLAB - 1
        k_base = K + b * stride_kb + g * stride_kh
        idx_row = IDX + b * stride_ib + t * stride_is
        ds_rows = DS + b * stride_dsb + t_local * stride_dss + heads[:, None] * stride_dsh

        acc = tl.zeros([BLOCK_H, SLAB], tl.float32)
        if D2 > 0:
            offs_d2 = D1 + tl.arange(0, D2)
            acc2 = tl.zeros([BLOCK_H, D2], tl.float32)
        # the row's extent: a multiple of EXTENT_GRAIN, so the dK/dV kernel wrote every dS slot read here
        count = tl.load(NUM + b * num_queries + t)
        for start in range(0, count, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            in_row = offs_n < num_idx
            kid = tl.load(idx_row + offs_n * stride_ik, mask=in_row, other=-1)
            valid = kid >= 0
            k_rows = k_base + kid.to(tl.int64)[:, None] * stride_kt
            kc = tl.load(k_rows + offs_c[None, :] * stride_kd, mask=valid[:, None], other=0.0)
            ds = tl.load(ds_rows + offs_n[None, :], mask=hmask[:, None] & in_row[None, :], other=0.0)
            acc = tl.dot(ds, kc, acc, input_precision=DOT_PREC)
            if D2 > 0:
                k2 = tl.load(k_rows + offs_d2[None, :] * stride_kd, mask=(valid & last_n)[:, None], other=0.0)
                acc2 = tl.dot(ds, k2, acc2, input_precision=DOT_PREC)

        dq_rows = DQ + b * stride_dqb + t * stride_dqs + heads[:, None] * stride_dqh
        tl.store(dq_rows + offs_c[None, :] * stride_dqd, acc.to(DQ.dtype.element_ty), mask=hmask[:, None])
        if D2 > 0:
            tl.store(dq_rows + offs_d2[None, :] * stride_dqd, acc2.to(DQ.dtype.element_ty), mask=(hmask & last_h)[:, None])

    @triton.jit
    def _scratch_reduce_kernel(
        SCR, PERM, SEG_START, SEG_KEY, ACC,
        stride_sp, stride_sh, stride_ab, stride_at, stride_ah,
        num_keys, num_head_blocks, num_cols,
        BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        """ACC[b, key, g, cols] += sum of one key's scratch rows, in sorted (query) order.

        Grid (unique keys of the chunk, Hkv, column blocks). Each (key, g, columns) has exactly one
        program, so the read-modify-write needs no atomics and the order is fixed.
        """
        u = tl.program_id(0)
        g = tl.program_id(1)
        cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < num_cols
        lo = tl.load(SEG_START + u)
        hi = tl.load(SEG_START + u + 1)
        key = tl.load(SEG_KEY + u)
        acc = tl.zeros([BLOCK_C], tl.float32)
        for i in range(lo, hi):
            row = SCR + tl.load(PERM + i) * stride_sp + (g * num_head_blocks) * stride_sh
            for hb in range(num_head_blocks):
                acc += tl.load(row + hb * stride_sh + cols, mask=cmask, other=0.0)
        b = key // num_keys
        s = key % num_keys
        dst = ACC + b * stride_ab + s * stride_at + g * stride_ah + cols
        tl.store(dst, tl.load(dst, mask=cmask, other=0.0) + acc, mask=cmask)


# ----------------------------------------------------------------------------- host launches

# Bytes of fp32 scratch one deterministic backward chunk may use.
SCRATCH_BYTES = 1 << 30
# Bytes of the dS buffer [B, chunk, Hq, K] of the split (wide-row) backward.
DS_BYTES = 1 << 30

# Per-token rows are walked up to their last key rounded up to this many slots (>= every BLOCK_N).
EXTENT_GRAIN = 128

# The tiled forward runs only where the widest tile union has at most this many times K keys.
TILED_FWD_MAX_UNION = 4

# Launch configs, keyed by kernel; tests and the tuning script override entries (BLOCK_N etc.).
_CONFIG_OVERRIDES: dict = {}


def _split_key_dim(d: int) -> tuple[int, int]:
    """d = D1 + D2 with D1 the largest power of two <= d; (0, 0) if D2 is not a power of two >= 16."""
    d1 = 1 << (d.bit_length() - 1)
    d2 = d - d1
    if d1 < 16 or (d2 and (d2 < 16 or d2 & (d2 - 1))):
        return 0, 0
    return d1, d2


def _v_is_k_prefix(k: torch.Tensor, v: torch.Tensor) -> bool:
    """v's elements are k's first Dv dims (same storage, offset and strides): ``v = k[..., :Dv]``."""
    return (
        v.data_ptr() == k.data_ptr()
        and v.shape[:3] == k.shape[:3]
        and v.stride() == k.stride()
        and v.shape[3] <= k.shape[3]
        and v.dtype == k.dtype
    )


def _v_grad_flows_into_k(k: torch.Tensor, v: torch.Tensor) -> bool:
    """True when autograd routes v's gradient into the storage of k (v is a view of k's base)."""
    if not (k.requires_grad and v.requires_grad and _v_is_k_prefix(k, v)):
        return False
    base = k if k._base is None else k._base
    return v._base is not None and v._base is base


def _gluon_mla_forward_applies(q: torch.Tensor, k: torch.Tensor, v_from_k: bool, run: "_KeyLists") -> bool:
    """The Hopper MLA forward (``mla_forward_gluon``) takes per-token lists of MLA-absorbed rows:
    one KV head of 576 dims whose first 512 are v, query heads in blocks of 64, bf16/fp16, unit
    inner strides and 16-byte aligned rows (its copies move 16-byte pieces), on an sm_90 GPU.
    ``_CONFIG_OVERRIDES["mla_gluon"] = False`` turns it off (the Triton forward then runs)."""
    if mla_forward_gluon is None or not q.is_cuda or run.tile_q or not _CONFIG_OVERRIDES.get("mla_gluon", True):
        return False
    rows_aligned = all(t.data_ptr() % 16 == 0 for t in (q, k)) and all(
        st % 8 == 0 for st in (*q.stride()[:3], k.stride(0), k.stride(1))
    )
    return (
        torch.cuda.get_device_capability(q.device) == (9, 0)
        and q.dtype in (torch.bfloat16, torch.float16)
        and k.dtype == q.dtype
        and v_from_k
        and k.shape[2] == 1
        and q.shape[2] % 64 == 0
        and q.shape[3] == 576
        and q.stride(3) == 1
        and k.stride(3) == 1
        and run.idx.stride(2) == 1
        and rows_aligned
    )


def triton_unsupported_reason(q, k, v) -> str | None:
    """Why the Triton kernel cannot take these inputs (None if it can)."""
    if not (q.dtype == k.dtype == v.dtype):
        return f"q, k, v must share one dtype for the Triton kernel, got {q.dtype}, {k.dtype}, {v.dtype}"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"the Triton kernel takes float16/bfloat16/float32, got {q.dtype}"
    dqk, dv = q.shape[-1], v.shape[-1]
    d1, _ = _split_key_dim(dqk)
    if d1 == 0:
        return f"Dqk = {dqk} must be a power of two >= 16 plus an optional power-of-two tail >= 16 (e.g. 576 = 512 + 64)"
    if dv < 16 or dv & (dv - 1):
        return f"Dv = {dv} must be a power of two >= 16 for the Triton kernel"
    return None


def _is_wide(dqk: int, dv: int) -> bool:
    """MLA-absorbed-like rows (576 + 512): big tiles, one program per token, split backward."""
    return dqk + dv > 512


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _config(kind: str, group: int, dqk: int, dv: int, num_idx: int) -> dict:
    """Block sizes and launch options of one kernel (``kind``), before ``_CONFIG_OVERRIDES``."""
    block_h = min(64, max(16, _next_pow2(group)))
    wide = _is_wide(dqk, dv)
    # Measured on one H200 (scripts/tune_sparse_attention.py, T = 16K, K = 2048, bf16).
    if kind == "fwd":
        cfg = dict(BLOCK_H=block_h, BLOCK_N=64, num_warps=8 if block_h >= 64 else 4, num_stages=2)
    elif kind == "bwd":
        # Wide rows split the backward in two kernels (dS + dK/dV, then dQ): the fused kernel's
        # [64, 576] fp32 dQ accumulator does not fit beside the rest. BLOCK_N 16 keeps the split
        # dK/dV kernel under sm_90's 227 KB of shared memory; 4 warps beat 8 there (78 vs 108 ms), and
        # 3 stages beat 2 (H200: 35.3 vs 36.8 ms at 8K, 590 vs 636 ms at 128K).
        cfg = dict(BLOCK_H=block_h, BLOCK_N=16 if wide else 32, num_warps=4 if wide or block_h < 64 else 8,
                   num_stages=3 if wide else 2)
        cfg["split"] = wide
    elif kind == "bwd_dq":  # dQ of the split backward, SLAB columns of the key dims per program
        cfg = dict(SLAB=128, BLOCK_N=64, num_warps=4, num_stages=3)
    elif kind == "fwd_tiled":  # BLOCK_H rows = (query, head) pairs of a query tile
        cfg = dict(BLOCK_N=32, num_warps=4, num_stages=3)
    else:  # "bwd_tiled"
        cfg = dict(BLOCK_N=64, num_warps=8, num_stages=2)
    cfg.update(_CONFIG_OVERRIDES.get(kind, {}))
    if kind.endswith("tiled"):
        cfg["BLOCK_H"] = _tile_rows()
    # Tiled kernels read membership bits a 32-bit word at a time: BLOCK_N in {32, 64, 128}.
    cfg["BLOCK_N"] = min(cfg["BLOCK_N"], max(32 if kind.endswith("tiled") else 16, _next_pow2(num_idx)))
    return cfg


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get full fp32 products (not tf32): the fp32 path is the accuracy path.
    return "ieee" if dtype == torch.float32 else "tf32"


class _KeyLists(NamedTuple):
    """What one program iterates: a token's own index row, or a query tile's union of keys.

    ``idx`` [B, P, L] int32 (-1 = skip) holds one key list per program (P = S tokens or S / tile_q
    tiles) and ``num`` [B, P] int32 how many of its slots a program walks: the union's length, or
    a token row's extent (up to its last key, ``_row_extent_kernel``). Tiled lists also carry
    ``bits`` [B * P * tile_q, W] (bit u of a query's row: the query selected union key u);
    per-token lists pass ``idx`` there.
    """

    idx: torch.Tensor
    num: torch.Tensor
    bits: torch.Tensor
    tile_q: int  # queries per tile; 0 = one program per token


def _union_tiles(indices: torch.Tensor, tile_q: int, num_keys: int):
    """Query tiles of ``tile_q`` consecutive queries: sorted union of their keys + membership bits.

    Neighbouring queries share most of their selection (local window, sinks, popular far keys), so
    a tile reads each shared key row once and runs one tensor-core product for all its queries'
    heads, and its dK/dV contribution per key is summed in registers before the one atomic add.
    Built by Triton kernels without a sort (``_tile_unions``; torch reference:
    ``reference.tile_unions_reference``). Returns None when a query lists one key twice (a bit
    cannot count it; the per-token path can).
    """
    lists = _tile_unions.tile_unions(indices, tile_q, num_keys)
    return None if lists is None else _KeyLists(*lists, tile_q)


def _tile_rows() -> int:
    """Rows (query, head pairs) of a query tile: the matmul M side of the tiled kernels; 0 = off.

    128 rows (32 queries of a GQA group of 4) rather than 64: each tile sums its keys' dK/dV in
    registers before one atomic add per key, so twice the queries per tile halve the atomics while
    the union grows only by the extra window keys. H200, T = 128K, far tokens shared by 64 queries:
    backward 89 -> 51 ms, forward 34.6 -> 31.7 ms (scripts/tune_sparse_attention.py).
    """
    return _CONFIG_OVERRIDES.get("tile", {}).get("rows", 128)


def _token_lists(indices: torch.Tensor) -> _KeyLists:
    """One program per token over its own (contiguous) index row, walked up to the row's extent."""
    B, S, L = indices.shape
    extent = torch.empty(B, S, dtype=torch.int32, device=indices.device)
    if B * S:
        block_r = 16
        _row_extent_kernel[(triton.cdiv(B * S, block_r),)](
            indices, extent, B * S, L, GRAIN=EXTENT_GRAIN, BLOCK_R=block_r, BLOCK_K=min(256, _next_pow2(L))
        )  # fmt: skip
    return _KeyLists(indices, extent, indices, 0)


def _key_lists(indices: torch.Tensor, num_keys: int, group: int, wide: bool) -> _KeyLists:
    """Query tiles (union key lists) where a tile holds >= 2 queries, else per-token index rows."""
    rows = _tile_rows()
    tile_q = rows // group if rows and not wide else 0
    if tile_q >= 2:
        lists = _union_tiles(indices, tile_q, num_keys)
        if lists is not None:
            return lists
    return _token_lists(indices)


def _sparse_attention_fwd(q, k, v, indices, scale: float):
    """Returns o, lse and the key lists (saved for the backward)."""
    B, S, Hq, Dqk = q.shape
    T, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    group = Hq // Hkv
    d1, d2 = _split_key_dim(Dqk)
    v_from_k = _v_is_k_prefix(k, v) and Dv == d1
    o = torch.empty(B, S, Hq, Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, S, Hq, dtype=torch.float32, device=q.device)
    lists = _key_lists(indices, T, group, _is_wide(Dqk, Dv))
    if S == 0:
        return o, lse, lists
    run = lists
    if lists.tile_q and lists.idx.shape[2] > TILED_FWD_MAX_UNION * indices.shape[2]:
        # Little overlap between neighbouring queries: a tile's product would be mostly masked
        # work, while the per-token forward only moves the selected rows. (The backward still
        # takes the tiles: there a key's contributions sum in registers before one atomic add.)
        run = _token_lists(indices)
    if _gluon_mla_forward_applies(q, k, v_from_k, run):
        mla_forward_gluon.mla_forward(q, k, run.idx, run.num, scale * _LOG2E, o, lse)
        return o, lse, lists
    L = run.idx.shape[2]
    if run.tile_q:
        cfg = _config("fwd_tiled", group, Dqk, Dv, L)
        nhb, programs = 1, run.idx.shape[1]
    else:
        cfg = _config("fwd", group, Dqk, Dv, L)
        nhb, programs = triton.cdiv(group, cfg["BLOCK_H"]), S
    _sparse_attn_fwd_kernel[(programs, B * Hkv * nhb)](
        q, k, v, run.idx, run.num, run.bits, o, lse,
        *q.stride(), *k.stride(), *v.stride(), *run.idx.stride(), run.bits.stride(0) if run.tile_q else 0,
        *o.stride(), *lse.stride(),
        S, L, Hkv, group, nhb, run.idx.shape[1], max(1, run.tile_q), scale * _LOG2E,
        D1=d1, D2=d2, DV=Dv, V_FROM_K=v_from_k, TILED=bool(run.tile_q), BLOCK_H=cfg["BLOCK_H"],
        BLOCK_N=cfg["BLOCK_N"], DOT_PREC=_dot_precision(q.dtype), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )  # fmt: skip
    return o, lse, lists


def _sparse_attention_bwd(q, k, v, lists, o, lse, do, dlse, scale: float, merge_dv: bool, deterministic: bool):
    """Returns (dq, dk, dv); dv is None when ``merge_dv`` folded it into dk."""
    B, S, Hq, Dqk = q.shape
    T, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    idx = lists.idx
    L = idx.shape[2]
    group = Hq // Hkv
    d1, d2 = _split_key_dim(Dqk)
    v_from_k = _v_is_k_prefix(k, v) and Dv == d1
    merge_dv = merge_dv and v_from_k
    tiled = bool(lists.tile_q)
    cfg = _config("bwd_tiled" if tiled else "bwd", group, Dqk, Dv, L)
    split = cfg.get("split", False)
    nhb = 1 if tiled else triton.cdiv(group, cfg["BLOCK_H"])
    ncol = Dqk if merge_dv else Dqk + Dv
    dq = torch.empty(B, S, Hq, Dqk, dtype=q.dtype, device=q.device)
    acc = torch.zeros(B, T, Hkv, ncol, dtype=torch.float32, device=q.device)
    units = idx.shape[1]  # programs along dim 0: tokens, or query tiles
    if S == 0:
        return dq, acc[..., :Dqk].to(k.dtype), None if merge_dv else acc[..., Dqk:].to(v.dtype)
    has_dlse = dlse is not None
    dlse_t = dlse if has_dlse else lse  # any fp32 [B, S, Hq] tensor; unread without HAS_DLSE
    common = dict(
        D1=d1, D2=d2, DV=Dv, V_FROM_K=v_from_k, MERGE_DV=merge_dv, HAS_DLSE=has_dlse,
        BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], DOT_PREC=_dot_precision(q.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    grid_heads = B * Hkv * nhb

    # Programs go in chunks when a per-chunk buffer is needed: dS (split kernels) or scratch.
    chunk = units
    if split:
        chunk = min(chunk, DS_BYTES // (B * Hq * L * q.element_size()))
    if deterministic:
        chunk = min(chunk, SCRATCH_BYTES // (B * L * Hkv * nhb * ncol * 4))
    chunk = max(1, chunk)
    ds_buf = torch.empty(B, chunk, Hq, L, dtype=q.dtype, device=q.device) if split else None
    if deterministic:
        target = torch.empty(B * chunk * L, Hkv * nhb, ncol, dtype=torch.float32, device=q.device)
        tstrides = (0, target.stride(0), target.stride(1))
    else:
        target, tstrides = acc, (acc.stride(0), acc.stride(1), acc.stride(2))

    for t0 in range(0, units, chunk):
        count = min(chunk, units - t0)
        if split:
            args = (
                *q.stride(), *k.stride(), *v.stride(), *idx.stride(), *o.stride(), *do.stride(),
                *lse.stride(), *dlse_t.stride(),
            )  # fmt: skip
            _sparse_attn_bwd_dkv_kernel[(count, grid_heads)](
                q, k, v, idx, lists.num, o, do, lse, dlse_t, ds_buf, target, *args,
                ds_buf.stride(0), ds_buf.stride(1), ds_buf.stride(2), *tstrides,
                t0, count, S, L, Hkv, group, nhb, scale, scale * _LOG2E, SCRATCH=deterministic, **common,
            )  # fmt: skip
            qcfg = _config("bwd_dq", group, Dqk, Dv, L)
            if EXTENT_GRAIN % qcfg["BLOCK_N"]:  # it would read dS slots past the row's extent
                raise ValueError(f"bwd_dq BLOCK_N = {qcfg['BLOCK_N']} must divide EXTENT_GRAIN = {EXTENT_GRAIN}")
            slab = min(d1, qcfg["SLAB"])
            _sparse_attn_bwd_dq_kernel[(count, grid_heads, d1 // slab)](
                ds_buf, k, idx, lists.num, dq, ds_buf.stride(0), ds_buf.stride(1), ds_buf.stride(2),
                *k.stride(), *idx.stride(), *dq.stride(), t0, S, L, Hkv, group, nhb,
                D1=d1, D2=d2, SLAB=slab, BLOCK_H=cfg["BLOCK_H"], BLOCK_N=qcfg["BLOCK_N"],
                DOT_PREC=_dot_precision(q.dtype), num_warps=qcfg["num_warps"], num_stages=qcfg["num_stages"],
            )  # fmt: skip
        else:
            _sparse_attn_bwd_kernel[(count, grid_heads)](
                q, k, v, idx, lists.num, lists.bits, o, do, lse, dlse_t, dq, target,
                *q.stride(), *k.stride(), *v.stride(), *idx.stride(), lists.bits.stride(0) if tiled else 0,
                *o.stride(), *do.stride(), *lse.stride(), *dlse_t.stride(), *dq.stride(), *tstrides,
                t0, count, S, L, Hkv, group, nhb, units, max(1, lists.tile_q), scale, scale * _LOG2E,
                SCRATCH=deterministic, TILED=tiled, **common,
            )  # fmt: skip
        if deterministic:
            _reduce_scratch(idx[:, t0 : t0 + count], target, acc, nhb, ncol)
    dk = acc[..., :Dqk].to(k.dtype)
    dv = None if merge_dv else acc[..., Dqk:].to(v.dtype)
    return dq, dk, dv


def _reduce_scratch(idx, scratch, acc, nhb: int, ncol: int) -> None:
    """acc[b, key] += the chunk's scratch rows of that key, summed in query order (no atomics)."""
    B, T, Hkv = acc.shape[0], acc.shape[1], acc.shape[2]
    batch_key = torch.arange(B, device=acc.device, dtype=torch.int64)[:, None, None] * T
    keys = torch.where(idx >= 0, idx.to(torch.int64) + batch_key, B * T).flatten()
    sorted_keys, perm = torch.sort(keys, stable=True)  # stable: a key's pairs stay in query order
    n_valid = int((idx >= 0).sum())
    if n_valid == 0:
        return
    seg_key, counts = torch.unique_consecutive(sorted_keys[:n_valid], return_counts=True)
    seg_start = torch.zeros(seg_key.numel() + 1, dtype=torch.int64, device=acc.device)
    torch.cumsum(counts, 0, out=seg_start[1:])
    block_c = 64
    _scratch_reduce_kernel[(seg_key.numel(), Hkv, triton.cdiv(ncol, block_c))](
        scratch, perm, seg_start, seg_key, acc,
        scratch.stride(0), scratch.stride(1), acc.stride(0), acc.stride(1), acc.stride(2),
        T, nhb, ncol, BLOCK_C=block_c,
    )  # fmt: skip


# ----------------------------------------------------------------------------- autograd wrapper


class _SparseAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, indices, scale, merge_dv, deterministic):
        o, lse, lists = _sparse_attention_fwd(q, k, v, indices, scale)
        ctx.save_for_backward(q, k, v, lists.idx, lists.num, lists.bits, o, lse)
        ctx.tile_q, ctx.scale, ctx.merge_dv, ctx.deterministic = lists.tile_q, scale, merge_dv, deterministic
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, idx, num, bits, o, lse = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        lists = _KeyLists(idx, num, bits, ctx.tile_q)
        dq, dk, dv = _sparse_attention_bwd(
            q, k, v, lists, o, lse, do, dlse, ctx.scale, ctx.merge_dv, ctx.deterministic
        )
        return dq, dk, dv, None, None, None, None


def _triton_sparse_attention(q, k, v, indices, scale, deterministic: bool = False):
    """Differentiable Triton sparse attention: (o [B, S, Hq, Dv] in q's dtype, lse [B, S, Hq] fp32)."""
    merge_dv = _v_grad_flows_into_k(k, v)
    return _SparseAttentionFn.apply(q, k, v, indices.contiguous(), float(scale), merge_dv, bool(deterministic))


_TRITON_KERNEL = _triton_sparse_attention if triton is not None else None


# ----------------------------------------------------------------------------- public function


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    *,
    scale: float | None = None,
    return_lse: bool = False,
    backend: str = "auto",
    deterministic: bool | None = None,
):
    """``o[b, i, h] = sum_{s in S_i} softmax_s(scale * q[b, i, h] . k[b, s, g(h)]) v[b, s, g(h)]``.

    ``S_i`` is the set in ``indices[b, i]`` (one set per query, shared by all heads; ``-1``
    entries are skipped; a repeated index counts once per occurrence, as in the reference).
    ``g(h) = h // (Hq // Hkv)`` maps query heads to KV heads.
    MLA absorbed form: ``Hkv = 1``, ``k`` the latent rows ``[B, T, 1, 576]`` and ``v`` a view of
    their first 512 dims (``k[..., :512]``); gradients of both add into ``k``'s buffer.

    Args:
        q: ``[B, S, Hq, Dqk]`` bf16/fp16/fp32 (fp64 for gradcheck).
        k: ``[B, T, Hkv, Dqk]``; Hq must be a multiple of Hkv.
        v: ``[B, T, Hkv, Dv]``.
        indices: int32 ``[B, S, K]`` with entries in ``[-1, T)``.
        scale: softmax scale; default ``Dqk ** -0.5``.
        return_lse: also return the fp32 log-sum-exp ``[B, S, Hq]`` (``-inf`` for a query with no
            selected key, whose output is 0). The lse is differentiable too.
        backend: ``"auto"`` | ``"torch"`` | ``"triton"``. The Triton kernel takes q, k, v of one
            dtype (fp16/bf16/fp32), ``Dv`` a power of two >= 16 and ``Dqk`` a power of two >= 16
            plus an optional power-of-two tail >= 16 (576 = 512 + 64); ``"auto"`` uses the
            reference for anything else.
        deterministic: Triton backward only. ``False``: dK/dV accumulate with fp32 atomics (fastest;
            the summation order, hence the last bits, vary between runs). ``True``: an ordered,
            atomic-free accumulation through a scratch buffer (bit-reproducible, slower). ``None``
            (default) follows ``torch.are_deterministic_algorithms_enabled()``.

    Returns:
        ``o`` ``[B, S, Hq, Dv]`` in q's dtype (and ``lse`` when asked); differentiable in q, k, v.
    """
    check_tensor("q", q, 4, "[B, S, Hq, Dqk]")
    B, S, Hq, Dqk = q.shape
    kdoc = f"[B={B}, T, Hkv, Dqk={Dqk}]"
    check_tensor("k", k, 4, kdoc)
    check_dim("k", k, 0, B, kdoc)
    check_dim("k", k, 3, Dqk, kdoc)
    T, Hkv = k.shape[1], k.shape[2]
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"q has Hq = {Hq} heads, not a multiple of k's Hkv = {Hkv} heads")
    vdoc = f"[B={B}, T={T}, Hkv={Hkv}, Dv]"
    check_tensor("v", v, 4, vdoc)
    for dim, size in ((0, B), (1, T), (2, Hkv)):
        check_dim("v", v, dim, size, vdoc)
    check_same_device(q=q, k=k, v=v, indices=indices)
    check_indices(indices, B, S, T)
    if deterministic is not None and not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool or None, got {type(deterministic).__name__}")
    if scale is None:
        scale = Dqk**-0.5
    unsupported = triton_unsupported_reason(q, k, v) if _TRITON_KERNEL is not None else "no Triton"
    if backend == "auto" and unsupported is not None:
        backend = "torch"
    chosen = resolve_backend(backend, q.device, _TRITON_KERNEL is not None)
    if chosen == "triton":
        if unsupported is not None:
            raise ValueError(f"backend='triton' cannot take these inputs: {unsupported}")
        if deterministic is None:
            deterministic = torch.are_deterministic_algorithms_enabled()
        o, lse = _TRITON_KERNEL(q, k, v, indices, scale, deterministic=deterministic)
    else:
        o, lse = reference.sparse_attention_reference(q, k, v, indices, scale)
    return (o, lse) if return_lse else o
