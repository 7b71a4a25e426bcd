"""Triton helpers shared across kernel packages: fp32 results rounded and exponentiated as torch's
kernels do (``lean_autograd``, ``lm_loss``), and the online log-sum-exp (``topk``, ``indexer_kl``)."""

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


# The online log-sum-exp: a running max m and sum l of exp(x - m) over blocks of x, where a key to skip
# is -inf in x. Until a row has seen a finite key, m stays -inf and l 0: the exponents then subtract 0
# instead of m, since exp(-inf - (-inf)) would be NaN. BASE2: x is in base-2 units (log2(e) folded into
# a scale), exponentiated with exp2, and lse_value converts back to natural log.
@triton.jit
def _pow(x, BASE2: tl.constexpr):
    if BASE2:
        return tl.exp2(x)
    else:
        return tl.exp(x)


@triton.jit
def lse_step(m, l, x, BASE2: tl.constexpr):
    """One block of a row: ``x`` of any shape, all of it one row's keys; ``m`` and ``l`` scalars. Returns
    the new (m, l)."""
    m_new = tl.maximum(m, tl.max(x))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, l * _pow(m - m_safe, BASE2) + tl.sum(_pow(x - m_safe, BASE2))


@triton.jit
def lse_step_rows(m, l, x, BASE2: tl.constexpr):
    """One block of several rows: ``x`` [rows, block], ``m`` and ``l`` [rows]. Returns the new (m, l)."""
    m_new = tl.maximum(m, tl.max(x, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, l * _pow(m - m_safe, BASE2) + tl.sum(_pow(x - m_safe[:, None], BASE2), axis=1)


@triton.jit
def lse_value(m, l, EMPTY: tl.constexpr, BASE2: tl.constexpr):
    """log(sum exp(x)) in natural log from the running (m, l); ``EMPTY`` where no key was finite."""
    if BASE2:
        return tl.where(l > 0, (m + tl.log2(tl.where(l > 0, l, 1.0))) * 0.6931471805599453, EMPTY)
    else:
        return tl.where(l > 0, m + tl.log(tl.where(l > 0, l, 1.0)), EMPTY)
