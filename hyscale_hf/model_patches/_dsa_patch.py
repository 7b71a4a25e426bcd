"""What patching an attention family involves besides the step: resolving the options, changing the
model (every change through one undo object) and the model-wide extras.

- ``resolve_indexer_options`` fills ``topk``, ``index_n_heads``, ``index_head_dim``, ``index_share`` and ``relu`` of the
  patch's ``HyScaleConfig``, each by one precedence: explicit HyScaleConfig > the saved record
  (``model.config.hyscale_indexer``, written by a dense family's patch and saved to config.json) >
  the model config's ``index_topk`` / ``index_n_heads`` / ``index_head_dim`` > the defaults (topk
  ``DEFAULT_TOPK``, the family's indexer shape and ReLU choice). The shape of indexer weights that
  exist binds: an explicit value that differs from the saved record's, or from a native DSA model's
  config (``shape_from_weights``), is an error; so is an explicit ``index_share`` other than the record's
  (the saved indexers sit on its layers), or other than 1 in a family that cannot choose it.
- ``PatchUndo`` records each change and restores the model exactly; ``patch_attention`` applies the
  changes every family makes: per-module attributes and instance forward, the attention
  implementation, lean layers, tiled MLPs and norms, the chunked LM loss.
"""

from __future__ import annotations

import types
from collections.abc import Callable

from torch import nn

from ..config import HyScaleConfig
from ..records import saved_record
from ..state import PatchState
from ._attn_switch import AttnSwitch
from ._attn_switch import install as install_attn_switch
from ._chunked_lm_loss import apply_chunked_lm_loss
from ._dense_weights import RECORD_ATTR
from ._lean_layers import apply_lean_layers
from ._tiled_layers import apply_tiled_modules

DEFAULT_TOPK = 2048
LAYER_STATE = "_hyscale_state"  # the PatchState on each patched attention module
ATTN_SWITCH = "_hyscale_attn_switch"  # the model's AttnSwitch on each patched attention module
_MODEL_KEYS = {"topk": "index_topk", "index_n_heads": "index_n_heads", "index_head_dim": "index_head_dim"}


def resolve_indexer_options(cfg: HyScaleConfig, model_config, *, default_shape: tuple[int, int] | None = None,
                            default_relu: bool = True, shape_from_weights: bool = False,
                            share_layers: bool = False) -> dict | None:
    """Fill ``cfg``'s indexer options in place by the precedence above; returns the saved record (or None).

    Args:
        model_config: the config the attention modules read (its ``hyscale_indexer`` record and ``index_*``).
        default_shape: ``(index_n_heads, index_head_dim)`` when neither cfg, record nor model config give one.
        default_relu: the family's own ReLU choice.
        shape_from_weights: the model config's ``index_n_heads`` / ``index_head_dim`` describe indexer
            weights the model has (native DSA families).
        share_layers: the family places its indexers by ``HyScaleConfig.index_share`` (dense families);
            others take only None or 1 there (their layout is the model's own).
    Raises ``ValueError`` (leaving ``cfg`` unchanged) when an explicit shape or ``index_share`` contradicts
    existing weights, or the head dim is odd.
    """
    saved = saved_record(model_config, RECORD_ATTR)
    if saved is not None and not isinstance(saved, dict):
        raise ValueError(f"model.config.{RECORD_ATTR} must be a dict written by hyscale_hf, got {type(saved).__name__}")
    record = saved or {}
    from_model = {name: getattr(model_config, key, None) for name, key in _MODEL_KEYS.items()}
    for name in ("index_n_heads", "index_head_dim"):
        explicit = getattr(cfg, name)
        if explicit is None:
            continue
        if name in record and record[name] != explicit:
            raise ValueError(
                f"HyScaleConfig.{name}={explicit} differs from the saved indexer's {name}={record[name]} "
                f"(model.config.{RECORD_ATTR}); the saved weights need the saved shape"
            )
        if shape_from_weights and from_model[name] != explicit:
            raise ValueError(
                f"HyScaleConfig.{name}={explicit} does not match the model's indexer ({name}={from_model[name]}); "
                "a DSA model's indexer shape is fixed by its weights: leave it None"
            )
    share = cfg.index_share
    saved_share = record.get("index_share", 1) if saved is not None else None  # records before the option: 1
    if not share_layers and share not in (None, 1):
        raise ValueError(f"HyScaleConfig.index_share={share} applies to dense models converted to DSA; this "
                         "model's indexer layers (and any IndexShare layers) are fixed by its own config: leave it None")
    if share_layers and share is not None and saved_share is not None and share != saved_share:
        raise ValueError(f"HyScaleConfig.index_share={share} differs from the saved indexers' index_share={saved_share} "
                         f"(model.config.{RECORD_ATTR}); the saved weights sit on that layout")
    share = int(share or saved_share or 1)
    if share_layers and share > 1 and not cfg.selection_replay:
        raise ValueError(f"index_share={share} (saved with the indexers) needs HyScaleConfig.selection_replay=True")
    defaults = dict(zip(("topk", "index_n_heads", "index_head_dim"), (DEFAULT_TOPK, *(default_shape or (None, None)))))
    values = {}
    for name, default in defaults.items():
        value = getattr(cfg, name) or record.get(name) or from_model[name] or default
        if value is None:
            raise ValueError(f"model.config has no {_MODEL_KEYS[name]}; set HyScaleConfig.{name}")
        values[name] = int(value)
    if values["index_head_dim"] % 2:
        raise ValueError(f"index_head_dim must be even (RoPE rotates pairs), got {values['index_head_dim']}")
    for name, value in values.items():
        setattr(cfg, name, value)
    cfg.index_share = share if share_layers else None
    cfg.relu = bool(cfg.relu if cfg.relu is not None else record.get("relu", default_relu))
    return saved


