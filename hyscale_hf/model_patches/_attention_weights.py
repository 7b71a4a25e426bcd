"""``output_attentions=True`` on a patched model: the attention probabilities, as eager attention gives them.

A patched layer never builds a ``[B, H, S, T]`` table; when attention weights are asked for (a debugging
aid at small T), this recomputes them: each query's softmax over the keys it attended to (its selection
in the sparse stage, its window of a sliding-window layer, every visible key in the dense warm-up),
scattered into the dense layout with zeros elsewhere. Attention sinks take their share as in the
attention itself, so a row then sums to less than one. As in eager attention, the layer's output is then
computed from these probabilities (``probabilities @ values``: the same attention, in another order of
summation), so gradients reach the returned weights.
"""

from __future__ import annotations

import torch


def _attended(indices: torch.Tensor | None, vis, B: int, S: int, T: int, device) -> torch.Tensor:
    """bool ``[B, S, T]``: the keys each query attended to."""
    if indices is None:
        start, end = vis.windows(B, S, T, device)
        return vis.visible(start, end, 0, T)
    valid = indices >= 0
    slot = torch.where(valid, indices.long(), T)  # -1 goes to a spare column, dropped below
    seen = torch.zeros(B, S, T + 1, dtype=torch.bool, device=device)
    seen.scatter_(2, slot, True)
    return seen[..., :T]


def attention_probabilities(q, k, scale: float, attended: torch.Tensor, sinks=None) -> torch.Tensor:
    """fp32 ``[B, H, S, T]`` probabilities of ``q [B, S, H, D]`` over ``k [B, T, Hkv, D]`` restricted to
    ``attended [B, S, T]``; a query that attended to nothing gets a zero row."""
    H, Hkv = q.shape[2], k.shape[2]
    kh = k.float().repeat_interleave(H // Hkv, dim=2)
    logits = torch.einsum("bshd,bthd->bhst", q.float(), kh) * scale
    logits = logits.masked_fill(~attended[:, None], float("-inf"))
    norm = torch.logsumexp(logits, dim=-1, keepdim=True)
    if sinks is not None:
        norm = torch.logaddexp(norm, sinks.float()[None, :, None, None])
    norm = torch.where(torch.isfinite(norm), norm, torch.zeros_like(norm))
    return torch.exp(logits - norm)


def attend_through(probabilities: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``[B, S, H, Dv]`` output of ``probabilities [B, H, S, T]`` over ``values [B, T, Hkv, Dv]``."""
    H, Hkv = probabilities.shape[1], values.shape[2]
    v = values.float().repeat_interleave(H // Hkv, dim=2)
    return torch.einsum("bhst,bthd->bshd", probabilities, v).to(values.dtype)


def layer_weights(attention, indices: torch.Tensor | None, vis) -> torch.Tensor:
    """The weights of one patched attention call (``attention``: ``GQAAttention`` or ``MLAAttention``
    after it attended), over the keys it attended to (``indices``, or every visible key when None)."""
    B, S, T = attention.shape
    attended = _attended(indices, vis, B, S, T, attention.device)
    k = attention.target()[1]
    return attention_probabilities(attention.differentiable_query(), k, attention.scale, attended,
                                   getattr(attention, "sinks", None))
