"""Long-context fine-tuning with hyscale_hf: dense warm-up of the indexer, then sparse training.

    python scripts/finetune_long.py                 # offline demo: tiny GLM-5-architecture model
    hyscale-finetune-long --model <hub id or path> --dataset <hub id or path> --seq_len 32768
    accelerate launch scripts/finetune_long.py ...  # several GPUs (DDP or FSDP2), same arguments

Steps: load (or build) the model and tokenizer, pack documents to ``--seq_len``, ``patch_model``,
gradient checkpointing with selection replay, ``Trainer`` + ``HyScaleCallback`` (dense warm-up for
``--dense_warmup_steps`` steps, then sparse), passkey retrieval at several depths, top-k recall on
held-out text, a loss-curve PNG, and a checkpoint (``trainer.save_model`` + ``hyscale_config.json``)
that is loaded back and compared. Everything lands in ``--output_dir`` (``results.json`` sums it up).

With no ``--model`` the run needs no network: it builds a small ``glm_moe_dsa`` model (GLM-5's
architecture: MLA, lightning indexer, MoE) with random weights, uses a byte-level tokenizer built
in code, and trains on the Python standard library's source files. Defaults depend on the device:
a few minutes on a 2-core CPU, a bigger model and longer context on a GPU. A random-init model this
small learns byte statistics in a few minutes, not retrieval: expect passkey accuracy near zero
there; the run shows the pipeline and the indexer's recall, not a trained long-context model.

Only the public ``hyscale_hf`` API is used.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from pathlib import Path

import datasets
import torch

import hyscale_hf

from .data import byte_tokenizer, load_documents, pack, stdlib_documents
from .passkey import PasskeyBuilder, passkey_accuracy
from .plots import plot_training_curves

# Settings that differ between the CPU demo, the GPU default and the CI smoke test (--tiny).
PRESETS = {
    "tiny": dict(seq_len=256, max_steps=6, dense_warmup_steps=2, dense_pretrain_steps=1, batch_size=1, lr=2e-3, logging_steps=1,
                 hidden_size=64, num_layers=2, index_topk=32, index_n_heads=2, index_head_dim=16,
                 passkey_trials=1, passkey_depths="0.0,1.0", passkey_length=400, eval_tokens=256),
    "cpu": dict(seq_len=1024, max_steps=120, dense_warmup_steps=20, dense_pretrain_steps=60, batch_size=1, lr=2e-3, logging_steps=5,
                hidden_size=128, num_layers=3, index_topk=64, index_n_heads=4, index_head_dim=32,
                passkey_trials=4, passkey_depths="0.0,0.25,0.5,0.75,1.0", eval_tokens=1024),
    "gpu": dict(seq_len=8192, max_steps=1000, dense_warmup_steps=100, dense_pretrain_steps=400, batch_size=2, lr=1e-3, logging_steps=10,
                hidden_size=512, num_layers=6, index_topk=512, index_n_heads=8, index_head_dim=64,
                passkey_trials=10, passkey_depths="0.0,0.25,0.5,0.75,1.0", eval_tokens=8192),
}
# Preset keys that shape the built model only (with --model, index_n_heads/index_head_dim given on the
# command line size the indexer that patch_model adds to a dense model).
BUILT_MODEL_KEYS = ("hidden_size", "num_layers", "index_topk", "index_n_heads", "index_head_dim")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = p.add_argument_group("model and data")
    src.add_argument("--model", help="hub id or local path of a supported model (default: build a small random-init glm_moe_dsa)")
    src.add_argument("--tokenizer", help="tokenizer id or path (default: the model's; the byte tokenizer without --model)")
    src.add_argument("--dataset", help="hub dataset id or local text/json/jsonl/parquet/csv file or folder "
                     "(default: the Python standard library's source files)")
    src.add_argument("--dataset_config")
    src.add_argument("--dataset_split", default="train")
    src.add_argument("--text_column", default="text")
    src.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                     help="weights dtype (auto: bfloat16 on GPU, float32 on CPU)")
    run = p.add_argument_group("training (None = preset default: --tiny, CPU or GPU)")
    run.add_argument("--tiny", action="store_true", help="seconds-long smoke run (CI)")
    run.add_argument("--seq_len", type=int)
    run.add_argument("--max_steps", type=int)
    run.add_argument("--dense_warmup_steps", type=int, help="steps that train only the indexer, attention dense")
    run.add_argument("--dense_pretrain_steps", type=int, help="steps before the warm-up that train everything "
                     "with dense attention (default: 0 with --model; the built random-init model needs them)")
    run.add_argument("--batch_size", type=int, help="per device")
    run.add_argument("--grad_accum", type=int, default=1)
    run.add_argument("--lr", type=float)
    run.add_argument("--logging_steps", type=int)
    run.add_argument("--topk", type=int, help="keys kept per query (default: the model's index_topk)")
    run.add_argument("--indexer_loss_coef", type=float, default=None, help="default: HyScaleConfig's")
    run.add_argument("--lm_loss_chunk", type=int, default=None,
                     help="compute the LM loss this many tokens at a time: the [seq_len, vocab] logits never exist "
                          "whole (long context with a large vocabulary)")
    run.add_argument("--no_gradient_checkpointing", action="store_true")
    run.add_argument("--lora_r", type=int, default=0, help="LoRA rank (0: full fine-tuning); the indexer trains fully")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--output_dir", default="hyscale_finetune_long")
    run.add_argument("--report_to", default="none")
    run.add_argument("--no_progress", action="store_true", help="plain log lines instead of a progress bar")
    built = p.add_argument_group("the built model (no --model); --index_n_heads/--index_head_dim also size the "
                                 "indexer added to a dense --model")
    built.add_argument("--hidden_size", type=int)
    built.add_argument("--num_layers", type=int)
    built.add_argument("--index_topk", type=int)
    built.add_argument("--index_n_heads", type=int)
    built.add_argument("--index_head_dim", type=int)
    ev = p.add_argument_group("evaluation")
    ev.add_argument("--passkey_depths", help="comma-separated depths in [0, 1]")
    ev.add_argument("--passkey_trials", type=int, help="keys per depth")
    ev.add_argument("--passkey_length", type=int, help="prompt length in tokens (default: --seq_len)")
    ev.add_argument("--eval_tokens", type=int, help="held-out tokens for top-k recall and reload check")
    args = p.parse_args(argv)
    preset = dict(PRESETS["tiny" if args.tiny else ("gpu" if torch.cuda.is_available() else "cpu")])
    if args.model is not None:
        preset["dense_pretrain_steps"] = 0  # a trained dense model: straight to the indexer warm-up
        for key in BUILT_MODEL_KEYS:  # the model brings its own shape
            preset.pop(key)
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.depths = [float(d) for d in args.passkey_depths.split(",")]
    args.passkey_length = args.passkey_length or args.seq_len
    for name in ("seq_len", "max_steps", "batch_size", "grad_accum", "logging_steps", "passkey_trials", "eval_tokens"):
        if getattr(args, name) <= 0:
            p.error(f"--{name} must be positive")
    if args.dense_warmup_steps < 0 or args.dense_pretrain_steps < 0:
        p.error("--dense_warmup_steps and --dense_pretrain_steps must be non-negative")
    if args.dense_pretrain_steps + args.dense_warmup_steps > args.max_steps:
        p.error("--dense_pretrain_steps + --dense_warmup_steps must not exceed --max_steps")
    return args


# ----------------------------------------------------------------------------- model


def build_glm5_model(args, tokenizer):
    """A small GLM-5-architecture model (glm_moe_dsa: MLA + lightning indexer + MoE), random init."""
    from transformers import AutoModelForCausalLM, GlmMoeDsaConfig

    h = args.hidden_size
    heads = max(2, h // 32)
    config = GlmMoeDsaConfig(
        vocab_size=len(tokenizer), hidden_size=h, intermediate_size=2 * h, moe_intermediate_size=h // 2,
        num_hidden_layers=args.num_layers, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, num_attention_heads=heads, num_key_value_heads=heads, q_lora_rank=h // 2,
        kv_lora_rank=h // 4, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
        index_topk=args.index_topk, index_n_heads=args.index_n_heads, index_head_dim=args.index_head_dim,
        max_position_embeddings=max(4096, 2 * args.seq_len), pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None, tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    return AutoModelForCausalLM.from_config(config, dtype=args.torch_dtype)


def load_model_and_tokenizer(args):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.model is None:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer) if args.tokenizer else byte_tokenizer()
        return build_glm5_model(args, tokenizer), tokenizer
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=args.torch_dtype)
    if model.config.model_type not in hyscale_hf.supported_model_types():
        raise SystemExit(
            f"{args.model} is a {model.config.model_type!r} model; supported: {', '.join(hyscale_hf.supported_model_types())}"
        )
    return model, tokenizer


def add_lora(model, rank: int):
    """LoRA on every linear layer outside the indexer and the LM head; the indexer trains in full."""
    from peft import LoraConfig, get_peft_model

    indexers = hyscale_hf.indexer_modules_to_save(model)
    head = model.get_output_embeddings()
    targets = [
        name for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not head
        and not any(name == i or name.startswith(i + ".") for i in indexers)
    ]
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=targets, modules_to_save=indexers,
                      task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


# ----------------------------------------------------------------------------- data


def training_documents(args, chars_needed: int) -> list[str]:
    if args.dataset is None:
        return stdlib_documents(chars_needed, seed=args.seed)
    return load_documents(args.dataset, config=args.dataset_config, split=args.dataset_split,
                          text_column=args.text_column, max_chars=chars_needed)


# ----------------------------------------------------------------------------- main


def _training_arguments(args, world_size: int):
    from transformers import TrainingArguments

    fields = TrainingArguments.__dataclass_fields__
    checkpointing = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    kwargs = dict(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum, learning_rate=args.lr, lr_scheduler_type="cosine",
        warmup_steps=min(10, args.max_steps // 10), weight_decay=0.0, logging_steps=args.logging_steps,
        save_strategy="no", report_to=args.report_to, seed=args.seed, bf16=args.torch_dtype == torch.bfloat16,
        disable_tqdm=args.no_progress, dataloader_drop_last=True, remove_unused_columns=False,
        use_cpu=not torch.cuda.is_available(),
        # Warm-up freezes everything but the indexer; DDP must then tolerate parameters without gradients.
        ddp_find_unused_parameters=(args.dense_warmup_steps > 0) if world_size > 1 else None,
    )
    kwargs[checkpointing] = not args.no_gradient_checkpointing
    return TrainingArguments(**kwargs)


def main(argv=None) -> dict:
    from transformers import AutoModelForCausalLM, Trainer, set_seed

    args = parse_args(argv)
    on_gpu = torch.cuda.is_available()
    args.torch_dtype = {"auto": torch.bfloat16 if on_gpu else torch.float32, "float32": torch.float32,
                        "bfloat16": torch.bfloat16}[args.dtype]
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    set_seed(args.seed)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()

    model, tokenizer = load_model_and_tokenizer(args)
    if int(os.environ.get("RANK", "0")) == 0:
        params = sum(p.numel() for p in model.parameters())
        print(f"hyscale_hf finetune_long: {args.model or 'glm_moe_dsa built in code (random init)'}, "
              f"{params / 1e6:.2f}M parameters, {'GPU' if on_gpu else 'CPU'} "
              f"({'tiny' if args.tiny else 'gpu' if on_gpu else 'cpu'} preset), seq_len {args.seq_len}, "
              f"{args.max_steps} steps ({args.dense_pretrain_steps} dense pre-training, {args.dense_warmup_steps} dense "
              "warm-up, then sparse)", flush=True)
    config_overrides = {}
    if args.topk is not None:
        config_overrides["topk"] = args.topk
    if args.indexer_loss_coef is not None:
        config_overrides["indexer_loss_coef"] = args.indexer_loss_coef
    if args.lm_loss_chunk is not None:
        config_overrides["lm_loss_chunk"] = args.lm_loss_chunk
    if args.model is not None:
        for name in ("index_n_heads", "index_head_dim"):
            if getattr(args, name) is not None:
                config_overrides[name] = getattr(args, name)
    hyscale_hf.patch_model(model, **config_overrides)
    if args.lora_r > 0:
        model = add_lora(model, args.lora_r)

    # Enough text for every step plus a held-out block (bytes per token ~ 1 for the byte tokenizer,
    # ~4 for subword tokenizers; over-asking is cheap).
    tokens_needed = (args.max_steps * args.batch_size * args.grad_accum * world_size + 2) * args.seq_len + args.eval_tokens
    chars_per_token = 1.1 if args.model is None and args.tokenizer is None else 5.0
    datasets.disable_progress_bars()
    docs = training_documents(args, int(tokens_needed * chars_per_token))
    blocks = pack(docs, tokenizer, args.seq_len)
    held_out_blocks = max(1, math.ceil(args.eval_tokens / args.seq_len))
    if len(blocks) <= held_out_blocks:
        raise SystemExit(f"only {len(blocks)} blocks of {args.seq_len} tokens; use more data or a shorter --seq_len")
    train_set = blocks.select(range(len(blocks) - held_out_blocks))
    eval_ids = torch.tensor(blocks.select(range(len(blocks) - held_out_blocks, len(blocks)))["input_ids"])
    eval_ids = eval_ids.reshape(1, -1)[:, : args.eval_tokens]

    callback = hyscale_hf.HyScaleCallback(dense_warmup_steps=args.dense_warmup_steps,
                                          dense_pretrain_steps=args.dense_pretrain_steps)
    trainer = Trainer(model=model, args=_training_arguments(args, world_size), train_dataset=train_set,
                      processing_class=tokenizer)
    callback.add_to(trainer)  # ahead of reporting integrations, so they log its values too
    train_output = trainer.train()
    train_seconds = time.time() - started

    # ---- evaluation (every process runs it: FSDP-sharded models need all ranks in each forward)
    model = trainer.model
    model.eval()
    device = next(model.parameters()).device
    live_config = hyscale_hf.patched_config(model)
    live_config.dense_warmup = False
    recall, recall_best = hyscale_hf.measure_topk_recall(model, {"input_ids": eval_ids.to(device)}, return_best=True)
    builder = PasskeyBuilder(tokenizer, args.passkey_length)
    passkey = passkey_accuracy(model, builder, args.depths, args.passkey_trials, seed=args.seed + 1)

    # ---- save, reload, compare
    if trainer.is_fsdp_enabled:
        # FSDP with SHARDED_STATE_DICT: save_model would write no weights; gather a full checkpoint.
        trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
    trainer.save_model(str(out))
    results = {
        "model": args.model or "glm_moe_dsa (random init, built in code)",
        "dataset": args.dataset or "python standard library sources",
        "seq_len": args.seq_len, "max_steps": args.max_steps, "dense_pretrain_steps": args.dense_pretrain_steps,
        "dense_warmup_steps": args.dense_warmup_steps,
        "train_tokens": int(args.max_steps * args.batch_size * args.grad_accum * world_size * args.seq_len),
        "train_seconds": round(train_seconds, 1), "final_train_loss": train_output.training_loss,
        "topk": live_config.topk, "topk_recall_held_out": recall, "topk_recall_best_held_out": recall_best,
        "passkey_accuracy": passkey["accuracy"], "passkey_token_accuracy": passkey["token_accuracy"],
        "passkey_per_depth": {str(k): v for k, v in passkey["per_depth"].items()},
        "selection_stats": hyscale_hf.selection_stats(),
    }
    if trainer.is_world_process_zero():
        (out / "hyscale_config.json").write_text(json.dumps(dataclasses.asdict(live_config), indent=2))
        (out / "log_history.json").write_text(json.dumps(trainer.state.log_history, indent=1))
        # A sharded (FSDP) model cannot run a forward on one rank alone: check reloads in one-process runs.
        if args.lora_r == 0 and world_size == 1:
            results["reload_max_abs_logit_diff"] = reload_check(AutoModelForCausalLM, out, model,
                                                                 eval_ids[:, : min(256, eval_ids.shape[1])])
        curve = plot_training_curves(trainer.state.log_history, args.dense_warmup_steps, out / "loss_curve.png",
                                     title=f"{results['model']}, {args.seq_len} tokens, top-{live_config.topk}",
                                     dense_pretrain_steps=args.dense_pretrain_steps)
        results["loss_curve"] = str(curve)
        results["total_seconds"] = round(time.time() - started, 1)
        (out / "results.json").write_text(json.dumps(results, indent=2))
        print_summary(results, out)
    return results


def reload_check(auto_cls, out: Path, model, ids: torch.Tensor) -> float:
    """Load the saved checkpoint, patch it with the saved HyScaleConfig, and compare logits."""
    saved = hyscale_hf.HyScaleConfig(**json.loads((out / "hyscale_config.json").read_text()))
    device = next(model.parameters()).device
    reloaded = auto_cls.from_pretrained(str(out), dtype=next(model.parameters()).dtype).to(device).eval()
    hyscale_hf.patch_model(reloaded, saved)
    with torch.no_grad():
        a = model(input_ids=ids.to(device)).logits.float()
        b = reloaded(input_ids=ids.to(device)).logits.float()
    return float((a - b).abs().max())


def print_summary(results: dict, out: Path) -> None:
    depth = "  ".join(f"{k}: {v:.2f}" for k, v in results["passkey_per_depth"].items())
    recall = results["topk_recall_held_out"]
    print(
        "\n=== hyscale_hf long-context fine-tuning ===\n"
        f"model            {results['model']}\n"
        f"data             {results['dataset']}\n"
        f"training         {results['train_tokens']} tokens, {results['train_seconds']} s (model, data and training)\n"
        f"final LM loss    {results['final_train_loss']:.4f}\n"
        f"top-k recall     {'n/a' if recall is None else f'{recall:.3f}'} (share of the dense attention mass on the "
        f"indexer's top-{results['topk']} keys, held-out text; the attention's own top-{results['topk']} holds "
        f"{'n/a' if recall is None else format(results['topk_recall_best_held_out'], '.3f')})\n"
        f"passkey          accuracy {results['passkey_accuracy']:.2f} (per depth {depth}), "
        f"token accuracy {results['passkey_token_accuracy']:.2f}\n"
        + (f"reload check     max |logit diff| {results['reload_max_abs_logit_diff']:.2e}\n"
           if "reload_max_abs_logit_diff" in results else "")
        + f"outputs          {out}/ (checkpoint, hyscale_config.json, loss_curve.png, log_history.json, results.json)\n"
    )


if __name__ == "__main__":
    main()
