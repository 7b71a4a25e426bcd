"""Selection replay: checkpoint recomputation reuses the forward's indices (docs/design.md section 7).

Selections enter the graph only through custom ops (``hyscale::hytopk`` for a full indexer layer,
``hyscale::shared_selection`` (or, under ``torch.compile``, the copying ``hyscale::reuse_indices``) for an
IndexShare layer taking its source layer's indices), which their callers run through
``kernels.kept_ops.kept_call``. Inside a checkpointed region with the replay context (``ReplayContextFn``)
that call goes through the region (``_Region``): the forward keeps the outputs, the recompute takes them
back instead of running the op, so the indexer and its top-k never run in backward and backward uses
exactly the forward's selection. The region keeps the sparse attention's output too where it is small
(``hyscale::sparse_attention_forward``). Every other op runs as under a plain checkpoint (no dispatch
mode); under ``torch.compile`` the context is selective checkpointing's with ``replay_policy``.

This module is the generic part, usable with any ``torch.utils.checkpoint`` call and free of
Transformers: the ``reuse_indices`` op, the region, ``ReplayContextFn`` (the ``context_fn``, with verify
mode and the offload of the selections), the policy for compiled regions and the counters.
``replay_context_fn()`` is the way in for your own non-reentrant ``checkpoint(...)`` calls. The ways in
through Transformers' gradient checkpointing (``enable_selection_replay``, ``wrap_layers_for_replay``) are
glue and live in ``hyscale_hf/model_patches/_checkpointing.py``.

``selection_stats()`` counts what ran where; verify mode (``HyScaleConfig.verify_replay``) reruns
each replayed selection and raises ``SelectionReplayMismatch`` if it differs.
"""

from __future__ import annotations

import itertools
import threading
from collections import defaultdict
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .kernels import kept_ops as _kept_ops
from .kernels.sparse_attn.forward_op import kept_by_replay, sparse_attention_forward_op
from .kernels.topk import hytopk_op, selection_counts
from .state import in_backward

# ----------------------------------------------------------------------------- IndexShare op

_SHARED_RUNS = {"forward": 0, "recompute": 0}


@torch.library.custom_op("hyscale::reuse_indices", mutates_args=())
def reuse_indices_op(indices: torch.Tensor) -> torch.Tensor:
    """The op of ``reuse_indices``: a copy of ``indices``."""
    _SHARED_RUNS["recompute" if in_backward() else "forward"] += 1
    return indices.clone()


@reuse_indices_op.register_fake
def _(indices):
    return torch.empty_like(indices)


def reuse_indices(indices: torch.Tensor) -> torch.Tensor:
    """An IndexShare layer's copy of its source layer's indices.

    Saved by the replay policy, so a recomputed shared layer uses exactly the indices of *its own*
    forward invocation even if the holder it read them from was overwritten since.
    """
    return kept_call(reuse_indices_op, indices)


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
        return kept_call(shared_selection, slot)
    finally:
        del _SLOTS[slot]


# ----------------------------------------------------------------------------- policy

SELECTION_OPS = frozenset({hytopk_op._opoverload, reuse_indices_op._opoverload, shared_selection._opoverload})
_ATTENTION_FORWARD = sparse_attention_forward_op._opoverload


def replay_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective-checkpoint policy of a region ``torch.compile`` traces (eager regions keep the same ops
    through ``_Region``): keep the selections, and the sparse attention's output where it is no larger than
    the selection (``kernels/sparse_attn/forward_op.py``: the recompute then skips the attention's forward
    kernels); recompute everything else."""
    if op in SELECTION_OPS or (op is _ATTENTION_FORWARD and kept_by_replay(args, kwargs)):
        return CheckpointPolicy.MUST_SAVE
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


class _Region:
    """The kept outputs of one replaying checkpoint call: its forward runs each kept op and keeps its output
    (``keep``), its recompute takes them back in the order the ops ran (``take``), per op. Selections are
    always kept (through ``offload.pack`` into pinned host memory when an offload is on); the attention's
    output where its call says so (``kept_by_replay``), and not under an offload (offloading is for
    contexts where device memory is short)."""

    def __init__(self, layer: str, verify: bool, offload, owner: torch.nn.Module | None) -> None:
        self.layer, self.verify, self.offload, self.owner = layer, verify, offload, owner
        self.saved: dict = defaultdict(list)
        self.taken: dict = defaultdict(int)

    def keeps(self, func, args: tuple) -> bool:
        if func in SELECTION_OPS:
            return True
        return func is _ATTENTION_FORWARD and self.offload is None and kept_by_replay(args, {})

    def keep(self, func, out) -> None:
        if self.offload is not None:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            out = (type(out), [self.offload.pack(t.detach(), "selection") for t in outs])
        self.saved[func].append(out)

    def take(self, func):
        entries = self.saved.get(func, [])
        call = self.taken[func]
        self.taken[func] += 1
        if call >= len(entries) or entries[call] is None:
            raise RuntimeError(f"selection replay: the recompute of {self.layer!r} ran {func} more often than its "
                               "forward did")
        out, entries[call] = entries[call], None
        if self.offload is not None:
            kind, packed = out
            outs = [self.offload.unpack(t) for t in packed]
            out = kind(outs) if kind in (tuple, list) else outs[0]
        return out, call

    def call(self, func, args: tuple, recompute: bool):
        if not self.keeps(func, args):
            return func(*args)
        if not recompute:
            out = func(*args)
            self.keep(func, out)
            return out
        saved, call = self.take(func)
        if func in SELECTION_OPS:
            saved_indices = saved[0] if isinstance(saved, (tuple, list)) else saved
            _REPLAY["replayed_selections"] += 1
            _REPLAY["replayed_indices"] += saved_indices.numel()
            if self.verify:
                fresh = func(*args)
                fresh_indices = fresh[0] if isinstance(fresh, (tuple, list)) else fresh
                _REPLAY["verified_selections"] += 1
                _check_same_selection(saved_indices, fresh_indices, func, call, self.layer)
        return saved


class _Phase:
    """One side of a replaying checkpoint call, its forward or its recompute, as ``torch.utils.checkpoint``
    enters it around the whole region. It only marks the thread (``_phases``): the kept ops alone go
    through the region (``kept_call``). Selective checkpointing's dispatch modes over the whole region
    (what the replay ran under before) cost every op of it a trip through Python, thousands a step."""

    def __init__(self, region: _Region, recompute: bool) -> None:
        self.region, self.recompute = region, recompute

    def __enter__(self):
        _phases().append(self)
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        stack = _phases()
        if stack and stack[-1] is self:
            stack.pop()
        return False


_LOCAL = threading.local()  # a recompute runs on autograd's thread for the device, not the caller's


def _phases() -> list[_Phase]:
    """This thread's open replay phases, outermost first."""
    stack = getattr(_LOCAL, "phases", None)
    if stack is None:
        stack = _LOCAL.phases = []
    return stack


