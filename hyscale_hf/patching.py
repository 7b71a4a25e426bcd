"""patch_model / unpatch_model and the registry of model families.

Families live in ``hyscale_hf/model_patches`` (one file each, the only code that knows
Transformers internals) and register themselves here with ``register_family``. An apply function
patches one model *instance* in place and returns an undo function that restores it exactly.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
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
    since the last ``pop_indexer_loss`` (for logging); ``pending_losses`` holds the losses of the
current forward that wait to be joined to its output (``indexer.attach_indexer_loss``).
``base_frozen`` is set while only the indexer trains (the callback's dense warm-up): forwards then
build no autograd graph outside the indexer (``indexer.before_forward``). ``selection_probe`` is set only while
    ``hyscale_hf.training`` samples top-k recall; patched modules report to it through
    ``hyscale_hf.training.observe_selection`` (a no-op while it is None).
    """

    config: HyScaleConfig
    family: ModelFamily
    undo: list[Callable[[], None]] = field(default_factory=list)
    indexer_losses: list[torch.Tensor] = field(default_factory=list)
    pending_losses: list[torch.Tensor] = field(default_factory=list)
    base_frozen: bool = False
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
# The model config attribute that carries the HyScaleConfig into config.json, so that
# ``from_pretrained(saved)`` + ``patch_model(model)`` patches the reload alike.
CONFIG_RECORD = "hyscale_config"


class LiveRecord(dict):
    """A record that a live patch wrote into a model config, as opposed to one read from config.json.

    Configs are shared objects (several models built from one config, a config kept by a test,
    ``copy.deepcopy(config)`` inside ``from_config``): a patch must tell its own records, and other
    live patches' or their in-memory copies', from a saved checkpoint's, which load back from JSON
    as plain dicts. With ``snapshot``, the record shows ``snapshot()``'s values whenever it is
    deep-copied (what ``PretrainedConfig.to_dict`` and so ``save_pretrained`` do), so a save writes the
    options as they are when saved, not as they were when patched.
    """

    def __init__(self, values: dict, snapshot: Callable[[], dict] | None = None) -> None:
        super().__init__(values)
        self._snapshot = snapshot

    def __deepcopy__(self, memo) -> LiveRecord:
        return LiveRecord(copy.deepcopy(self._snapshot() if self._snapshot is not None else dict(self), memo))


def saved_record(model_config, name: str) -> dict | None:
    """The record ``name`` of ``model_config`` if it was loaded with the config, else None (absent,
    or written by a live patch of this or another model)."""
    record = model_config.__dict__.get(name)
    return None if record is None or isinstance(record, LiveRecord) else record


class _Absent:
    """Marks a config attribute that did not exist (a class: deepcopy keeps its identity)."""


class RestoreRecord:
    """Undo of ``set_record``. A callable object rather than a closure, so that a deep copy of a
    patched model gets an undo that restores the copy's config."""

    def __init__(self, model_config, name: str) -> None:
        self.model_config, self.name = model_config, name
        self.previous = model_config.__dict__.get(name, _Absent)

    def __call__(self) -> None:
        if self.previous is _Absent:
            self.model_config.__dict__.pop(self.name, None)
        else:
            setattr(self.model_config, self.name, self.previous)


def set_record(model_config, name: str, record: LiveRecord) -> RestoreRecord:
    """Write ``record`` into ``model_config``; returns the undo that restores what was there."""
    undo = RestoreRecord(model_config, name)
    setattr(model_config, name, record)
    return undo


class _ConfigSnapshot:
    """``dataclasses.asdict`` of a patch's live config (an object, not a lambda: see RestoreRecord)."""

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


def supported_model_types() -> list[str]:
    """``config.model_type`` values ``patch_model`` accepts with the installed Transformers."""
    return sorted(_FAMILIES)


def family_of(model_type: str) -> ModelFamily:
    if model_type not in _FAMILIES:
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

    ``config`` with ``overrides`` applied (``topk=...`` etc.). Without ``config``: the options a
    saved patched model was saved with (``model.config.hyscale_config``, written to config.json by
    ``save_pretrained``), else ``HyScaleConfig()``. Raises ``ValueError`` for an unsupported model type (listing the supported ones) or a model
    that is already patched.
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
    state = PatchState(config=cfg, family=family)
    undo = family.apply(target, state)
    state.undo.append(undo)
    setattr(target, _STATE_ATTR, state)
    state.undo.append(set_record(model_config, CONFIG_RECORD, LiveRecord({}, _ConfigSnapshot(state))))
    _install_loss_sink(target, state)
    if cfg.selection_replay:
        from .replay import enable_selection_replay  # replay imports this module

        try:
            enable_selection_replay(target)
        except Exception:
            unpatch_model(target)
            raise
    return model


class _LossSinkHooks:
    """Forward pre-hook and hook of a patched root for ``indexer.before_forward`` / ``sink_pending_losses``
    (an object holding the state, so that a deep copy of the model hooks the copy's state)."""

    def __init__(self, state: PatchState) -> None:
        self.state = state

    def before(self, module, args, kwargs):
        from .indexer import before_forward

        return before_forward(self.state, module, args, kwargs)

    def after(self, module, args, output):
        from .indexer import sink_pending_losses

        return sink_pending_losses(self.state, output)


def _install_loss_sink(model: torch.nn.Module, state: PatchState) -> None:
    """Hooks on the patched root that join a frozen base's indexer losses to its output
    (``indexer.attach_indexer_loss``): cleared before each forward, joined after it."""
    hooks = _LossSinkHooks(state)
    handles = [model.register_forward_pre_hook(hooks.before, with_kwargs=True), model.register_forward_hook(hooks.after)]
    state.undo.append(_RemoveHooks(model, handles))


class _RemoveHooks:
    """Removes forward hooks by id. ``RemovableHandle`` holds a weak reference to the original
    module's hook dict, so after ``copy.deepcopy`` of a patched model it would unhook the original."""

    _DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
              "_forward_hooks_always_called")

    def __init__(self, module: torch.nn.Module, handles) -> None:
        self.module, self.ids = module, [h.id for h in handles]

    def __call__(self) -> None:
        for name in self._DICTS:
            hooks = getattr(self.module, name, {})
            for hook_id in self.ids:
                hooks.pop(hook_id, None)


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
