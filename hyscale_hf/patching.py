"""patch_model / unpatch_model: the front door between a user's model and the model families.

Families live in ``hyscale_hf/model_patches`` (one file each, the only code that knows
Transformers internals) and register themselves in ``hyscale_hf.families`` when that package is
imported. An apply function patches one model *instance* in place and returns an undo function
that restores it exactly.

Import rule (docs/design.md section 3): this module never imports ``model_patches`` at module
level, so ``import hyscale_hf.patching`` stays free of Transformers. The functions that need the
families (``patch_model``, ``supported_model_types``, ``family_of``) import it on first use.
That is not a cycle: ``model_patches`` registers through ``hyscale_hf.families`` and reads patch
state through ``hyscale_hf.state``, and neither of those (nor anything else ``model_patches``
imports) imports this module.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from .config import HyScaleConfig
from .families import _FAMILIES, ModelFamily
from .indexer import install_loss_sink
from .records import LiveRecord, saved_record, set_record
from .state import STATE_ATTR, PatchState, base_model, patch_state

# The model config attribute that carries the HyScaleConfig into config.json, so that
# ``from_pretrained(saved)`` + ``patch_model(model)`` patches the reload alike.
CONFIG_RECORD = "hyscale_config"


def _load_families() -> None:
    """Import ``hyscale_hf.model_patches``, whose family modules register themselves (once per process)."""
    from . import model_patches  # noqa: F401


def supported_model_types() -> list[str]:
    """``config.model_type`` values ``patch_model`` accepts with the installed Transformers."""
    _load_families()
    return sorted(_FAMILIES)


def family_of(model_type: str) -> ModelFamily:
    _load_families()
    if model_type not in _FAMILIES:
        raise ValueError(
            f"hyscale_hf does not support model_type {model_type!r}; supported: {', '.join(supported_model_types())}"
        )
    return _FAMILIES[model_type]


class _ConfigSnapshot:
    """``dataclasses.asdict`` of a patch's live config (an object, not a lambda, so that a deep copy
    of a patched model snapshots the copy's config)."""

    def __init__(self, state: PatchState) -> None:
        self.state = state

    def __call__(self) -> dict:
        return dataclasses.asdict(self.state.config)


def _config_from_record(model_config) -> HyScaleConfig:
    """``HyScaleConfig`` of a saved patched model (its ``hyscale_config`` record), or the defaults."""
    record = saved_record(model_config, CONFIG_RECORD)
    if record is None:
        return HyScaleConfig()
    if not isinstance(record, dict):
        raise ValueError(f"model.config.{CONFIG_RECORD} must be a dict written by hyscale_hf, got {type(record).__name__}")
    known = {f.name for f in dataclasses.fields(HyScaleConfig)}
    unknown = sorted(set(record) - known)
    if unknown:
        warnings.warn(f"model.config.{CONFIG_RECORD} has options this hyscale_hf does not know, ignored: {unknown}",
                      stacklevel=3)
    return HyScaleConfig(**{k: v for k, v in record.items() if k in known})


def is_patched(model: torch.nn.Module) -> bool:
    return patch_state(model) is not None


def patch_model(model: torch.nn.Module, config: HyScaleConfig | None = None, *, state_dict: dict | None = None,
                **overrides) -> torch.nn.Module:
    """Patch ``model`` in place for hyscale_hf and return it.

    ``config`` with ``overrides`` applied (``topk=...`` etc.). Without ``config``: the options a
    saved patched model was saved with (``model.config.hyscale_config``, written to config.json by
    ``save_pretrained``), else ``HyScaleConfig()``. Raises ``ValueError`` for an unsupported model
    type (listing the supported ones) or a model that is already patched.

    ``state_dict``: the state dict a dense model was loaded from (``from_pretrained(None, config=...,
    state_dict=sd)``, or your own): its indexer tensors (``*.indexer.*``), which ``from_pretrained``
    drops because the unpatched class has no indexer, are copied into the added indexers. A native DSA
    model's indexers are part of its checkpoint, so it takes none.

    The patched model gets its own copy of its config (``model.config`` is no longer the object it was
    built from), so patching it changes no other model that shares that object;
    ``unpatch_model`` puts the original back.
    """
    if config is not None and not isinstance(config, HyScaleConfig):
        raise TypeError(f"config must be a HyScaleConfig or None, got {type(config).__name__}")
    target = base_model(model)
    model_config = getattr(target, "config", None)
    if model_config is None or not hasattr(model_config, "model_type"):
        raise TypeError(f"model must be a Transformers PreTrainedModel (with .config.model_type), got {type(model).__name__}")
    cfg = (config or _config_from_record(model_config)).replace(**overrides)
    if is_patched(target):
        raise ValueError("model is already patched; call hyscale_hf.unpatch_model(model) first")
    family = family_of(model_config.model_type)
    if state_dict is not None and not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict of tensors (a model's state_dict()), got {type(state_dict).__name__}")
    if state_dict is not None and family.kind != "dense":
        raise ValueError(f"state_dict is for the indexers patch_model adds to dense models; a {model_config.model_type} "
                         "model's own indexers are part of its checkpoint (from_pretrained loads them)")
    state = PatchState(config=cfg, family=family, load_from=state_dict)
    # The patch writes into the model's config; another model sharing that object must not see it.
    from .model_patches._own_config import give_own_config

    state.undo.append(give_own_config(model, model_config))
    model_config = target.config
    try:
        undo = family.apply(target, state)
    except BaseException:
        for step in reversed(state.undo):
            step()
        raise
    finally:
        state.load_from = None  # never kept: the model would hold a second copy of the tensors
    state.undo.append(undo)
    setattr(target, STATE_ATTR, state)
    state.undo.append(set_record(model_config, CONFIG_RECORD, LiveRecord({}, _ConfigSnapshot(state))))
    state.undo.append(install_loss_sink(target, state))
    if cfg.selection_replay:
        # Transformers' checkpointing hooks are glue, so they live with the families (loaded above).
        from .model_patches._checkpointing import enable_selection_replay

        try:
            enable_selection_replay(target)
        except Exception:
            unpatch_model(target)
            raise
    return model


def unpatch_model(model: torch.nn.Module) -> torch.nn.Module:
    """Restore a patched model to its exact original behaviour; returns it."""
    target = base_model(model)
    state = patch_state(target)
    if state is None:
        raise ValueError("model is not patched by hyscale_hf")
    for undo in reversed(state.undo):
        undo()
    delattr(target, STATE_ATTR)
    return model
