"""HyScaleCallback: the DSA indexer training recipe as a Transformers ``TrainerCallback``.

Stages (DeepSeek-V3.2-Exp report, section 2.1), by optimizer step:

1. Dense warm-up (``dense_warmup_steps`` steps): attention stays dense, every parameter except the
   indexer's is frozen, and the indexer learns the dense KL loss.
2. Sparse stage (the rest): top-k selection on; every parameter that was trainable when training
   began trains again, the indexer on the sparse KL loss and the rest on the LM loss.

An optional stage 0 (``dense_pretrain_steps``) before the warm-up trains everything with dense
attention: for models trained from scratch, whose random-init attention gives the indexer nothing
to learn yet.

The indexer loss needs no change to ``Trainer.compute_loss``: patched attention modules join it to
the graph (``attach_indexer_loss``). The callback only flips ``config.dense_warmup`` on the patched
model, freezes/unfreezes parameters, and logs.
"""

from __future__ import annotations

import math
import warnings

import torch
from transformers import TrainerCallback

from .replay import selection_stats
from .state import PatchState, patch_state
from .training import RecallProbe, indexer_parameter_names

DENSE_PRETRAIN, DENSE_WARMUP, SPARSE = 0, 1, 2
STAGE_NAMES = {DENSE_PRETRAIN: "dense pre-training", DENSE_WARMUP: "dense warm-up", SPARSE: "sparse"}


