"""Held-out evaluation of one model state: perplexity, top-k recall of the dense attention mass, passkey.

The recipe evaluates four states of one model on the same held-out tokens: the dense original
(before ``patch_model``), sparse with the fresh indexer, sparse after the dense warm-up, and sparse
after sparse training. Patched states are evaluated in the sparse stage whatever stage training is
in, and the stage is restored afterwards.

- Perplexity: ``exp`` of the mean next-token NLL over every held-out block (each block a separate
  sequence of ``seq_len`` tokens, so dense and sparse read the same tokens with the same context).
- Top-k recall: for sampled queries of every full indexer layer, the share of that layer's dense
  attention mass (summed over heads) that the indexer's top-k keys hold, and the ceiling, the share
  the attention's own top-k holds (``hyscale_hf.sample_topk_recall``), taken in the same forwards as
  the perplexity. A dense model keeps all the mass: recall is reported as None there.
- Passkey retrieval (``passkey.passkey_accuracy``): teacher-forced, at the given depths.
"""

from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import TrainerCallback

import hyscale_hf

from .passkey import PasskeyBuilder, passkey_accuracy


@contextmanager
def sparse_stage(model):
    """Evaluate a patched model with sparse attention (restores the live stage after); no-op if unpatched."""
    if not hyscale_hf.is_patched(model):
        yield
        return
    config = hyscale_hf.patched_config(model)
    before = config.dense_warmup
    config.dense_warmup = False
    try:
        yield
    finally:
        config.dense_warmup = before


@torch.no_grad()
def evaluate(
    model,
    blocks: torch.Tensor,
    *,
    passkey: PasskeyBuilder | None = None,
    depths=(),
    trials: int = 0,
    seed: int = 0,
    recall_queries: int = 64,
    progress: bool = True,
    desc: str = "evaluate",
) -> dict:
    """Metrics of ``model`` on held-out ``blocks`` (int64 ``[n, seq_len]``) and passkey prompts.

    Returns ``perplexity``, ``nll`` (nats per predicted token), ``tokens`` (predicted tokens),
    ``topk_recall`` / ``topk_recall_best`` (None for an unpatched model or when no query sees more
    than top-k keys), ``topk``, passkey ``passkey_accuracy`` / ``passkey_token_accuracy`` /
    ``passkey_per_depth`` (when ``passkey`` is given) and ``seconds``. The model's train/eval mode is
    restored.
    """
    from tqdm.auto import tqdm

    if blocks.dim() != 2 or blocks.shape[1] < 2:
        raise ValueError(f"blocks must be [n, seq_len >= 2] token ids, got shape {tuple(blocks.shape)}")
    started = time.time()
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    patched = hyscale_hf.is_patched(model)
    nll_sum, count, recall_sum, best_sum, recall_n = 0.0, 0, 0.0, 0.0, 0
    try:
        with sparse_stage(model):
            for row in tqdm(blocks, desc=desc, unit="block", disable=not progress):
                ids = row[None].to(device)
                if patched:
                    with hyscale_hf.sample_topk_recall(model, recall_queries) as probe:
                        loss = model(input_ids=ids, labels=ids).loss
                    total, best, n = probe.totals()
                    recall_sum, best_sum, recall_n = recall_sum + total, best_sum + best, recall_n + n
                else:
                    loss = model(input_ids=ids, labels=ids).loss
                predicted = ids.shape[1] - 1
                nll_sum += float(loss) * predicted
                count += predicted
            result = {
                "perplexity": math.exp(nll_sum / count),
                "nll": nll_sum / count,
                "tokens": count,
                "topk": hyscale_hf.patched_config(model).topk if patched else None,
                "topk_recall": recall_sum / recall_n if recall_n else None,
                "topk_recall_best": best_sum / recall_n if recall_n else None,
            }
            if passkey is not None and trials > 0 and depths:
                keys = passkey_accuracy(model, passkey, depths, trials, seed=seed, progress=progress, desc=f"{desc}: passkey")
                result.update({
                    "passkey_accuracy": keys["accuracy"], "passkey_token_accuracy": keys["token_accuracy"],
                    "passkey_per_depth": {str(d): v for d, v in keys["per_depth"].items()},
                })
    finally:
        model.train(was_training)
    result["seconds"] = round(time.time() - started, 1)
    return result


def stage_evaluation(args, name: str, model, passkey, held_out, checkpoint: str | None) -> dict:
    """``evaluate`` of one model state of the recipe, written to ``evaluation_<name>.json`` at once; a
    resumed run (``checkpoint`` given) reads the states evaluated before its checkpoint back instead.
    Every process runs the forwards (FSDP-sharded models need all ranks in each one)."""
    path = Path(args.output_dir) / f"evaluation_{name}.json"
    if checkpoint is not None and path.is_file():
        return json.loads(path.read_text())
    from ..context_parallel import context_parallel_paused

    with context_parallel_paused(model):  # each rank evaluates whole sequences (--cp_size splits training only)
        result = evaluate(model, held_out, passkey=passkey, depths=args.depths, trials=args.passkey_trials,
                          seed=args.seed + 1, progress=not args.no_progress and args.main_process, desc=name)
    if args.main_process:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
    return result


class WarmupEvaluationCallback(TrainerCallback):
    """Evaluates the model as the dense warm-up ends: at the start of the first sparse step, with the
    weights the warm-up left. ``result`` is then ``{"sparse_after_warmup": ...}`` (empty without a
    warm-up, or without a sparse step after it). Add it with ``add_to`` so it runs before
    ``HyScaleCallback`` starts that step's own top-k recall sample; its forwards count in that step's
    ``replay_*`` counters, which are those of the sparse stage."""

    def __init__(self, args, passkey, held_out, checkpoint: str | None) -> None:
        self.args, self.passkey, self.held_out = args, passkey, held_out
        self.end = args.dense_pretrain_steps + args.dense_warmup_steps
        self.result = {}
        saved = Path(args.output_dir) / "evaluation_sparse_after_warmup.json"
        if args.dense_warmup_steps and checkpoint is not None and saved.is_file():  # resumed after the warm-up
            self.result = {"sparse_after_warmup": json.loads(saved.read_text())}

    def add_to(self, trainer) -> WarmupEvaluationCallback:
        callbacks = trainer.callback_handler.callbacks
        callbacks[:] = [self] + [c for c in callbacks if c is not self]
        return self

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if self.args.dense_warmup_steps and state.global_step == self.end and not self.result:
            self.result = {"sparse_after_warmup": stage_evaluation(
                self.args, "sparse_after_warmup", model, self.passkey, self.held_out, None)}
