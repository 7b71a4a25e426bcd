"""Decoder-layer MLPs run in token tiles (``HyScaleConfig.tile_tokens``; ``hyscale_hf.tiling``).

Every Transformers decoder layer (a module with a ``gradient_checkpointing`` flag) calls its MLP as
``self.mlp(hidden_states)``, a token-wise map (dense SwiGLU, or a MoE block routing each token on its
own). The MLP gets an instance forward that runs its current forward (the lean one where
``_lean_layers`` gave it one, else its class's) on tiles of the live ``tile_tokens``. Installed on every
patched model, so setting ``patched_config(model).tile_tokens`` later takes effect at the next forward.
The norms are not tiled: a lean RMSNorm keeps only its input, which the residual stream holds anyway.
"""

from __future__ import annotations

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
        if tile is None or args or kwargs or x.dim() != 3:
            return inner(x, *args, **kwargs)
        return tiled_tokens(inner, x, tile, dim=1)


def apply_tiled_mlps(model: nn.Module, state: PatchState, undo) -> None:
    """Give the MLP of every decoder layer of ``model`` its tiled forward (changes through ``undo``)."""
    for layer in model.modules():
        mlp = getattr(layer, "mlp", None)
        if not hasattr(layer, "gradient_checkpointing") or not isinstance(mlp, nn.Module):
            continue
        undo.set_attr(mlp, "forward", _TiledForward(mlp, mlp.__dict__.get("forward"), state))
