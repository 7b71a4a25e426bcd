"""Benchmark: a GLM-5-shaped stack trained with accelerate FSDP2 on 2 GPUs against 1 GPU.

The model is the GLM-5-shaped ``glm_moe_dsa`` stack of ``hyscale_hf.benchmarking.stacks`` (hidden
6144, 64 heads, q_lora 2048, kv_lora 512, qk_nope 192, rope 64, v 256, 32 indexer heads of dim
128, topk 2048, dense MLPs of 12288, vocab 32000), ``--layers`` layers, seeded random init, patched by hyscale_hf, each decoder
layer checkpointed by ``hyscale_hf.wrap_layers_for_replay`` (selection replay), AdamW. Every
optimizer step takes the same global batch of ``--global_batch`` sequences of ``--seq_len`` random
tokens; each process runs its share one sequence at a time (gradient accumulation), so a 1-process
and a 2-process run take the same optimizer steps and their losses must agree up to bf16 rounding.

Recorded per step: LM loss and indexer loss (means over the global batch), wall time (all
processes synchronised); per process: peak GPU memory; selection-replay counters. Run from the
repository root (PYTHONPATH=. or the package installed):

    accelerate launch --config_file scripts/accelerate/fsdp2_2gpu.yaml scripts/bench_fsdp2.py \\
        --seq_len 32768 --out results/fsdp2_2gpu.json
    accelerate launch --config_file scripts/accelerate/fsdp2_2gpu.yaml --num_processes 1 scripts/bench_fsdp2.py \\
        --seq_len 32768 --out results/fsdp2_1gpu.json
    python scripts/bench_fsdp2.py --compare results/fsdp2_1gpu.json results/fsdp2_2gpu.json

``--tiny``: tiny dims on the CPU (smoke test, with scripts/accelerate/fsdp2_cpu_gloo.yaml).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

import hyscale_hf
from hyscale_hf.benchmarking.stacks import GLM5, TINY, build_model


def run(args) -> dict:
    from accelerate import Accelerator

    accelerator = Accelerator()
    rank, world, device = accelerator.process_index, accelerator.num_processes, accelerator.device
    if args.global_batch % world:
        raise ValueError(f"--global_batch {args.global_batch} does not split over {world} processes")
    per_rank = args.global_batch // world
    dims = TINY if args.tiny else GLM5
    # fp32 weights: with mixed_precision bf16, accelerate's FSDP2 keeps fp32 sharded masters and
    # computes in bf16 (it would upcast bf16 trainable weights to fp32 anyway).
    model = build_model(dims, args.layers, args.seq_len, device, torch.float32)
    hyscale_hf.patch_model(model, indexer_loss_coef=args.indexer_loss_coef)
    hyscale_hf.wrap_layers_for_replay(model)
    model.config.use_cache = False
    state = hyscale_hf.patching.patch_state(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer = accelerator.prepare(model, optimizer)

    gen = torch.Generator().manual_seed(1)
    data = [torch.randint(3, dims["vocab_size"], (args.global_batch, args.seq_len), generator=gen)
            for _ in range(args.steps)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    hyscale_hf.reset_selection_stats()
    rows = []
    for step, batch in enumerate(data):
        accelerator.wait_for_everyone()
        _sync(device)
        t0 = time.perf_counter()
        lm = torch.zeros((), device=device)
        for i in range(per_rank):  # this process's sequences, one at a time
            ids = batch[rank * per_rank + i : rank * per_rank + i + 1].to(device)
            loss = model(input_ids=ids, labels=ids).loss / per_rank
            accelerator.backward(loss)
            lm += loss.detach()
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        accelerator.wait_for_everyone()
        seconds = time.perf_counter() - t0
        indexer_loss = state.pop_indexer_loss()  # None when no layer computed it (coefficient 0)
        indexer = torch.tensor(float("nan") if indexer_loss is None else indexer_loss, device=device)
        row = {"step": step, "seconds": seconds, "lm_loss": accelerator.reduce(lm, "mean").item(),
               "indexer_loss": accelerator.reduce(indexer, "mean").item()}
        rows.append(row)
        if accelerator.is_main_process:
            print(f"step {step}: {seconds:.2f} s, LM loss {row['lm_loss']:.4f}, indexer loss {row['indexer_loss']:.5f}",
                  flush=True)

    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    peaks = accelerator.gather(torch.tensor([peak], device=device)).tolist()
    stats = {k: accelerator.reduce(torch.tensor(v, device=device), "sum").item()
             for k, v in hyscale_hf.selection_stats().items()}
    timed = [r["seconds"] for r in rows[args.warmup :]] or [r["seconds"] for r in rows]
    import transformers

    return {
        "benchmark": "FSDP2 training step, GLM-5-shaped stack, selection replay (wrap_layers_for_replay)",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "processes": world, "distributed_type": str(accelerator.distributed_type),
        "mixed_precision": accelerator.mixed_precision, "torch": torch.__version__,
        "transformers": transformers.__version__, "layers": args.layers, "dims": dims, "seq_len": args.seq_len,
        "global_batch": args.global_batch, "tokens_per_step": args.global_batch * args.seq_len,
        "steps": rows, "warmup_steps": args.warmup, "median_step_seconds": statistics.median(timed),
        "tokens_per_second": args.global_batch * args.seq_len / statistics.median(timed),
        "peak_gib_per_process": peaks, "selection_stats": stats,
    }


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compare(paths: list[str]) -> str:
    results = [json.loads(Path(p).read_text()) for p in paths]
    base = results[0]
    lines = [f"{'run':<28} | procs | median step s | tokens/s | peak GiB per process | max |dLM| vs first | "
             "max |dIndexer| vs first | indexer runs fwd/recompute"]
    for path, r in zip(paths, results):
        steps = min(len(r["steps"]), len(base["steps"]))
        d_lm = max(abs(r["steps"][i]["lm_loss"] - base["steps"][i]["lm_loss"]) for i in range(steps))
        d_ix = max(abs(r["steps"][i]["indexer_loss"] - base["steps"][i]["indexer_loss"]) for i in range(steps))
        peaks = ", ".join(f"{p:.1f}" for p in r["peak_gib_per_process"])
        s = r["selection_stats"]
        lines.append(f"{os.path.basename(path):<28} | {r['processes']:>5} | {r['median_step_seconds']:>13.2f} | "
                     f"{r['tokens_per_second']:>8.0f} | {peaks:>20} | {d_lm:>18.2e} | {d_ix:>23.2e} | "
                     f"{s['indexer_forward']:.0f}/{s['indexer_recompute']:.0f}")
    lines.append("LM loss per step: " + "; ".join(
        f"{os.path.basename(p)}: " + " ".join(f"{row['lm_loss']:.4f}" for row in r["steps"]) for p, r in zip(paths, results)))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="results JSON (written by the main process)")
    p.add_argument("--tiny", action="store_true", help="tiny dims on the CPU (smoke test)")
    p.add_argument("--seq_len", type=int, help="tokens per sequence (default 32768; --tiny: 32)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--global_batch", type=int, default=2, help="sequences per optimizer step, over all processes")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the median step time")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--indexer_loss_coef", type=float, default=1e-3,
                   help="at 1e-3 the indexer's gradients are tiny and AdamW turns their rounding noise into "
                   "visible loss differences between runs; 1.0 makes the 1- vs 2-process comparison tight")
    p.add_argument("--compare", nargs="+", metavar="JSON", help="only print a table of results files (first = reference)")
    args = p.parse_args()
    if args.compare:
        print(compare(args.compare))
        return
    if not args.out:
        p.error("--out is required (or --compare)")
    args.seq_len = args.seq_len or (32 if args.tiny else 32768)
    for name in ("seq_len", "layers", "global_batch", "steps"):
        if getattr(args, name) <= 0:
            p.error(f"--{name} must be positive")
    result = run(args)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(compare([args.out]))
        print("wrote", args.out)


if __name__ == "__main__":
    main()
