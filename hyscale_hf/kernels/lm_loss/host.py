"""Launch of the fused cross-entropy kernel (``triton_kernels.py``) and the torch code it equals."""

from __future__ import annotations

import os

import torch

try:  # Triton is a Linux x86-64 dependency; elsewhere only the torch path exists.
    import triton
    import triton.language as tl

    from . import triton_kernels as kernels

    _TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
except ImportError:  # pragma: no cover
    triton = None
    _TL_DTYPES = {}

HAS_TRITON = triton is not None
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Vocabulary columns per loop step: 8192 fp32 values are 32 per thread of 8 warps. The interpreter runs
# a block as numpy arrays, where smaller blocks only add loop steps.
BLOCK_V = 8192
INTERPRET_BLOCK_V = 1024


def cross_entropy_grad_(logits: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor, ignore_index: int,
                        use_triton: bool) -> torch.Tensor:
    """The summed cross-entropy of ``logits`` ``[n, V]`` (unit column stride) against ``labels`` ``[n]``
    (int64, each in ``[0, V)`` or ``ignore_index``), as an fp32 scalar; ``logits`` is overwritten with
    the gradient of that sum times ``scale`` (fp32 0-d), in its own dtype."""
    if use_triton:
        n, V = logits.shape
        loss = torch.empty(n, dtype=torch.float32, device=logits.device)
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        block = min(triton.next_power_of_2(V), INTERPRET_BLOCK_V if interpreted else BLOCK_V)
        kernels.cross_entropy_grad[(n,)](
            logits, labels, scale, loss, V, logits.stride(0), ignore_index, BLOCK=block,
            TY=_TL_DTYPES[logits.dtype], PRECISE_EXP=logits.device.type == "cuda", INTERPRET=interpreted,
            num_warps=8 if block >= 4096 else 4)
        return loss.sum()
    # The torch ops autograd runs for F.cross_entropy(logits.float(), labels, reduction="sum") and
    # its backward, written into the logits as the kernel does.
    logp = torch.log_softmax(logits.float(), dim=-1)
    valid = labels != ignore_index
    safe = torch.where(valid, labels, 0)[:, None]
    total = torch.where(valid, -logp.gather(1, safe).squeeze(1), 0.0).sum()
    grad = logp.exp_()
    grad.scatter_add_(1, safe, torch.full_like(safe, -1, dtype=grad.dtype))
    grad.mul_(torch.where(valid, scale, 0.0)[:, None])
    logits.copy_(grad)
    return total
