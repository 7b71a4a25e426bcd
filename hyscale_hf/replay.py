"""Selection replay: checkpoint recomputation reuses the forward's indices (DESIGN section 7).

Selections enter the graph only through dispatcher-visible custom ops (``hyscale::hytopk`` for a
full indexer layer, ``hyscale::reuse_indices`` for an IndexShare layer taking its source layer's
indices), so a selective-checkpoint policy can save their outputs and the recompute replays them:
the indexer and its top-k never run in backward, and backward uses exactly the forward's selection.

Three ways in, all non-reentrant ``torch.utils.checkpoint`` with ``context_fn=ReplayContextFn(...)``:

- ``enable_selection_replay(model)`` (``patch_model`` calls it when ``selection_replay=True``):
  Transformers' own gradient checkpointing (``model.gradient_checkpointing_enable(...)``,
  ``activation_checkpointing_enable(...)``, the Trainer's ``gradient_checkpointing`` /
  ``activation_checkpointing`` arguments) gets the replay policy on every checkpointed layer.
- ``wrap_layers_for_replay(model)``: for stacks that checkpoint layers themselves (accelerate FSDP2
  with ``fsdp_activation_checkpointing: false``): wraps the decoder layers in ``checkpoint_wrapper``.
- ``replay_context_fn()``: the ``context_fn`` for your own ``checkpoint(...)`` calls.

Reentrant checkpointing cannot take a ``context_fn`` and would silently rerun the indexer, so it is
refused with a ``ValueError``. ``selection_stats()`` counts what ran where; verify mode
(``HyScaleConfig.verify_replay``) reruns each replayed selection and raises if it differs.
"""

from __future__ import annotations

import functools
import inspect
from collections import defaultdict
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .indexer import in_backward
from .kernels.topk import hytopk_op, selection_counts
from .patching import add_undo, base_model, patch_state

# ----------------------------------------------------------------------------- IndexShare op

_SHARED_RUNS = {"forward": 0, "recompute": 0}


@torch.library.custom_op("hyscale::reuse_indices", mutates_args=())
def reuse_indices(indices: torch.Tensor) -> torch.Tensor:
    """An IndexShare layer's copy of its source layer's indices.

    Saved by the replay policy, so a recomputed shared layer uses exactly the indices of *its own*
    forward invocation even if the holder it read them from was overwritten since.
    """
    _SHARED_RUNS["recompute" if in_backward() else "forward"] += 1
    return indices.clone()


@reuse_indices.register_fake
def _(indices):
    return torch.empty_like(indices)


# ----------------------------------------------------------------------------- policy

SELECTION_OPS = frozenset({hytopk_op._opoverload, reuse_indices._opoverload})


def replay_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective-checkpoint policy: keep the selections, recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if op in SELECTION_OPS else CheckpointPolicy.PREFER_RECOMPUTE


# ----------------------------------------------------------------------------- counters

_REPLAY = {"replayed_selections": 0, "replayed_indices": 0, "verified_selections": 0}


def selection_stats() -> dict[str, int]:
    """Process-wide counts since the last ``reset_selection_stats()``.

    - ``indexer_forward`` / ``indexer_recompute``: runs of the HyTopK selection op outside / inside
      autograd's backward (inside = checkpoint recompute; verify mode's reruns count here too).
    - ``shared_forward`` / ``shared_recompute``: the same for IndexShare layers' ``reuse_indices``.
    - ``replayed_selections``: selections a recompute took from the forward's saved copy instead of
      running the op; ``replayed_indices``: the number of index entries in them.
    - ``verified_selections``: replayed selections that verify mode recomputed and compared.
    """
    return {
        "indexer_forward": selection_counts.RUNS["forward"],
        "indexer_recompute": selection_counts.RUNS["recompute"],
        "shared_forward": _SHARED_RUNS["forward"],
        "shared_recompute": _SHARED_RUNS["recompute"],
        **_REPLAY,
    }


def reset_selection_stats() -> None:
    selection_counts.reset()
    for counts in (_SHARED_RUNS, _REPLAY):
        for key in counts:
            counts[key] = 0


# ----------------------------------------------------------------------------- context_fn


class SelectionReplayMismatch(RuntimeError):
    """Verify mode: a recomputed selection differs from the one saved in forward."""


