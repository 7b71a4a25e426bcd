"""HyScaleCallback: the DSA indexer training recipe as a Transformers ``TrainerCallback``.

Stages (DeepSeek-V3.2-Exp report, section 2.1):

1. Dense warm-up (the first ``dense_warmup_steps`` optimizer steps): attention stays dense, every
   parameter except the indexer's is frozen, and the indexer learns the dense KL loss.
2. Sparse stage: top-k selection on; every parameter that was trainable when training began trains
   again, the indexer on the sparse KL loss and the rest on the LM loss.

The indexer loss needs no change to ``Trainer.compute_loss``: patched attention modules join it to
the graph (``attach_indexer_loss``). The callback only flips ``config.dense_warmup`` on the patched
model, freezes/unfreezes parameters, and logs.
"""

from __future__ import annotations

import math

import torch
from transformers import TrainerCallback

from .patching import PatchState, patch_state
from .training import RecallProbe, indexer_parameter_names


class HyScaleCallback(TrainerCallback):
    """Runs the dense warm-up, switches to sparse attention at ``dense_warmup_steps``, and logs.

    Args:
        dense_warmup_steps: optimizer steps of dense warm-up (0: sparse from the first step).
            Resuming from a checkpoint past this step starts in the sparse stage.
        indexer_loss_coef: overrides ``HyScaleConfig.indexer_loss_coef`` of the patched model.
        recall_queries: queries per indexer layer scored for the top-k recall metric (0 disables).
        recall_every: sample recall on the training forward of every ``recall_every``-th step;
            default: the Trainer's ``logging_steps``, so each logged step carries a fresh value.

    Logged with the Trainer's training loss (into ``logs``, and into ``state.log_history`` whose
    entry the Trainer writes before ``on_log`` runs): ``indexer_loss`` (mean over full indexer
    layers and steps since the last log), ``topk_recall`` (share of dense attention mass kept by
    the top-k, on the sampled steps), ``sparse_stage`` (1 if the last logged step ran sparse) and, when selection replay is on,
    its counters with a ``replay_`` prefix. Under several processes the means are taken over all.

    Reporting integrations (``report_to``) are called before callbacks passed to ``Trainer``; to
    have them receive these values too, add the callback with ``callback.add_to(trainer)``.

    Parameters are frozen by ``requires_grad`` after the optimizer is built, so frozen parameters
    get no gradient and the optimizer skips them. With DDP, set ``ddp_find_unused_parameters=True``
    during a warm-up (unused parameters on all ranks keep ``grad=None``).
    """

    def __init__(
        self,
        dense_warmup_steps: int = 0,
        *,
        indexer_loss_coef: float | None = None,
        recall_queries: int = 64,
        recall_every: int | None = None,
    ) -> None:
        if not isinstance(dense_warmup_steps, int) or isinstance(dense_warmup_steps, bool) or dense_warmup_steps < 0:
            raise ValueError(f"dense_warmup_steps must be a non-negative int, got {dense_warmup_steps!r}")
        if indexer_loss_coef is not None and (
            not isinstance(indexer_loss_coef, (int, float)) or not math.isfinite(indexer_loss_coef) or indexer_loss_coef < 0
        ):
            raise ValueError(f"indexer_loss_coef must be a non-negative number or None, got {indexer_loss_coef!r}")
        if not isinstance(recall_queries, int) or recall_queries < 0:
            raise ValueError(f"recall_queries must be a non-negative int, got {recall_queries!r}")
        if recall_every is not None and (not isinstance(recall_every, int) or recall_every <= 0):
            raise ValueError(f"recall_every must be a positive int or None, got {recall_every!r}")
        self.dense_warmup_steps = dense_warmup_steps
        self.indexer_loss_coef = indexer_loss_coef
        self.recall_queries = recall_queries
        self.recall_every = recall_every
        self.in_warmup = False
        self._state: PatchState | None = None
        self._params: dict[str, torch.nn.Parameter] = {}
        self._trainable: set[str] = set()
        self._indexer: set[str] = set()
        self._indexer_total = 0
        self._last_step_sparse = False
        self._probe: RecallProbe | None = None
        self._reset_window()

    # ------------------------------------------------------------------ wiring

    def add_to(self, trainer) -> HyScaleCallback:
        """Add this callback to ``trainer`` ahead of its other callbacks (reporting integrations
        included), so every logger sees the values it adds. Returns the callback."""
        trainer.callback_handler.callbacks.insert(0, self)
        return self

    def _reset_window(self) -> None:
        self._loss_sum, self._loss_steps = 0.0, 0
        self._recall_sum, self._recall_n = 0.0, 0

    # ------------------------------------------------------------------ stages

    def _set_trainable(self, names: set[str]) -> None:
        for name, param in self._params.items():
            param.requires_grad_(name in names)

    def enter_warmup(self) -> None:
        """Dense attention; only the indexer's (initially trainable) parameters train."""
        if not self._indexer:
            raise ValueError(
                "dense warm-up needs trainable indexer parameters, but none of "
                f"the model's {self._indexer_total} indexer parameters is trainable. "
                "With PEFT, pass modules_to_save=hyscale_hf.indexer_modules_to_save(model) to the PEFT config."
            )
        self._state.config.dense_warmup = True
        self._set_trainable(self._indexer)
        self.in_warmup = True

    def enter_sparse(self) -> None:
        """Top-k selection on; everything that was trainable when training began trains."""
        self._state.config.dense_warmup = False
        self._set_trainable(self._trainable)
        self.in_warmup = False

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
        if state.global_step < self.dense_warmup_steps:
            self.enter_warmup()
        else:
            self.enter_sparse()

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
        total, count = self._probe.totals()
        self._recall_sum += total
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
        self._last_step_sparse = not self.in_warmup
        if self.in_warmup and state.global_step >= self.dense_warmup_steps:
            self.enter_sparse()

    def _window_values(self, args) -> dict[str, float]:
        totals = torch.tensor(
            [self._loss_sum, self._loss_steps, self._recall_sum, self._recall_n], dtype=torch.float64
        )
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            totals = totals.to(args.device)
            torch.distributed.all_reduce(totals)
            totals = totals.cpu()
        loss_sum, loss_steps, recall_sum, recall_n = totals.tolist()
        values: dict[str, float] = {}
        if loss_steps:
            values["indexer_loss"] = loss_sum / loss_steps
        if recall_n:
            values["topk_recall"] = recall_sum / recall_n
        values["sparse_stage"] = 1.0 if self._last_step_sparse else 0.0
        self._reset_window()
        return values

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs or self._state is None:
            return  # evaluation and end-of-training summaries
        values = self._window_values(args)
        logs.update(values)
        # The Trainer appended a copy of ``logs`` to log_history before calling on_log.
        last = state.log_history[-1] if state.log_history else None
        if last is not None and last.get("step") == state.global_step and last.get("loss") == logs["loss"]:
            last.update(values)

    def on_train_end(self, args, state, control, **kwargs):
        """Restore ``requires_grad`` as training found it. The stage stays where training ended
        (``config.dense_warmup`` is still True if it ended inside the warm-up)."""
        self._stop_probe()
        if self._state is not None:
            self._set_trainable(self._trainable)
