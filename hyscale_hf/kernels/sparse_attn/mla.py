"""MLA absorbed-form sparse attention that does not keep the absorbed query for backward.

In MLA's absorbed form each head's query is ``attn_q = [q_nope . W_UK, q_rot]`` (GLM-5: 64 heads x
576 dims, 72 KiB per token in bf16), built from ``q_nope`` (192 dims a head) that the model keeps
anyway. Plain autograd saves both: ``q_nope`` for the absorb and ``attn_q`` for the attention. Under
gradient checkpointing that absorbed query is the largest tensor a layer's recompute holds. Here
the Triton path saves ``q_nope``, ``q_rot`` and ``W_UK`` and rebuilds ``attn_q`` in backward (one
small matmul, the same bits as in forward); outputs and gradients are those of the composition
``naive.mla_sparse_attention_reference``.
"""

from __future__ import annotations

import torch

from ..checks import check_dim, check_indices, check_same_device, check_tensor, resolve_backend
from .forward_op import sparse_attention_forward
from .head_probs import HeadProbs, prob_sum_pass
from .host import (
    HAS_TRITON,
    KeyLists,
    SparseAttentionConfig,
    resolve_config,
    sparse_attention_bwd,
    triton_unsupported_reason,
)
from .mla_query import absorbed_query
from .naive import mla_sparse_attention_reference


class _MLASparseAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_nope, q_rot, w_uk, kv, indices, value_dim, scale, deterministic, config, head_probs):
        attn_q = absorbed_query(q_nope, q_rot, w_uk)
        v = kv[..., :value_dim]
        o, lse, lists = sparse_attention_forward(attn_q, kv, v, indices, scale, config)
        # query tiles walk key unions, not the index rows: the head sums then need the rows themselves
        rows = (indices,) if head_probs is not None and lists.tile_q else ()
        ctx.save_for_backward(q_nope, q_rot, w_uk, kv, lists.idx, lists.num, lists.bits, o, lse, *rows)
        ctx.tile_q, ctx.value_dim, ctx.scale, ctx.deterministic = lists.tile_q, value_dim, scale, deterministic
        ctx.config, ctx.head_probs = config, head_probs
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(attn_q)
        return o, lse, attn_q

    @staticmethod
    def backward(ctx, do, dlse, _d_attn_q):
        q_nope, q_rot, w_uk, kv, idx, num, bits, o, lse, *rows = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        attn_q = absorbed_query(q_nope, q_rot, w_uk)
        v = kv[..., : ctx.value_dim]
        lists = KeyLists(idx, num, bits, ctx.tile_q)
        psum = None
        if ctx.head_probs is not None and not ctx.tile_q:
            psum = torch.zeros(idx.shape, dtype=torch.float32, device=idx.device)
        dq, dkv, dv, psum_done = sparse_attention_bwd(
            attn_q, kv, v, lists, o, lse, do, dlse, ctx.scale, True, ctx.deterministic, ctx.config, psum=psum
        )
        if ctx.head_probs is not None:
            if not psum_done:  # the kernel that ran has no fused head sums: one pass of their own
                psum = prob_sum_pass(attn_q, kv, rows[0] if rows else idx, lse, ctx.scale, "triton")
            ctx.head_probs.value = psum
        del attn_q
        if dv is not None:  # the kernel could not add v's gradient into k's columns itself
            dkv[..., : ctx.value_dim] += dv
        latent_dim = w_uk.shape[-1]
        dq_latent, dq_rot = dq[..., :latent_dim], dq[..., latent_dim:]
        d_nope = torch.einsum("bshc,hnc->bshn", dq_latent, w_uk.to(dq.dtype)) if ctx.needs_input_grad[0] else None
        d_w_uk = None
        if ctx.needs_input_grad[2]:
            d_w_uk = torch.einsum("bshn,bshc->hnc", q_nope, dq_latent).to(w_uk.dtype)
        d_rot = dq_rot.to(q_rot.dtype) if ctx.needs_input_grad[1] else None
        return d_nope, d_rot, d_w_uk, dkv, None, None, None, None, None, None


