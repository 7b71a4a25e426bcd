"""Torch reference of ``op.rotary_embedding``, the test oracle: the de-interleave + ``rotate_half``
form of RoPE (as Transformers wrote its interleaved RoPE before 5.24, and its plain RoPE today)."""

from __future__ import annotations

import torch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rotary_embedding_reference(x, cos, sin, *, interleaved: bool, rotary_dims: int | None = None,
                               rotary_first: bool = True) -> torch.Tensor:
    """x [B, S, H, D]; cos, sin [B, S, r] with r = rotary_dims (default D). RoPE on the first (or last)
    r dims of each head, the rest passed through; interleaved pairs (x0, x1), (x2, x3), ... come out
    de-interleaved (the rotated evens, then the rotated odds), as Transformers' interleaved RoPE does."""
    D = x.shape[-1]
    r = D if rotary_dims is None else rotary_dims
    sizes = [r, D - r] if rotary_first else [D - r, r]
    parts = list(torch.split(x, sizes, dim=-1))
    i = 0 if rotary_first else 1
    rot = parts[i]
    if interleaved:
        b, s, h, _ = rot.shape
        rot = rot.reshape(b, s, h, r // 2, 2).transpose(4, 3).reshape(b, s, h, r)
    c, s_ = cos.unsqueeze(2), sin.unsqueeze(2)
    parts[i] = rot * c + _rotate_half(rot) * s_
    return torch.cat(parts, dim=-1)
