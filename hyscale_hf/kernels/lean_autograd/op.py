"""Memory-lean autograd for the dense parts of a decoder layer: torch path and fused Triton kernels.

Under gradient checkpointing, the backward of a layer first recomputes the layer and holds every
tensor autograd saved for it at once; at long context those saved activations, not attention, set
the peak (GLM-5 dims at 128K tokens: about half a MiB per token per layer). The functions here compute
the same forward as the plain torch code (on the torch path: bit-identical), but save fewer and
smaller tensors and recompute the cheap elementwise parts in backward:

- ``rms_norm``: saves the input in its own dtype (usually the layer input, held anyway) and the
  fp32 inverse RMS per row. The plain code saves an fp32 copy of the input: 4 bytes per element
  instead of 0 extra.
- ``swiglu_mlp``: ``down(silu(gate(x)) * up(x))`` saving ``x``, ``gate(x)`` and ``up(x)``. The plain
  code also saves ``silu(gate(x))`` and the product: 4 tensors of the intermediate width instead of 2.

The plain compositions the torch path (``backend="torch"``) equals bit for bit are
``naive.rms_norm_reference`` and ``naive.swiglu_mlp_reference``. That path runs one torch kernel, one
pass over a ``[T, N]`` tensor, per elementwise op; ``backend="triton"`` (the default ``"auto"`` on
CUDA) runs the elementwise parts as fused Triton kernels instead (``triton_kernels.py``, launched by
``host.py``), saving the same tensors. They round where the torch ops round, so their results equal
the torch path's but for the last bits of the fp32 statistics (RMSNorm's row sums add in another
order) and of ``exp``; the SwiGLU matmuls are torch's in both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes

from ..checks import check_backend, check_same_device, resolve_backend
from . import host


def _use_triton(backend: str, **tensors: torch.Tensor) -> bool:
    """Whether ``backend`` runs the Triton kernels on these tensors (named for the errors); "auto"
    falls back to torch for dtypes the kernels do not take (float64), "triton" refuses them."""
    check_backend(backend)
    other = [f"{name} is {str(t.dtype).replace('torch.', '')}" for name, t in tensors.items()
             if t.dtype not in host.TRITON_DTYPES]
    if backend == "auto" and other:
        return False
    if resolve_backend(backend, next(iter(tensors.values())).device, host.HAS_TRITON) == "torch":
        return False
    if other:
        raise ValueError(f"backend='triton' takes float16, bfloat16 and float32 tensors, but {', '.join(other)}; "
                         "use backend='torch' (or 'auto') for other dtypes")
    check_same_device(**tensors)
    # An empty input launches nothing: the torch path gives its (empty) result.
    return all(t.numel() > 0 for t in tensors.values())


def _inverse_rms(x32: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, use_triton):
        ctx.use_triton = use_triton
        if use_triton:
            y, r = host.rms_norm_fwd(x, weight, eps)  # r: [rows] fp32, the same bytes as the torch path's
            ctx.save_for_backward(x, weight, r)
            return y
        x32 = x.to(torch.float32)
        r = _inverse_rms(x32, eps)
        ctx.save_for_backward(x, weight, r)
        return weight * (x32 * r).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, r = ctx.saved_tensors
        if ctx.use_triton:
            dx, dw = host.rms_norm_bwd(dy, x, weight, r, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
            return dx, dw, None, None
        xn = x.to(torch.float32) * r  # normalised input, fp32 (recomputed, same bits as forward)
        dx = dw = None
        if ctx.needs_input_grad[1]:
            dw = (dy * xn.to(x.dtype)).reshape(-1, weight.shape[-1]).sum(0).to(weight.dtype)
        if ctx.needs_input_grad[0]:
            g = (dy * weight).to(torch.float32)
            dx = (r * (g - xn * (g * xn).mean(-1, keepdim=True))).to(x.dtype)
        return dx, dw, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "auto") -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps))`` with the statistics in fp32 (the Llama/GLM RMSNorm).

    Args:
        x: ``[..., N]`` input of any float dtype (the Triton kernels: float16, bfloat16, float32).
        weight: ``[N]`` scale.
        eps: added to the mean square.
        backend: ``"auto"`` (Triton on CUDA tensors, else torch), ``"torch"`` or ``"triton"``.

    Returns: ``weight * normalised.to(x.dtype)``, in x's and weight's promoted dtype. The torch path is
    bit-identical to ``naive.rms_norm_reference``; the Triton one rounds at the same places, its fp32
    inverse RMS may differ from torch's in the last bits (summation order).
    """
    if weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"weight must be [N] with N = x.shape[-1] = {x.shape[-1]}, got {tuple(weight.shape)}")
    return _RMSNormFn.apply(x, weight, float(eps), _use_triton(backend, x=x, weight=weight))


