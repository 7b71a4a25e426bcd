"""Triton kernels of the indexer KL loss (host launches and public function: ``op.py``).

Sparse stage, one program per query (b, i). With P[s] = sum_h exp(scale * attn_q[i, h] . attn_k[s, g(h)]
- lse[h]) the unnormalised target over the selected keys, Z = sum_s P[s], p = P / Z and
lseI = logsumexp_s I[s], the per-query loss is
    KL = sum_s p log p - p (I - lseI) = A / Z - log Z - C / Z + lseI,  A = sum P log P, C = sum P I,
so one streaming pass over the K selected keys yields it (no second pass, no [S, T] table).
The backward needs only p and softmax(I) per selected key: P is saved ([B, S, K] fp32, the only
O(S * K) state) with Z and lseI per query, so the attention tensors are never read again.

P can also come from elsewhere (``P_GIVEN``: the sparse attention's backward sums it over heads as
it recomputes its probabilities; ``attn_prob_sum_kernel`` is that sum as a pass of its own): the
forward then only scores the indexer.
"""

import triton
import triton.language as tl

from ..triton_math import lse_step, lse_step_rows, lse_value


@triton.jit
def _attn_logits_tile(aq_ptr, ak_ptr, q_rows, row_mask, k_rows, key_mask, DQK,
                      BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DA: tl.constexpr,
                      PRECISION: tl.constexpr):
    """[BLOCK_G, BLOCK_K] fp32 dot products attn_q[q_rows] . attn_k[k_rows] (row offsets in elements),
    accumulated over Dqk in BLOCK_DA slices so a 576-wide MLA latent row needs no power-of-2 padding."""
    acc = tl.zeros((BLOCK_G, BLOCK_K), dtype=tl.float32)
    for d0 in range(0, DQK, BLOCK_DA):
        offs_d = d0 + tl.arange(0, BLOCK_DA)
        dmask = offs_d < DQK
        q = tl.load(aq_ptr + q_rows[:, None] + offs_d[None, :], mask=row_mask[:, None] & dmask[None, :], other=0.0)
        k = tl.load(ak_ptr + k_rows[:, None] + offs_d[None, :], mask=key_mask[:, None] & dmask[None, :], other=0.0)
        acc = tl.dot(q, tl.trans(k), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _indexer_query(iq_ptr, iw_ptr, b, i, s_iq_b, s_iq_s, s_iq_h, s_iw_b, s_iw_s, H, D,
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Query i of batch b's indexer heads: offsets, masks, q [BLOCK_H, BLOCK_D] and w [BLOCK_H]."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    hmask = offs_h < H
    dmask = offs_d < D
    q = tl.load(iq_ptr + b * s_iq_b + i * s_iq_s + offs_h[:, None] * s_iq_h + offs_d[None, :],
                mask=hmask[:, None] & dmask[None, :], other=0.0)
    w = tl.load(iw_ptr + b * s_iw_b + i * s_iw_s + offs_h, mask=hmask, other=0.0)
    return offs_h, offs_d, hmask, dmask, q, w


@triton.jit
def _indexer_key_tile(ik_ptr, idx_ptr, q, b, i, k0, K, s_ik_b, s_ik_t, s_idx_b, s_idx_s, offs_d, dmask,
                      BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """Selected-key tile k0 of query i: slot offsets and mask, which slots hold a key, the key rows
    (index 0 where none, loaded as zeros) and the per-head products qk [BLOCK_H, BLOCK_K] fp32."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    kmask = offs_k < K
    idx = tl.load(idx_ptr + b * s_idx_b + i * s_idx_s + offs_k, mask=kmask, other=-1)
    valid = idx >= 0
    safe_idx = tl.where(valid, idx, 0).to(tl.int64)
    kt = tl.load(ik_ptr + b * s_ik_b + safe_idx[:, None] * s_ik_t + offs_d[None, :],
                 mask=valid[:, None] & dmask[None, :], other=0.0)
    qk = tl.dot(q, tl.trans(kt), input_precision=PRECISION)  # [BLOCK_H, BLOCK_K]
    return offs_k, kmask, valid, safe_idx, kt, qk


@triton.jit
def _plogp(p):
    """p log p elementwise, 0 where p <= 0 (the KL's A term before its sum)."""
    return tl.where(p > 0, p * tl.log(tl.where(p > 0, p, 1.0)), 0.0)


@triton.jit
def _kl_value(a, c, z, lse_i):
    """KL = A / Z - log Z - C / Z + lseI from the sums A = sum P log P, C = sum P I and Z = sum P; 0 where
    the target is empty (Z = 0)."""
    z_safe = tl.where(z > 0, z, 1.0)
    return tl.where(z > 0, (a - c) / z_safe - tl.log(z_safe) + lse_i, 0.0)


@triton.jit
def attn_lse_kernel(
    idx_ptr, aq_ptr, ak_ptr, lse_ptr,
    S, K, DQK, G, HKV,
    s_idx_b, s_idx_s, s_aq_b, s_aq_s, s_aq_h, s_ak_b, s_ak_t, s_ak_h,
    scale_log2,
    BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DA: tl.constexpr, PRECISION: tl.constexpr,
):
    """Attention log-sum-exp per head over the query's selected keys (when the caller has none);
    writes lse [B, S, Hq] fp32, -inf for a query without a selected key."""
    i = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    gmask = offs_g < G
    for g in range(0, HKV):
        heads = g * G + offs_g
        q_rows = b * s_aq_b + i * s_aq_s + heads.to(tl.int64) * s_aq_h
        m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
        acc = tl.zeros((BLOCK_G,), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            idx = tl.load(idx_ptr + b * s_idx_b + i * s_idx_s + offs_k, mask=offs_k < K, other=-1)
            valid = idx >= 0
            k_rows = b * s_ak_b + tl.where(valid, idx, 0).to(tl.int64) * s_ak_t + g * s_ak_h
            logits = _attn_logits_tile(aq_ptr, ak_ptr, q_rows, gmask, k_rows, valid, DQK,
                                       BLOCK_G, BLOCK_K, BLOCK_DA, PRECISION) * scale_log2
            logits = tl.where(valid[None, :], logits, float("-inf"))
            m, acc = lse_step_rows(m, acc, logits, True)
        lse = lse_value(m, acc, float("-inf"), True)
        tl.store(lse_ptr + (b * S + i) * (HKV * G) + heads, lse, mask=gmask)


@triton.jit
def _head_prob_sum_tile(aq_ptr, ak_ptr, lse_ptr, b, i, row, safe_idx, valid, offs_g, gmask, DQK, G, HKV,
                        s_aq_b, s_aq_s, s_aq_h, s_ak_b, s_ak_t, s_ak_h, scale_log2,
                        BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DA: tl.constexpr,
                        PRECISION: tl.constexpr):
    """P [BLOCK_K] of one selected-key tile: sum over the query heads of exp(scale q.k - lse) (lse a
    finite fp32 [B, S, Hq] row, 0 standing in for a query without keys), 0 on invalid slots."""
    p_un = tl.zeros((BLOCK_K,), tl.float32)
    for g in range(0, HKV):
        heads = g * G + offs_g
        q_rows = b * s_aq_b + i * s_aq_s + heads.to(tl.int64) * s_aq_h
        k_rows = b * s_ak_b + safe_idx * s_ak_t + g * s_ak_h
        logits = _attn_logits_tile(aq_ptr, ak_ptr, q_rows, gmask, k_rows, valid, DQK,
                                   BLOCK_G, BLOCK_K, BLOCK_DA, PRECISION)
        lse = tl.load(lse_ptr + row * (HKV * G) + heads, mask=gmask, other=0.0)
        prob = tl.exp2(logits * scale_log2 - lse[:, None] * 1.4426950408889634)
        p_un += tl.sum(tl.where(gmask[:, None] & valid[None, :], prob, 0.0), axis=0)
    return p_un


@triton.jit
def attn_prob_sum_kernel(
    idx_ptr, aq_ptr, ak_ptr, lse_ptr, p_ptr,
    S, K, DQK, G, HKV,
    s_idx_b, s_idx_s, s_aq_b, s_aq_s, s_aq_h, s_ak_b, s_ak_t, s_ak_h,
    scale_log2,
    BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DA: tl.constexpr, PRECISION: tl.constexpr,
):
    """The loss's target alone: P [B, S, K] fp32 of query (b, i) (program (i, b))."""
    i = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    row = b * S + i
    offs_g = tl.arange(0, BLOCK_G)
    gmask = offs_g < G
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < K
        idx = tl.load(idx_ptr + b * s_idx_b + i * s_idx_s + offs_k, mask=kmask, other=-1)
        valid = idx >= 0
        safe_idx = tl.where(valid, idx, 0).to(tl.int64)
        p_un = _head_prob_sum_tile(aq_ptr, ak_ptr, lse_ptr, b, i, row, safe_idx, valid, offs_g, gmask, DQK, G, HKV,
                                   s_aq_b, s_aq_s, s_aq_h, s_ak_b, s_ak_t, s_ak_h, scale_log2,
                                   BLOCK_G, BLOCK_K, BLOCK_DA, PRECISION)
        tl.store(p_ptr + row * K + offs_k, p_un, mask=kmask)


@triton.jit
def indexer_kl_fwd_kernel(
    iq_ptr, ik_ptr, iw_ptr, idx_ptr, aq_ptr, ak_ptr, lse_ptr,
    kl_ptr, p_ptr, z_ptr, lsei_ptr,
    S, K, H, D, DQK, G, HKV,
    s_iq_b, s_iq_s, s_iq_h, s_ik_b, s_ik_t, s_iw_b, s_iw_s, s_idx_b, s_idx_s,
    s_aq_b, s_aq_s, s_aq_h, s_ak_b, s_ak_t, s_ak_h,
    scale_log2,
    RELU: tl.constexpr, STORE_P: tl.constexpr, P_GIVEN: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_DA: tl.constexpr, PRECISION_I: tl.constexpr, PRECISION_A: tl.constexpr,
):
    """Per-query KL, Z and lseI; P from the attention tensors (and stored with STORE_P), or with
    P_GIVEN read from p_ptr (masked by the valid slots; the attention pointers are then unread)."""
    i = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    row = b * S + i
    offs_h, offs_d, hmask, dmask, q, w = _indexer_query(
        iq_ptr, iw_ptr, b, i, s_iq_b, s_iq_s, s_iq_h, s_iw_b, s_iw_s, H, D, BLOCK_H, BLOCK_D
    )
    offs_g = tl.arange(0, BLOCK_G)
    gmask = offs_g < G

    m_i = tl.full((), float("-inf"), tl.float32)  # running max of I over valid keys
    l_i = tl.zeros((), tl.float32)  # running sum of exp(I - m_i)
    z = tl.zeros((), tl.float32)  # sum P
    a = tl.zeros((), tl.float32)  # sum P log P
    c = tl.zeros((), tl.float32)  # sum P I
    for k0 in range(0, K, BLOCK_K):
        offs_k, kmask, valid, safe_idx, kt, qk = _indexer_key_tile(
            ik_ptr, idx_ptr, q, b, i, k0, K, s_ik_b, s_ik_t, s_idx_b, s_idx_s, offs_d, dmask, BLOCK_K, PRECISION_I
        )
        if RELU:
            qk = tl.maximum(qk, 0.0)
        logit_i = tl.sum(qk * w[:, None], axis=0)  # 0 on invalid keys (their k rows load as 0)

        if P_GIVEN:
            p_un = tl.load(p_ptr + row * K + offs_k, mask=valid, other=0.0)
        else:
            p_un = _head_prob_sum_tile(aq_ptr, ak_ptr, lse_ptr, b, i, row, safe_idx, valid, offs_g, gmask, DQK, G,
                                       HKV, s_aq_b, s_aq_s, s_aq_h, s_ak_b, s_ak_t, s_ak_h, scale_log2,
                                       BLOCK_G, BLOCK_K, BLOCK_DA, PRECISION_A)
        if STORE_P and not P_GIVEN:
            tl.store(p_ptr + row * K + offs_k, p_un, mask=kmask)
        z += tl.sum(p_un)
        a += tl.sum(_plogp(p_un))
        c += tl.sum(p_un * logit_i)

        masked_i = tl.where(valid, logit_i, float("-inf"))
        m_i, l_i = lse_step(m_i, l_i, masked_i, False)

    lse_i = lse_value(m_i, l_i, 0.0, False)
    tl.store(kl_ptr + row, _kl_value(a, c, z, lse_i))
    tl.store(z_ptr + row, z)
    tl.store(lsei_ptr + row, lse_i)


@triton.jit
def _target_mass(p_row, idx_row, K, BLOCK_K: tl.constexpr):
    """Z = sum of a query's target over its slots that hold a key (the forward's Z, as a pass of its own)."""
    z = tl.zeros((BLOCK_K,), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < K
        idx = tl.load(idx_row + offs_k, mask=kmask, other=-1)
        z += tl.load(p_row + offs_k, mask=kmask & (idx >= 0), other=0.0)
    return tl.sum(z)


@triton.jit
def indexer_kl_bwd_kernel(
    iq_ptr, ik_ptr, iw_ptr, idx_ptr, p_ptr, z_ptr, lsei_ptr, gkl_ptr,
    dq_ptr, dw_ptr, dk_ptr, kl_ptr,
    S, K, H, D, T,
    s_iq_b, s_iq_s, s_iq_h, s_ik_b, s_ik_t, s_iw_b, s_iw_s, s_idx_b, s_idx_s, s_gkl_b, s_gkl_s,
    RELU: tl.constexpr, ONE_PASS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    """dKL/dI[s] = g * (softmax(I)[s] * [Z > 0] - p[s]); then through w and the ReLU to dq, dw,
    and dk (fp32 atomics: one [BLOCK_K, D] scatter-add per key tile, order not deterministic).

    ``ONE_PASS``: the loss and its gradients at once, without the forward. lseI is given (``lsei_ptr``:
    hytopk's log-sum-exp of the selected scores, the same logits up to summation order), Z is summed
    from the target first (``_target_mass``; ``z_ptr`` unread), and the KL terms A and C accumulate
    beside the gradients (the forward's formula), stored to ``kl_ptr``."""
    i = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    row = b * S + i
    offs_h, offs_d, hmask, dmask, q, w = _indexer_query(
        iq_ptr, iw_ptr, b, i, s_iq_b, s_iq_s, s_iq_h, s_iw_b, s_iw_s, H, D, BLOCK_H, BLOCK_D
    )
    g = tl.load(gkl_ptr + b * s_gkl_b + i * s_gkl_s).to(tl.float32)
    if ONE_PASS:
        z = _target_mass(p_ptr + row * K, idx_ptr + b * s_idx_b + i * s_idx_s, K, BLOCK_K)
    else:
        z = tl.load(z_ptr + row)
    lse_i = tl.load(lsei_ptr + row)
    if ONE_PASS:  # a query without keys has the selection's -inf: its terms are all masked out
        lse_i = tl.where(lse_i == float("-inf"), 0.0, lse_i)
    g_soft = tl.where(z > 0, g, 0.0)  # sum_s p = 1, or 0 when the target is empty
    g_p = g / tl.where(z > 0, z, 1.0)

    dq = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    dw = tl.zeros((BLOCK_H,), tl.float32)
    a = tl.zeros((), tl.float32)  # ONE_PASS: sum P log P and sum P I
    c = tl.zeros((), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k, kmask, valid, safe_idx, kt, qk = _indexer_key_tile(
            ik_ptr, idx_ptr, q, b, i, k0, K, s_ik_b, s_ik_t, s_idx_b, s_idx_s, offs_d, dmask, BLOCK_K, PRECISION
        )
        r = qk
        if RELU:
            r = tl.maximum(qk, 0.0)
        logit_i = tl.sum(r * w[:, None], axis=0)
        p_un = tl.load(p_ptr + row * K + offs_k, mask=kmask, other=0.0)
        d_i = tl.where(valid, g_soft * tl.exp(logit_i - lse_i) - g_p * p_un, 0.0)
        if ONE_PASS:
            p_live = tl.where(valid, p_un, 0.0)
            a += tl.sum(_plogp(p_live))
            c += tl.sum(p_live * logit_i)
        dw += tl.sum(r * d_i[None, :], axis=1)
        dqk = w[:, None] * d_i[None, :]
        if RELU:
            dqk = tl.where(qk >= 0, dqk, 0.0)  # torch.clamp_min passes the gradient at exactly 0
        dqk_in = dqk.to(kt.dtype)
        dq = tl.dot(dqk_in, kt, dq, input_precision=PRECISION)
        dkt = tl.dot(tl.trans(dqk_in), q, input_precision=PRECISION)  # [BLOCK_K, BLOCK_D]
        tl.atomic_add(dk_ptr + (b * T + safe_idx[:, None]) * D + offs_d[None, :], dkt,
                      mask=valid[:, None] & dmask[None, :], sem="relaxed")
    tl.store(dq_ptr + row * H * D + offs_h[:, None] * D + offs_d[None, :], dq.to(dq_ptr.dtype.element_ty),
             mask=hmask[:, None] & dmask[None, :])
    tl.store(dw_ptr + row * H + offs_h, dw, mask=hmask)
    if ONE_PASS:
        tl.store(kl_ptr + row, _kl_value(a, c, z, lse_i))
