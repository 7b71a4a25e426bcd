"""Checkpoints, resume and interruption for the long-context fine-tuning recipe.

The Trainer does the work: its checkpoints (``save_steps``, ``save_total_limit``), its resume
(optimizer, scheduler, RNG, data position) and its loop (a signal only asks it, through
``control``, to save and stop after the current step). This module adds what the recipe needs on
top:

- every checkpoint also holds ``hyscale_config.json`` (the patch settings, to reload it as a sparse
  model) and ``recipe_args.json`` (the arguments a resume must repeat);
- Transformers 5.24's resume loads the checkpoint file with ``load_state_dict(strict=False)``,
  which skips the weights its loader converts (GLM-5's fused experts ``mlp.experts.gate_up_proj``
  are saved per expert) and carries on with the freshly initialised ones. ``restore_weights``
  loads the checkpoint the way ``from_pretrained`` does, and ``VerifyResumeCallback`` then checks,
  once the Trainer has loaded its own way, that every weight equals the checkpoint's, refusing to
  train otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

import hyscale_hf

ARGS_FILE = "recipe_args.json"
CONFIG_FILE = "hyscale_config.json"
# Arguments that decide the training trajectory: a resume must give the checkpoint's values.
TRAINING_ARGS = (
    "model", "tokenizer", "dataset", "dataset_config", "dataset_split", "text_column", "dtype", "preset", "seq_len",
    "max_steps", "dense_pretrain_steps", "dense_warmup_steps", "batch_size", "grad_accum", "lr", "indexer_lr", "topk",
    "indexer_loss_coef", "lm_loss_chunk", "gradient_checkpointing", "seed", "lora_r", "lora_alpha", "lora_dropout",
    "lora_target_modules", "hidden_size", "num_layers", "index_n_heads", "index_head_dim", "index_share", "eval_split",
    "eval_fraction", "eval_tokens", "world_size", "rope_yarn_factor",
)


class ResumeMismatch(RuntimeError):
    """A resumed model's weights differ from its checkpoint's."""


def training_args_record(args) -> dict:
    return {key: getattr(args, key, None) for key in TRAINING_ARGS}


def sparse_config_record(model) -> dict:
    """The live HyScaleConfig as saved next to a model: sparse (the stage a reload is used in)."""
    return dataclasses.asdict(hyscale_hf.patched_config(model)) | {"dense_warmup": False}


def prepare_output_dir(args) -> None:
    out = Path(args.output_dir)
    if args.overwrite_output_dir and out.is_dir():
        # A stale checkpoint-* of an earlier run would be what a later bare --resume_from_checkpoint picks.
        for old in out.glob(f"{PREFIX_CHECKPOINT_DIR}-*"):
            shutil.rmtree(old)
    out.mkdir(parents=True, exist_ok=True)


def resolve_resume(args) -> str | None:
    """The checkpoint folder to resume from (None: a fresh run), its arguments checked against ``args``."""
    if args.resume_from_checkpoint is None:
        return None
    if args.resume_from_checkpoint == "latest":
        found = get_last_checkpoint(args.output_dir) if Path(args.output_dir).is_dir() else None
        if found is None:
            raise SystemExit(f"error: --resume_from_checkpoint: no {PREFIX_CHECKPOINT_DIR}-* folder in --output_dir "
                             f"{args.output_dir}")
        path = Path(found)
    else:
        path = Path(args.resume_from_checkpoint)
    saved_file = path / ARGS_FILE
    if not (path / "trainer_state.json").is_file() or not saved_file.is_file():
        raise SystemExit(f"error: --resume_from_checkpoint {path}: not a checkpoint of this recipe "
                         f"(needs trainer_state.json and {ARGS_FILE})")
    saved, now = json.loads(saved_file.read_text()), training_args_record(args)
    differ = [f"--{k}: checkpoint {saved.get(k)!r}, now {now[k]!r}" for k in TRAINING_ARGS if saved.get(k) != now[k]]
    if differ:
        raise SystemExit(f"error: --resume_from_checkpoint {path} was written by a run with other training arguments; "
                         "give the same ones to continue it:\n  " + "\n  ".join(differ))
    return str(path)


class CheckpointFilesCallback(TrainerCallback):
    """Writes ``hyscale_config.json`` and ``recipe_args.json`` into every Trainer checkpoint."""

    def __init__(self, args) -> None:
        self.record = training_args_record(args)

    def on_save(self, args, state, control, model=None, **kwargs):
        if state.is_world_process_zero:
            folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
            (folder / CONFIG_FILE).write_text(json.dumps(sparse_config_record(model), indent=2))
            (folder / ARGS_FILE).write_text(json.dumps(self.record, indent=2))


class InterruptCallback(TrainerCallback):
    """SIGTERM / SIGINT: finish the current step, then have the Trainer log, checkpoint and stop.

    A second signal of the same kind gets the default behaviour (Ctrl-C twice stops at once). With
    several processes the flag is reduced over all of them each step, so they all save together.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        self.signum = signum
        signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))

    def on_train_begin(self, args, state, control, **kwargs):
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def on_step_end(self, args, state, control, **kwargs):
        flag = torch.tensor([float(self.signum or 0)])
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            flag = flag.to(args.device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        if flag.item():
            self.signum = self.signum or int(flag.item())
            control.should_log = control.should_save = control.should_training_stop = True
        return control

    def on_train_end(self, args, state, control, **kwargs):
        for s, handler in self._previous.items():
            if signal.getsignal(s) == self._handle:
                signal.signal(s, handler)


class LogFinalStepCallback(TrainerCallback):
    """Log the last step even when --max_steps is no multiple of --logging_steps, so the reported
    final loss is the last step's window and the loss curve reaches the end of the run."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps:
            control.should_log = True
        return control


# ----------------------------------------------------------------------------- resume weights


def _peft_state(model) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model)


def _is_peft(model) -> bool:
    return hasattr(model, "peft_config")


def reference_weights(model, checkpoint: str) -> dict[str, torch.Tensor]:
    """The checkpoint's weights under the live model's names, loaded as ``from_pretrained`` loads
    them (converted expert layouts included) and patched like ``model``; for a PEFT model, its
    adapter file (LoRA weights and the indexers in ``modules_to_save``)."""
    if _is_peft(model):
        from safetensors.torch import load_file

        return load_file(str(Path(checkpoint) / "adapter_model.safetensors"))
    dtype = next(model.parameters()).dtype
    reloaded = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype)
    hyscale_hf.patch_model(reloaded, hyscale_hf.HyScaleConfig(**json.loads((Path(checkpoint) / CONFIG_FILE).read_text())))
    return {k: v.detach().cpu() for k, v in reloaded.state_dict().items()}


def mismatched_weights(model, reference: dict[str, torch.Tensor]) -> list[str]:
    """Names whose live value differs from ``reference`` (or that one side lacks), one line each."""
    live = _peft_state(model) if _is_peft(model) else model.state_dict()
    problems = [f"{k}: not in the checkpoint" for k in live if k not in reference]
    problems += [f"{k}: in the checkpoint, not in the model" for k in reference if k not in live]
    for key in live.keys() & reference.keys():
        a, b = live[key].detach().cpu(), reference[key]
        if a.shape != b.shape or not torch.equal(a, b.to(a.dtype)):
            problems.append(f"{key}: differs from the checkpoint")
    return sorted(problems)


def restore_weights(model, reference: dict[str, torch.Tensor]) -> None:
    """Copy ``reference`` (from ``reference_weights``) into ``model``; the Trainer's own load that
    follows rewrites the tensors it can read with the same values and leaves the others as set here."""
    if _is_peft(model):
        return  # PEFT adapters load name for name: nothing for the Trainer to miss
    model.load_state_dict(reference, strict=True)


class VerifyResumeCallback(TrainerCallback):
    """At the start of a resumed run (after the Trainer loaded the checkpoint), refuse to train
    unless every weight equals the checkpoint's."""

    def __init__(self, checkpoint: str, reference: dict[str, torch.Tensor]) -> None:
        self.checkpoint, self.reference = checkpoint, reference

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        problems = mismatched_weights(model, self.reference)
        self.reference = {}  # the copy is not needed any more
        if problems:
            raise ResumeMismatch(
                f"resuming from {self.checkpoint}: {len(problems)} weight(s) do not match the checkpoint, so "
                "training would continue from wrong weights; refusing. First ones:\n  " + "\n  ".join(problems[:8])
            )
