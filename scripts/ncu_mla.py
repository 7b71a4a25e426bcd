"""One MLA-absorbed sparse attention forward + backward inside an NVTX range named ``mla``, for Nsight
Compute to profile its kernels (issue 26: where the Gluon forward and dK/dV kernels lose time).

The shapes and selection are bench_sparse_attention.py's MLA rows (64 heads, 576 / 512, bf16, top-2048
``realistic_selection``: sinks, a local window, far tokens of their own per query). A call before the
range compiles and warms the kernels, so the range holds the steady state only.

    ncu --clock-control none --nvtx --nvtx-include "mla/" -k regex:mla_forward --set full \\
        python scripts/ncu_mla.py --seqlen 32768
    (gpu_check.sh's ncu_mla stage runs this once per kernel: the forward, then the dS + dK/dV)
"""

from __future__ import annotations

import argparse

import torch

from hyscale_hf import sparse_attention
from hyscale_hf.benchmarking.inputs import realistic_selection


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlen", type=int, default=32768)
    p.add_argument("--topk", type=int, default=2048)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ncu_mla.py profiles GPU kernels: no CUDA device here")
    T, H, Dqk, Dv = args.seqlen, 64, 576, 512
    torch.manual_seed(0)
    idx = realistic_selection(T, args.topk)
    q = torch.randn(1, T, H, Dqk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kv = torch.randn(1, T, 1, Dqk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(1, T, H, Dv, device="cuda", dtype=torch.bfloat16)

    def step():
        q.grad = kv.grad = None
        sparse_attention(q, kv, kv[..., :Dv], idx).backward(do)

    step()  # compile and warm
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("mla")
    step()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    print(f"mla T={T} H={H} K={args.topk}: fwd + bwd done, |dq| {q.grad.float().norm():.3e}")


if __name__ == "__main__":
    main()
