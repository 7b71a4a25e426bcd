"""Sparse attention as dense attention under the selection's mask: the fast CPU path for short key ranges.

The reference (``naive.py``) gathers every query's selected K/V rows into ``[B, S, K, Hkv, D]``
copies, which on a CPU cost several times the attention itself. When the key range is short, the
same result comes cheaper from attention over all keys, with each key's logit offset by the log of
how often the query lists it: ``-inf`` for a key not listed, ``0`` for a key listed once, ``log 2``
for one listed twice (the op's contract counts a repeated index once per occurrence). The softmax is
then exactly the reference's over the selected multiset, up to rounding.

The attention itself is PyTorch's CPU flash kernel (the one ``scaled_dot_product_attention`` runs on
a CPU with a float mask), called through its aten op because that also returns the log-sum-exp the
indexer loss reuses. It keeps no ``[S, T]`` probabilities for backward: the backward kernel
recomputes them. Measured on 2 cores at SmolLM2's shape (1024 tokens, 9 / 3 heads of 64, top-128),
forward and backward take 0.09 s a layer, against 0.40 s for the same softmax written as torch
matmuls with autograd. The kernel has no gradient for the lse; ``_MaskedFlash.backward`` adds it
(the lse's gradient is the softmax, so it needs the probabilities once more, a chunk of queries at
a time).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..checks import has_values
from ..windows import compute_dtype

# Bound on the [B, S, T] selection bias (fp32 bytes) the kernel reads as its mask.
MAX_BIAS_BYTES = 256 * 2**20
# Keep the recomputed probabilities of one query chunk within this many bytes (lse gradient only).
CHUNK_BYTES = 64 * 2**20
# Attending to all T keys instead of the K selected ones costs T / K times the attention's FLOPs;
# beyond this ratio the reference's gathers are cheaper even on a CPU.
MAX_KEYS_PER_SELECTED = 32


def fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor) -> bool:
    """Whether this path is the cheaper torch path for these inputs (and its memory is small).

    Only for finite inputs on a CPU, outside ``torch.compile``: an unselected key still enters the
    kernel here (with weight 0), so a NaN or inf in its row would reach every query, where the
    op's contract (``docs/design.md``, sparse attention) says a query never sees keys it does not
    select; the reference gathers only the selected rows. The check is one pass over q, k and v,
    small next to the ``S x T`` attention.
    """
    B, S = q.shape[:2]
    T, K = k.shape[1], indices.shape[-1]
    if q.device.type != "cpu" or 4 * B * S * T > MAX_BIAS_BYTES or T > MAX_KEYS_PER_SELECTED * max(1, K):
        return False
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0:
        return False  # empty inputs: the reference's outputs keep their graph to q, k and v
    if torch.compiler.is_compiling() or not all(has_values(x) for x in (q, k, v)):
        return False  # shape propagation (meta, fake tensors) or tracing: no values to check
    return all(bool(torch.isfinite(x).all()) for x in (q, k, v))


def selection_bias(indices: torch.Tensor, num_keys: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, S, T]``: log of how many times each query lists each key (``-inf`` when never; -1 skipped)."""
    B, S, _ = indices.shape
    valid = indices >= 0
    counts = torch.zeros(B, S, num_keys + 1, dtype=dtype, device=indices.device)
    slot = torch.where(valid, indices.long(), num_keys)  # -1 lands in a spare column, dropped below
    counts.scatter_add_(2, slot, valid.to(dtype))
    return counts[..., :num_keys].log()


class _MaskedFlash(torch.autograd.Function):
    """CPU flash attention under an additive mask, with a gradient for its lse too.

    q ``[B, H, S, D]``, k and v ``[B, H, T, D]`` (one head dim for all three, as the kernel wants),
    bias ``[B, 1, S, T]`` with at least one finite entry per row -> o ``[B, H, S, D]``, lse ``[B, H, S]``.
    """

    @staticmethod
    def forward(ctx, q, k, v, bias, scale):
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=bias, scale=scale)[:2]
        ctx.save_for_backward(q, k, v, bias, o, lse)
        ctx.scale = scale
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, bias, o, lse = ctx.saved_tensors
        scale = ctx.scale
        if do is None:
            dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        else:
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                do.contiguous(), q, k, v, o, lse, 0.0, False, attn_mask=bias, scale=scale)
        if dlse is not None:  # d lse / d logit = p: dq += scale * dlse * (p @ k), dk += scale * p^T @ (dlse * q)
            B, H, S, T = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
            chunk = max(1, CHUNK_BYTES // (q.element_size() * B * H * T))
            dq, dk = dq.clone(), dk.clone()
            for c0 in range(0, S, chunk):
                c1 = min(S, c0 + chunk)
                logits = torch.matmul(q[:, :, c0:c1], k.transpose(-1, -2)) * scale + bias[:, :, c0:c1]
                p = torch.exp(logits - lse[:, :, c0:c1, None]) * dlse[:, :, c0:c1, None] * scale
                dq[:, :, c0:c1] += torch.matmul(p, k)
                dk += torch.matmul(p.transpose(-1, -2), q[:, :, c0:c1])
        return dq, dk, dv, None, None


def sparse_attention_masked_dense(q, k, v, indices, scale):
    """The contract of ``naive.sparse_attention_reference``: q ``[B, S, Hq, Dqk]``, k ``[B, T, Hkv, Dqk]``,
    v ``[B, T, Hkv, Dv]``, indices ``[B, S, K]`` int32 (-1 skipped) -> o ``[B, S, Hq, Dv]`` (q's dtype,
    zeros for a query with no key) and lse ``[B, S, Hq]`` fp32 (fp64 for fp64 inputs; ``-inf`` for a
    query with no key). Differentiable in q, k, v (o and lse)."""
    Hq, Dqk = q.shape[2], q.shape[3]
    Hkv, Dv = k.shape[2], v.shape[3]
    dt = compute_dtype(q, k, v)
    width = max(Dqk, Dv)  # the kernel takes one head dim: zero columns add nothing to a logit or an output
    group = Hq // Hkv

    def heads_first(x: torch.Tensor, expand: bool) -> torch.Tensor:
        x = F.pad(x.to(dt), (0, width - x.shape[-1])).transpose(1, 2)
        return x.repeat_interleave(group, dim=1) if expand and group > 1 else x

    empty = (indices < 0).all(-1)  # [B, S]: a query with no key
    # An empty row gets bias 0 so the kernel's softmax stays finite; its output and lse are replaced below.
    bias = selection_bias(indices, k.shape[1], dt).masked_fill(empty[..., None], 0.0)[:, None]
    o, lse = _MaskedFlash.apply(heads_first(q, False), heads_first(k, True), heads_first(v, True), bias, float(scale))
    gone = empty[:, None]  # [B, 1, S]
    o = o.masked_fill(gone[..., None], 0.0)[..., :Dv].transpose(1, 2).to(q.dtype).contiguous()
    return o, lse.masked_fill(gone, float("-inf")).transpose(1, 2)
