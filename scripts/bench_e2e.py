"""End-to-end benchmark: one training step of a model stack, and the longest trainable context.

A training step is forward + backward + AdamW step with gradient checkpointing on every layer, on one
sequence of T tokens (bf16). Stacks (``--stack``, ``hyscale_hf.benchmarking.stacks``): ``glm5``, a
GLM-5-shaped DSA model (2 layers by default), and ``smollm2``, a dense Llama with SmolLM2-135M's
dimensions (30 layers), the converted-dense-model case. Arms, each on the same token ids:

  hyscale       patch_model(model): HyTopK + sparse attention + selection replay
  native        glm5 only: the unpatched Transformers glm_moe_dsa path (indexer score table + dense mask)
  dense         glm5: the same dims as deepseek_v3 (MLA without indexer); smollm2: the Llama itself; SDPA
  replay_off    patch_model(model, selection_replay=False)
  lean_off      patch_model(model, lean_activations=False): RMSNorm and MLP keep what Transformers keeps
                (not run unless named in --arms)
  tiled         patch_model(model, tile_tokens=--tile-tokens): token-wise work in checkpointed tiles
  tiled_offload ... and offload_activations=True: checkpointed layer inputs in pinned host memory
                (neither run unless named in --arms)

``--model DIR`` replaces the random-init smollm2 stack with a converted dense model the main job
saved (``finetune_long.py --output_dir DIR``) and the random tokens with real text (the standard
library's sources): the patched arms train it with its trained indexer, ``dense`` without it, so the
sparse kernels run on the selections a trained indexer makes.

For each arm and T: median step time, tokens/s, peak memory, or "OOM". Then the longest context each
arm trains at (doubling T from the largest length that fit until a step runs out of memory or takes
longer than --step-cap-s). Writes JSON and a PNG plot.

    python scripts/bench_e2e.py --out results/            # GPU: T = 16K..128K, then the search
    python scripts/bench_e2e.py --stack smollm2 --arms hyscale dense --seqlens 32768 131072 --search-arms
    python scripts/bench_e2e.py --stack smollm2 --index-share 2 --arms hyscale dense --seqlens 131072 --search-arms
    python scripts/bench_e2e.py --model /tmp/realmodel --arms hyscale dense --seqlens 32768 131072
    python scripts/bench_e2e.py --tiny --out /tmp/e2e     # CPU smoke run at toy size
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

# Long-context steps allocate and free whole-sequence tensors of many sizes; in the caching allocator's
# fixed segments the freed space fragments (a 1M-token step failed asking 12 GiB with 18 GiB reserved
# but unallocated). Set before torch starts CUDA; a setting in the environment wins. Every arm runs
# under it.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

from hyscale_hf.benchmarking.memory import free, host_pinned_gib, is_oom, oom_message
from hyscale_hf.benchmarking.stacks import ARMS, STACKS, TILE_TOKENS, make_arm, step_loss, time_ms
from hyscale_hf.benchmarking.trained import check_saved, saved_dims, text_ids

DEFAULT_ARMS = ARMS[:4]


def oom_row(T: int, err: BaseException) -> dict:
    """An OOM row, with the message: device memory or pinned host memory (the offload's) ran out."""
    return {"T": T, "oom": True, "error": oom_message(err), "host_pinned_peak_gib": host_pinned_gib()}


def step_ids(T: int, vocab: int, tokenizer=None) -> torch.Tensor:
    """A step's ``[1, T]`` token ids: random (seeded by T), or with the saved model's ``tokenizer``
    real text (the first T tokens of the standard library's sources)."""
    if tokenizer is not None:
        return text_ids(tokenizer, T)
    return torch.randint(3, vocab, (1, T), generator=torch.Generator().manual_seed(T))


def measure(model, optimizer, ids: torch.Tensor, device, warmup: int, reps: int, loss_chunk: int = 0) -> dict:
    T = ids.shape[1]
    ids = ids.to(device)

    def step():
        optimizer.zero_grad(set_to_none=True)
        step_loss(model, ids, loss_chunk).backward()
        optimizer.step()

    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        if hasattr(torch.cuda, "reset_peak_host_memory_stats"):
            torch.cuda.reset_peak_host_memory_stats()
    times = time_ms(step, device, reps)
    ms = statistics.median(times)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return {"T": T, "step_ms": ms, "times_ms": times, "tokens_per_s": T / ms * 1e3, "peak_gib": peak,
            "host_pinned_peak_gib": host_pinned_gib() if device.type == "cuda" else None}


def run_arm(arm: str, args, dims, device, dtype) -> dict:
    """Timed lengths, then the doubling search for the longest trainable context."""
    rows, longest = [], None
    share = {} if args.index_share is None else {"index_share": args.index_share}
    model, optimizer = make_arm(args.stack, arm, dims, args.layers, max(args.search_max, max(args.seqlens)), device,
                                dtype, tile_tokens=args.tile_tokens, saved=args.model, **share)
    try:
        for T in args.seqlens:
            try:
                row = measure(model, optimizer, step_ids(T, dims["vocab_size"], args.tokenizer), device, args.warmup,
                              args.reps, args.loss_chunk)
                longest = T
            except Exception as err:  # noqa: BLE001 - only OOM is expected; others re-raised
                if not is_oom(err):
                    raise
                row = oom_row(T, err)
            optimizer.zero_grad(set_to_none=True)
            free(device)
            print(f"{arm:>10} T={T:>7}: " + ("OOM" if row.get("oom") else
                  f"{row['step_ms']:.0f} ms, {row['tokens_per_s']:.0f} tok/s, peak {row['peak_gib'] or 0:.1f} GiB"),
                  flush=True)
            rows.append(row)
            if row.get("oom"):
                break
        search = []
        tried = {r["T"] for r in rows}
        if longest is not None and arm in args.search_arms:
            T = longest * 2
            while T in tried and T <= args.search_max:  # a timed length already answered (OOM)
                T *= 2
            while T <= args.search_max:
                try:
                    r = measure(model, optimizer, step_ids(T, dims["vocab_size"], args.tokenizer), device, 0, 1,
                                args.loss_chunk)
                    search.append(r)
                    longest = T
                    print(f"{arm:>10} search T={T}: ok, {r['step_ms']:.0f} ms, peak {r['peak_gib'] or 0:.1f} GiB, "
                          f"pinned host {r['host_pinned_peak_gib'] or 0:.1f} GiB", flush=True)
                    if r["step_ms"] > args.step_cap_s * 1e3:
                        break
                except Exception as err:  # noqa: BLE001
                    if not is_oom(err):
                        raise
                    search.append(oom_row(T, err))
                    print(f"{arm:>10} search T={T}: OOM ({search[-1]['error']})", flush=True)
                    break
                finally:
                    optimizer.zero_grad(set_to_none=True)
                    free(device)
                T *= 2
        return {"arm": arm, "rows": rows, "search": search, "longest_trained_T": longest}
    finally:
        del model, optimizer
        free(device)


def ratios(result: dict) -> dict:
    """Step-time ratio of each arm to hyscale at each T where both ran."""
    by_arm = {a["arm"]: {r["T"]: r for r in a["rows"] if not r.get("oom")} for a in result["arms"]}
    out = {}
    for arm, rows in by_arm.items():
        if arm == "hyscale":
            continue
        out[arm] = {str(T): rows[T]["step_ms"] / by_arm["hyscale"][T]["step_ms"]
                    for T in rows if T in by_arm.get("hyscale", {})}
    return out


def tokens(T: int) -> str:
    return f"{T // 1024}K" if T >= 1024 and T % 1024 == 0 else str(T)


def table(result: dict) -> str:
    seqlens = result["seqlens"]
    head = "arm         | " + " | ".join(f"T={tokens(T)} ms (GiB)" for T in seqlens) + " | longest trained T"
    lines = [head]
    for a in result["arms"]:
        cells = []
        rows = {r["T"]: r for r in a["rows"]}
        for T in seqlens:
            r = rows.get(T)
            peak = "-" if r is None or r.get("peak_gib") is None else f"{r['peak_gib']:.0f}"
            cells.append("-" if r is None else "OOM" if r.get("oom") else f"{r['step_ms']:.0f} ({peak})")
        searched = "" if a["search"] else " (not searched)"  # the longest timed length, not a limit
        lines.append(f"{a['arm']:<11} | " + " | ".join(f"{c:>16}" for c in cells) + f" | {a['longest_trained_T']}{searched}")
    for arm, rs in result["ratios_vs_hyscale"].items():
        lines.append(f"{arm} / hyscale step time: " + ", ".join(f"T={T}: {v:.2f}x" for T, v in rs.items()))
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for a in result["arms"]:
        rows = [r for r in a["rows"] + a["search"] if not r.get("oom")]
        if rows:
            ax1.plot([r["T"] for r in rows], [r["step_ms"] for r in rows], "o-", label=a["arm"])
            if rows[0]["peak_gib"] is not None:
                ax2.plot([r["T"] for r in rows], [r["peak_gib"] for r in rows], "o-", label=a["arm"])
    for ax, ylabel in ((ax1, "step time (ms)"), (ax2, "peak memory (GiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per sequence")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend()
    label = result.get("model") or STACKS[result["stack"]]["label"]
    fig.suptitle(f"{label} training step ({result['layers']} layers, {result['device']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="outputs/bench_e2e", help="folder for bench_e2e.json and bench_e2e.png")
    p.add_argument("--tiny", action="store_true", help="toy dims on the CPU (smoke test)")
    p.add_argument("--stack", choices=sorted(STACKS), default=None,
                   help="model stack (default: glm5; smollm2 with --model)")
    p.add_argument("--model", default=None,
                   help="a converted dense model saved by finetune_long.py (its --output_dir), trained instead of the "
                        "random-init smollm2 stack, on real text: the patched arms with its trained indexer, dense "
                        "without it")
    p.add_argument("--arms", nargs="+", default=None, choices=ARMS,
                   help="default: hyscale native dense replay_off (glm5), hyscale dense replay_off (smollm2)")
    p.add_argument("--seqlens", nargs="+", type=int, default=None)
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: 2 for glm5, 30 for smollm2)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--search-max", type=int, default=None, help="largest T tried by the doubling search")
    p.add_argument("--step-cap-s", type=float, default=60.0, help="stop the search once a step takes longer")
    p.add_argument("--loss-chunk", type=int, default=0,
                   help="tokens per LM-head/cross-entropy chunk (0: the model's own loss over whole logits)")
    p.add_argument("--tile-tokens", type=int, default=None,
                   help=f"tile_tokens of the tiled arms (default: {TILE_TOKENS}, 16 with --tiny)")
    p.add_argument("--search-arms", nargs="*", default=None, choices=ARMS,
                   help="arms that run the longest-context search (none: skip it)")
    p.add_argument("--index-share", type=int, default=None,
                   help="smollm2 stack: an indexer on every N-th layer in the patched arms, the layers between "
                        "reusing its selection (HyScaleConfig.index_share; a --model keeps its saved layout)")
    args = p.parse_args(argv)
    if args.model is not None:
        if reason := check_saved(args.model):
            p.error(f"--model {args.model}: {reason}")
        if args.stack not in (None, "smollm2"):
            p.error(f"--model runs a saved converted dense model as the smollm2 stack, not --stack {args.stack}")
        if args.tiny or args.layers:
            p.error("--model: the saved model sets the dims and layers (drop --tiny / --layers)")
    args.stack = args.stack or ("smollm2" if args.model else "glm5")
    if args.index_share is not None and (args.index_share <= 0 or args.stack == "glm5" or args.model is not None):
        p.error(f"--index-share {args.index_share}: a positive N, for the random-init smollm2 stack (the glm5 stack's "
                "and a saved --model's indexer layers are their own)")
    stack = STACKS[args.stack]
    default_arms = [a for a in DEFAULT_ARMS if not (args.stack == "smollm2" and a == "native")]
    args.arms = args.arms or default_arms
    args.search_arms = default_arms if args.search_arms is None else args.search_arms
    if args.stack == "smollm2" and "native" in args.arms + args.search_arms:
        p.error("--arms native: the smollm2 stack is a dense model (its unpatched arm is 'dense')")
    args.layers = args.layers or stack["layers"]
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    dims = stack["tiny"] if args.tiny else stack["dims"]
    args.tokenizer = None
    if args.model is not None:
        dims, args.layers, args.tokenizer = saved_dims(args.model, stack["dims"])
    args.seqlens = args.seqlens or ([32, 64] if args.tiny else [16384, 32768, 65536, 131072])
    args.search_max = args.search_max or (256 if args.tiny else 1 << 20)
    args.tile_tokens = args.tile_tokens or (16 if args.tiny else TILE_TOKENS)
    if args.tile_tokens <= 0:
        p.error(f"--tile-tokens must be positive, got {args.tile_tokens}")
    import transformers

    result = {
        "benchmark": f"{stack['label']} training step (fwd+bwd+AdamW, gradient checkpointing)", "stack": args.stack,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__, "dtype": str(dtype),
        "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "model": args.model, "text": "stdlib sources" if args.model else "random tokens",
        "layers": args.layers, "dims": dims, "seqlens": args.seqlens, "warmup": args.warmup, "reps": args.reps,
        "loss_chunk": args.loss_chunk, "tile_tokens": args.tile_tokens, "index_share": args.index_share, "arms": [],
    }
    os.makedirs(args.out, exist_ok=True)
    for arm in args.arms:  # the JSON is rewritten after each arm, so a cut-short run keeps what finished
        result["arms"].append(run_arm(arm, args, dims, device, dtype))
        result["ratios_vs_hyscale"] = ratios(result)
        with open(os.path.join(args.out, "bench_e2e.json"), "w") as f:
            json.dump(result, f, indent=1)
    plot(result, os.path.join(args.out, "bench_e2e.png"))
    print(table(result))
    return result


if __name__ == "__main__":
    main()
