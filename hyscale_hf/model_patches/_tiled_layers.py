"""Token-wise modules run in token tiles (``HyScaleConfig.tile_tokens``; ``hyscale_hf.tiling``).

Two kinds of module are token-wise in every Transformers decoder: the MLP a decoder layer (a module
with a ``gradient_checkpointing`` flag) calls as ``self.mlp(hidden_states)`` (dense SwiGLU, or a MoE
block routing each token on its own), and the norms (``*RMSNorm`` / ``*LayerNorm`` over the last dim:
the layer norms, MLA's ``q_a_layernorm`` / ``kv_a_layernorm``, the indexer's ``k_norm``, the final
norm). A norm keeps little for backward, but its forward and backward work in fp32 temporaries of
several times its input, which at long context set the peak. Each gets an instance forward that runs
its current forward (the lean one where ``_lean_layers`` gave it one, else its class's) on tiles of the
live ``tile_tokens``: inputs ``[B, T, ...]`` tiled along T. Installed on every patched model, so setting
``patched_config(model).tile_tokens`` later takes effect at the next forward.
"""

from __future__ import annotations

import torch
from torch import nn

from ..state import PatchState
from ..tiling import tiled_tokens


class _TiledForward:
    """An MLP's instance forward: its previous forward on token tiles (an object, so deepcopy copies it)."""

    def __init__(self, module: nn.Module, previous, state: PatchState) -> None:
        self.module, self.previous, self.state = module, previous, state

    def _inner(self):
        return self.previous if self.previous is not None else type(self.module).forward.__get__(self.module)

    def __call__(self, x, *args, **kwargs):
        inner = self._inner()
        tile = self.state.config.tile_tokens
        if tile is None or args or kwargs or not isinstance(x, torch.Tensor) or x.dim() < 3:
            return inner(x, *args, **kwargs)
        return tiled_tokens(inner, x, tile, dim=1, params=self.module.parameters)


def _is_token_norm(m: nn.Module) -> bool:
    """A norm over the last dim only (its weight, where it has one, is 1-D)."""
    if not type(m).__name__.endswith(("RMSNorm", "LayerNorm")):
        return False
    shape = getattr(m, "normalized_shape", None)
    weight = getattr(m, "weight", None)
    return (shape is None or len(shape) == 1) and (not isinstance(weight, torch.Tensor) or weight.dim() == 1)


def apply_tiled_modules(model: nn.Module, state: PatchState, undo) -> None:
    """Give every decoder layer's MLP and every norm of ``model`` its tiled forward (changes through ``undo``)."""
    chosen = {}
    for layer in model.modules():
        mlp = getattr(layer, "mlp", None)
        if hasattr(layer, "gradient_checkpointing") and isinstance(mlp, nn.Module):
            chosen[id(mlp)] = mlp
    for m in model.modules():
        if _is_token_norm(m):
            chosen[id(m)] = m
    for m in chosen.values():
        undo.set_attr(m, "forward", _TiledForward(m, m.__dict__.get("forward"), state))
