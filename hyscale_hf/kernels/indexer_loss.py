"""Indexer KL loss: trains the lightning indexer to match the main attention's distribution.

Layout (docs/design.md section 3): Triton kernels, host launch functions, the autograd wrapper, the public
function. The torch path is ``reference.indexer_kl_loss_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference
from ._checks import (
    check_cu_seqlens,
    check_dim,
    check_indices,
    check_same_device,
    check_tensor,
    resolve_backend,
)

# ----------------------------------------------------------------------------- Triton kernels
#
# Sparse stage, one program per query (b, i). With P[s] = sum_h exp(scale * attn_q[i, h] . attn_k[s, g(h)]
# - lse[h]) the unnormalised target over the selected keys, Z = sum_s P[s], p = P / Z and
# lseI = logsumexp_s I[s], the per-query loss is
#     KL = sum_s p log p - p (I - lseI) = A / Z - log Z - C / Z + lseI,  A = sum P log P, C = sum P I,
# so one streaming pass over the K selected keys yields it (no second pass, no [S, T] table).
# The backward needs only p and softmax(I) per selected key: P is saved ([B, S, K] fp32, the only
# O(S * K) state) with Z and lseI per query, so the attention tensors are never read again.

_LOG2E = 1.4426950408889634


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
def _attn_lse_kernel(
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
            m_new = tl.maximum(m, tl.max(logits, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            acc = acc * tl.exp2(m - m_safe) + tl.sum(tl.exp2(logits - m_safe[:, None]), axis=1)
            m = m_new
        lse = tl.where(acc > 0, (m + tl.log2(tl.where(acc > 0, acc, 1.0))) * 0.6931471805599453, float("-inf"))
        tl.store(lse_ptr + (b * S + i) * (HKV * G) + heads, lse, mask=gmask)


@triton.jit
def _indexer_kl_fwd_kernel(
    iq_ptr, ik_ptr, iw_ptr, idx_ptr, aq_ptr, ak_ptr, lse_ptr,
    kl_ptr, p_ptr, z_ptr, lsei_ptr,
    S, K, H, D, DQK, G, HKV,
    s_iq_b, s_iq_s, s_iq_h, s_ik_b, s_ik_t, s_iw_b, s_iw_s, s_idx_b, s_idx_s,
    s_aq_b, s_aq_s, s_aq_h, s_ak_b, s_ak_t, s_ak_h,
    scale_log2,
    RELU: tl.constexpr, STORE_P: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_DA: tl.constexpr, PRECISION_I: tl.constexpr, PRECISION_A: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    row = b * S + i
    offs_h, offs_d, hmask, dmask, q, w = _indexer_query(
        iq_ptr, iw_ptr, b, i, s_iq_b, s_iq_s, s_iq_h, s_iw_b, s_iw_s, H, D, BLOCK_H, BLOCK_D
    )
    offs_g = tl.arange(0, BLOCK_G)
    gmask = offs_g < G
    HQ = HKV * G

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

        p_un = tl.zeros((BLOCK_K,), tl.float32)
        for g in range(0, HKV):
            heads = g * G + offs_g
            q_rows = b * s_aq_b + i * s_aq_s + heads.to(tl.int64) * s_aq_h
            k_rows = b * s_ak_b + safe_idx * s_ak_t + g * s_ak_h
            logits = _attn_logits_tile(aq_ptr, ak_ptr, q_rows, gmask, k_rows, valid, DQK,
                                       BLOCK_G, BLOCK_K, BLOCK_DA, PRECISION_A)
            lse = tl.load(lse_ptr + row * HQ + heads, mask=gmask, other=0.0)
            prob = tl.exp2(logits * scale_log2 - lse[:, None] * 1.4426950408889634)
            p_un += tl.sum(tl.where(gmask[:, None] & valid[None, :], prob, 0.0), axis=0)
        if STORE_P:
            tl.store(p_ptr + row * K + offs_k, p_un, mask=kmask)
        z += tl.sum(p_un)
        a += tl.sum(tl.where(p_un > 0, p_un * tl.log(tl.where(p_un > 0, p_un, 1.0)), 0.0))
        c += tl.sum(p_un * logit_i)

        masked_i = tl.where(valid, logit_i, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(masked_i))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(masked_i - m_safe))
        m_i = m_new

    lse_i = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), 0.0)
    z_safe = tl.where(z > 0, z, 1.0)
    kl = tl.where(z > 0, (a - c) / z_safe - tl.log(z_safe) + lse_i, 0.0)
    tl.store(kl_ptr + row, kl)
    tl.store(z_ptr + row, z)
    tl.store(lsei_ptr + row, lse_i)


@triton.jit
def _indexer_kl_bwd_kernel(
    iq_ptr, ik_ptr, iw_ptr, idx_ptr, p_ptr, z_ptr, lsei_ptr, gkl_ptr,
    dq_ptr, dw_ptr, dk_ptr,
    S, K, H, D, T,
    s_iq_b, s_iq_s, s_iq_h, s_ik_b, s_ik_t, s_iw_b, s_iw_s, s_idx_b, s_idx_s, s_gkl_b, s_gkl_s,
    RELU: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    """dKL/dI[s] = g * (softmax(I)[s] * [Z > 0] - p[s]); then through w and the ReLU to dq, dw,
    and dk (fp32 atomics: one [BLOCK_K, D] scatter-add per key tile, order not deterministic)."""
    i = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    row = b * S + i
    offs_h, offs_d, hmask, dmask, q, w = _indexer_query(
        iq_ptr, iw_ptr, b, i, s_iq_b, s_iq_s, s_iq_h, s_iw_b, s_iw_s, H, D, BLOCK_H, BLOCK_D
    )
    g = tl.load(gkl_ptr + b * s_gkl_b + i * s_gkl_s).to(tl.float32)
    z = tl.load(z_ptr + row)
    lse_i = tl.load(lsei_ptr + row)
    g_soft = tl.where(z > 0, g, 0.0)  # sum_s p = 1, or 0 when the target is empty
    g_p = g / tl.where(z > 0, z, 1.0)

    dq = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    dw = tl.zeros((BLOCK_H,), tl.float32)
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


# ----------------------------------------------------------------------------- host launches

_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(n))


# Launch tiles on CUDA per kernel, picked by scripts/bench_indexer_loss.py --sweep on one H200
# (T = 16384, K = 2048, bf16). Forward: 3 stages took MLA (64 heads x 576) from 17.4 to 14.1 ms and
# left GQA (32/8 x 128) at ~20 ms; 8 warps were slower everywhere. Backward: 64 keys, 4 warps, 2
# stages measured best (8.8 ms). The lse pass shares the forward's loop nest and tiles.
_GPU_TILES = {
    "lse": {"BLOCK_K": 64, "BLOCK_DA": 64, "num_warps": 4, "num_stages": 3},
    "fwd": {"BLOCK_K": 64, "BLOCK_DA": 64, "num_warps": 4, "num_stages": 3},
    "bwd": {"BLOCK_K": 64, "num_warps": 4, "num_stages": 2},
}
_INTERPRETER_TILES = {"BLOCK_K": 16, "BLOCK_DA": 16}


def _launch_config(kernel: str, device: torch.device, key_tile: int | None, dqk: int | None = None) -> dict:
    cfg = dict(_GPU_TILES[kernel]) if device.type == "cuda" else dict(_INTERPRETER_TILES)
    if key_tile is not None:
        cfg["BLOCK_K"] = key_tile
    if kernel == "bwd":
        cfg.pop("BLOCK_DA", None)
    else:
        cfg["BLOCK_DA"] = min(cfg["BLOCK_DA"], _pow2(dqk))
    return cfg


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs get true fp32 products (Triton's default for fp32 dot is tf32); 16-bit inputs
    # run on the tensor cores with fp32 accumulation either way.
    return "ieee" if dtype == torch.float32 else "tf32"


def _common_dtype(name_a, a, name_b, b):
    if a.dtype not in _TRITON_DTYPES or b.dtype not in _TRITON_DTYPES:
        raise ValueError(
            f"the Triton indexer loss takes fp16/bf16/fp32 {name_a}/{name_b}, got {a.dtype}/{b.dtype}; "
            "use backend='torch' (the exact reference) for float64"
        )
    dt = torch.promote_types(a.dtype, b.dtype)
    return a.to(dt), b.to(dt)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def attention_lse_triton(attn_q, attn_k, indices, scale, *, key_tile=None):
    """Per-head attention log-sum-exp over each query's selected keys: fp32 [B, S, Hq]."""
    attn_q, attn_k = _common_dtype("attn_q", attn_q, "attn_k", attn_k)
    attn_q, attn_k = _last_dim_contiguous(attn_q), _last_dim_contiguous(attn_k)
    indices = indices.contiguous()
    B, S, Hq, Dqk = attn_q.shape
    Hkv = attn_k.shape[2]
    G = Hq // Hkv
    cfg = _launch_config("lse", attn_q.device, key_tile, Dqk)
    lse = torch.empty(B, S, Hq, dtype=torch.float32, device=attn_q.device)
    if B * S == 0:
        return lse
    _attn_lse_kernel[(S, B)](
        indices, attn_q, attn_k, lse,
        S, indices.shape[2], Dqk, G, Hkv,
        indices.stride(0), indices.stride(1), *attn_q.stride()[:3], *attn_k.stride()[:3],
        scale * _LOG2E,
        BLOCK_G=_pow2(G), PRECISION=_precision(attn_q.dtype), **cfg,
    )
    return lse


