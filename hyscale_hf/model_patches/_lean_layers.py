"""Memory-lean forwards for a patched model's RMSNorms and SwiGLU MLPs (``HyScaleConfig.lean_activations``).

At long context a checkpointed layer's recompute, not attention, sets the peak memory: for each token
Transformers' RMSNorm keeps an fp32 copy of its input and the MLP keeps four tensors of its
intermediate width. ``kernels.rms_norm`` / ``kernels.swiglu_mlp`` compute the same forward bits and
keep less. A module gets the lean forward only when it is one of these shapes (Transformers'
``*RMSNorm`` with ``weight`` and ``variance_epsilon``; an MLP of bias-free ``gate_proj``, ``up_proj``,
``down_proj`` ``nn.Linear`` with a SiLU ``act_fn``, torch's or Transformers') AND the lean op's torch path
reproduces its own forward bit for bit on a probe input (the torch path: on CUDA the lean forward runs
the ops' Triton kernels, which round as the torch path does but may differ in the last bits of fp32
statistics, so a bit-for-bit probe of them would refuse modules that compute the same function); anything else (Gemma-style ``1 + weight`` norms, GELU MLPs, quantised
or meta weights, modules that already carry an instance forward such as accelerate hooks) keeps its
own forward. A projection wrapped later (PEFT LoRA) sends the MLP back to its own forward at call time.

Where the family says its decoder layers end in ``residual + self.mlp(x)`` (``mlp_ends_layer``: nothing
after the MLP saves its output), the MLP skips its down projection in the recompute of its own layer
(``replay.recompute_owner()``): the recompute's output is dropped, and the backward reads only what the
MLP saved, which it still saves. GLM-4 normalises the MLP's output first, so it does not say so.
"""

from __future__ import annotations

import functools
import types

import torch
from torch import nn

from ..kernels import rms_norm, swiglu_mlp
from ..replay import recompute_owner
from ..state import PatchState

_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _lean_norm_forward(self, hidden_states, backend="auto"):
    return rms_norm(hidden_states, self.weight, self.variance_epsilon, backend=backend)


def _lean_mlp_forward(self, x, *args, backend="auto", ends_layer=False, **kwargs):
    if args or kwargs or any(type(getattr(self, name)) is not nn.Linear for name in _PROJECTIONS):
        return type(self).forward(self, x, *args, **kwargs)  # e.g. PEFT wrapped a projection after patching
    dropped = ends_layer and getattr(recompute_owner(), "mlp", None) is self  # its layer's recompute
    return swiglu_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight, backend=backend,
                      compute_output=not dropped)


def _torch_norm_forward(self, hidden_states):
    return rms_norm(hidden_states, self.weight, self.variance_epsilon, backend="torch")


def _torch_mlp_forward(self, x):
    return swiglu_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight, backend="torch")


def _is_rms_norm(m: nn.Module) -> bool:
    w = getattr(m, "weight", None)
    return (
        type(m).__name__.endswith("RMSNorm")
        and isinstance(w, torch.Tensor)
        and w.dim() == 1
        and isinstance(getattr(m, "variance_epsilon", None), float)
    )


def _is_swiglu_mlp(m: nn.Module) -> bool:
    projections = [getattr(m, name, None) for name in _PROJECTIONS]
    return (
        all(type(p) is nn.Linear and p.bias is None for p in projections)
        and type(getattr(m, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation")  # torch's, Transformers'

        and projections[0].weight.shape == projections[1].weight.shape
    )


@torch.no_grad()
def _same_bits(m: nn.Module, lean, width: int, dtype: torch.dtype, device) -> bool:
    """``lean`` (the lean op's torch path) gives ``m``'s own output bit for bit on a random probe input."""
    if device.type == "meta":
        return False
    g = torch.Generator(device="cpu").manual_seed(0)
    probe = (torch.randn(2, 3, width, generator=g) * 2).to(device=device, dtype=dtype)
    try:
        return bool(torch.equal(type(m).forward(m, probe), lean(m, probe)))
    except Exception:  # noqa: BLE001 - a module the lean forward cannot run is simply not swapped
        return False


class _LeanUndo:
    """Removes the lean instance forwards (a callable object, so deepcopy of a model carries it along)."""

    def __init__(self) -> None:
        self.modules: list[nn.Module] = []

    def __call__(self) -> None:
        for m in self.modules:
            m.__dict__.pop("forward", None)
        self.modules.clear()


def apply_lean_layers(model: nn.Module, state: PatchState, mlp_ends_layer: bool = False) -> _LeanUndo:
    """Give every matching RMSNorm and SwiGLU MLP of ``model`` its lean forward (when
    ``state.config.lean_activations``); returns the undo. ``mlp_ends_layer``: the family's decoder
    layers end in ``residual + self.mlp(x)``, so a layer's MLP may skip its output in that layer's
    recompute."""
    undo = _LeanUndo()
    if not state.config.lean_activations:
        return undo
    for m in model.modules():
        if "forward" in m.__dict__:  # an instance forward is already there (accelerate hook, another patch)
            continue
        extra = {}
        if _is_rms_norm(m):
            lean, probe, width, ref = _lean_norm_forward, _torch_norm_forward, m.weight.shape[0], m.weight
        elif _is_swiglu_mlp(m):
            lean, probe, width, ref = _lean_mlp_forward, _torch_mlp_forward, m.gate_proj.weight.shape[1], m.gate_proj.weight
            extra["ends_layer"] = mlp_ends_layer
        else:
            continue
        if _same_bits(m, probe, width, ref.dtype, ref.device):
            # the ops' backend is the patch's (HyScaleConfig.backend): "torch" keeps them off the kernels
            forward = functools.update_wrapper(functools.partial(lean, backend=state.config.backend, **extra), lean)
            m.forward = types.MethodType(forward, m)
            undo.modules.append(m)
    return undo