def kept_call(func, *args):
    """``func(*args)`` for an op a replaying checkpoint may keep (installed for the kernels as
    ``kernels.kept_ops.kept_call``): inside a replay phase, through its region (kept in forward, taken
    back in the recompute); elsewhere, and under ``torch.compile`` (whose regions run under the
    selective-checkpoint modes, ``ReplayContextFn``), a plain call."""
    if torch.compiler.is_compiling():
        return func(*args)
    stack = _phases()
    if not stack:
        return func(*args)
    phase = stack[-1]
    return phase.region.call(func._opoverload if hasattr(func, "_opoverload") else func, args, phase.recompute)


_kept_ops.install(kept_call)


def _check_same_selection(saved: torch.Tensor, fresh: torch.Tensor, func, call: int, layer: str) -> None:
    if saved.shape == fresh.shape and saved.dtype == fresh.dtype and torch.equal(saved, fresh):
        return
    shared = func in (reuse_indices_op._opoverload, shared_selection._opoverload)
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
        if torch.compiler.is_compiling():  # the compiler traces selective checkpointing's modes over the region
            return create_selective_checkpoint_contexts(replay_policy)
        offload = self.offload() if self.offload is not None else None
        region = _Region(self.layer, verify, offload, self.owner)
        return _Phase(region, False), _Phase(region, True)

    def __repr__(self) -> str:
        return f"ReplayContextFn(layer={self.layer!r})"


def replaying() -> bool:
    """True inside the recompute of a checkpoint that replays selections (a ``ReplayContextFn``'s
    recompute phase is open on this thread). A selection op that runs in backward while this is False
    was recomputed by a checkpoint without the replay context (reentrant, or no ``context_fn``). False
    while torch.compile traces (a compiled region's recompute is the compiler's graph)."""
    return not torch.compiler.is_compiling() and any(phase.recompute for phase in _phases())


def recompute_owner() -> torch.nn.Module | None:
    """The module whose forward is being recomputed: the ``owner`` of the innermost replay checkpoint
    in its recompute, None outside one or where the region has no owner. The recompute's output is
    dropped (non-reentrant checkpointing keeps only what the forward saved), so a module that knows
    its output reaches nothing but the owner's output may skip computing it there. None while
    torch.compile traces: a compiled region's recompute is the compiler's graph, not this eager one."""
    if torch.compiler.is_compiling():
        return None
    for phase in reversed(_phases()):
        if phase.recompute:
            return phase.region.owner
    return None


def in_replay_checkpoint() -> bool:
    """True inside a checkpointed region with the replay context, in its forward or its recompute: what
    the region saves there lives only until its backward (recomputed regions), not from forward on."""
    if not torch.compiler.is_compiling():
        return bool(_phases())
    # traced: the region runs under selective checkpointing's caching mode with the replay policy
    return any(getattr(mode, "policy_fn", None) is replay_policy for mode in _get_current_dispatch_mode_stack())


def placeholder_indices(batch: int, queries: int, device) -> torch.Tensor:
    """An empty int32 ``[batch, queries, 0]`` for ``share_selection`` in a replaying recompute whose source
    selection is gone (the replay returns the forward's selection whatever the op is given)."""
    return torch.empty(batch, queries, 0, dtype=torch.int32, device=device)


def replay_context_fn(layer: str = "<checkpointed region>", verify: bool = False) -> ReplayContextFn:
    """The ``context_fn`` for your own checkpoint calls::

        torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False,
                                          context_fn=hyscale_hf.replay_context_fn("block 3"))
    """
    return ReplayContextFn(layer, verify)
