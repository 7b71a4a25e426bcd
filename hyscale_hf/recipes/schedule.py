"""Learning-rate schedules that follow the training stages: one for the base model, one for the indexer.

One cosine over the whole run (the Trainer's default) spends most of its decay on the stages where a
parameter group is frozen. With a long dense warm-up and a short sparse stage, the base model then
fine-tunes at a few percent of ``--lr`` and the indexer's last warm-up steps barely move it. So each
group's schedule runs over the steps where that group trains (``callbacks.HyScaleCallback``'s stages):

- the **base model** trains in the dense pre-training and in the sparse stage (it is frozen in the
  dense warm-up): a linear warm-up then a cosine decay to 0 over those steps, the warm-up window
  skipped;
- the **indexer** trains in every stage (on the dense KL until the sparse stage): a linear warm-up
  then a constant rate, as DSA's indexer warm-up runs; measured on SmolLM2, its held-out perplexity
  kept falling from 30 to 60 warm-up steps, so a decay there would waste the steps it pays for.

Both are ``LambdaLR`` multipliers of the group's peak rate; they are pure functions of the step, so a
resumed run continues on the same curve (the Trainer restores the scheduler's step count).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class StageSchedule:
    """Step -> learning-rate multiplier for one parameter group (a picklable callable for ``LambdaLR``).

    ``active`` are the ``[start, stop)`` step ranges where the group trains; ``warmup`` steps of linear
    warm-up from its first active step; ``decay``: cosine to 0 over its active steps, else constant.
    """

    active: tuple[tuple[int, int], ...]
    warmup: int
    decay: bool

    def __call__(self, step: int) -> float:
        done, total = 0, 0
        for start, stop in self.active:
            total += max(0, stop - start)
            done += min(max(0, step - start), max(0, stop - start))
        if not any(start <= step < stop for start, stop in self.active):
            return 0.0  # frozen at this step (or past the run)
        if self.warmup > 0 and done < self.warmup:
            return (done + 1) / (self.warmup + 1)
        if not self.decay:
            return 1.0
        span = max(1, total - self.warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (done - self.warmup) / span)))


def stage_schedules(max_steps: int, dense_pretrain_steps: int, dense_warmup_steps: int,
                    warmup_steps: int) -> tuple[StageSchedule, StageSchedule]:
    """``(base, indexer)`` schedules of a run with these stage lengths (``HyScaleCallback``'s); each warms
    up over ``warmup_steps``, capped at a tenth of the steps where it trains."""
    sparse_start = dense_pretrain_steps + dense_warmup_steps
    base_active = ((0, dense_pretrain_steps), (sparse_start, max_steps))
    indexer_active = ((0, max_steps),)

    def warmup(active) -> int:  # at most a tenth of the group's own steps: a short stage is not all warm-up
        return min(warmup_steps, sum(stop - start for start, stop in active) // 10)

    return (StageSchedule(base_active, warmup(base_active), decay=True),
            StageSchedule(indexer_active, warmup(indexer_active), decay=False))
