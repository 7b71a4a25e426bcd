"""Where a checkpoint sees the ops whose outputs it keeps.

Selection replay (``hyscale_hf.replay``) keeps the outputs of a few custom ops of a checkpointed region
(``hyscale::hytopk``, the sparse attention's forward) and hands them back to the region's recompute
instead of running the ops again. The kernels call those ops through ``kept_call``, which runs the replay's
hook (``install``) or, without one, the op itself. Selective checkpointing's dispatch modes, which found
the ops by watching every op of the region, cost every other op a trip through Python (thousands of ops
a training step). This module keeps the kernels room free of the replay (which lives in the core and
imports the kernels).
"""

from __future__ import annotations

from collections.abc import Callable

_HOOK: Callable | None = None


def install(hook: Callable | None) -> None:
    """Make ``hook(op, *args)`` run every kept op (None: the ops run as they are)."""
    global _HOOK
    _HOOK = hook


def kept_call(op, *args):
    """``op(*args)`` for an op whose outputs a checkpoint may keep: through the installed hook, if any."""
    return op(*args) if _HOOK is None else _HOOK(op, *args)