class _Absent:
    """Marks an instance attribute that did not exist (a class: deepcopy keeps its identity)."""


class PatchUndo:
    """Restores a patched model exactly: each change goes through it and is undone in reverse order.

    A callable object holding data (objects, names, previous values, undo objects), never closures,
    so ``copy.deepcopy`` of a patched model (e.g. a reference model for RL fine-tuning) copies it
    with the model and the copy's undo restores the copy. A second call does nothing.
    """

    def __init__(self) -> None:
        self._steps: list[tuple] = []

    def set_attr(self, obj, name: str, value) -> None:
        """Set an instance attribute (a submodule too); undo puts back the instance's own earlier
        value, or removes the attribute."""
        own = obj._modules if isinstance(obj, nn.Module) and name in obj._modules else obj.__dict__
        self._steps.append(("attr", obj, name, own.get(name, _Absent)))
        setattr(obj, name, value)

    def set_value(self, obj, name: str, value) -> None:
        """Set an attribute through its setter (a config's ``_attn_implementation``, a parameter's
        ``requires_grad``); undo sets the earlier value back."""
        self._steps.append(("value", obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def add(self, undo: Callable[[], None]) -> None:
        """Run ``undo`` (an undo object of its own, e.g. a record's or the lean layers') in turn."""
        self._steps.append(("call", undo, None, None))

    def __call__(self) -> None:
        while self._steps:
            kind, obj, name, previous = self._steps.pop()
            if kind == "call":
                obj()
            elif previous is not _Absent:
                setattr(obj, name, previous)
            elif isinstance(obj, nn.Module) and name in obj._modules:
                del obj._modules[name]
            else:
                obj.__dict__.pop(name, None)


def patch_attention(model: nn.Module, state: PatchState, modules: list[nn.Module], forward,
                    prepare: Callable[[PatchUndo, nn.Module], None] | None = None,
                    finish: Callable[[PatchUndo], None] | None = None, mlp_ends_layer: bool = False) -> PatchUndo:
    """Patch ``modules`` (the model's attention modules) in place; returns the undo.

    Each module gets ``prepare(undo, module)`` (a family's own attributes), the state under
    ``LAYER_STATE`` and ``forward`` bound to it as its instance forward (nothing changes at class
    level: docs/design.md section 8); the model's Transformers models get the hooks that put
    ``ATTN_IMPLEMENTATION`` in their configs while they run (``_attn_switch``); then
    ``finish(undo)``, the lean layers, the tiled MLPs and norms and the chunked LM loss. A step that raises undoes the others.
    ``mlp_ends_layer``: the family's decoder layers end in ``residual + self.mlp(x)`` (``_lean_layers``).
    """
    undo = PatchUndo()
    try:
        for m in modules:
            if prepare is not None:
                prepare(undo, m)
            undo.set_attr(m, LAYER_STATE, state)
            undo.set_attr(m, "forward", types.MethodType(forward, m))
        # The configs keep the user's implementation; ATTN_IMPLEMENTATION is there while a patched call runs.
        switch = AttnSwitch(list({id(m.config): m.config for m in modules}.values()))
        for m in modules:
            undo.set_attr(m, ATTN_SWITCH, switch)
        install_attn_switch(model, switch, undo)
        state.attn_switch = switch
        if finish is not None:
            finish(undo)
        undo.add(apply_lean_layers(model, state, mlp_ends_layer))
        apply_tiled_modules(model, state, undo)  # after the lean forwards, which it runs per tile
        undo.add(apply_chunked_lm_loss(model, state))
    except BaseException:
        undo()
        raise
    return undo