class _ReplayRecomputeMode(TorchDispatchMode):
    """Recompute side of the replay context: SAC's cache below, this mode on top of it.

    Every selection op first reaches this mode, which asks the cache below for the saved output
    (so the op does not run), counts it, and in verify mode also reruns the op with all dispatch
    modes off and compares the indices bit for bit.
    """

    def __init__(self, cached_mode: TorchDispatchMode, layer: str, verify: bool) -> None:
        super().__init__()
        self.cached_mode = cached_mode
        self.layer = layer
        self.verify = verify
        self.calls: dict = defaultdict(int)

    def __enter__(self):
        self.cached_mode.__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self.cached_mode.__exit__(None, None, None)
            raise

    def __exit__(self, exc_type, exc_value, traceback):
        try:
            super().__exit__(exc_type, exc_value, traceback)
        finally:
            self.cached_mode.__exit__(exc_type, exc_value, traceback)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in SELECTION_OPS:
            return func(*args, **kwargs)
        saved = func(*args, **kwargs)  # served from the forward's copy by the SAC mode below
        saved_indices = saved[0] if isinstance(saved, (tuple, list)) else saved
        _REPLAY["replayed_selections"] += 1
        _REPLAY["replayed_indices"] += saved_indices.numel()
        call = self.calls[func]
        self.calls[func] += 1
        if self.verify:
            with _disable_current_modes():  # a real rerun, and a comparison the SAC cache must not see
                fresh = func(*args, **kwargs)
                fresh_indices = fresh[0] if isinstance(fresh, (tuple, list)) else fresh
                _REPLAY["verified_selections"] += 1
                _check_same_selection(saved_indices, fresh_indices, func, call, self.layer)
        return saved


def _check_same_selection(saved: torch.Tensor, fresh: torch.Tensor, func, call: int, layer: str) -> None:
    if saved.shape == fresh.shape and saved.dtype == fresh.dtype and torch.equal(saved, fresh):
        return
    shared = func is reuse_indices._opoverload
    what = "IndexShare indices (reuse_indices)" if shared else "HyTopK selection"
    if saved.shape != fresh.shape or saved.dtype != fresh.dtype:
        detail = f"saved {tuple(saved.shape)} {saved.dtype}, recomputed {tuple(fresh.shape)} {fresh.dtype}"
    else:
        differ = saved != fresh
        first = [int(i) for i in differ.nonzero()[0].tolist()]
        detail = f"{int(differ.sum())} of {saved.numel()} indices differ, first at position {first}"
    cause = (
        "the shared layer read its source layer's indices from state that changed since its forward "
        "call (a holder shared between forward invocations?)"
        if shared
        else "the indexer's inputs or weights changed between forward and backward, or the "
        "selection is not deterministic"
    )
    raise SelectionReplayMismatch(
        f"selection replay verify: the recomputed {what} (call {call} in checkpointed layer "
        f"{layer!r}) differs bit for bit from the one saved in forward: {detail}. Likely cause: {cause}. "
        "Training with replay uses the saved selection; without replay this backward would have "
        "used a different one."
    )


class ReplayContextFn:
    """``context_fn`` for non-reentrant ``torch.utils.checkpoint``: replay the selections.

    ``layer`` names the checkpointed region in verify-mode errors. ``verify`` is a bool or a
    callable read at each checkpoint call (patched models read their live
    ``HyScaleConfig.verify_replay``).
    """

    def __init__(self, layer: str = "<checkpointed region>", verify: bool | Callable[[], bool] = False) -> None:
        self.layer = layer
        self.verify = verify

    def __call__(self):
        forward_mode, cached_mode = create_selective_checkpoint_contexts(replay_policy)
        verify = bool(self.verify() if callable(self.verify) else self.verify)
        return forward_mode, _ReplayRecomputeMode(cached_mode, self.layer, verify)

    def __repr__(self) -> str:
        return f"ReplayContextFn(layer={self.layer!r})"


def replay_context_fn(layer: str = "<checkpointed region>", verify: bool = False) -> ReplayContextFn:
    """The ``context_fn`` for your own checkpoint calls::

        torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False,
                                          context_fn=hyscale_hf.replay_context_fn("block 3"))
    """
    return ReplayContextFn(layer, verify)


# ----------------------------------------------------------------------------- Transformers checkpointing

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
    function Transformers set, kept for undo; it still applies offload and the user's kwargs)."""

    def __init__(self, inner: Callable, context_fn: ReplayContextFn) -> None:
        self.inner = inner
        self.context_fn = context_fn

    def __call__(self, function, *args, **kwargs):
        kwargs = {**kwargs, "use_reentrant": False, "context_fn": self.context_fn}
        return self.inner(function, *args, **kwargs)


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
        module._gradient_checkpointing_func = _ReplayCheckpointFunc(inner, ReplayContextFn(name, verify))


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
            preserve_rng_state=preserve_rng_state,
            context_fn=ReplayContextFn(fqn, verify_fn),
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
