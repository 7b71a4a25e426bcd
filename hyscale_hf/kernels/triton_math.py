"""Triton helpers that make a kernel's fp32 results round and exponentiate as torch's kernels do,
shared by the kernels that promise torch's roundings (``lean_autograd``, ``lm_loss``)."""

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def round_like_torch(x, TY: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 ``x`` rounded to ``TY`` to nearest even, as torch rounds. Compiled Triton converts so; the
    interpreter (Triton 3.x) truncates fp32 -> bf16, so under it bf16 is rounded from the bits."""
    if INTERPRET:
        if TY == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + (0x7FFF + ((bits >> 16) & 1))
            half = tl.where(x == x, bits >> 16, 0x7FC0)  # NaN would carry into inf: a quiet NaN instead
            return half.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(TY)
    else:
        return x.to(TY)


@triton.jit
def exp_like_torch(x, PRECISE_EXP: tl.constexpr):
    # tl.exp compiles to the approximate ex2 (off by several ulp for |x| >> 1); libdevice's expf is
    # what torch's CUDA kernels call. The interpreter has no libdevice: it runs tl.exp (numpy's exp).
    if PRECISE_EXP:
        return libdevice.exp(x)
    else:
        return tl.exp(x)