def indexer_kl_forward_triton(index_q, index_k, index_w, attn_q, attn_k, indices, attn_lse, scale, relu,
                              *, save_target=True, key_tile=None):
    """Per-query KL [B, S] fp32, plus (P [B, S, K] fp32 or None, Z [B, S], lseI [B, S]) for backward."""
    index_q, index_k = _common_dtype("index_q", index_q, "index_k", index_k)
    attn_q, attn_k = _common_dtype("attn_q", attn_q, "attn_k", attn_k)
    index_q, index_k, attn_q, attn_k = map(_last_dim_contiguous, (index_q, index_k, attn_q, attn_k))
    index_w = _last_dim_contiguous(index_w.float())
    indices = indices.contiguous()
    B, S, H, D = index_q.shape
    K = indices.shape[2]
    Hq, Dqk = attn_q.shape[2:]
    Hkv = attn_k.shape[2]
    dev = index_q.device
    if attn_lse is None:
        attn_lse = attention_lse_triton(attn_q, attn_k, indices, scale, key_tile=key_tile)
    # As the reference: a non-finite lse (a query without keys) counts as 0.
    lse = torch.where(torch.isfinite(attn_lse), attn_lse, torch.zeros_like(attn_lse)).float().contiguous()
    kl = torch.empty(B, S, dtype=torch.float32, device=dev)
    z = torch.empty(B, S, dtype=torch.float32, device=dev)
    lse_i = torch.empty(B, S, dtype=torch.float32, device=dev)
    target = torch.empty(B, S, K, dtype=torch.float32, device=dev) if save_target else kl
    if B * S == 0:
        return kl, (target if save_target else None), z, lse_i
    cfg = _launch_config("fwd", dev, key_tile, Dqk)
    _indexer_kl_fwd_kernel[(S, B)](
        index_q, index_k, index_w, indices, attn_q, attn_k, lse,
        kl, target, z, lse_i,
        S, K, H, D, Dqk, Hq // Hkv, Hkv,
        *index_q.stride()[:3], *index_k.stride()[:2], *index_w.stride()[:2], *indices.stride()[:2],
        *attn_q.stride()[:3], *attn_k.stride()[:3],
        scale * _LOG2E,
        RELU=relu, STORE_P=save_target,
        BLOCK_H=_pow2(H), BLOCK_D=_pow2(D), BLOCK_G=_pow2(Hq // Hkv),
        PRECISION_I=_precision(index_q.dtype), PRECISION_A=_precision(attn_q.dtype), **cfg,
    )
    return kl, (target if save_target else None), z, lse_i


def indexer_kl_backward_triton(grad_kl, index_q, index_k, index_w, indices, target, z, lse_i, relu,
                               *, key_tile=None):
    """Gradients (d index_q, d index_k, d index_w) of sum(grad_kl * KL). d index_k is accumulated with
    fp32 atomics, so its bits can vary between runs (summation order); the others are deterministic."""
    q_dtype, k_dtype, w_dtype = index_q.dtype, index_k.dtype, index_w.dtype
    index_q, index_k = _common_dtype("index_q", index_q, "index_k", index_k)
    index_q, index_k = _last_dim_contiguous(index_q), _last_dim_contiguous(index_k)
    index_w = _last_dim_contiguous(index_w.float())
    indices = indices.contiguous()
    B, S, H, D = index_q.shape
    T, K = index_k.shape[1], indices.shape[2]
    dev = index_q.device
    dq = torch.empty(B, S, H, D, dtype=q_dtype, device=dev)
    dw = torch.empty(B, S, H, dtype=torch.float32, device=dev)
    dk = torch.zeros(B, T, D, dtype=torch.float32, device=dev)
    if B * S > 0:
        cfg = _launch_config("bwd", dev, key_tile)
        _indexer_kl_bwd_kernel[(S, B)](
            index_q, index_k, index_w, indices, target, z, lse_i, grad_kl,
            dq, dw, dk,
            S, K, H, D, T,
            *index_q.stride()[:3], *index_k.stride()[:2], *index_w.stride()[:2], *indices.stride()[:2],
            *grad_kl.stride(),
            RELU=relu, BLOCK_H=_pow2(H), BLOCK_D=_pow2(D), PRECISION=_precision(index_q.dtype), **cfg,
        )
    return dq, dk.to(k_dtype), dw.to(w_dtype)


# ----------------------------------------------------------------------------- autograd wrapper


class _IndexerKLSparse(torch.autograd.Function):
    """Per-query sparse-stage KL [B, S]; gradients to index_q, index_k, index_w only."""

    @staticmethod
    def forward(ctx, index_q, index_k, index_w, attn_q, attn_k, indices, attn_lse, scale, relu, key_tile):
        needs_grad = any(ctx.needs_input_grad[:3])
        kl, target, z, lse_i = indexer_kl_forward_triton(
            index_q, index_k, index_w, attn_q, attn_k, indices, attn_lse, scale, relu,
            save_target=needs_grad, key_tile=key_tile,
        )
        if needs_grad:
            ctx.save_for_backward(index_q, index_k, index_w, indices, target, z, lse_i)
        ctx.relu, ctx.key_tile = relu, key_tile
        return kl

    @staticmethod
    def backward(ctx, grad_kl):
        index_q, index_k, index_w, indices, target, z, lse_i = ctx.saved_tensors
        dq, dk, dw = indexer_kl_backward_triton(
            grad_kl, index_q, index_k, index_w, indices, target, z, lse_i, ctx.relu, key_tile=ctx.key_tile
        )
        need = ctx.needs_input_grad
        return (dq if need[0] else None, dk if need[1] else None, dw if need[2] else None,
                None, None, None, None, None, None, None)


def indexer_kl_loss_triton(index_q, index_k, index_w, attn_q, attn_k, indices, *, attn_lse, scale, relu,
                           reduction, key_tile=None):
    """Sparse-stage loss through the Triton kernels; the same reductions as the reference."""
    attn_lse = None if attn_lse is None else attn_lse.detach()
    kl = _IndexerKLSparse.apply(index_q, index_k, index_w, attn_q.detach(), attn_k.detach(), indices,
                                attn_lse, scale, relu, key_tile)
    if reduction == "none":
        return kl
    if reduction == "sum":
        return kl.sum()
    if reduction == "mean":
        return kl.sum() / (indices >= 0).any(-1).sum().clamp_min(1)
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


_TRITON_KERNEL = indexer_kl_loss_triton


# ----------------------------------------------------------------------------- public function


def indexer_kl_loss(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    index_w: torch.Tensor,
    attn_q: torch.Tensor,
    attn_k: torch.Tensor,
    indices: torch.Tensor | None = None,
    *,
    attn_lse: torch.Tensor | None = None,
    scale: float | None = None,
    relu: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    window_start: torch.Tensor | None = None,
    reduction: str = "mean",
    backend: str = "auto",
):
    """``KL(p[i] || softmax(I[i]))`` per query, averaged (DeepSeek-V3.2-Exp, section 2.1).

    ``I[i, s] = sum_h index_w[i, h] * ReLU(index_q[i, h] . index_k[s])`` are the indexer logits;
    ``p[i]`` is the main attention's probabilities summed over heads and L1-normalised, computed
    from ``attn_q``, ``attn_k`` (and ``attn_lse`` when given) and detached: the loss trains only
    the indexer (gradients reach ``index_q``, ``index_k``, ``index_w``).

    Sparse stage (``indices`` given): both distributions live on each query's selected set.
    Dense warm-up (``indices=None``): over every visible key (causal, ``cu_seqlens`` and
    ``window_start`` as in ``hytopk``), computed a query chunk at a time so memory stays
    O(chunk * T) in forward and backward.

    Args:
        index_q: ``[B, S, H, D]``; index_k: ``[B, T, D]``; index_w: ``[B, S, H]`` fp32.
        attn_q: ``[B, S, Hq, Dqk]``; attn_k: ``[B, T, Hkv, Dqk]`` (MLA absorbed: Hkv = 1, the
            latent rows with rope dims).
        indices: int32 ``[B, S, K]`` (``-1`` skipped) or None for the dense warm-up loss.
        attn_lse: optional fp32 ``[B, S, Hq]``: the attention's own log-sum-exp over the same key
            set (sparse_attention's ``lse`` in the sparse stage); recomputed when None.
        scale: the attention's softmax scale; default ``Dqk ** -0.5``.
        relu: the indexer's ReLU flag (as in ``hytopk``).
        reduction: ``"mean"`` over queries with a key, ``"sum"``, or ``"none"`` (``[B, S]``).
        backend: ``"auto"`` | ``"torch"`` | ``"triton"``. The Triton kernels cover the sparse stage
            for fp16/bf16/fp32 inputs (``"auto"`` picks them on CUDA; float64 and the dense warm-up
            run on the torch reference, and asking ``"triton"`` for those is a ``ValueError``).

    Returns:
        The loss (fp32 scalar, or ``[B, S]`` with ``reduction="none"``).

    Triton sparse stage: forward and backward read only the selected keys. Saved for backward:
    the target probabilities ``[B, S, K]`` fp32 plus two fp32 numbers per query (no attention
    tensor is read again). ``d index_k`` is summed with fp32 atomics, so its last bits can vary
    between runs; ``d index_q`` and ``d index_w`` are deterministic. The backward feeds
    ``dI * w`` to the tensor cores in the inputs' dtype (bf16/fp16 rounding, as ``dS`` in flash
    attention); fp32 inputs use exact fp32 products.
    """
    check_tensor("index_q", index_q, 4, "[B, S, H, D]")
    B, S, H, D = index_q.shape
    kdoc = f"[B={B}, T, D={D}]"
    check_tensor("index_k", index_k, 3, kdoc)
    check_dim("index_k", index_k, 0, B, kdoc)
    check_dim("index_k", index_k, 2, D, kdoc)
    T = index_k.shape[1]
    wdoc = f"[B={B}, S={S}, H={H}] float32"
    check_tensor("index_w", index_w, 3, wdoc, dtypes=(torch.float32, torch.float64))
    for dim, size in ((0, B), (1, S), (2, H)):
        check_dim("index_w", index_w, dim, size, wdoc)
    check_tensor("attn_q", attn_q, 4, f"[B={B}, S={S}, Hq, Dqk]")
    check_dim("attn_q", attn_q, 0, B, f"[B={B}, S={S}, Hq, Dqk]")
    check_dim("attn_q", attn_q, 1, S, f"[B={B}, S={S}, Hq, Dqk]")
    Hq, Dqk = attn_q.shape[2:]
    adoc = f"[B={B}, T={T}, Hkv, Dqk={Dqk}]"
    check_tensor("attn_k", attn_k, 4, adoc)
    for dim, size in ((0, B), (1, T), (3, Dqk)):
        check_dim("attn_k", attn_k, dim, size, adoc)
    if Hq % attn_k.shape[2]:
        raise ValueError(f"attn_q has Hq = {Hq} heads, not a multiple of attn_k's Hkv = {attn_k.shape[2]}")
    if attn_lse is not None:
        ldoc = f"[B={B}, S={S}, Hq={Hq}] float32"
        check_tensor("attn_lse", attn_lse, 3, ldoc, dtypes=(torch.float32, torch.float64))
        for dim, size in ((0, B), (1, S), (2, Hq)):
            check_dim("attn_lse", attn_lse, dim, size, ldoc)
    if S > T:
        raise ValueError(f"index_q has S = {S} queries but index_k has only T = {T} keys; need S <= T")
    check_same_device(index_q=index_q, index_k=index_k, index_w=index_w, attn_q=attn_q, attn_k=attn_k,
                      indices=indices, attn_lse=attn_lse)
    if indices is not None:
        check_indices(indices, B, S, T)
    else:
        check_cu_seqlens(cu_seqlens, B, S, T, index_q.device)
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if scale is None:
        scale = Dqk**-0.5
    if backend == "triton" and indices is None:
        raise ValueError("backend='triton' covers the sparse stage (indices given); the dense warm-up loss "
                         "(indices=None) runs on the chunked torch path: use backend='auto' or 'torch'")
    kernel_dtypes = all(t.dtype in _TRITON_DTYPES for t in (index_q, index_k, attn_q, attn_k))
    if backend == "triton" and not kernel_dtypes:
        raise ValueError("backend='triton' computes in fp32 from fp16/bf16/fp32 inputs; float64 inputs need "
                         "backend='torch' (the exact reference)")
    chosen = resolve_backend(backend, index_q.device,
                             _TRITON_KERNEL is not None and indices is not None and kernel_dtypes)
    if chosen == "triton":
        return _TRITON_KERNEL(index_q, index_k, index_w, attn_q, attn_k, indices, attn_lse=attn_lse,
                              scale=scale, relu=relu, reduction=reduction)
    return reference.indexer_kl_loss_reference(
        index_q, index_k, index_w, attn_q, attn_k, indices, attn_lse=attn_lse, scale=scale, relu=relu,
        cu_seqlens=cu_seqlens, window_start=window_start, reduction=reduction,
    )
