"""The RoPE kernel (launch and autograd: ``op.py``).

One program per ``BLOCK_M`` rows (a row: one head of one token). The rotated dims ``[ROT0, ROT0 + 2 *
HALF)`` of a row hold pairs (a1, a2): (x[2j], x[2j + 1]) when INTERLEAVED, else (x[j], x[HALF + j]);
forward writes ``a1 c1 - a2 s1`` to out[j] and ``a2 c2 + a1 s2`` to out[HALF + j] (c1, s1 =
cos, sin[j]; c2, s2 = cos, sin[HALF + j], or c1, s1 again when INTERLEAVED, as Transformers reads
only the table's first half there). BWD runs the transposed rotation from the output layout back:
``g1 c1 + g2 s2`` and ``g2 c2 - g1 s1``. Every product is rounded to the output dtype before the sum
(the input dtype; the host sends only float16 / bfloat16 here), where the torch ops round, and the
host compiles it with ``enable_fp_fusion=False`` (with fusion the H200 build fused a product and the
sum into one multiply-add, an ulp off in a quarter of the results): the results are those of the
torch code, bit for bit. The other dims of the row are copied.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rope_kernel(
    X, COS, SIN, OUT, rows, S, H,
    sxb, sxs, sxh, scb, scs, sob, sos, soh,
    D: tl.constexpr, ROT0: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, INTERLEAVED: tl.constexpr, BWD: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = m < rows
    h = m % H
    s = (m // H) % S
    b = m // (H * S)
    x_row = X + b * sxb + s * sxs + h * sxh
    o_row = OUT + b * sob + s * sos + h * soh
    c_row = b * scb + s * scs

    # the dims outside the rotated range, copied
    d = tl.arange(0, BLOCK_D)
    passed = (d < D) & ((d < ROT0) | (d >= ROT0 + 2 * HALF))
    pm = mmask[:, None] & passed[None, :]
    tl.store(o_row[:, None] + d[None, :], tl.load(x_row[:, None] + d[None, :], mask=pm), mask=pm)

    j = tl.arange(0, BLOCK_HALF)
    jm = mmask[:, None] & (j < HALF)[None, :]
    if INTERLEAVED:
        pair1, pair2 = ROT0 + 2 * j, ROT0 + 2 * j + 1
    else:
        pair1, pair2 = ROT0 + j, ROT0 + HALF + j
    halves1, halves2 = ROT0 + j, ROT0 + HALF + j
    if BWD:  # read the output layout, write the input's
        src1, src2, dst1, dst2 = halves1, halves2, pair1, pair2
    else:
        src1, src2, dst1, dst2 = pair1, pair2, halves1, halves2
    a1 = tl.load(x_row[:, None] + src1[None, :], mask=jm)
    a2 = tl.load(x_row[:, None] + src2[None, :], mask=jm)
    dt = a1.dtype
    cm = (j < HALF)[None, :] & mmask[:, None]
    c1 = tl.load(COS + c_row[:, None] + j[None, :], mask=cm).to(tl.float32)
    s1 = tl.load(SIN + c_row[:, None] + j[None, :], mask=cm).to(tl.float32)
    if INTERLEAVED:
        c2, s2 = c1, s1
    else:
        c2 = tl.load(COS + c_row[:, None] + HALF + j[None, :], mask=cm).to(tl.float32)
        s2 = tl.load(SIN + c_row[:, None] + HALF + j[None, :], mask=cm).to(tl.float32)
    a1, a2 = a1.to(tl.float32), a2.to(tl.float32)
    if BWD:
        o1 = (a1 * c1).to(dt).to(tl.float32) + (a2 * s2).to(dt).to(tl.float32)
        o2 = (a2 * c2).to(dt).to(tl.float32) - (a1 * s1).to(dt).to(tl.float32)
    else:
        o1 = (a1 * c1).to(dt).to(tl.float32) - (a2 * s1).to(dt).to(tl.float32)
        o2 = (a2 * c2).to(dt).to(tl.float32) + (a1 * s2).to(dt).to(tl.float32)
    tl.store(o_row[:, None] + dst1[None, :], o1.to(dt), mask=jm)
    tl.store(o_row[:, None] + dst2[None, :], o2.to(dt), mask=jm)
