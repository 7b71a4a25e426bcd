"""Selection replay through Transformers' gradient checkpointing (docs/design.md section 7).

The generic replay (policy, ``ReplayContextFn``, verify mode, counters) is ``hyscale_hf.replay``;
this module puts its ``context_fn`` where Transformers and accelerate checkpoint layers. It knows
Transformers internals (``_gradient_checkpointing_func`` on each checkpointed layer, which of
``activation_checkpointing_enable`` / ``gradient_checkpointing_enable`` a version routes through,
the ``gradient_checkpointing`` flag of decoder layers, ``config.use_cache``), so it lives with the
families. Two ways in, both non-reentrant ``torch.utils.checkpoint`` with
``context_fn=ReplayContextFn(...)``:

- ``enable_selection_replay(model)`` (``patch_model`` calls it when ``selection_replay=True``):
  Transformers' own gradient checkpointing (``model.gradient_checkpointing_enable(...)``,
  ``activation_checkpointing_enable(...)``, the Trainer's ``gradient_checkpointing`` /
  ``activation_checkpointing`` arguments) gets the replay policy on every checkpointed layer.
- ``wrap_layers_for_replay(model)``: for stacks that checkpoint layers themselves (accelerate FSDP2
  with ``fsdp_activation_checkpointing: false``): wraps the decoder layers in ``checkpoint_wrapper``.

Reentrant checkpointing cannot take a ``context_fn`` and would silently rerun the indexer, so it is
refused with a ``ValueError``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch

from ..offload import model_offload, offload_context
from ..replay import ReplayContextFn
from ..state import add_undo, base_model, patch_state

_REENTRANT_MESSAGE = (
    "hyscale_hf selection replay needs non-reentrant checkpointing (use_reentrant=False): reentrant "
    "checkpointing cannot take a selective-checkpoint context, so it would silently rerun the indexer "
    "and its top-k in backward. Drop use_reentrant=True from the checkpointing kwargs, or patch with "
    "selection_replay=False to recompute the selection instead."
)
_HANDLE_ATTR = "_hyscale_replay"


class _Missing:
    """'No instance attribute was there' (survives deepcopy as itself)."""

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


_MISSING = _Missing()
# Entry points and the name of their checkpoint-kwargs argument (5.17: gradient_checkpointing_enable
# only; 5.23+: activation_checkpointing_enable, with gradient_checkpointing_enable a deprecated alias).
_ENTRY_KWARG = {
    "activation_checkpointing_enable": "activation_checkpointing_kwargs",
    "gradient_checkpointing_enable": "gradient_checkpointing_kwargs",
}


class _ReplayCheckpointFunc:
    """A layer's ``_gradient_checkpointing_func`` with the replay context added (``inner`` is the
    function Transformers set, kept for undo; it still applies Transformers' offload and the user's
    kwargs), and ``HyScaleConfig.offload_activations``' hooks around it (``offload()`` gives them)."""

    def __init__(self, inner: Callable, context_fn: ReplayContextFn, offload: Callable | None = None) -> None:
        self.inner = inner
        self.context_fn = context_fn
        self.offload = offload

    def __call__(self, function, *args, **kwargs):
        kwargs = {**kwargs, "use_reentrant": False, "context_fn": self.context_fn}
        with offload_context(self.offload() if self.offload is not None else None):
            return self.inner(function, *args, **kwargs)


class _OffloadSwitch:
    """The patched model's ``HostOffload`` while its live config asks for offload (read per call)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __call__(self):
        return model_offload(patch_state(self.model))


class _OffloadingCheckpoint:
    """``torch.utils.checkpoint.checkpoint`` under the offload hooks, for ``checkpoint_wrapper``."""

    def __init__(self, offload: _OffloadSwitch) -> None:
        self.offload = offload

    def __call__(self, function, *args, **kwargs):
        with offload_context(self.offload()):
            return torch.utils.checkpoint.checkpoint(function, *args, **kwargs)


def _checked_checkpoint_kwargs(kwargs: dict | None) -> dict:
    """The user's checkpoint kwargs with ``use_reentrant=False``; refuses reentrant / a foreign context_fn."""
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"checkpointing kwargs must be a dict or None, got {type(kwargs).__name__}")
    kwargs = dict(kwargs or {})
    if kwargs.get("use_reentrant"):
        raise ValueError(_REENTRANT_MESSAGE)
    context_fn = kwargs.pop("context_fn", None)
    if context_fn is not None and not isinstance(context_fn, ReplayContextFn):
        raise ValueError(
            "checkpointing kwargs carry their own context_fn, but hyscale_hf selection replay supplies "
            "the context_fn; patch with selection_replay=False to use your own."
        )
    kwargs["use_reentrant"] = False
    return kwargs


