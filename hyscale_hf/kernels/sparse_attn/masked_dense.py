"""Sparse attention as dense attention under the selection's mask: the fast torch path for short key ranges.

The reference (``naive.py``) gathers every query's selected K/V rows into ``[B, S, K, Hkv, D]``
copies, which on a CPU cost several times the attention itself (a patched SmolLM2 training step at
1024 tokens spent most of its time there). When the key range is short, the same result comes
cheaper from matmuls over all keys, with each key's logit offset by the log of how often the query
lists it: ``-inf`` for a key not listed, ``0`` for a key listed once, ``log 2`` for one listed twice
(the op's contract counts a repeated index once per occurrence). The softmax is then exactly the
reference's over the selected multiset, up to rounding.

Memory: the ``[B, Hq, chunk, T]`` logits of one query chunk in forward, and autograd keeps every
chunk's probabilities for backward, ``O(B * Hq * S * T)`` in all; ``fits`` says when that is small.
Long contexts take the Triton kernels (or the reference's gathers on a CPU).
"""

from __future__ import annotations

import torch

from ..checks import has_values
from ..windows import compute_dtype

# Bound on the [B, Hq, S, T] probabilities autograd keeps for backward (fp32 bytes).
MAX_SCORE_BYTES = 256 * 2**20
# Keep the logits of one query chunk within this many bytes in forward.
CHUNK_BYTES = 64 * 2**20
# Scoring all T keys instead of the K selected ones costs T / K times the attention's FLOPs; beyond
# this ratio the reference's gathers are cheaper even on a CPU.
MAX_KEYS_PER_SELECTED = 32


def fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor) -> bool:
    """Whether this path is the cheaper torch path for these inputs (and its memory is small).

    Only for finite inputs on a real device, outside ``torch.compile``: an unselected key still enters
    the matmuls here (with weight 0), so a NaN or inf in its row would reach every query, where the
    op's contract (``docs/design.md``, sparse attention) says a query never sees keys it does not
    select; the reference gathers only the selected rows. The check is one pass over q, k and v,
    small next to the ``S x T`` matmuls, and a host sync, which costs nothing on a CPU.
    """
    B, S, Hq, _ = q.shape
    T, K = k.shape[1], indices.shape[-1]
    if 4 * B * Hq * S * T > MAX_SCORE_BYTES or T > MAX_KEYS_PER_SELECTED * max(1, K):
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


def sparse_attention_masked_dense(q, k, v, indices, scale):
    """The contract of ``naive.sparse_attention_reference``: q ``[B, S, Hq, Dqk]``, k ``[B, T, Hkv, Dqk]``,
    v ``[B, T, Hkv, Dv]``, indices ``[B, S, K]`` int32 (-1 skipped) -> o ``[B, S, Hq, Dv]`` (q's dtype,
    zeros for a query with no key) and lse ``[B, S, Hq]`` fp32 (fp64 for fp64 inputs; ``-inf`` for a
    query with no key). Differentiable in q, k, v through torch autograd."""
    B, S, Hq, _ = q.shape
    T, Hkv, Dv = k.shape[1], k.shape[2], v.shape[-1]
    G = Hq // Hkv
    dt = compute_dtype(q, k, v)
    kt = k.to(dt).permute(0, 2, 3, 1)[:, :, None]  # [B, Hkv, 1, D, T]
    vt = v.to(dt).transpose(1, 2)[:, :, None]  # [B, Hkv, 1, T, Dv]
    chunk = max(1, CHUNK_BYTES // (4 * B * Hq * T))
    outs, lses = [], []
    for c0 in range(0, S, chunk):
        c1 = min(S, c0 + chunk)
        idx = indices[:, c0:c1]
        qc = q[:, c0:c1].to(dt).view(B, c1 - c0, Hkv, G, -1).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, c, D]
        empty = (idx < 0).all(-1)  # [B, c]: a query with no key
        # An empty row gets bias 0 so its logits, logsumexp and their gradients stay finite; its p is zeroed.
        bias = selection_bias(idx, T, dt).masked_fill(empty[..., None], 0.0)
        logits = torch.matmul(qc, kt) * scale + bias[:, None, None]  # [B, Hkv, G, c, T]
        lse = torch.logsumexp(logits, dim=-1)
        gone = empty[:, None, None]  # [B, 1, 1, c]
        p = torch.exp(logits - lse[..., None]).masked_fill(gone[..., None], 0.0)
        outs.append(torch.matmul(p, vt).permute(0, 3, 1, 2, 4).reshape(B, c1 - c0, Hq, Dv))
        lses.append(lse.masked_fill(gone, float("-inf")).permute(0, 3, 1, 2).reshape(B, c1 - c0, Hq))
    return torch.cat(outs, dim=1).to(q.dtype), torch.cat(lses, dim=1)
