"""Benchmark: the indexer KL's target (``HeadProbs``) on GQA query tiles, its own kernel against the fused
atomics, at a converted SmolLM2's attention shape (9 query / 3 KV heads, D = 64, K = 2048, bf16).

The sparse stage's layers hand ``sparse_attention`` a ``HeadProbs``: the backward then leaves each
query's head-summed probabilities on its index slots. ``tile_head_probs`` (default) computes them in a
kernel of its own, one program per query tile and all heads, no atomics; the baseline in the same run
adds them inside the tiled backward kernel by one fp32 atomic per (query, head, key)
(``SparseAttentionConfig(tiled_head_probs=False)``). Per T and selection, median ms of:
forward + backward without the target, with the fused atomics, and with the kernel at each
``--configs`` (``BLOCK_N:num_warps``); the targets of both paths are compared (max abs difference).

Selections: ``realistic_selection`` with far tokens shared by 64 neighbouring queries (42-query tiles
then hold unions of a few thousand keys, as a trained SmolLM2 indexer's do on real text:
``bench_trained_selections.py``) and with far tokens drawn per query (wide unions).

    python scripts/bench_head_probs.py --T 32768 131072 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import torch

from hyscale_hf import sparse_attention
from hyscale_hf.benchmarking.inputs import realistic_selection
from hyscale_hf.benchmarking.timing import cuda_median_ms
from hyscale_hf.kernels.sparse_attn import HeadProbs, SparseAttentionConfig

HQ, HKV, D, K = 9, 3, 64, 2048


def step(q, k, v, idx, config, head_probs: bool):
    """One forward + backward; returns the target when asked for."""
    hp = HeadProbs() if head_probs else None
    o = sparse_attention(q, k, v, idx, check_range=False, unique_indices=True, head_probs=hp, config=config)
    o.backward(torch.ones_like(o))
    return hp.take() if hp else None


def bench(T: int, far_share: int, configs: list[tuple[int, int]], reps: int) -> dict:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, T, HQ, D, device=dev, generator=g, dtype=torch.bfloat16).requires_grad_()
    k = torch.randn(1, T, HKV, D, device=dev, generator=g, dtype=torch.bfloat16).requires_grad_()
    v = torch.randn(1, T, HKV, D, device=dev, generator=g, dtype=torch.bfloat16).requires_grad_()
    idx = realistic_selection(T, K, far_share=far_share, device=dev)
    base = SparseAttentionConfig()
    fused = dataclasses.replace(base, tiled_head_probs=False)
    row = {"T": T, "far_share": far_share}
    row["fwd_bwd_ms"] = cuda_median_ms(lambda: step(q, k, v, idx, base, False), reps)
    row["fused_atomics_ms"] = cuda_median_ms(lambda: step(q, k, v, idx, fused, True), reps)
    want = step(q, k, v, idx, fused, True)
    row["kernel"] = []
    for block_n, warps in configs:
        cfg = dataclasses.replace(base, probs_tiled={"BLOCK_N": block_n, "num_warps": warps})
        got = step(q, k, v, idx, cfg, True)
        ms = cuda_median_ms(lambda cfg=cfg: step(q, k, v, idx, cfg, True), reps)
        row["kernel"].append({"BLOCK_N": block_n, "num_warps": warps, "ms": ms,
                              "max_abs_diff": float((got - want).abs().max())})
    best = min(row["kernel"], key=lambda r: r["ms"])
    row["head_sums_fused_ms"] = row["fused_atomics_ms"] - row["fwd_bwd_ms"]
    row["head_sums_kernel_ms"] = best["ms"] - row["fwd_bwd_ms"]
    row["speedup"] = row["fused_atomics_ms"] / best["ms"]
    print(f"T={T} far_share={far_share}: fwd+bwd {row['fwd_bwd_ms']:.2f} ms, with head sums: fused atomics "
          f"{row['fused_atomics_ms']:.2f} ms, kernel " + ", ".join(
              f"{r['BLOCK_N']}x{r['num_warps']}w {r['ms']:.2f} (diff {r['max_abs_diff']:.1e})" for r in row["kernel"])
          + f"; head sums alone {row['head_sums_fused_ms']:.2f} -> {row['head_sums_kernel_ms']:.2f} ms, "
          f"step {row['speedup']:.2f}x", flush=True)
    return row


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"T={r['T'] // 1024}K\nfar/{r['far_share']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(1.8 * len(rows) + 3, 4))
    for off, key, name in [(-0.25, "fwd_bwd_ms", "fwd+bwd, no target"), (0.0, "fused_atomics_ms", "fused atomics"),
                           (0.25, None, "tile_head_probs (best config)")]:
        vals = [r[key] if key else min(c["ms"] for c in r["kernel"]) for r in rows]
        ax.bar([i + off for i in x], vals, 0.25, label=name)
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("ms")
    ax.set_title("GQA sparse attention fwd+bwd with the KL target (9/3 heads, D 64, K 2048)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--far-share", type=int, nargs="+", default=[64, 1])
    ap.add_argument("--configs", nargs="+", default=["64:8", "64:4", "128:8"], help="BLOCK_N:num_warps")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_head_probs.py needs a CUDA GPU")
    configs = [tuple(int(x) for x in c.split(":")) for c in a.configs]
    rows = [bench(T, fs, configs, a.reps) for T in a.T for fs in a.far_share]
    os.makedirs(a.out, exist_ok=True)
    data = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": [HQ, HKV, D, K], "rows": rows}
    with open(os.path.join(a.out, "bench_head_probs.json"), "w") as f:
        json.dump(data, f, indent=1)
    plot(rows, os.path.join(a.out, "bench_head_probs.png"))


if __name__ == "__main__":
    main()
