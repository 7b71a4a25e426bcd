"""The chunked LM loss, forward + backward, on its two paths and against the whole-logits loss.

One sequence of T tokens through an LM head of GLM-5's size (hidden 6144, vocabulary 154880), bf16,
``chunk`` tokens at a time. Arms, in the same process on the same inputs:

- ``fused``: ``chunked_cross_entropy`` with the head as an ``nn.Linear``: gradients formed in forward,
  the cross-entropy's in one Triton kernel;
- ``checkpointed``: the same call with the head as a plain callable (as a LoRA or FSDP-wrapped head
  is taken): checkpointed chunks, the logits recomputed in backward;
- ``whole``: ``F.cross_entropy`` over the whole fp32 logits (Transformers' loss), where it fits.

Prints the times and the ratios to ``fused``; writes ``bench_lm_loss.json`` and ``.png`` to ``--out``.

    python scripts/bench_lm_loss.py --out $OUT/lm_loss [--seqlens 65536 131072] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch import nn

from hyscale_hf.benchmarking.cli import require_positive
from hyscale_hf.benchmarking.memory import is_oom
from hyscale_hf.benchmarking.stacks import time_ms
from hyscale_hf.kernels import chunked_cross_entropy

ARMS = ("fused", "checkpointed", "whole")


def loss_fn(arm: str, head: nn.Linear, chunk: int):
    if arm == "fused":
        return lambda h, y: chunked_cross_entropy(h, head, y, chunk)
    if arm == "checkpointed":
        return lambda h, y: chunked_cross_entropy(h, lambda x: F.linear(x, head.weight), y, chunk)
    return lambda h, y: F.cross_entropy(head(h).float(), y)


def measure(arm: str, T: int, args, device, dtype) -> dict:
    g = torch.Generator(device=device).manual_seed(T)
    head = nn.Linear(args.hidden, args.vocab, bias=False, device=device, dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(args.vocab, args.hidden, device=device, generator=g) * args.hidden**-0.5)
    h = torch.randn(T, args.hidden, device=device, generator=g).to(dtype).requires_grad_()
    y = torch.randint(0, args.vocab, (T,), device=device, generator=g)
    fn = loss_fn(arm, head, args.chunk)

    def step():
        h.grad = head.weight.grad = None
        fn(h, y).backward()

    row = {"arm": arm, "T": T}
    try:
        step()  # warm-up: Triton compilation, cuBLAS heuristics, allocator
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        times = time_ms(step, device, args.reps)
        row["ms"] = sorted(times)[len(times) // 2]
        if device.type == "cuda":
            row["peak_gib_above_inputs"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    except Exception as err:  # noqa: BLE001 - only an out-of-memory becomes a row
        if not is_oom(err):
            raise
        row["oom"] = True
    print(f"{arm:>13} T={T:>7}: " + (f"{row['ms']:.1f} ms" if "ms" in row else "out of memory"), flush=True)
    return row


def plot(result: dict, path: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for arm in result["arms"]:
        rows = [r for r in result["rows"] if r["arm"] == arm and "ms" in r]
        ax.plot([r["T"] for r in rows], [r["ms"] for r in rows], marker="o", label=arm)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens")
    ax.set_ylabel("forward + backward ms")
    ax.set_title(f"LM loss, hidden {result['hidden']}, vocab {result['vocab']}, chunk {result['chunk']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlens", nargs="+", type=int, default=None, help="default: 65536 131072 (GPU), 64 (--tiny)")
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    p.add_argument("--hidden", type=int, default=None, help="default: 6144 (GLM-5), 32 (--tiny)")
    p.add_argument("--vocab", type=int, default=None, help="default: 154880 (GLM-5), 500 (--tiny)")
    p.add_argument("--chunk", type=int, default=None, help="tokens per chunk; default: 16384, 16 (--tiny)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="toy sizes on the CPU (smoke test)")
    p.add_argument("--out", default="outputs/bench_lm_loss")
    args = p.parse_args(argv)
    args.seqlens = args.seqlens or ([64] if args.tiny else [65536, 131072])
    for name, tiny, full in (("hidden", 32, 6144), ("vocab", 500, 154880), ("chunk", 16, 16384)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    require_positive(p, args, "hidden", "vocab", "chunk", "reps")
    if any(T <= 0 for T in args.seqlens):
        p.error(f"--seqlens must be positive, got {args.seqlens}")
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "dtype": str(dtype), "hidden": args.hidden, "vocab": args.vocab, "chunk": args.chunk,
              "reps": args.reps, "arms": args.arms, "rows": [], "ratios_vs_fused": {}}
    os.makedirs(args.out, exist_ok=True)
    for T in args.seqlens:
        for arm in args.arms:
            result["rows"].append(measure(arm, T, args, device, dtype))
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the arm's tensors went with measure's frame
    fused = {r["T"]: r["ms"] for r in result["rows"] if r["arm"] == "fused" and "ms" in r}
    for r in result["rows"]:
        if r["arm"] != "fused" and "ms" in r and r["T"] in fused:
            result["ratios_vs_fused"].setdefault(r["arm"], {})[str(r["T"])] = r["ms"] / fused[r["T"]]
    for arm, ratios in result["ratios_vs_fused"].items():
        print(f"{arm} / fused: " + ", ".join(f"T={T}: {x:.2f}x" for T, x in ratios.items()))
    path = os.path.join(args.out, "bench_lm_loss.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path, "and the plot" if plot(result, os.path.join(args.out, "bench_lm_loss.png")) else "")
    return result


if __name__ == "__main__":
    main()