def _check_steps(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")


class HyScaleCallback(TrainerCallback):
    """Runs the dense warm-up, switches to sparse attention after it, and logs the indexer's progress.

    Args:
        dense_warmup_steps: optimizer steps of dense warm-up (0: no warm-up). Resuming from a
            checkpoint starts in the stage of the resumed step.
        dense_pretrain_steps: optimizer steps before the warm-up that train everything with dense
            attention (default 0; for models trained from scratch).
        indexer_loss_coef: overrides ``HyScaleConfig.indexer_loss_coef`` of the patched model.
        recall_queries: queries per indexer layer scored for the top-k recall metric (0 disables).
        recall_every: sample recall on the training forward of every ``recall_every``-th step;
            default: the Trainer's ``logging_steps``, so each logged step carries a fresh value.

    Logged with the Trainer's training loss (into ``logs``, and into ``state.log_history``, whose
    entry the Trainer writes before ``on_log`` runs):

    - ``indexer_loss``: KL loss, mean over full indexer layers and steps since the last log;
    - ``topk_recall``: share of the dense attention mass that the indexer's top-k keeps, on a
      sample of queries of the sampled steps' training batches, and ``topk_recall_best``: the share
      the attention's own top-k holds on the same queries (what a perfect indexer would reach);
    - ``hyscale_stage``: the stage of the last logged step (0 dense pre-training, 1 dense warm-up,
      2 sparse);
    - ``replay_*``: selection-replay counters since the last log (``hyscale_hf.selection_stats``),
      when the model was patched with ``selection_replay=True``.

    Under several processes, means and counters are taken over all of them. Reporting integrations
    (``report_to``) run before callbacks passed to ``Trainer(callbacks=...)``; to have them receive
    these values too, add the callback with ``callback.add_to(trainer)``.

    Parameters are frozen through ``requires_grad`` after the Trainer built its optimizer (with
    every parameter trainable at that time), so a frozen parameter gets no gradient and the
    optimizer skips it. With DDP, use ``ddp_find_unused_parameters=True`` when there is a warm-up.
    ZeRO/FSDP1 flat parameters cannot be frozen one by one; FSDP2 can.
    """

    def __init__(
        self,
        dense_warmup_steps: int = 0,
        *,
        dense_pretrain_steps: int = 0,
        indexer_loss_coef: float | None = None,
        recall_queries: int = 64,
        recall_every: int | None = None,
    ) -> None:
        _check_steps("dense_warmup_steps", dense_warmup_steps)
        _check_steps("dense_pretrain_steps", dense_pretrain_steps)
        if indexer_loss_coef is not None and (
            not isinstance(indexer_loss_coef, (int, float)) or not math.isfinite(indexer_loss_coef) or indexer_loss_coef < 0
        ):
            raise ValueError(f"indexer_loss_coef must be a non-negative number or None, got {indexer_loss_coef!r}")
        if not isinstance(recall_queries, int) or recall_queries < 0:
            raise ValueError(f"recall_queries must be a non-negative int, got {recall_queries!r}")
        if recall_every is not None and (not isinstance(recall_every, int) or recall_every <= 0):
            raise ValueError(f"recall_every must be a positive int or None, got {recall_every!r}")
        self.dense_warmup_steps = dense_warmup_steps
        self.dense_pretrain_steps = dense_pretrain_steps
        self.indexer_loss_coef = indexer_loss_coef
        self.recall_queries = recall_queries
        self.recall_every = recall_every
        self.stage: int | None = None
        self._state: PatchState | None = None
        self._params: dict[str, torch.nn.Parameter] = {}
        self._trainable: set[str] = set()
        self._indexer: set[str] = set()
        self._indexer_total = 0
        self._last_step_stage: int | None = None
        self._probe: RecallProbe | None = None
        self._replay_base: dict[str, int] = {}
        self._warned_no_recall = False
        self._reset_window()

    # ------------------------------------------------------------------ wiring

    def add_to(self, trainer) -> HyScaleCallback:
        """Add this callback to ``trainer`` ahead of its other callbacks (reporting integrations
        included), so every logger sees the values it adds; if it was passed to the Trainer already,
        it moves to the front. Returns the callback."""
        callbacks = trainer.callback_handler.callbacks
        callbacks[:] = [self] + [c for c in callbacks if c is not self]
        return self

    def _reset_window(self) -> None:
        self._loss_sum, self._loss_steps = 0.0, 0
        self._recall_sum, self._best_sum, self._recall_n = 0.0, 0.0, 0

    # ------------------------------------------------------------------ stages

    def stage_at(self, completed_steps: int) -> int:
        """The stage of the step that runs after ``completed_steps`` optimizer steps."""
        if completed_steps < self.dense_pretrain_steps:
            return DENSE_PRETRAIN
        if completed_steps < self.dense_pretrain_steps + self.dense_warmup_steps:
            return DENSE_WARMUP
        return SPARSE

    def _enter(self, stage: int) -> None:
        if stage == self.stage:
            return
        if stage == DENSE_WARMUP and not self._indexer:
            raise ValueError(
                "dense warm-up needs trainable indexer parameters, but none of the model's "
                f"{self._indexer_total} indexer parameters is trainable. With PEFT, pass "
                "modules_to_save=hyscale_hf.indexer_modules_to_save(model) to the PEFT config."
            )
        trainable = self._indexer if stage == DENSE_WARMUP else self._trainable
        for name, param in self._params.items():
            param.requires_grad_(name in trainable)
        self._state.config.dense_warmup = stage != SPARSE
        self._state.base_frozen = stage == DENSE_WARMUP  # forwards then skip the frozen base's graph
        self.stage = stage

    # ------------------------------------------------------------------ Trainer events

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._state = patch_state(model) if model is not None else None
        if self._state is None:
            raise ValueError("HyScaleCallback needs a model patched with hyscale_hf.patch_model")
        if self.indexer_loss_coef is not None:
            self._state.config.indexer_loss_coef = float(self.indexer_loss_coef)
        self._params = dict(model.named_parameters())
        self._trainable = {n for n, p in self._params.items() if p.requires_grad}
        all_indexer = indexer_parameter_names(model)
        self._indexer_total = len(all_indexer)
        self._indexer = set(all_indexer) & self._trainable
        self._state.pop_indexer_loss()  # drop anything recorded before training
        self._reset_window()
        self._replay_base = selection_stats()
        self.stage = None
        self._enter(self.stage_at(state.global_step))

    def _recall_due(self, args, state) -> bool:
        if self.recall_queries == 0:
            return False
        every = self.recall_every or max(1, int(state.logging_steps or args.logging_steps or 1))
        step = state.global_step + 1  # the step about to run
        return step % every == 0 or (step == 1 and bool(args.logging_first_step))

    def on_step_begin(self, args, state, control, **kwargs):
        if self._state is not None and self._recall_due(args, state) and self._state.selection_probe is None:
            self._probe = RecallProbe(self.recall_queries)
            self._state.selection_probe = self._probe

    def _stop_probe(self) -> None:
        if self._probe is None:
            return
        if self._state.selection_probe is self._probe:
            self._state.selection_probe = None
        total, best, count = self._probe.totals()
        if count == 0 and self._probe.calls > 0 and self.stage == SPARSE and not self._warned_no_recall:
            self._warned_no_recall = True
            warnings.warn(
                f"hyscale_hf: no query of the sampled batch sees more than top-k = {self._state.config.topk} keys, so "
                "sparse attention keeps every key (it equals dense attention) and topk_recall is not logged; use a "
                "top-k below the sequence length", stacklevel=2)
        self._recall_sum += total
        self._best_sum += best
        self._recall_n += count
        self._probe = None

    def on_substep_end(self, args, state, control, **kwargs):
        self._stop_probe()  # one micro-batch per sampled step is enough

    def on_step_end(self, args, state, control, **kwargs):
        self._stop_probe()
        loss = self._state.pop_indexer_loss()
        if loss is not None:
            self._loss_sum += loss
            self._loss_steps += 1
        self._last_step_stage = self.stage
        self._enter(self.stage_at(state.global_step))

    def _window_values(self, args) -> dict[str, float]:
        replay = self._state.config.selection_replay
        now = selection_stats() if replay else {}
        counters = [now[k] - self._replay_base.get(k, 0) for k in now]
        totals = torch.tensor(
            [self._loss_sum, self._loss_steps, self._recall_sum, self._best_sum, self._recall_n, *counters],
            dtype=torch.float64,
        )
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            totals = totals.to(args.device)
            torch.distributed.all_reduce(totals)
            totals = totals.cpu()
        loss_sum, loss_steps, recall_sum, best_sum, recall_n, *counters = totals.tolist()
        values: dict[str, float] = {}
        if loss_steps:
            values["indexer_loss"] = loss_sum / loss_steps
        if recall_n:
            values["topk_recall"] = recall_sum / recall_n
            values["topk_recall_best"] = best_sum / recall_n
        values["hyscale_stage"] = float(self._last_step_stage)
        values.update({f"replay_{k}": int(v) for k, v in zip(now, counters)})
        self._replay_base = now
        self._reset_window()
        return values

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs or self._state is None or self._last_step_stage is None:
            return  # evaluation and end-of-training summaries
        values = self._window_values(args)
        logs.update(values)
        # The Trainer appended a copy of ``logs`` to log_history before calling on_log.
        last = state.log_history[-1] if state.log_history else None
        if last is not None and last.get("step") == state.global_step and last.get("loss") == logs["loss"]:
            last.update(values)

    def on_train_end(self, args, state, control, **kwargs):
        """Restore ``requires_grad`` as training found it. Attention stays in the stage training
        ended in (``config.dense_warmup`` is still True if it ended before the sparse stage)."""
        self._stop_probe()
        if self._state is not None:
            self._state.base_frozen = False
            for name, param in self._params.items():
                param.requires_grad_(name in self._trainable)
