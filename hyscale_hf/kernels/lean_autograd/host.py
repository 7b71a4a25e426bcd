"""Launches of the lean RMSNorm / SwiGLU Triton kernels (kernels: ``triton_kernels.py``; autograd: ``op.py``)."""

from __future__ import annotations

import functools
import os

import torch

try:  # Triton is a Linux x86-64 dependency; elsewhere only the torch path exists.
    import triton

    from . import triton_kernels as kernels
except ImportError:  # pragma: no cover
    triton = None

# Whether this build has the Triton kernels (the ops' "triton" backend).
HAS_TRITON = triton is not None
# Dtypes the kernels take (they compute in fp32; float64 stays on the torch path).
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Widest RMSNorm row held in registers as one block (GLM-5's 6144 pads to 8192). Wider rows loop over
# LOOP_BLOCK_N-column blocks in two passes, the second re-reading the row from cache: a 16K-32K row
# in one block would spill the backward's five fp32 row tiles out of registers.
MAX_BLOCK_N = 8192
LOOP_BLOCK_N = 4096
# Elements per program of narrow rows (several rows per tile) and of the SwiGLU elementwise tiles.
TILE_ELEMENTS = 4096
EW_BLOCK_N = 1024
# RMSNorm backward programs per SM, each walking many rows and writing one row of dw partial sums
# (as Liger's RMSNorm backward does): a 16-warp program on 8192-wide tiles holds most of an SM's
# registers. Not tuned on a GPU yet.
BWD_PROGRAMS_PER_SM = 1

_TL_DTYPES = {}
if HAS_TRITON:
    import triton.language as tl

    _TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, N]`` with unit column stride: the kernels take any row stride (so row slices
    and row-broadcast gradients are read in place), but elements of a row must be adjacent; only
    tensors without such a view (e.g. transposed, or a gradient expanded from a scalar) are copied."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 or t2.shape[-1] == 1 else t2.contiguous()


def _warps(elements: int) -> int:
    return 16 if elements >= 8192 else 8 if elements >= 2048 else 4


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _programs(device: torch.device, tiles: int) -> int:
    # The interpreter runs programs one after another: a few suffice (and give each several tiles).
    cap = _sm_count(device.index) * BWD_PROGRAMS_PER_SM if device.type == "cuda" else 4
    return max(1, min(tiles, cap))


def _rms_blocks(M: int, N: int) -> tuple[int, int, bool]:
    width = triton.next_power_of_2(N)
    if width <= MAX_BLOCK_N:
        return max(1, min(triton.next_power_of_2(M), TILE_ELEMENTS // width)), width, True
    return 1, LOOP_BLOCK_N, False


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """y = ``weight * normalised.to(x.dtype)`` shaped like x (dtype: x's and weight's promoted) and
    the fp32 inverse RMS per row ``[rows]``. ``x`` non-empty."""
    N = x.shape[-1]
    x2 = _rows(x)
    M = x2.shape[0]
    y = torch.empty((M, N), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    r = torch.empty(M, dtype=torch.float32, device=x.device)
    BLOCK_M, BLOCK_N, one = _rms_blocks(M, N)
    kernels.rms_norm_fwd[(triton.cdiv(M, BLOCK_M),)](
        x2, weight.contiguous(), y, r, M, N, x2.stride(0), y.stride(0), eps, 1.0 / N,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, ONE_BLOCK=one, INTERPRET=_interpreted(), num_warps=_warps(BLOCK_M * BLOCK_N))
    return y.view(x.shape), r


def rms_norm_bwd(dy, x, weight, r, need_dx: bool, need_dw: bool):
    """(dx or None, dw or None) of ``rms_norm_fwd`` from its output gradient ``dy``."""
    N = x.shape[-1]
    x2, dy2 = _rows(x), _rows(dy)
    M = x2.shape[0]
    BLOCK_M, BLOCK_N, one = _rms_blocks(M, N)
    P = _programs(x.device, triton.cdiv(M, BLOCK_M))
    dx = torch.empty((M, N), dtype=x.dtype, device=x.device) if need_dx else None
    dwp = torch.empty((P, N), dtype=torch.float32, device=x.device) if need_dw else None
    w = weight.contiguous()
    common = dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, INTERPRET=_interpreted(), num_warps=_warps(BLOCK_M * BLOCK_N))
    if need_dx or (need_dw and one):
        kernels.rms_norm_bwd[(P,)](
            x2, w, r, dy2, dx if need_dx else x2, dwp if need_dw else r, M, N, x2.stride(0), dy2.stride(0),
            N if dx is None else dx.stride(0), 1.0 / N, G_TY=_TL_DTYPES[torch.promote_types(dy.dtype, weight.dtype)],
            ONE_BLOCK=one, DX=need_dx, DW=need_dw and one, **common)
    if need_dw and not one:
        kernels.rms_norm_dw[(P, triton.cdiv(N, BLOCK_N))](x2, r, dy2, dwp, M, N, x2.stride(0), dy2.stride(0), **common)
    dw = dwp.sum(0).to(weight.dtype) if need_dw else None
    return (dx.view(x.shape) if need_dx else None), dw


def _ew_launch(kernel, M: int, N: int, device: torch.device, *args) -> None:
    BLOCK_N = min(triton.next_power_of_2(N), EW_BLOCK_N)
    BLOCK_M = max(1, min(triton.next_power_of_2(M), TILE_ELEMENTS // BLOCK_N))
    # Row tiles on grid axis 0 (up to 2**31 - 1 programs); column blocks on axis 1 (up to 65535).
    kernel[(triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))](
        *args, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, PRECISE_EXP=device.type == "cuda", INTERPRET=_interpreted(),
        num_warps=_warps(BLOCK_M * BLOCK_N))


def swiglu_product(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` (same shape and dtype as gate, which up shares)."""
    g2, u2 = _rows(gate), _rows(up)
    M, N = g2.shape
    h = torch.empty((M, N), dtype=gate.dtype, device=gate.device)
    _ew_launch(kernels.swiglu_fwd, M, N, gate.device, g2, u2, h, M, N, g2.stride(0), u2.stride(0), h.stride(0))
    return h.view(gate.shape)


def swiglu_grads(d_prod: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_gate, d_up) from the gradient of ``silu(gate) * up``. d_gate is written over ``d_prod``
    (a temporary of the caller's, one intermediate-width buffer fewer) unless it has no row view."""
    dp2, g2, u2 = _rows(d_prod), _rows(gate), _rows(up)
    M, N = g2.shape
    d_up = torch.empty((M, N), dtype=gate.dtype, device=gate.device)
    _ew_launch(kernels.swiglu_bwd, M, N, gate.device, dp2, g2, u2, dp2, d_up, M, N, dp2.stride(0), g2.stride(0),
               u2.stride(0), dp2.stride(0), d_up.stride(0))
    return dp2.reshape(gate.shape), d_up.view(gate.shape)
