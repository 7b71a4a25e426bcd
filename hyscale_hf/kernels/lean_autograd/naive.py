"""The plain torch compositions the lean autograd functions must equal bit for bit (the test oracle)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Llama/GLM RMSNorm as Transformers writes it (statistics in fp32, scale after the cast)."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def swiglu_mlp_reference(x, w_gate, w_up, w_down) -> torch.Tensor:
    """The bias-free SwiGLU MLP: ``down(silu(gate(x)) * up(x))``."""
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)
