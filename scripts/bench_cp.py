"""Context parallelism: per-rank step time, tokens/s, peak memory and the collectives' share of a step.

    torchrun --nproc_per_node 2 scripts/bench_cp.py --tokens-per-rank 262144 --out results/   # 2 GPUs
    torchrun --nproc_per_node 8 scripts/bench_cp.py --tokens-per-rank 524288 --out results/   # 8 GPUs
    torchrun --nproc_per_node 2 scripts/bench_cp.py --tiny --out /tmp/bench_cp                  # 2 CPU processes

In one run, on every rank (a training step of a benchmark stack: forward, backward, AdamW):

1. baseline: the stack on this rank alone at ``--tokens-per-rank`` tokens (no collectives), so each GPU
   measures the single-GPU figure at the same tokens per GPU;
2. context parallel: ``hyscale_hf.enable_context_parallel`` over all ranks, one sequence of
   ``world x --tokens-per-rank`` tokens.

Printed and written by rank 0 (``bench_cp.json``, ``bench_cp.png``): per rank, both step times, tokens/s
and peak memory; the per-GPU throughput of context parallelism against the baseline (the multi-GPU
issue asks >= 0.85); and the share of a context-parallel step spent in its collectives (device time of
the all-gather and reduce-scatter kernels over the step; on CPU, the time of the c10d calls), from one
profiled step. An OOM is recorded with its message instead of a figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist

import hyscale_hf
from hyscale_hf.benchmarking.cli import require_positive
from hyscale_hf.benchmarking.memory import free, is_oom, oom_message
from hyscale_hf.benchmarking.stacks import STACKS, make_arm, sync, time_ms

_COLLECTIVES = ("allgather", "all_gather", "reduce_scatter", "reducescatter")


def step_fn(model, optimizer, ids):
    def step():
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()

    return step


def measure(step, device, warmup: int, reps: int) -> dict:
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = time_ms(step, device, reps)
    ms = statistics.median(times)
    return {"step_ms": ms, "times_ms": times,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None}


def collective_share(step, device) -> float:
    """Share of one step's time in all-gather / reduce-scatter (device kernels on CUDA, c10d calls on CPU)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=activities) as prof:
        ms = time_ms(step, device, 1)[0]
    total = 0.0
    for event in prof.key_averages():
        name = event.key.lower()
        if not any(c in name for c in _COLLECTIVES):
            continue
        if device.type == "cuda":
            total += getattr(event, "self_device_time_total", 0.0) or getattr(event, "self_cuda_time_total", 0.0)
        elif name.startswith("c10d::"):
            total += event.cpu_time_total
    return total / 1e3 / ms


def run_phase(name: str, build, warmup: int, reps: int, device, profile_share: bool) -> dict:
    try:
        model, optimizer, ids = build()
        step = step_fn(model, optimizer, ids)
        row = {"phase": name, "tokens": ids.shape[1], **measure(step, device, warmup, reps)}
        if profile_share:
            row["collective_share"] = collective_share(step, device)
    except Exception as err:  # noqa: BLE001 - only OOM is expected; others re-raised
        if not is_oom(err):
            raise
        row = {"phase": name, "oom": True, "error": oom_message(err)}
    free(device)
    return row


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stack", choices=sorted(STACKS), default="glm5")
    p.add_argument("--arm", choices=("hyscale", "tiled", "tiled_offload"), default="hyscale",
                   help="patch options of bench_e2e's arm of that name (tiling and offload for the longest contexts)")
    p.add_argument("--tokens-per-rank", type=int, default=131072)
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the stack's)")
    p.add_argument("--loss-chunk", type=int, default=16384, help="HyScaleConfig.lm_loss_chunk")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="toy dims on CPU processes (gloo), a smoke run")
    p.add_argument("--out", default="outputs/bench_cp")
    args = p.parse_args(argv)
    require_positive(p, args, *("tokens_per_rank", "loss_chunk", "reps"))
    if args.tokens_per_rank % 2:
        p.error(f"--tokens-per-rank must be even (two chunks per rank), got {args.tokens_per_rank}")
    cuda = torch.cuda.is_available() and not args.tiny
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    stack = STACKS[args.stack]
    dims = stack["tiny"] if args.tiny else stack["dims"]
    layers = args.layers or stack["layers"]
    per_rank = 16 if args.tiny else args.tokens_per_rank
    T = world * per_rank
    chunk = min(args.loss_chunk, per_rank)

    def build(tokens: int, cp: bool):
        def make():
            model, optimizer = make_arm(args.stack, args.arm, dims, layers, tokens, device, dtype, lm_loss_chunk=chunk,
                                        **({"tile_tokens": 8} if args.tiny else {}))
            if cp:
                hyscale_hf.enable_context_parallel(model)
            g = torch.Generator().manual_seed(tokens)  # the same sequence on every rank of the group
            ids = torch.randint(3, dims["vocab_size"], (1, tokens), generator=g).to(device)
            return model, optimizer, ids

        return make

    rows = [run_phase("baseline", build(per_rank, False), args.warmup, args.reps, device, False)]
    dist.barrier()
    rows.append(run_phase("context_parallel", build(T, True), args.warmup, args.reps, device, True))
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    result = {"stack": args.stack, "arm": args.arm, "layers": layers, "world": world, "tokens_per_rank": per_rank, "tokens": T,
              "device": torch.cuda.get_device_name() if cuda else "cpu", "ranks": gathered}
    if rank == 0:
        report(result, args.out)
    dist.barrier()
    return result


def report(result: dict, out: str) -> None:
    lines = []

    def fig(row):
        if row.get("oom"):
            return "OOM"
        row["tokens_per_s_per_gpu"] = result["tokens_per_rank"] / row["step_ms"] * 1e3
        peak = "" if row["peak_gib"] is None else f", peak {row['peak_gib']:.1f} GiB"
        return f"{row['step_ms']:.0f} ms ({row['tokens_per_s_per_gpu']:.0f} tok/s per GPU{peak})"

    for r, (base, cp) in enumerate(result["ranks"]):
        ratio = None
        if not base.get("oom") and not cp.get("oom"):
            # Per-GPU throughput: the CP step moves tokens_per_rank of this rank's tokens in cp's step time.
            ratio = base["step_ms"] / cp["step_ms"]
            cp["per_gpu_throughput_vs_baseline"] = ratio
        share = cp.get("collective_share")
        lines.append(f"rank {r}: baseline {fig(base)}; context parallel {fig(cp)}"
                     + ("" if ratio is None else f"; per-GPU throughput {ratio:.3f}x of baseline")
                     + ("" if share is None else f"; collectives {100 * share:.1f}% of the step"))
    print(f"{result['stack']} stack, {result['world']} ranks x {result['tokens_per_rank']} tokens "
          f"= {result['tokens']} tokens per sequence")
    print("\n".join(lines))
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench_cp.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(out, "bench_cp.png"))


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = range(result["world"])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, phase in enumerate(("baseline", "context_parallel")):
        ms = [rows[i].get("step_ms", 0) or 0 for rows in result["ranks"]]
        ax.bar([r + 0.4 * i for r in ranks], ms, width=0.4, label=f"{phase} ({result['tokens_per_rank'] if i == 0 else result['tokens']} tokens)")
    ax.set_xlabel("rank")
    ax.set_ylabel("step time (ms)")
    ax.set_title(f"context parallelism, {result['world']} ranks, {result['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    try:
        main()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
