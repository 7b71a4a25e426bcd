"""Benchmark: selection replay on vs off under gradient checkpointing, GLM-5-shaped stack, one GPU.

A patched glm_moe_dsa model with GLM-5's attention and indexer dims (hidden 6144, 64 heads,
q_lora 2048, kv_lora 512, qk_nope 192, rope 64, v 256, 32 indexer heads of dim 128, topk 2048),
two layers with dense MLPs, a small vocabulary, bf16, one sequence of T tokens, gradient
checkpointing on every layer. Each step is forward + backward (LM loss + indexer loss).

Arms, in the same run on the same inputs, alternating:
  - ``replay off``: patched with ``selection_replay=False``: checkpoint recompute reruns the
    indexer (HyTopK) of every layer in backward;
  - ``replay on``: ``enable_selection_replay``: the recompute takes the forward's indices.
Also HyTopK alone at the same T (H = 32, D = 128, topk 2048): replay should save about
``layers x HyTopK`` per step. Each arm records median step time, peak memory and
``selection_stats()`` per step (indexer runs in forward / recompute, replayed selections).

Run from the repository root (PYTHONPATH=. or the package installed):

    python scripts/bench_replay.py --out results/                # T = 32768 65536, JSON (+ PNG)
    python scripts/bench_replay.py --tiny --out /tmp/replay      # CPU smoke run at a tiny size
    python scripts/bench_replay.py --plot results/bench_replay.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics

import torch

import hyscale_hf
from hyscale_hf.benchmarking.stacks import GLM5, TINY, build_model, enable_checkpointing, time_ms


def bench_hytopk(T: int, dims: dict, device, dtype, reps: int) -> float:
    H, D, K = dims["index_n_heads"], dims["index_head_dim"], dims["index_topk"]
    gen = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(1, T, H, D, device=device, generator=gen).to(dtype)
    k = torch.randn(1, T, D, device=device, generator=gen).to(dtype)
    w = torch.rand(1, T, H, device=device, generator=gen) * H**-0.5
    fn = lambda: hyscale_hf.hytopk(q, k, w, K)
    if device.type == "cuda":
        import triton

        return float(triton.testing.do_bench(fn, warmup=50, rep=500, return_mode="median"))
    fn()
    return statistics.median(time_ms(fn, device, reps))


def bench_step(model, ids, device, warmup: int, reps: int) -> dict:
    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    hyscale_hf.reset_selection_stats()
    times = time_ms(step, device, reps)
    stats = {k: v / reps for k, v in hyscale_hf.selection_stats().items()}
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return {"median_ms": statistics.median(times), "times_ms": times, "peak_gib": peak, "stats_per_step": stats}


def run(args) -> dict:
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    dims = TINY if args.tiny else GLM5
    seqlens = args.seqlens or ([64, 128] if args.tiny else [32768, 65536])
    model = build_model(dims, args.layers, max(seqlens), device, dtype)
    hyscale_hf.patch_model(model, selection_replay=False)
    enable_checkpointing(model)
    import transformers

    result = {
        "benchmark": "selection replay under gradient checkpointing (GLM-5-shaped stack, forward+backward)",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__, "dtype": str(dtype),
        "layers": args.layers, "dims": dims, "warmup": args.warmup, "reps": args.reps, "rounds": args.rounds,
        "rows": [],
    }
    for T in seqlens:
        try:
            row = bench_seqlen(model, T, dims, device, dtype, args)
        except torch.cuda.OutOfMemoryError as e:  # keep the other lengths' results
            row = {"T": T, "error": f"out of memory: {str(e).splitlines()[0]}"}
            print(f"T={T}: {row['error']}", flush=True)
        result["rows"].append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


def bench_seqlen(model, T: int, dims: dict, device, dtype, args) -> dict:
    """One sequence length: both arms alternating, then HyTopK alone."""
    gen = torch.Generator(device="cpu").manual_seed(T)
    ids = torch.randint(3, dims["vocab_size"], (1, T), generator=gen).to(device)
    arms = {"off": [], "on": []}
    detail = {}
    for _ in range(args.rounds):  # alternate the arms so drift hits both
        for arm in ("off", "on"):
            undo = hyscale_hf.enable_selection_replay(model) if arm == "on" else None
            r = bench_step(model, ids, device, args.warmup, args.reps)
            if undo is not None:
                undo()
            arms[arm] += r["times_ms"]
            detail[arm] = r
    topk_ms = bench_hytopk(T, dims, device, dtype, args.reps)
    row = {"T": T, "hytopk_ms": topk_ms}
    for arm in ("off", "on"):
        row[f"replay_{arm}"] = {**detail[arm], "median_ms": statistics.median(arms[arm]), "times_ms": arms[arm]}
    row["saved_ms"] = row["replay_off"]["median_ms"] - row["replay_on"]["median_ms"]
    row["speedup"] = row["replay_off"]["median_ms"] / row["replay_on"]["median_ms"]
    row["expected_saving_ms"] = args.layers * topk_ms
    print(f"T={T}: off {row['replay_off']['median_ms']:.1f} ms, on {row['replay_on']['median_ms']:.1f} ms, "
          f"x{row['speedup']:.3f}; HyTopK {topk_ms:.2f} ms; recompute runs/step off "
          f"{row['replay_off']['stats_per_step']['indexer_recompute']:.0f}, on "
          f"{row['replay_on']['stats_per_step']['indexer_recompute']:.0f}", flush=True)
    return row


def table(result: dict) -> str:
    lines = ["   T  | replay off ms | replay on ms | speedup | saved ms | layers x HyTopK ms | recompute runs off/on | peak GiB off/on"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"{r['T']:>6} | {r['error']}")
            continue
        off, on = r["replay_off"], r["replay_on"]
        peak = "-" if off["peak_gib"] is None else f"{off['peak_gib']:.1f}/{on['peak_gib']:.1f}"
        lines.append(
            f"{r['T']:>6} | {off['median_ms']:>13.1f} | {on['median_ms']:>12.1f} | {r['speedup']:>7.3f} | "
            f"{r['saved_ms']:>8.1f} | {r['expected_saving_ms']:>18.1f} | "
            f"{off['stats_per_step']['indexer_recompute']:>10.0f}/{on['stats_per_step']['indexer_recompute']:<10.0f} | {peak}"
        )
    return "\n".join(lines)


def plot(result: dict, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in result["rows"] if "error" not in r]
    if not rows:
        return False
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.38
    off = [r["replay_off"]["median_ms"] for r in rows]
    on = [r["replay_on"]["median_ms"] for r in rows]
    ax.bar([x - width / 2 for x in xs], off, width, label="replay off (indexer recomputed)")
    ax.bar([x + width / 2 for x in xs], on, width, label="replay on")
    for x, r in zip(xs, rows):
        ax.text(x + width / 2, r["replay_on"]["median_ms"], f"x{r['speedup']:.3f}\nHyTopK {r['hytopk_ms']:.1f} ms",
                ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [f"T = {r['T']}" for r in rows])
    ax.set_ylabel("forward + backward step (ms, median)")
    ax.set_title(f"Selection replay, {result['layers']}-layer GLM-5-shaped stack, checkpointing on\n{result['device']}",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results", help="folder for bench_replay.json / .png")
    p.add_argument("--tiny", action="store_true", help="tiny dims on the CPU (smoke test)")
    p.add_argument("--seqlens", type=int, nargs="*", help="sequence lengths T (default 32768 65536)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reps", type=int, default=3, help="timed steps per arm per round")
    p.add_argument("--rounds", type=int, default=2, help="off/on alternations")
    p.add_argument("--plot", metavar="JSON", help="only redraw the PNG from a results JSON")
    args = p.parse_args()
    if args.plot:
        with open(args.plot) as f:
            result = json.load(f)
        png = os.path.splitext(args.plot)[0] + ".png"
        print(table(result))
        print("wrote", png) if plot(result, png) else print("matplotlib missing: no PNG")
        return
    os.makedirs(args.out, exist_ok=True)
    result = run(args)
    path = os.path.join(args.out, "bench_replay.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    png = os.path.join(args.out, "bench_replay.png")
    drawn = plot(result, png)
    print(table(result))
    print("wrote", path, "and " + png if drawn else "(matplotlib missing: no PNG; redraw with --plot)")


if __name__ == "__main__":
    main()