def mla_sparse_attention(
    q_nope: torch.Tensor,
    q_rot: torch.Tensor,
    w_uk: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    *,
    value_dim: int,
    scale: float,
    backend: str = "auto",
    deterministic: bool | None = None,
    config: SparseAttentionConfig | None = None,
    check_range: bool = True,
    head_probs: HeadProbs | None = None,
):
    """Sparse attention in MLA absorbed form: ``sparse_attention(attn_q, kv, kv[..., :value_dim], indices)``
    with ``attn_q = cat([einsum("bshn,hnc->bshc", q_nope, w_uk), q_rot], -1)``.

    Args:
        q_nope: ``[B, S, H, N]`` the non-rotary query part.
        q_rot: ``[B, S, H, R]`` the rotary query part (after RoPE).
        w_uk: ``[H, N, C]`` the key up-projection (absorbed into the query).
        kv: ``[B, T, 1, C + R]`` one latent row per token (normalised latent, rotated key).
        indices: int32 ``[B, S, K]`` selected rows (``-1`` skipped).
        value_dim: the values are ``kv[..., :value_dim]`` (C for MLA); their gradient adds into ``kv``.
        scale, backend, deterministic, config, check_range: as in ``sparse_attention``.
        head_probs: a ``HeadProbs`` to receive the head-summed probabilities ``[B, S, K]`` fp32 on
            each query's index slots (the indexer KL's target): filled in this call's backward on the
            Triton path (fused into the Gluon dK/dV kernel where it runs), in its forward on the torch path.

    Returns:
        ``(o [B, S, H, value_dim], lse [B, S, H] fp32, attn_q [B, S, H, C + R])``; ``attn_q`` carries no
        gradient (for consumers that only read it, like the indexer's KL target). The Triton path saves
        ``q_nope``, ``q_rot`` and ``w_uk`` instead of ``attn_q`` for backward and rebuilds it there.
    """
    check_tensor("q_nope", q_nope, 4, "[B, S, H, N]")
    B, S, H, N = q_nope.shape
    check_tensor("q_rot", q_rot, 4, f"[B={B}, S={S}, H={H}, R]")
    for dim, size in ((0, B), (1, S), (2, H)):
        check_dim("q_rot", q_rot, dim, size, f"[B={B}, S={S}, H={H}, R]")
    check_tensor("w_uk", w_uk, 3, f"[H={H}, N={N}, C]")
    check_dim("w_uk", w_uk, 0, H, f"[H={H}, N={N}, C]")
    check_dim("w_uk", w_uk, 1, N, f"[H={H}, N={N}, C]")
    C, R = w_uk.shape[2], q_rot.shape[3]
    kdoc = f"[B={B}, T, 1, C + R = {C + R}]"
    check_tensor("kv", kv, 4, kdoc)
    check_dim("kv", kv, 0, B, kdoc)
    check_dim("kv", kv, 2, 1, kdoc)
    check_dim("kv", kv, 3, C + R, kdoc)
    if not 0 < value_dim <= C + R:
        raise ValueError(f"value_dim must be in (0, {C + R}], got {value_dim}")
    check_same_device(q_nope=q_nope, q_rot=q_rot, w_uk=w_uk, kv=kv, indices=indices)
    check_indices(indices, B, S, kv.shape[1], check_range=check_range)

    unsupported = None if HAS_TRITON else "no Triton"
    if unsupported is None and q_nope.dtype != kv.dtype:  # attn_q is built in q_nope's dtype
        unsupported = f"q_nope and kv must share one dtype for the Triton kernel, got {q_nope.dtype} and {kv.dtype}"
    if unsupported is None:
        probe = kv.new_empty((1, 1, 1, C + R))  # shape/dtype stand-ins for the absorbed query
        unsupported = triton_unsupported_reason(probe, kv, kv[..., :value_dim])
    if backend == "auto" and unsupported is not None:
        backend = "torch"
    chosen = resolve_backend(backend, kv.device, HAS_TRITON)
    if head_probs is not None and not isinstance(head_probs, HeadProbs):
        raise TypeError(f"head_probs must be a HeadProbs or None, got {type(head_probs).__name__}")
    if chosen == "torch":
        o, lse, attn_q = mla_sparse_attention_reference(q_nope, q_rot, w_uk, kv, indices, value_dim, scale)
        if head_probs is not None:
            head_probs.value = prob_sum_pass(attn_q, kv, indices, lse, scale, "torch")
        return o, lse, attn_q.detach()
    if unsupported is not None:
        raise ValueError(f"backend='triton' cannot take these inputs: {unsupported}")
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    return _MLASparseAttentionFn.apply(q_nope, q_rot, w_uk, kv, indices.contiguous(), int(value_dim), float(scale),
                                       bool(deterministic), resolve_config(config), head_probs)