def _why_not_replayable(func) -> str | None:
    """Why a layer's checkpoint function cannot take the replay context (None if it can)."""
    if isinstance(func, _ReplayCheckpointFunc):
        func = func.inner
    if isinstance(func, functools.partial):
        keywords = func.keywords
        if keywords.get("use_reentrant"):
            return _REENTRANT_MESSAGE
        context_fn = keywords.get("context_fn")
        if context_fn is not None and not isinstance(context_fn, ReplayContextFn):
            return "its checkpoint function already carries a context_fn of its own"
        return None
    if func is torch.utils.checkpoint.checkpoint:
        return None
    return f"its checkpoint function {func!r} is not torch.utils.checkpoint.checkpoint"


def _checkpointed_modules(model: torch.nn.Module):
    """(name, module, active) for every module Transformers gave a checkpoint function."""
    for name, module in model.named_modules():
        func = module.__dict__.get("_gradient_checkpointing_func")
        if func is not None:
            yield name or "<model>", module, bool(getattr(module, "gradient_checkpointing", False))


def _install_policy(model: torch.nn.Module, verify: Callable[[], bool]) -> None:
    """Give every checkpointed layer the replay context (refusing, before any change, an active
    layer whose checkpointing cannot take it)."""
    found = list(_checkpointed_modules(model))
    for name, module, active in found:
        problem = _why_not_replayable(module._gradient_checkpointing_func)
        if active and problem:
            raise ValueError(f"cannot enable selection replay on {name}: {problem}")
    for name, module, _ in found:
        func = module._gradient_checkpointing_func
        if _why_not_replayable(func):
            continue  # inactive and not replayable: never called
        inner = func.inner if isinstance(func, _ReplayCheckpointFunc) else func
        offload = _OffloadSwitch(model)
        module._gradient_checkpointing_func = _ReplayCheckpointFunc(inner, ReplayContextFn(name, verify, offload, module),
                                                                    offload)


def _remove_policy(model: torch.nn.Module) -> None:
    for _, module, _ in list(_checkpointed_modules(model)):
        func = module._gradient_checkpointing_func
        if isinstance(func, _ReplayCheckpointFunc):
            module._gradient_checkpointing_func = func.inner


def _entry_points(model: torch.nn.Module) -> list[str]:
    """The checkpointing entry points to wrap so that every public path reaches a wrapper once.

    With ``activation_checkpointing_enable`` (5.23+) the deprecated ``gradient_checkpointing_enable``
    routes through it, so only it is wrapped (wrapping both would make the new API call the
    deprecated one and warn) -- unless a subclass overrides ``gradient_checkpointing_enable``.
    """
    cls = type(model)
    if callable(getattr(model, "activation_checkpointing_enable", None)):
        names = ["activation_checkpointing_enable"]
        owner = {n: next((c for c in cls.__mro__ if n in c.__dict__), None) for n in _ENTRY_KWARG}
        if owner["gradient_checkpointing_enable"] is not None and owner["activation_checkpointing_enable"] in (
            owner["gradient_checkpointing_enable"].__mro__[1:]
        ):
            names.append("gradient_checkpointing_enable")
        return names
    if callable(getattr(model, "gradient_checkpointing_enable", None)):
        return ["gradient_checkpointing_enable"]
    return []


# What enable_selection_replay leaves on a model is held in objects, not closures: deepcopy of a
# patched model (e.g. a frozen reference model) then yields an independent model whose wrappers,
# verify switch and undo refer to the copy, never to the original.


class _EnableWithReplay:
    """``owner.<name>`` replaced: injects non-reentrant kwargs, calls the entry point it replaces,
    then installs the policy on all of ``model`` (``owner`` is ``model`` or a Transformers model
    nested in it, e.g. ``model.model``)."""

    def __init__(self, owner: torch.nn.Module, name: str, model: torch.nn.Module, verify, previous) -> None:
        self.owner, self.name, self.model, self.verify, self.previous = owner, name, model, verify, previous
        original = self._original()
        self.__doc__ = original.__doc__
        self.__signature__ = inspect.signature(original)  # PEFT inspects the entry point's parameters

    def _original(self):
        if self.previous is not _MISSING:
            return self.previous
        return getattr(type(self.owner), self.name).__get__(self.owner)

    def __call__(self, *args, **kwargs):
        if args:
            args = (_checked_checkpoint_kwargs(args[0]), *args[1:])
        else:
            key = next((k for k in _ENTRY_KWARG.values() if k in kwargs), _ENTRY_KWARG[self.name])
            kwargs[key] = _checked_checkpoint_kwargs(kwargs.get(key))
        result = self._original()(*args, **kwargs)
        _install_policy(self.model, self.verify)
        return result


