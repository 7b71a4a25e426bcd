"""Triton kernels of the lean RMSNorm and SwiGLU elementwise parts (launches: ``host.py``; autograd: ``op.py``).

The torch code makes one pass over a ``[T, N]`` tensor per elementwise op (a cast, a square, a
multiply, ...); each kernel here reads every input once and writes every output once, computing in
fp32 registers. Where the torch ops round an intermediate to a 16-bit dtype, the kernels round at
the same place, so the results differ from the torch path's only where an fp32 operation does:

- RMSNorm's sum of squares (and the backward's row sum) adds in another order than torch's reduction;
- ``exp``: compiled on CUDA, libdevice's ``expf`` (what torch's CUDA kernels call); under the CPU
  interpreter numpy's, which differs from torch's CPU (Sleef) ``exp`` in the last bit at times.

Tiles are ``[BLOCK_M rows, BLOCK_N columns]`` of 2-D row-major views with unit column stride and
any row stride; row offsets are int64 (1M rows x 32K columns passes 2**31 elements).
"""

import triton
import triton.language as tl

from ..triton_math import exp_like_torch, round_like_torch


@triton.jit
def _tile(ptr, rows, rmask, stride, cols, N):
    """Pointers and mask of the tile ``rows x cols`` of a row-major view with row stride ``stride``."""
    return ptr + rows.to(tl.int64)[:, None] * stride + cols[None, :], rmask[:, None] & (cols < N)[None, :]


@triton.jit
def _normed(x, r, w, X_TY: tl.constexpr, Y_TY: tl.constexpr, INTERPRET: tl.constexpr):
    """``weight * (x * r).to(x.dtype)`` with torch's roundings: normalised in fp32, rounded to x's dtype,
    then the product with the weight in fp32 rounded to y's (the promoted) dtype."""
    xn = round_like_torch(x * r[:, None], X_TY, INTERPRET).to(tl.float32)
    return round_like_torch(w.to(tl.float32)[None, :] * xn, Y_TY, INTERPRET)


