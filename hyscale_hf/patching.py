"""patch_model / unpatch_model and the registry of model families.

Families live in ``hyscale_hf/model_patches`` (one file each, the only code that knows
Transformers internals) and register themselves here with ``register_family``. An apply function
patches one model *instance* in place and returns an undo function that restores it exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .config import HyScaleConfig

ApplyFn = Callable[[torch.nn.Module, "PatchState"], Callable[[], None]]


@dataclass(frozen=True)
class ModelFamily:
    """A registered family: ``kind`` is "dsa" (native sparse attention) or "dense" (indexer added)."""

    model_type: str
    apply: ApplyFn
    kind: str


@dataclass
class PatchState:
    """What ``patch_model`` leaves on a model, shared with its patched modules.

    ``config`` is live: the Trainer callback flips ``config.dense_warmup`` and patched modules
    read it on every forward. ``indexer_losses`` collects each full indexer layer's detached loss
    since the last ``pop_indexer_loss`` (for logging). ``selection_probe`` is set only while
    ``hyscale_hf.training`` samples top-k recall; patched modules report to it through
    ``hyscale_hf.training.observe_selection`` (a no-op while it is None).
    """

    config: HyScaleConfig
    family: ModelFamily
    undo: list[Callable[[], None]] = field(default_factory=list)
    indexer_losses: list[torch.Tensor] = field(default_factory=list)
    selection_probe: Callable[..., None] | None = None

    def record_indexer_loss(self, loss: torch.Tensor) -> None:
        self.indexer_losses.append(loss.detach())

    def pop_indexer_loss(self) -> float | None:
        """Mean of the recorded per-layer indexer losses since the last call (None if none)."""
        if not self.indexer_losses:
            return None
        value = torch.stack([x.float().cpu() for x in self.indexer_losses]).mean().item()
        self.indexer_losses.clear()
        return value


_FAMILIES: dict[str, ModelFamily] = {}
_STATE_ATTR = "_hyscale_state"


def register_family(model_type: str, apply: ApplyFn, kind: str) -> None:
    """Register ``apply`` for models whose ``config.model_type`` is ``model_type``.

    ``apply(model, state)`` patches one model instance in place (``state.config`` holds the options;
    keep ``state`` on the patched modules if they need the live config or loss log) and returns an
    undo function that restores the instance exactly.
    """
    if kind not in ("dsa", "dense"):
        raise ValueError(f"kind must be 'dsa' or 'dense', got {kind!r}")
    if model_type in _FAMILIES:
        raise ValueError(f"model type {model_type!r} is already registered")
    _FAMILIES[model_type] = ModelFamily(model_type, apply, kind)


def _registered() -> dict[str, ModelFamily]:
    # The families register themselves when hyscale_hf.model_patches is imported. The package's lazy
    # __init__ imports it on first use of a public name; this covers importing this module directly.
    from . import model_patches  # noqa: F401

    return _FAMILIES


def supported_model_types() -> list[str]:
    """``config.model_type`` values ``patch_model`` accepts with the installed Transformers."""
    return sorted(_registered())


def family_of(model_type: str) -> ModelFamily:
    if model_type not in _registered():
        raise ValueError(
            f"hyscale_hf does not support model_type {model_type!r}; supported: {', '.join(supported_model_types())}"
        )
    return _FAMILIES[model_type]


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The Transformers model under a PEFT wrapper (or ``model`` itself)."""
    seen = set()
    while hasattr(model, "get_base_model") and id(model) not in seen:
        seen.add(id(model))
        inner = model.get_base_model()
        if inner is model:
            break
        model = inner
    return model


def patch_state(model: torch.nn.Module) -> PatchState | None:
    """The ``PatchState`` of a patched model (PEFT wrappers looked through), else None."""
    return getattr(base_model(model), _STATE_ATTR, None)


def is_patched(model: torch.nn.Module) -> bool:
    return patch_state(model) is not None


def patch_model(model: torch.nn.Module, config: HyScaleConfig | None = None, **overrides) -> torch.nn.Module:
    """Patch ``model`` in place for hyscale_hf and return it.

    ``config`` (default ``HyScaleConfig()``) with ``overrides`` applied (``topk=...`` etc.).
    Raises ``ValueError`` for an unsupported model type (listing the supported ones) or a model
    that is already patched.
    """
    if config is not None and not isinstance(config, HyScaleConfig):
        raise TypeError(f"config must be a HyScaleConfig or None, got {type(config).__name__}")
    cfg = (config or HyScaleConfig()).replace(**overrides)
    target = base_model(model)
    model_config = getattr(target, "config", None)
    if model_config is None or not hasattr(model_config, "model_type"):
        raise TypeError(f"model must be a Transformers PreTrainedModel (with .config.model_type), got {type(model).__name__}")
    if is_patched(target):
        raise ValueError("model is already patched; call hyscale_hf.unpatch_model(model) first")
    family = family_of(model_config.model_type)
    state = PatchState(config=cfg, family=family)
    undo = family.apply(target, state)
    state.undo.append(undo)
    setattr(target, _STATE_ATTR, state)
    if cfg.selection_replay:
        from .replay import enable_selection_replay  # replay imports this module

        try:
            enable_selection_replay(target)
        except Exception:
            unpatch_model(target)
            raise
    return model


def add_undo(model: torch.nn.Module, undo: Callable[[], None]) -> None:
    """Run ``undo`` when ``model`` is unpatched (after the family's own undo; last added runs first)."""
    state = patch_state(model)
    if state is None:
        raise ValueError("model is not patched by hyscale_hf")
    state.undo.append(undo)


def unpatch_model(model: torch.nn.Module) -> torch.nn.Module:
    """Restore a patched model to its exact original behaviour; returns it."""
    target = base_model(model)
    state = patch_state(target)
    if state is None:
        raise ValueError("model is not patched by hyscale_hf")
    for undo in reversed(state.undo):
        undo()
    delattr(target, _STATE_ATTR)
    return model