class _VerifySwitch:
    """Verify mode as read at each checkpoint call: fixed, or the patched model's live config."""

    def __init__(self, model: torch.nn.Module, verify: bool | None) -> None:
        self.model, self.verify = model, verify

    def __call__(self) -> bool:
        if self.verify is not None:
            return bool(self.verify)
        state = patch_state(self.model)
        return bool(state is not None and state.config.verify_replay)


class _UndoReplay:
    """Undo of enable_selection_replay (run by unpatch_model; a second run does nothing)."""

    def __init__(self, model: torch.nn.Module, entries: list) -> None:
        self.model, self.entries = model, entries

    def __call__(self) -> None:
        if self.model.__dict__.get(_HANDLE_ATTR) is not self:
            return
        for owner, name, value in self.entries:
            if value is _MISSING:
                owner.__dict__.pop(name, None)
            else:
                setattr(owner, name, value)
        _remove_policy(self.model)
        del self.model.__dict__[_HANDLE_ATTR]


def enable_selection_replay(model: torch.nn.Module, *, verify: bool | None = None) -> Callable[[], None]:
    """Make gradient checkpointing on ``model`` replay the forward's selections.

    Wraps the instance's checkpointing entry point (``gradient_checkpointing_enable`` on
    Transformers 5.17, ``activation_checkpointing_enable`` on 5.23+, which the deprecated name and
    the Trainer both go through) so every later enable runs non-reentrant checkpointing with
    ``ReplayContextFn`` (``every_n_layers``, ``offload`` and other kwargs pass through); if
    checkpointing is already on, the checkpointed layers get the policy now. ``use_reentrant=True``
    and a ``context_fn`` of your own raise ``ValueError``.

    Args:
        model: a Transformers model (PEFT wrappers looked through). ``patch_model`` calls this when
            ``HyScaleConfig.selection_replay`` is True and ``unpatch_model`` undoes it.
        verify: verify mode (rerun each replayed selection in recompute and raise
            ``SelectionReplayMismatch`` if it differs). ``None``: the patched model's live
            ``HyScaleConfig.verify_replay`` (off for an unpatched model).

    Returns:
        A function undoing it (idempotent: a second enable returns the first one's undo).
    """
    target = base_model(model)
    existing = target.__dict__.get(_HANDLE_ATTR)
    if existing is not None:
        return existing
    verify_fn = _VerifySwitch(target, verify)
    if not _entry_points(target):
        raise TypeError(
            f"{type(target).__name__} has no gradient_checkpointing_enable / activation_checkpointing_enable; "
            "use hyscale_hf.wrap_layers_for_replay(model) or pass hyscale_hf.replay_context_fn() to your own "
            "torch.utils.checkpoint.checkpoint calls"
        )
    _install_policy(target, verify_fn)  # checkpointing already on (refuses reentrant before any change)
    # The model and every Transformers model inside it (model.model, ...): enabling any of them
    # must install the policy.
    owners = [(m, _entry_points(m)) for m in target.modules()]
    previous = [(m, name, m.__dict__.get(name, _MISSING)) for m, names in owners for name in names]
    for owner, name, value in previous:
        setattr(owner, name, _EnableWithReplay(owner, name, target, verify_fn, value))
    undo = _UndoReplay(target, previous)
    target.__dict__[_HANDLE_ATTR] = undo
    if patch_state(target) is not None:
        add_undo(target, undo)
    return undo


# ----------------------------------------------------------------------------- layers checkpointed by hand


class _UnwrapLayers:
    """Undo of wrap_layers_for_replay: puts the original layers and ``config.use_cache`` back
    (an object, for deepcopy)."""

    def __init__(self, layers: list, config=None, use_cache=None) -> None:
        self.layers = layers
        self.config, self.use_cache = config, use_cache

    def __call__(self) -> None:
        for parent, child_name, child in self.layers:
            setattr(parent, child_name, child)
        if self.config is not None:
            self.config.use_cache = self.use_cache


