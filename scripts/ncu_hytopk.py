"""One HyTopK call inside an NVTX range named ``hytopk``, for Nsight Compute to profile its kernels.

The call before it compiles and warms the kernels, so the range holds the steady state only. Inputs are
bench_hytopk.py's (random bf16 q and k, positive head weights), causal, top-K.

    ncu --clock-control none --nvtx --nvtx-include "hytopk/" --set full \\
        python scripts/ncu_hytopk.py --heads 4 --dim 64 --seqlen 32768
    (gpu_check.sh's ncu_hytopk stage runs this once per kernel: one launch each of scan, refine, finalize)
"""

from __future__ import annotations

import argparse

import torch

import hyscale_hf


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=4, help="indexer heads")
    p.add_argument("--dim", type=int, default=64, help="indexer head dim")
    p.add_argument("--seqlen", type=int, default=32768)
    p.add_argument("--topk", type=int, default=2048)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ncu_hytopk.py profiles GPU kernels: no CUDA device here")
    gen = torch.Generator(device="cuda").manual_seed(0)
    T, H, D = args.seqlen, args.heads, args.dim
    q = torch.randn(1, T, H, D, device="cuda", generator=gen).to(torch.bfloat16)
    k = torch.randn(1, T, D, device="cuda", generator=gen).to(torch.bfloat16)
    w = torch.rand(1, T, H, device="cuda", generator=gen) * H**-0.5
    hyscale_hf.hytopk(q, k, w, args.topk)  # compile and warm
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("hytopk")
    idx = hyscale_hf.hytopk(q, k, w, args.topk)
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    print(f"hytopk T={T} H={H} D={D} K={args.topk}: {tuple(idx.shape)} indices")


if __name__ == "__main__":
    main()
