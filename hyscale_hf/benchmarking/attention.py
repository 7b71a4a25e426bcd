"""The dense attention baseline of the sparse attention benchmarks: causal SDPA on ``[B, T, H, D]``.

On CUDA it runs the flash backend (what a dense model trains with); elsewhere PyTorch picks the
backend (CPU smoke runs of the scripts). Grouped-query attention uses SDPA's ``enable_gqa`` where
the backend supports it, else repeats the KV heads; ``DENSE_GQA`` records which ran, for the JSON.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

DENSE_GQA = dict(native=True)


def dense_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA of q ``[B, T, Hq, D]`` over k, v ``[B, T, Hkv, D]``; output ``[B, T, Hq, D]``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    backend = sdpa_kernel([SDPBackend.FLASH_ATTENTION]) if q.is_cuda else contextlib.nullcontext()
    with backend:
        if DENSE_GQA["native"]:
            try:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
            except RuntimeError as e:  # flash without GQA support in this torch: repeat the KV heads
                DENSE_GQA.update(native=False, note=str(e)[:200])
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
