"""Triton kernels of the sparse attention (host launches: ``host.py``; public function: ``op.py``).

Kernel design (docs/design.md section 6). A program owns a block of "rows" (query, head pairs) that share
one key list, gathers the listed key rows ``BLOCK_N`` at a time and runs an online softmax:

- MLA absorbed (wide rows, Dqk + Dv > 512): one program per query token and up to 64 of its heads
  (all heads share the one latent row, so the heads are the matmul M side). The key dim is split
  into a power-of-two part and a power-of-two tail (576 = 512 + 64: Triton tiles are powers of
  two); when ``v`` is the first ``Dv`` dims of ``k`` the gathered key tile doubles as the value tile.
  On sm_90 (Hopper) the forward of the GLM-5 / DeepSeek-V3.2 shape (576 = 512 + 64, v = k[..., :512],
  heads in blocks of 64, bf16/fp16) runs a warp-specialised Gluon kernel instead
  (``mla_forward_gluon.py``): its gather, Q K^T and P V overlap, where this Triton kernel runs them one
  after another (H200, T = 128K: 389 against 276 TFLOP/s in one run; BENCHMARKS.md). Same blocks,
  same results.
- GQA/MHA: query tiles. A tile of ``128 // G`` consecutive queries times the G heads of one KV head
  forms 128 rows over the sorted union of the tile's selected keys, with a per-query bitmask of
  membership (``host.union_tiles``: Triton kernels in ``tile_unions.py``, no sort). Neighbouring
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

import triton
import triton.language as tl


@triton.jit
def _program_rows(
    NUM, BITS, pid0, g, hb, b, num_queries, num_idx, group, num_tiles, tile_q, stride_bits,
    TILED: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """The (query, head) rows of one program, how far it walks its key list and the list's length.

    Per token (TILED False): program pid0 is query token pid0; rows are BLOCK_H heads of KV head g
    (head block hb); it walks the row's extent (``row_extent_kernel``) and masks slots by the
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
def row_extent_kernel(
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
def sparse_attn_fwd_kernel(
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

    # l = 0: no key, or only -inf logits (o = 0, lse = -inf). A NaN or +inf logit makes l NaN,
    # and then lse is NaN too, not -inf (which would claim the row had no key): the reference's rule.
    no_key = l_i == 0
    l_safe = tl.where(no_key, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(no_key, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    o_rows = OUT + b * stride_ob + row_t * stride_os + row_h * stride_oh
    tl.store(o_rows[:, None] + offs_v[None, :] * stride_od, out.to(OUT.dtype.element_ty), mask=rmask[:, None])
    tl.store(LSE + b * stride_lb + row_t * stride_ls + row_h * stride_lh, lse, mask=rmask)

@triton.jit
def sparse_attn_bwd_kernel(
    Q, K, V, IDX, NUM, BITS, OUT, DO, LSE, DLSE, DQ, DKV, PSUM,
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
    stride_pb, stride_ps, stride_pk,
    t_offset, chunk_len, num_queries, num_idx, num_kv_heads, group, num_head_blocks, num_tiles, tile_q,
    sm_scale, qk_scale,
    D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr, V_FROM_K: tl.constexpr,
    MERGE_DV: tl.constexpr, HAS_DLSE: tl.constexpr, SCRATCH: tl.constexpr, TILED: tl.constexpr,
    HAS_PSUM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """dQ of one program's rows and the dK/dV contributions of its (rows, key list) pairs.

    Grid (chunk_len, B * Hkv * NHB); the program is token (or tile) ``t_offset + program_id(0)``.
    A key-list slot j's contribution (summed over the program's rows) goes to DKV row
    ``(b, key)`` by fp32 atomics, or with ``SCRATCH`` to scratch row
    ``(b * chunk_len + program_id(0)) * num_idx + j`` (head slot g * NHB + hb).
    Columns: ``[0, D1 + D2)`` dK, then ``[D1 + D2, D1 + D2 + DV)`` dV unless ``MERGE_DV`` adds
    dV into the first DV (= D1) columns.

    ``HAS_PSUM``: also add each (query, index slot)'s head-summed P into PSUM [B, S, K] fp32 (the
    indexer KL's target, ``HeadProbs``) with fp32 atomics. Per token a program sums its heads in
    registers and adds at the list position (the programs of one query's KV heads meet there); a tile
    (only with ``SparseAttentionConfig.tiled_head_probs`` off or a model wider than
    ``host.TILE_PROBS_MAX_WIDTH``; else ``tile_head_probs.py`` fills PSUM without atomics)
    adds each (query, head) row's P at the key's rank among the keys that query selected, the count of
    its membership bits before it (the query's row must be sorted ascending, -1 after its keys:
    ``hytopk``'s rows), so one query's heads and KV heads meet on its slots.
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
    psum_row = PSUM + b * stride_pb
    seen = tl.zeros([BLOCK_H], tl.int32)  # tiles, HAS_PSUM: each row's selected keys before this block
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
        if HAS_PSUM:
            if TILED:  # one atomic add per (row, key): a per-query head sum first was slower (notes.md)
                taken = live.to(tl.int32)
                slot = seen[:, None] + tl.cumsum(taken, axis=1) - 1
                seen += tl.sum(taken, axis=1)
                dst_p = psum_row + row_t[:, None] * stride_ps + slot.to(tl.int64) * stride_pk
                tl.atomic_add(dst_p, p, mask=live, sem="relaxed")
            else:
                tl.atomic_add(psum_row + pid0 * stride_ps + offs_n * stride_pk, tl.sum(p, axis=0), mask=valid,
                              sem="relaxed")
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
def sparse_attn_bwd_dkv_kernel(
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

    Same programs and destinations as ``sparse_attn_bwd_kernel`` but without the dQ
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
def sparse_attn_bwd_dq_kernel(
    DS, K, IDX, NUM, DQ,
    stride_dsb, stride_dss, stride_dsh,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_ib, stride_is, stride_ik, stride_nb, stride_ns,
    stride_dqb, stride_dqs, stride_dqh, stride_dqd,
    t_offset, idx_t0, num_idx, num_kv_heads, group, num_head_blocks,
    D1: tl.constexpr, D2: tl.constexpr, SLAB: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """Split backward, part 2: dQ[:, SLAB columns] = dS @ K[selected, columns] for one token.

    Grid (chunk_len * (D1 // SLAB), B * Hkv * NHB): a token's column slabs are neighbouring programs,
    so they run together and its dS rows (1 GiB a chunk, far past L2) come from memory once, not once
    a slab; the last column slab also owns the D2 tail. Token t's slots are row t - idx_t0 of IDX and
    NUM (0: IDX holds every token and NUM [B, S] the rows' extents, multiples of EXTENT_GRAIN; the
    chunk's first token: IDX holds the chunk's regrouped slots and NUM their walks' ends, multiples of
    BLOCK_N, ``key_passes``), and it reads the first NUM[b, row] of them, every one of which the dK/dV
    kernel wrote to dS (zeros where no key). The masks are by num_idx, which Triton specializes as a
    multiple of 16: a mask by a loaded count or by the loaded keys is not provably uniform over
    16-slot runs, and the dS loads then lose their vector width and their pipelining (H200, 128K:
    121 ms against 76).
    """
    t_local = (tl.program_id(0) // (D1 // SLAB)).to(tl.int64)
    t = t_offset + t_local
    j = tl.program_id(0) % (D1 // SLAB)
    hb, g, b = _head_block(num_head_blocks, num_kv_heads)

    heads, hmask = _block_heads(hb, g, group, BLOCK_H)
    offs_c = j * SLAB + tl.arange(0, SLAB)
    # Vector forms of "this program owns the D2 tail" (masks need tensors, not a scalar bool).
    last_n = (tl.zeros([BLOCK_N], tl.int32) + j) == D1 // SLAB - 1
    last_h = (tl.zeros([BLOCK_H], tl.int32) + j) == D1 // SLAB - 1
    k_base = K + b * stride_kb + g * stride_kh
    idx_row = IDX + b * stride_ib + (t - idx_t0) * stride_is
    ds_rows = DS + b * stride_dsb + t_local * stride_dss + heads[:, None] * stride_dsh

    acc = tl.zeros([BLOCK_H, SLAB], tl.float32)
    if D2 > 0:
        offs_d2 = D1 + tl.arange(0, D2)
        acc2 = tl.zeros([BLOCK_H, D2], tl.float32)
    count = tl.load(NUM + b * stride_nb + (t - idx_t0) * stride_ns)
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
def row_delta_kernel(
    DO, OUT, DLSE, DELTA, stride_dob, stride_dos, stride_doh, stride_ob, stride_os, stride_oh,
    stride_dlb, stride_dls, stride_dlh, stride_eb, stride_es, stride_eh, t_offset, num_heads,
    DV: tl.constexpr, BLOCK_H: tl.constexpr, HAS_DLSE: tl.constexpr,
):  # fmt: skip
    """DELTA[b, r, h] = rowsum(dO * O) - dlse of token t_offset + r (fp32): the backward's per-row term.

    Grid (rows, B, cdiv(H, BLOCK_H)); the head rows of dO and O have unit inner stride.
    """
    r = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    t = t_offset + r
    heads = (tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)  # dO's head stride can be S * Dv
    hmask = heads < num_heads
    cols = tl.arange(0, DV)
    do = tl.load(DO + b * stride_dob + t * stride_dos + heads[:, None] * stride_doh + cols[None, :],
                 mask=hmask[:, None], other=0.0)  # fmt: skip
    o = tl.load(OUT + b * stride_ob + t * stride_os + heads[:, None] * stride_oh + cols[None, :],
                mask=hmask[:, None], other=0.0)  # fmt: skip
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + b * stride_dlb + t * stride_dls + heads * stride_dlh, mask=hmask, other=0.0)
    tl.store(DELTA + b * stride_eb + r * stride_es + heads * stride_eh, delta, mask=hmask)


@triton.jit
def scratch_reduce_kernel(
    SCR, PERM, SEG_START, SEG_KEY, ACC,
    stride_sp, stride_sh, stride_ab, stride_at, stride_ah,
    num_keys, num_head_blocks, num_cols,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """ACC[b, key, g, cols] += the sum of one key's scratch rows, in a fixed order: tiles of BLOCK_R
    rows in sorted (query) order, each summed as one tile.

    Grid (unique keys of the chunk, Hkv, column blocks). Each (key, g, columns) has exactly one
    program, so the read-modify-write needs no atomics and the order is fixed. A tile of rows per
    step rather than one row: the rows' addresses come from PERM, and one 256-byte load at a time
    behind that dependent load left the reduction latency-bound.
    """
    u = tl.program_id(0)
    g = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < num_cols
    lo = tl.load(SEG_START + u)
    hi = tl.load(SEG_START + u + 1)
    key = tl.load(SEG_KEY + u)
    acc = tl.zeros([BLOCK_C], tl.float32)
    for i0 in range(lo, hi, BLOCK_R):
        r = i0 + tl.arange(0, BLOCK_R)
        rmask = r < hi
        rows = SCR + tl.load(PERM + r, mask=rmask, other=0)[:, None] * stride_sp + (g * num_head_blocks) * stride_sh
        for hb in range(num_head_blocks):
            tile = tl.load(rows + hb * stride_sh + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
            acc += tl.sum(tile, axis=0)
    b = key // num_keys
    s = key % num_keys
    dst = ACC + b * stride_ab + s * stride_at + g * stride_ah + cols
    tl.store(dst, tl.load(dst, mask=cmask, other=0.0) + acc, mask=cmask)
