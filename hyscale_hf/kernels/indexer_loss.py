"""Indexer KL loss: trains the lightning indexer to match the main attention's distribution.

Layout (DESIGN section 3): Triton kernels, host launch functions, the autograd wrapper, the public
function. The torch path is ``reference.indexer_kl_loss_reference``.
"""

from __future__ import annotations

import torch

from . import reference
from ._checks import (
    check_cu_seqlens,
    check_dim,
    check_indices,
    check_same_device,
    check_tensor,
    resolve_backend,
)

# ----------------------------------------------------------------------------- Triton backend

_TRITON_KERNEL = None  # set to a differentiable sparse-stage loss once the Triton kernel exists


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
        backend: ``"auto"`` | ``"torch"`` | ``"triton"`` (the Triton kernel covers the sparse stage).

    Returns:
        The loss (fp32 scalar, or ``[B, S]`` with ``reduction="none"``).
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
    chosen = resolve_backend(backend, index_q.device, _TRITON_KERNEL is not None and indices is not None)
    if chosen == "triton":
        return _TRITON_KERNEL(index_q, index_k, index_w, attn_q, attn_k, indices, attn_lse=attn_lse,
                              scale=scale, relu=relu, reduction=reduction)
    return reference.indexer_kl_loss_reference(
        index_q, index_k, index_w, attn_q, attn_k, indices, attn_lse=attn_lse, scale=scale, relu=relu,
        cu_seqlens=cu_seqlens, window_start=window_start, reduction=reduction,
    )
