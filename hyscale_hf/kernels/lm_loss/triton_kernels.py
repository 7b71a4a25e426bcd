"""Triton kernel of the chunked LM loss: a chunk's cross-entropy and its gradient over the logits in
one kernel (launch: ``host.py``; autograd: ``op.py``).

The torch code makes about ten passes over the ``[n, vocab]`` logits per chunk (the fp32 copy, the
log-softmax, its backward, the cast back); at GLM-5's 154K vocabulary and 128K tokens one fp32 pass
over a step's logits moves about 160 GB. Here each row is read twice (its max and sum of exponents,
then the gradient) and written once, in the logits' own buffer, computing in fp32 registers.
"""

import triton
import triton.language as tl

from ..triton_math import exp_like_torch, round_like_torch


@triton.jit
def cross_entropy_grad(logits, labels, scale, loss, V, stride, ignore_index, BLOCK: tl.constexpr,
                       TY: tl.constexpr, PRECISE_EXP: tl.constexpr, INTERPRET: tl.constexpr):
    """Row ``r`` (one per program): ``loss[r] = logsumexp(x) - x[label]`` (0 where the label is
    ``ignore_index``), and ``x`` overwritten with ``(softmax(x) - onehot(label)) * scale`` rounded to
    ``TY`` (0 on ignored rows), which is the cross-entropy's gradient in fp32 cast to the logits' dtype,
    as autograd forms it through ``logits.float()``."""
    row = tl.program_id(0).to(tl.int64)
    ptr = logits + row * stride
    cols = tl.arange(0, BLOCK)
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
    s = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    for start in range(0, V, BLOCK):  # online max and sum of exponents
        c = start + cols
        x = tl.load(ptr + c, mask=c < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * exp_like_torch(m - m_new, PRECISE_EXP) + tl.sum(exp_like_torch(x - m_new, PRECISE_EXP), 0)
        m = m_new
    lse = m + tl.log(s)
    y = tl.load(labels + row)
    valid = y != ignore_index
    x_y = tl.load(ptr + y, mask=valid, other=0.0).to(tl.float32)
    tl.store(loss + row, tl.where(valid, lse - x_y, 0.0))
    coef = tl.where(valid, tl.load(scale), 0.0)
    for start in range(0, V, BLOCK):
        c = start + cols
        x = tl.load(ptr + c, mask=c < V, other=0.0).to(tl.float32)
        g = (exp_like_torch(x - lse, PRECISE_EXP) - tl.where(c == y, 1.0, 0.0)) * coef
        tl.store(ptr + c, round_like_torch(g, TY, INTERPRET), mask=c < V)
