"""How often the selection op really ran, split into forward and backward (checkpoint recompute).

The count happens inside the ``hyscale::hytopk`` custom op's body, so it sees exactly the runs that
did the work: a selection served from a selective-checkpoint cache (selection replay) never
reaches the body. ``hyscale_hf.replay`` reads and resets these numbers for ``selection_stats()``;
this module stays torch-only so the kernels package never imports the core.
"""

from __future__ import annotations

import torch

RUNS = {"forward": 0, "recompute": 0}


def record_selection_run() -> None:
    """Count one run of the selection op; runs during autograd's backward are recomputes."""
    in_backward = torch._C._current_graph_task_id() != -1
    RUNS["recompute" if in_backward else "forward"] += 1


def reset() -> None:
    for key in RUNS:
        RUNS[key] = 0
