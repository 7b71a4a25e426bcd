"""Probe: the MLA sparse backward with its dK/dV atomics in key passes of different sizes.

The Gluon dK/dV kernel adds 2.3 KB per (query, key) pair into a [T, 576] fp32 accumulator: 302 MB
at 128K, six times the H200's L2. ``SparseAttentionConfig.mla_bwd_pass_bytes`` splits the adds into
key ranges whose slice of the accumulator stays in L2 (``kernels/sparse_attn/key_passes.py``). This
probe times the whole sparse attention backward (64 heads, Dqk 576, Dv 512, bf16) for each
``--pass-mib`` (0: one pass, the same-run baseline) on two selections:
- ``realistic``: ``realistic_selection`` (sinks, a local window, far tokens), as
  ``bench_sparse_attention.py`` times it;
- ``step``: the first layer's HyTopK selection in the benchmark step (``bench_e2e.py``'s GLM-5
  stack: random-init indexer, random tokens, keys spread over the whole past).
Prints milliseconds and the ratio to one pass; writes JSON.

    python scripts/probe_dkv_passes.py --T 131072 --pass-mib 0 16 32 64 --out results/dkv_passes.json

With ``--scratch-mib`` it times the deterministic backward instead, for each
``SparseAttentionConfig.det_scratch_bytes`` (the first is the baseline): each chunk of queries stores
its pairs' contributions to that much scratch before they are summed per key.

    python scripts/probe_dkv_passes.py --T 32768 --scratch-mib 1024 2048 4096 --selections realistic

``--profile`` also prints each size's kernels (torch.profiler, CUDA time of one backward after the
timed ones): where the time goes, dK/dV against dQ against the deterministic per-key sum.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from torch.profiler import ProfilerActivity, profile

from hyscale_hf import sparse_attention
from hyscale_hf.benchmarking.inputs import realistic_selection
from hyscale_hf.benchmarking.timing import timed
from hyscale_hf.kernels.sparse_attn import SparseAttentionConfig


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, default=131072)
    ap.add_argument("--K", type=int, default=2048)
    ap.add_argument("--pass-mib", type=int, nargs="+", default=[0, 8, 16, 32, 64])
    ap.add_argument("--scratch-mib", type=int, nargs="+", help="time the deterministic backward at these scratch sizes")
    ap.add_argument("--selections", nargs="+", choices=("realistic", "step"), default=["realistic", "step"])
    ap.add_argument("--budget-ms", type=float, default=3000.0)
    ap.add_argument("--out", default="outputs/probe_dkv_passes.json")
    ap.add_argument("--profile", action="store_true", help="print each size's kernel times of one backward")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_dkv_passes.py times GPU kernels: it needs a CUDA device")
    T, H, Dqk, Dv = args.T, 64, 576, 512
    det = args.scratch_mib is not None
    sizes = args.scratch_mib if det else args.pass_mib
    field = "det_scratch_bytes" if det else "mla_bwd_pass_bytes"
    res = dict(device=torch.cuda.get_device_name(), T=T, K=args.K, deterministic=det, runs={})
    for name in args.selections:
        if name == "step":
            from probe_selection_sharing import step_selections  # this script's folder is on sys.path

            idx = step_selections(T)[0]
        else:
            idx = realistic_selection(T, args.K)
        torch.manual_seed(0)
        q = torch.randn(1, T, H, Dqk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        kv = torch.randn(1, T, 1, Dqk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        do = torch.randn(1, T, H, Dv, device="cuda", dtype=torch.bfloat16)
        runs = res["runs"][name] = {}
        for mib in sizes:
            config = SparseAttentionConfig(**{field: mib << 20})
            o = sparse_attention(q, kv, kv[..., :Dv], idx, config=config, deterministic=det)

            def bwd(o=o, q=q, kv=kv, do=do):
                q.grad = kv.grad = None
                o.backward(do, retain_graph=True)

            runs[mib] = timed(bwd, budget_ms=args.budget_ms)
            if args.profile:
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                    bwd()
                    torch.cuda.synchronize()
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
            del o
            what = "scratch" if det else "pass"
            print(f"{name:10s} {what} {mib:4d} MiB: backward {runs[mib]:8.2f} ms  x{runs[sizes[0]] / runs[mib]:.3f}",
                  flush=True)  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