@triton.jit
def rms_norm_fwd(x_ptr, w_ptr, y_ptr, r_ptr, M, N, stride_x, stride_y, eps, inv_n,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ONE_BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    """y [M, N] and the fp32 inverse RMS r [M] = rsqrt(sum(x^2) * (1/N) + eps) (torch's CUDA mean
    multiplies its sum by 1/N too). ONE_BLOCK: the row fits one BLOCK_N block and stays in registers;
    else two passes over BLOCK_N-column blocks (the second reads the row again, from cache)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    cols = tl.arange(0, BLOCK_N)
    X_TY: tl.constexpr = x_ptr.dtype.element_ty
    Y_TY: tl.constexpr = y_ptr.dtype.element_ty
    if ONE_BLOCK:
        xp, mask = _tile(x_ptr, rows, rmask, stride_x, cols, N)
        x = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
        r = tl.math.rsqrt(tl.sum(x * x, axis=1) * inv_n + eps)
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0)
        yp, _ = _tile(y_ptr, rows, rmask, stride_y, cols, N)
        tl.store(yp, _normed(x, r, w, X_TY, Y_TY, INTERPRET), mask=mask)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for n0 in range(0, N, BLOCK_N):
            xp, mask = _tile(x_ptr, rows, rmask, stride_x, n0 + cols, N)
            x = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
            acc += x * x
        r = tl.math.rsqrt(tl.sum(acc, axis=1) * inv_n + eps)
        for n0 in range(0, N, BLOCK_N):
            xp, mask = _tile(x_ptr, rows, rmask, stride_x, n0 + cols, N)
            x = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + n0 + cols, mask=n0 + cols < N, other=0.0)
            yp, _ = _tile(y_ptr, rows, rmask, stride_y, n0 + cols, N)
            tl.store(yp, _normed(x, r, w, X_TY, Y_TY, INTERPRET), mask=mask)
    tl.store(r_ptr + rows, r, mask=rmask)


@triton.jit
def _rms_grad_parts(x_ptr, w_ptr, dy_ptr, rows, rmask, r, cols, N, stride_x, stride_dy,
                    G_TY: tl.constexpr, INTERPRET: tl.constexpr):
    """Of one tile: xn = x * r (fp32), dy (fp32), g = (dy * weight) rounded to G_TY (the dtype torch's
    product has: the gradient of the normalised input) and back to fp32, and the mask."""
    xp, mask = _tile(x_ptr, rows, rmask, stride_x, cols, N)
    dyp, _ = _tile(dy_ptr, rows, rmask, stride_dy, cols, N)
    xn = tl.load(xp, mask=mask, other=0.0).to(tl.float32) * r[:, None]
    dy = tl.load(dyp, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    g = round_like_torch(dy * w[None, :], G_TY, INTERPRET).to(tl.float32)
    return xn, dy, g, mask


@triton.jit
def rms_norm_bwd(x_ptr, w_ptr, r_ptr, dy_ptr, dx_ptr, dwp_ptr, M, N, stride_x, stride_dy, stride_dx, inv_n,
                 G_TY: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ONE_BLOCK: tl.constexpr,
                 DX: tl.constexpr, DW: tl.constexpr, INTERPRET: tl.constexpr):
    """dx = r * (g - xn * mean(g * xn)) in x's dtype, each program walking row tiles pid, pid + P, ...

    ONE_BLOCK (and DW): the program also sums dy * xn.to(x.dtype) over its rows in fp32 and writes
    the sum to row pid of dwp [P, N]; the host adds those rows up (deterministic: no atomics). The
    products are not rounded to x's dtype one by one, as torch's are before its fp32 sum.
    Else (rows wider than a block) dx only, in two passes per row; ``rms_norm_dw`` gives dw."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    X_TY: tl.constexpr = x_ptr.dtype.element_ty
    DX_TY: tl.constexpr = dx_ptr.dtype.element_ty
    dw = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for tile in range(pid, tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        r = tl.load(r_ptr + rows, mask=rmask, other=0.0)
        if ONE_BLOCK:
            xn, dy, g, mask = _rms_grad_parts(x_ptr, w_ptr, dy_ptr, rows, rmask, r, cols, N, stride_x, stride_dy,
                                              G_TY, INTERPRET)
            if DW:
                dw += dy * round_like_torch(xn, X_TY, INTERPRET).to(tl.float32)
            if DX:
                c = tl.sum(g * xn, axis=1) * inv_n
                dxp, _ = _tile(dx_ptr, rows, rmask, stride_dx, cols, N)
                tl.store(dxp, round_like_torch(r[:, None] * (g - xn * c[:, None]), DX_TY, INTERPRET), mask=mask)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for n0 in range(0, N, BLOCK_N):
                xn, dy, g, mask = _rms_grad_parts(x_ptr, w_ptr, dy_ptr, rows, rmask, r, n0 + cols, N, stride_x,
                                                  stride_dy, G_TY, INTERPRET)
                acc += g * xn
            c = tl.sum(acc, axis=1) * inv_n
            for n0 in range(0, N, BLOCK_N):
                xn, dy, g, mask = _rms_grad_parts(x_ptr, w_ptr, dy_ptr, rows, rmask, r, n0 + cols, N, stride_x,
                                                  stride_dy, G_TY, INTERPRET)
                dxp, _ = _tile(dx_ptr, rows, rmask, stride_dx, n0 + cols, N)
                tl.store(dxp, round_like_torch(r[:, None] * (g - xn * c[:, None]), DX_TY, INTERPRET), mask=mask)
    if ONE_BLOCK:
        if DW:
            tl.store(dwp_ptr + pid * N + cols, tl.sum(dw, axis=0), mask=cols < N)


@triton.jit
def rms_norm_dw(x_ptr, r_ptr, dy_ptr, dwp_ptr, M, N, stride_x, stride_dy,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr):
    """dw partial sums of rows wider than a block: program (pid, j) sums columns block j of
    dy * (x * r).to(x.dtype) over row tiles pid, pid + P, ... into dwp[pid] (fp32; the host adds up)."""
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    X_TY: tl.constexpr = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for tile in range(pid, tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        r = tl.load(r_ptr + rows, mask=rmask, other=0.0)
        xp, mask = _tile(x_ptr, rows, rmask, stride_x, cols, N)
        dyp, _ = _tile(dy_ptr, rows, rmask, stride_dy, cols, N)
        xn = round_like_torch(tl.load(xp, mask=mask, other=0.0).to(tl.float32) * r[:, None], X_TY, INTERPRET)
        acc += tl.load(dyp, mask=mask, other=0.0).to(tl.float32) * xn.to(tl.float32)
    tl.store(dwp_ptr + pid * N + cols, tl.sum(acc, axis=0), mask=cols < N)


@triton.jit
def _silu_and_sigmoid(g, PRECISE_EXP: tl.constexpr):
    """fp32 silu(g) = g / (1 + exp(-g)) and sigmoid(g) = 1 / (1 + exp(-g)), torch's formulas, with
    IEEE divisions (Triton's ``/`` on fp32 compiles to an approximate one)."""
    d = 1.0 + exp_like_torch(-g, PRECISE_EXP)
    return tl.math.div_rn(g, d), tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), d)


@triton.jit
def swiglu_fwd(g_ptr, u_ptr, h_ptr, M, N, stride_g, stride_u, stride_h,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISE_EXP: tl.constexpr, INTERPRET: tl.constexpr):
    """h = silu(gate) * up, as torch's ``F.silu(gate) * up``: silu in fp32 rounded to gate's dtype, then
    the product in fp32 rounded again."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < M
    TY: tl.constexpr = g_ptr.dtype.element_ty
    gp, mask = _tile(g_ptr, rows, rmask, stride_g, cols, N)
    up, _ = _tile(u_ptr, rows, rmask, stride_u, cols, N)
    hp, _ = _tile(h_ptr, rows, rmask, stride_h, cols, N)
    act, _ = _silu_and_sigmoid(tl.load(gp, mask=mask, other=0.0).to(tl.float32), PRECISE_EXP)
    act = round_like_torch(act, TY, INTERPRET).to(tl.float32)
    tl.store(hp, round_like_torch(act * tl.load(up, mask=mask, other=0.0).to(tl.float32), TY, INTERPRET), mask=mask)


@triton.jit
def swiglu_bwd(dp_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, M, N, stride_dp, stride_g, stride_u, stride_dg, stride_du,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISE_EXP: tl.constexpr, INTERPRET: tl.constexpr):
    """From d_prod (the gradient of silu(gate) * up): d_up = d_prod * silu(gate) and d_gate =
    silu_backward(d_prod * up, gate), each product rounded to gate's dtype where torch's is. d_gate may
    be written over d_prod (each element is read before it is written, by the same program)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < M
    TY: tl.constexpr = g_ptr.dtype.element_ty
    dpp, mask = _tile(dp_ptr, rows, rmask, stride_dp, cols, N)
    gp, _ = _tile(g_ptr, rows, rmask, stride_g, cols, N)
    up, _ = _tile(u_ptr, rows, rmask, stride_u, cols, N)
    dp = tl.load(dpp, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gp, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up, mask=mask, other=0.0).to(tl.float32)
    act, s = _silu_and_sigmoid(g, PRECISE_EXP)
    d_up = round_like_torch(dp * round_like_torch(act, TY, INTERPRET).to(tl.float32), TY, INTERPRET)
    t = round_like_torch(dp * u, TY, INTERPRET).to(tl.float32)
    d_gate = round_like_torch(t * s * (1.0 + g * (1.0 - s)), TY, INTERPRET)  # aten silu_backward's formula
    dgp, _ = _tile(dg_ptr, rows, rmask, stride_dg, cols, N)
    dup, _ = _tile(du_ptr, rows, rmask, stride_du, cols, N)
    tl.store(dgp, d_gate, mask=mask)
    tl.store(dup, d_up, mask=mask)