def _default_layer_filter(module: torch.nn.Module) -> bool:
    # Transformers' decoder layers (GradientCheckpointingLayer) carry a gradient_checkpointing flag.
    return hasattr(module, "gradient_checkpointing")


def wrap_layers_for_replay(
    model: torch.nn.Module,
    *,
    layer_filter: Callable[[torch.nn.Module], bool] | None = None,
    preserve_rng_state: bool = True,
    verify: bool | None = None,
) -> Callable[[], None]:
    """Checkpoint the decoder layers with ``checkpoint_wrapper`` and the replay context.

    For stacks that checkpoint layers themselves instead of through Transformers, e.g. accelerate
    FSDP2: call this **before** ``accelerator.prepare`` (or before building the Trainer) and set
    ``fsdp_activation_checkpointing: false`` in the accelerate config -- accelerate's own activation
    checkpointing wraps layers without a ``context_fn`` and would rerun the indexer in backward.
    Leave Transformers' gradient checkpointing off as well (this refuses to double-checkpoint).
    accelerate's FSDP2 wrap policy looks through ``CheckpointWrapper``, so the layers still get
    their own FSDP groups. Example (accelerate config: ``fsdp_version: 2``,
    ``fsdp_activation_checkpointing: false``)::

        model = hyscale_hf.patch_model(AutoModelForCausalLM.from_pretrained(name))
        hyscale_hf.wrap_layers_for_replay(model)
        model, optimizer = accelerator.prepare(model, optimizer)

    Args:
        model: the model (PEFT wrappers looked through).
        layer_filter: which children of ``nn.ModuleList``s to wrap; default: Transformers decoder
            layers (modules with a ``gradient_checkpointing`` attribute).
        preserve_rng_state: passed to ``torch.utils.checkpoint`` (accelerate passes False; True
            keeps dropout identical in recompute).
        verify: as in ``enable_selection_replay``.

    Returns:
        A function restoring the unwrapped layers (also run by ``unpatch_model``). While wrapped,
        ``model.config.use_cache`` is False (recomputed layers must not append to a KV cache).
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        CheckpointWrapper,
        checkpoint_wrapper,
    )

    target = base_model(model)
    if any(active for _, _, active in _checkpointed_modules(target)):
        raise ValueError(
            "Transformers gradient checkpointing is on for this model; wrap_layers_for_replay would "
            "checkpoint the layers twice. Call model.gradient_checkpointing_disable() first, or use "
            "enable_selection_replay with Transformers' checkpointing instead."
        )
    keep = layer_filter or _default_layer_filter
    verify_fn = _VerifySwitch(target, verify)
    chosen, already_wrapped = [], 0
    for parent_name, parent in target.named_modules():
        if not isinstance(parent, torch.nn.ModuleList):
            continue
        for child_name, child in parent.named_children():
            fqn = f"{parent_name}.{child_name}" if parent_name else child_name
            if isinstance(child, CheckpointWrapper):
                if isinstance(child.checkpoint_fn.keywords.get("context_fn"), ReplayContextFn):
                    already_wrapped += 1
                    continue
                raise ValueError(
                    f"{fqn} is already wrapped by checkpoint_wrapper without the replay context (accelerate's "
                    "fsdp_activation_checkpointing?); set fsdp_activation_checkpointing: false"
                )
            if keep(child):
                chosen.append((parent, child_name, fqn, child))
    if not chosen and already_wrapped:
        return _UnwrapLayers([])  # wrapped before: its undo is the one to run
    if not chosen:
        raise ValueError("wrap_layers_for_replay found no decoder layers to wrap; pass layer_filter=...")
    for parent, child_name, fqn, child in chosen:
        wrapped = checkpoint_wrapper(
            child,
            checkpoint_impl=CheckpointImpl.NO_REENTRANT,
            checkpoint_fn=_OffloadingCheckpoint(_OffloadSwitch(target)),
            use_reentrant=False,
            preserve_rng_state=preserve_rng_state,
            context_fn=ReplayContextFn(fqn, verify_fn, _OffloadSwitch(target), child),
        )
        setattr(parent, child_name, wrapped)

    # A KV cache would be appended to again by the recomputed layers (Transformers' own checkpointing
    # turns it off for the same reason); training needs none.
    config = getattr(target, "config", None)
    use_cache = getattr(config, "use_cache", None)
    if use_cache:
        config.use_cache = False
    undo = _UnwrapLayers([(parent, child_name, child) for parent, child_name, _, child in chosen],
                         config if use_cache else None, use_cache)
    if patch_state(target) is not None:
        add_undo(target, undo)
    return undo
