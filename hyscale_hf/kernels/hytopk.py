"""HyTopK: score every visible key with the lightning indexer and keep each query's exact top-k.

Layout (DESIGN section 3): Triton kernels, host launch functions, the custom op, the public function.
The custom op ``torch.ops.hyscale.hytopk`` is what selective checkpointing sees (selection replay).
"""

from __future__ import annotations

import torch

from . import _selection_counts, reference
from ._checks import (
    check_cu_seqlens,
    check_dim,
    check_same_device,
    check_tensor,
    check_topk,
    resolve_backend,
)

# ----------------------------------------------------------------------------- Triton backend

_TRITON_KERNEL = None  # set to the host launch function once the Triton kernel is available


# ----------------------------------------------------------------------------- custom op


@torch.library.custom_op("hyscale::hytopk", mutates_args=())
def hytopk_op(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    topk: int,
    cu_seqlens: torch.Tensor | None,
    window_start: torch.Tensor | None,
    relu: bool,
    check_nan: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatcher-visible HyTopK: returns (indices int32 [B, S, topk], scores fp32 [B, S, topk])."""
    _selection_counts.record_selection_run()  # replayed selections never get here (selection_stats)
    if backend == "triton":
        return _TRITON_KERNEL(
            q, k, w, topk, cu_seqlens=cu_seqlens, window_start=window_start, relu=relu, check_nan=check_nan
        )
    return reference.hytopk_reference(
        q, k, w, topk, cu_seqlens=cu_seqlens, window_start=window_start, relu=relu, check_nan=check_nan
    )


@hytopk_op.register_fake
def _(q, k, w, topk, cu_seqlens, window_start, relu, check_nan, backend):
    B, S = q.shape[:2]
    return q.new_empty(B, S, topk, dtype=torch.int32), q.new_empty(B, S, topk, dtype=torch.float32)


# ----------------------------------------------------------------------------- public function


def hytopk(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    topk: int,
    *,
    cu_seqlens: torch.Tensor | None = None,
    window_start: torch.Tensor | None = None,
    relu: bool = True,
    return_scores: bool = False,
    check_nan: bool = False,
    backend: str = "auto",
):
    """Exact top-k of the lightning-indexer scores, without a score table.

    ``I[b, i, s] = sum_h w[b, i, h] * ReLU(q[b, i, h, :] . k[b, s, :])`` for every key ``s``
    visible to query ``i``, which sits at key position ``T - S + i``: visible means
    ``start <= s <= T - S + i``, with ``start`` the first key of the query's packed sequence
    (``cu_seqlens``) or ``window_start`` (e.g. the first non-pad key), else 0.

    Selection rule (unique set): score descending, then key index ascending; ``-0.0`` equals
    ``+0.0``; NaN ranks below ``-inf`` (or raises with ``check_nan=True``); invisible keys are
    never selected.

    Args:
        q: indexer queries ``[B, S, H, D]``, bf16/fp16/fp32.
        k: indexer keys ``[B, T, D]`` (one key per token, shared by the heads), same dtype family.
        w: per-query head weights ``[B, S, H]``, fp32 (scales folded in).
        topk: K > 0. With K >= visible keys every visible key is returned.
        cu_seqlens: optional int32/int64 ``[N + 1]`` packed-sequence offsets (needs B = 1, S = T).
        window_start: optional integer ``[B]`` or ``[B, S]``: first visible key per row/query.
        relu: apply ReLU to each head's logit (family-specific; default on).
        return_scores: also return the fp32 scores of the selected keys.
        check_nan: raise ``ValueError`` if a visible key scores NaN.
        backend: ``"auto"`` | ``"torch"`` | ``"triton"`` (see ``hyscale_hf.kernels``).

    Returns:
        ``indices`` int32 ``[B, S, topk]``: selected key indices sorted ascending, ``-1`` padded;
        with ``return_scores`` also ``scores`` fp32 ``[B, S, topk]`` aligned with ``indices``
        (``-inf`` in padded slots).
    """
    check_tensor("q", q, 4, "[B, S, H, D]")
    B, S, H, D = q.shape
    check_tensor("k", k, 3, f"[B={B}, T, D={D}]")
    check_dim("k", k, 0, B, f"[B={B}, T, D={D}]")
    check_dim("k", k, 2, D, f"[B={B}, T, D={D}]")
    T = k.shape[1]
    check_tensor("w", w, 3, f"[B={B}, S={S}, H={H}] float32", dtypes=(torch.float32, torch.float64))
    check_dim("w", w, 0, B, f"[B={B}, S={S}, H={H}]")
    check_dim("w", w, 1, S, f"[B={B}, S={S}, H={H}]")
    check_dim("w", w, 2, H, f"[B={B}, S={S}, H={H}]")
    check_topk(topk)
    if S > T:
        raise ValueError(f"q has S = {S} queries but k has only T = {T} keys; need S <= T")
    check_same_device(q=q, k=k, w=w, cu_seqlens=cu_seqlens, window_start=window_start)
    check_cu_seqlens(cu_seqlens, B, S, T, q.device)
    if window_start is not None:
        check_tensor("window_start", window_start, window_start.dim(), "[B] or [B, S] integer",
                     dtypes=(torch.int32, torch.int64))
        if tuple(window_start.shape) not in ((B,), (B, S)):
            raise ValueError(f"window_start must have shape [B={B}] or [B={B}, S={S}], got {tuple(window_start.shape)}")
    chosen = resolve_backend(backend, q.device, _TRITON_KERNEL is not None)
    indices, scores = hytopk_op(q, k, w, topk, cu_seqlens, window_start, relu, check_nan, chosen)
    return (indices, scores) if return_scores else indices