def _swiglu_product(gate, up, use_triton):
    return host.swiglu_product(gate, up) if use_triton else F.silu(gate) * up


class _SwiGLUMLPFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, use_triton, compute_output):
        gate, up = F.linear(x, w_gate), F.linear(x, w_up)
        ctx.use_triton = use_triton
        ctx.save_for_backward(x, gate, up, w_gate, w_up, w_down)
        if not compute_output:  # the caller drops the output: save for backward, skip the down projection
            # Zeros of the output's shape and dtype (gate's: the forward's matmul dtype, autocast or not),
            # made with the dispatch modes off: under torch.compile a replaying region runs under selective
            # checkpointing's modes, whose recompute (where callers skip) refuses ops its forward did not run.
            with _disable_current_modes():
                return torch.zeros(*x.shape[:-1], w_down.shape[0], dtype=gate.dtype, device=x.device)
        return F.linear(_swiglu_product(gate, up, use_triton), w_down)

    @staticmethod
    def backward(ctx, dy):
        x, gate, up, w_gate, w_up, w_down = ctx.saved_tensors
        # Under autocast the forward's matmuls ran in gate's dtype (bf16) over fp32 weights and inputs:
        # compute in that dtype here too, and hand each gradient back in its input's dtype, as
        # autograd of autocast's casts does.
        cd = gate.dtype
        dy, x_c = dy.to(cd), x.to(cd)
        flat = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
        dx = dwg = dwu = dwd = None
        if ctx.use_triton:
            # The product is recomputed (one more read of gate and up) rather than written by the
            # gradient kernel: then it is dead before d_prod exists, and at most two
            # intermediate-width temporaries are alive at once (d_prod, then d_gate, over it, and d_up).
            if ctx.needs_input_grad[3]:
                dwd = (flat(dy).t() @ flat(host.swiglu_product(gate, up))).to(w_down.dtype)
            d_gate, d_up = host.swiglu_grads(dy @ w_down.to(cd), gate, up)
        else:
            # Ordered so that at most two intermediate-width temporaries are alive besides gate and up.
            act = F.silu(gate)
            if ctx.needs_input_grad[3]:
                dwd = (flat(dy).t() @ flat(act * up)).to(w_down.dtype)
            d_prod = dy @ w_down.to(cd)
            d_up = d_prod * act
            del act
            d_gate = torch.ops.aten.silu_backward(d_prod * up, gate)  # what autograd of F.silu computes
            del d_prod
        if ctx.needs_input_grad[0]:
            dx = (d_gate @ w_gate.to(cd) + d_up @ w_up.to(cd)).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dwg = (flat(d_gate).t() @ flat(x_c)).to(w_gate.dtype)
        if ctx.needs_input_grad[2]:
            dwu = (flat(d_up).t() @ flat(x_c)).to(w_up.dtype)
        return dx, dwg, dwu, dwd, None, None


def swiglu_mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
               backend: str = "auto", compute_output: bool = True) -> torch.Tensor:
    """``F.linear(silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)`` (bias-free SwiGLU MLP).

    Args:
        x: ``[..., H]`` (the Triton kernels: float16, bfloat16, float32, with the weights).
        w_gate, w_up: ``[I, H]``.
        w_down: ``[H_out, I]``.
        backend: ``"auto"`` (Triton elementwise kernels on CUDA tensors, else torch), ``"torch"`` or
            ``"triton"``; the matmuls are torch's either way.
        compute_output: False saves for backward exactly what True saves (so the backward is the
            same) but skips the product and the down projection and returns zeros of the output's
            shape: for a caller that drops the output, such as a checkpoint's recompute of a layer
            whose MLP output reaches only the layer's output.

    Returns: ``[..., H_out]``. The torch path is bit-identical to ``naive.swiglu_mlp_reference``; the
    Triton one rounds at the same places, its fp32 ``exp`` may differ from torch's in the last bit.
    """
    hidden, inter = x.shape[-1], w_gate.shape[0]
    for name, w, shape in (("w_gate", w_gate, (inter, hidden)), ("w_up", w_up, (inter, hidden))):
        if tuple(w.shape) != shape:
            raise ValueError(f"{name} must be [I, H] = {list(shape)} for x [..., {hidden}], got {list(w.shape)}")
    if w_down.dim() != 2 or w_down.shape[1] != inter:
        raise ValueError(f"w_down must be [H_out, I={inter}], got {list(w_down.shape)}")
    use_triton = _use_triton(backend, x=x, w_gate=w_gate, w_up=w_up, w_down=w_down)
    return _SwiGLUMLPFn.apply(x, w_gate, w_up, w_down, use_triton, bool(compute_output))
