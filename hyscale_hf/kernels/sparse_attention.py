"""Sparse attention: each query attends only to its selected keys (GQA/MHA and MLA absorbed).

Layout (DESIGN section 3): Triton kernels, host launch functions, the autograd wrapper, the public
function. The torch path is ``reference.sparse_attention_reference`` (autograd through gathers).
"""

from __future__ import annotations

import torch

from . import reference
from ._checks import check_dim, check_indices, check_same_device, check_tensor, resolve_backend

# ----------------------------------------------------------------------------- Triton backend

_TRITON_KERNEL = None  # set to a differentiable (q, k, v, indices, scale) -> (o, lse) once it exists


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
):
    """``o[b, i, h] = sum_{s in S_i} softmax_s(scale * q[b, i, h] . k[b, s, g(h)]) v[b, s, g(h)]``.

    ``S_i`` is the set in ``indices[b, i]`` (one set per query, shared by all heads; ``-1``
    entries are skipped). ``g(h) = h // (Hq // Hkv)`` maps query heads to KV heads.
    MLA absorbed form: ``Hkv = 1``, ``k`` the latent rows ``[B, T, 1, 576]`` and ``v`` a view of
    their first 512 dims (``k[..., :512]``); gradients of both add into ``k``'s buffer.

    Args:
        q: ``[B, S, Hq, Dqk]`` bf16/fp16/fp32 (fp64 for gradcheck).
        k: ``[B, T, Hkv, Dqk]``; Hq must be a multiple of Hkv.
        v: ``[B, T, Hkv, Dv]``.
        indices: int32 ``[B, S, K]`` with entries in ``[-1, T)``.
        scale: softmax scale; default ``Dqk ** -0.5``.
        return_lse: also return the fp32 log-sum-exp ``[B, S, Hq]`` (``-inf`` for a query with no
            selected key, whose output is 0).
        backend: ``"auto"`` | ``"torch"`` | ``"triton"``.

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
    if Hq % Hkv:
        raise ValueError(f"q has Hq = {Hq} heads, not a multiple of k's Hkv = {Hkv} heads")
    vdoc = f"[B={B}, T={T}, Hkv={Hkv}, Dv]"
    check_tensor("v", v, 4, vdoc)
    for dim, size in ((0, B), (1, T), (2, Hkv)):
        check_dim("v", v, dim, size, vdoc)
    check_same_device(q=q, k=k, v=v, indices=indices)
    check_indices(indices, B, S, T)
    if scale is None:
        scale = Dqk**-0.5
    chosen = resolve_backend(backend, q.device, _TRITON_KERNEL is not None)
    if chosen == "triton":
        o, lse = _TRITON_KERNEL(q, k, v, indices, scale)
    else:
        o, lse = reference.sparse_attention_reference(q, k, v, indices, scale)
    return (o, lse) if return_lse else o
