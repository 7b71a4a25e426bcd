"""Selection replay: checkpoint recomputation reuses the forward's indices (docs/design.md section 7).

Selections enter the graph only through dispatcher-visible custom ops (``hyscale::hytopk`` for a
full indexer layer, ``hyscale::shared_selection`` (or, under ``torch.compile``, the copying
``hyscale::reuse_indices``) for an IndexShare layer taking its source layer's indices), so a
selective-checkpoint policy can save their outputs and the recompute replays them:
the indexer and its top-k never run in backward, and backward uses exactly the forward's selection.
The same policy keeps the sparse attention's output where it is small (``hyscale::sparse_attention_forward``).

This module is the generic part, usable with any ``torch.utils.checkpoint`` call and free of
Transformers: the ``reuse_indices`` op, the policy, ``ReplayContextFn`` (the ``context_fn`` that
applies it, with verify mode) and the counters. ``replay_context_fn()`` is the way in for your own
non-reentrant ``checkpoint(...)`` calls. The ways in through Transformers' gradient checkpointing
(``enable_selection_replay``, ``wrap_layers_for_replay``) are glue and live in
``hyscale_hf/model_patches/_checkpointing.py``.

``selection_stats()`` counts what ran where; verify mode (``HyScaleConfig.verify_replay``) reruns
each replayed selection and raises ``SelectionReplayMismatch`` if it differs.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _disable_current_modes,
    _get_current_dispatch_mode_stack,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .kernels.sparse_attn.forward_op import kept_by_replay, sparse_attention_forward_op
from .kernels.topk import hytopk_op, selection_counts
from .state import in_backward

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


# The tensors share_selection hands to shared_selection, by slot, for the duration of one call.
_SLOTS: dict[int, torch.Tensor] = {}
_NEXT_SLOT = itertools.count()


@torch.library.custom_op("hyscale::shared_selection", mutates_args=())
def shared_selection(slot: int) -> torch.Tensor:
    """The indices ``share_selection`` put in ``slot``, returned as they are: no copy. They are no input of
    the op (it takes none), so the op may return them, and the replay policy's saved copy of its output is
    then the source's own tensor again: the shared layer's recompute gets its own forward's selection
    without a second copy in memory."""
    _SHARED_RUNS["recompute" if in_backward() else "forward"] += 1
    return _SLOTS[slot]


def share_selection(indices: torch.Tensor) -> torch.Tensor:
    """An IndexShare layer's use of its source layer's ``indices``: through ``shared_selection``, so a
    replaying checkpoint keeps the very tensor the layer attended over, however its holder changes later
    (``reuse_indices`` did that with a copy: one more selection in memory per shared layer). Under
    ``torch.compile`` the copying ``reuse_indices`` (dynamo cannot trace the slot)."""
    if torch.compiler.is_compiling():
        return reuse_indices(indices)
    slot = next(_NEXT_SLOT)
    _SLOTS[slot] = indices
    try:
        return shared_selection(slot)
    finally:
        del _SLOTS[slot]


# ----------------------------------------------------------------------------- policy

SELECTION_OPS = frozenset({hytopk_op._opoverload, reuse_indices._opoverload, shared_selection._opoverload})
_ATTENTION_FORWARD = sparse_attention_forward_op._opoverload


def replay_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective-checkpoint policy: keep the selections, and the sparse attention's output where it is no
    larger than the selection (``kernels/sparse_attn/forward_op.py``: the recompute then skips the
    attention's forward kernels); recompute everything else."""
    if op in SELECTION_OPS or (op is _ATTENTION_FORWARD and kept_by_replay(args, kwargs)):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _recompute_all(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """The policy under an offloading store: the selections are kept by ``_SelectionStore`` instead, and
    the attention's output is recomputed (offloading is for contexts where device memory is short)."""
    return CheckpointPolicy.PREFER_RECOMPUTE


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


class _SelectionStore:
    """The selections of one checkpointed call, kept by hand where selective checkpointing would keep
    them in its own device-side cache: each output tensor goes through ``offload.pack`` (pinned host
    memory, ``hyscale_hf.offload``) in forward and comes back through ``offload.unpack`` in recompute,
    in the order the ops ran."""

    def __init__(self, offload) -> None:
        self.offload = offload
        self.saved: dict = defaultdict(list)

    # The copies run with every dispatch mode off: the selective-checkpoint modes below must not count
    # them among the region's ops (the recompute would then see ops the forward did not run).
    def put(self, func, out) -> None:
        outs = out if isinstance(out, (tuple, list)) else (out,)
        with _disable_current_modes():
            packed = [self.offload.pack(t.detach(), "selection") for t in outs]
        self.saved[func].append((type(out), packed))

    def take(self, func, call: int):
        entries = self.saved.get(func, [])
        if call >= len(entries) or entries[call] is None:
            raise RuntimeError(f"selection replay: recompute ran {func} more often than the forward did")
        kind, packed = entries[call]
        entries[call] = None
        with _disable_current_modes():
            outs = [self.offload.unpack(t) for t in packed]
        return kind(outs) if kind in (tuple, list) else outs[0]


class _OnTopOf(TorchDispatchMode):
    """A dispatch mode entered on top of ``below`` (a selective-checkpoint mode): one context to hand
    ``torch.utils.checkpoint``, the two modes entered and left together."""

    def __init__(self, below: TorchDispatchMode) -> None:
        super().__init__()
        self.below = below

    def __enter__(self):
        self.below.__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self.below.__exit__(None, None, None)
            raise

    def __exit__(self, exc_type, exc_value, traceback):
        try:
            super().__exit__(exc_type, exc_value, traceback)
        finally:
            self.below.__exit__(exc_type, exc_value, traceback)


class _ReplayForwardMode(_OnTopOf):
    """Forward side of the replay context with a ``_SelectionStore``: SAC's caching mode below (which
    keeps nothing: ``_recompute_all``), this mode on top handing each selection's output to the store."""

    def __init__(self, caching_mode: TorchDispatchMode, store: _SelectionStore) -> None:
        super().__init__(caching_mode)
        self.store = store

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in SELECTION_OPS:
            self.store.put(func, out)
        return out


class _ReplayRecomputeMode(_OnTopOf):
    """Recompute side of the replay context: SAC's cache below, this mode on top of it.

    Every selection op first reaches this mode, which takes the saved output from the cache below
    (or from the ``_SelectionStore``, when the selections are offloaded) so the op does not run,
    counts it, and in verify mode also reruns the op with all dispatch modes off and compares the
    indices bit for bit.
    """

    def __init__(self, cached_mode: TorchDispatchMode, layer: str, verify: bool,
                 store: _SelectionStore | None = None, owner: torch.nn.Module | None = None) -> None:
        super().__init__(cached_mode)
        self.layer = layer
        self.verify = verify
        self.store = store
        self.owner = owner
        self.calls: dict = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in SELECTION_OPS:
            return func(*args, **kwargs)
        call = self.calls[func]
        self.calls[func] += 1
        if self.store is not None:
            saved = self.store.take(func, call)
        else:
            saved = func(*args, **kwargs)  # served from the forward's copy by the SAC mode below
        saved_indices = saved[0] if isinstance(saved, (tuple, list)) else saved
        _REPLAY["replayed_selections"] += 1
        _REPLAY["replayed_indices"] += saved_indices.numel()
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
    shared = func in (reuse_indices._opoverload, shared_selection._opoverload)
    what = "IndexShare indices" if shared else "HyTopK selection"
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
    ``HyScaleConfig.verify_replay``). ``offload``, a callable read at each call, returns a
    ``hyscale_hf.offload.HostOffload`` to keep the selections in host memory between forward and
    recompute, or None to leave them in selective checkpointing's device-side cache. ``owner`` is
    the module whose whole forward the region is (a decoder layer), or None: ``recompute_owner()``
    names it inside the recompute.
    """

    def __init__(self, layer: str = "<checkpointed region>", verify: bool | Callable[[], bool] = False,
                 offload: Callable | None = None, owner: torch.nn.Module | None = None) -> None:
        self.layer = layer
        self.verify = verify
        self.offload = offload
        self.owner = owner

    def __call__(self):
        verify = bool(self.verify() if callable(self.verify) else self.verify)
        offload = self.offload() if self.offload is not None else None
        if offload is None:
            forward_mode, cached_mode = create_selective_checkpoint_contexts(replay_policy)
            return forward_mode, _ReplayRecomputeMode(cached_mode, self.layer, verify, owner=self.owner)
        store = _SelectionStore(offload)
        caching_mode, cached_mode = create_selective_checkpoint_contexts(_recompute_all)
        return (_ReplayForwardMode(caching_mode, store),
                _ReplayRecomputeMode(cached_mode, self.layer, verify, store, self.owner))

    def __repr__(self) -> str:
        return f"ReplayContextFn(layer={self.layer!r})"


def replaying() -> bool:
    """True inside the recompute of a checkpoint that replays selections (a ``ReplayContextFn``'s
    recompute mode is on the dispatch stack). A selection op that runs in backward while this is False
    was recomputed by a checkpoint without the replay context (reentrant, or no ``context_fn``)."""
    return any(isinstance(mode, _ReplayRecomputeMode) for mode in _get_current_dispatch_mode_stack())


def recompute_owner() -> torch.nn.Module | None:
    """The module whose forward is being recomputed: the ``owner`` of the innermost replay checkpoint
    in its recompute, None outside one or where the region has no owner. The recompute's output is
    dropped (non-reentrant checkpointing keeps only what the forward saved), so a module that knows
    its output reaches nothing but the owner's output may skip computing it there. None while
    torch.compile traces: a compiled region's recompute is the compiler's graph, not this eager one."""
    if torch.compiler.is_compiling():
        return None
    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, _ReplayRecomputeMode):
            return mode.owner
    return None


def in_replay_checkpoint() -> bool:
    """True inside a checkpointed region with the replay context, in its forward or its recompute: what
    the region saves there lives only until its backward (recomputed regions), not from forward on."""
    for mode in _get_current_dispatch_mode_stack():
        if isinstance(mode, (_ReplayForwardMode, _ReplayRecomputeMode)):
            return True
        if getattr(mode, "policy_fn", None) is replay_policy:  # SAC's caching mode of the plain forward
            return True
    return False


def placeholder_indices(batch: int, queries: int, device) -> torch.Tensor:
    """An empty int32 ``[batch, queries, 0]`` for ``share_selection`` in a replaying recompute whose source
    selection is gone (the replay returns the forward's selection whatever the op is given). Made with the
    dispatch modes off: selective checkpointing refuses ops in a recompute that its forward did not run."""
    with _disable_current_modes():
        return torch.empty(batch, queries, 0, dtype=torch.int32, device=device)


def replay_context_fn(layer: str = "<checkpointed region>", verify: bool = False) -> ReplayContextFn:
    """The ``context_fn`` for your own checkpoint calls::

        torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False,
                                          context_fn=hyscale_hf.replay_context_fn("block 3"))
    """
    return ReplayContextFn(layer, verify)
