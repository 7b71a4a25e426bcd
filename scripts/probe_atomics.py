"""Probe: how fast fp32 atomic adds into key rows go with the MLA backward's access pattern.

The MLA backward adds each (query, key) pair's 576-wide fp32 contribution into the key's row of a
[T, 576] accumulator (docs/design.md section 6). This probe runs only that part: one program per
query token walks its selected keys (``benchmarking.inputs.realistic_selection``: sinks, a local
window and far tokens) in blocks of BN, forms a [BN, 576] tile with a small tensor-core product
(so the values sit in the accumulator layout, as in the kernel) and adds it to the rows, by
fp32 atomics or, as the same-run baseline, by plain stores (racy, for the bandwidth only), and
"compute" without writes. ``trans`` forms the tile transposed ([576, BN], the Triton kernel's
layout: scalar atomics). Prints each variant's time and the contribution bytes per second; writes
JSON.

    python scripts/probe_atomics.py --T 32768 --out results/atomics.json
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl

from hyscale_hf.benchmarking.inputs import realistic_selection
from hyscale_hf.benchmarking.timing import timed

ATOMIC, STORE, COMPUTE = 0, 1, 2


@triton.jit
def probe_kernel(ACC, IDX, A, B, L, MODE: tl.constexpr, BN: tl.constexpr, TRANS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.arange(0, BN)
    d = tl.arange(0, 512)
    r = 512 + tl.arange(0, 64)
    h = tl.arange(0, 64)
    a = tl.load(A + offs_n[:, None] * 64 + h[None, :])  # [BN, 64]: stands in for dS^T
    b1 = tl.load(B + h[:, None] * 576 + d[None, :])  # [64, 512] and [64, 64]: Q
    b2 = tl.load(B + h[:, None] * 576 + r[None, :])
    for start in range(0, L, BN):
        kid = tl.load(IDX + t * L + start + offs_n)
        valid = kid >= 0
        if TRANS:
            c1 = tl.dot(tl.trans(b1), tl.trans(a))  # [512, BN]
            c2 = tl.dot(tl.trans(b2), tl.trans(a))
            cols = ACC + kid.to(tl.int64)[None, :] * 576
            if MODE == 0:
                tl.atomic_add(cols + d[:, None], c1, mask=valid[None, :], sem="relaxed")
                tl.atomic_add(cols + r[:, None], c2, mask=valid[None, :], sem="relaxed")
            else:
                tl.store(cols + d[:, None], c1, mask=valid[None, :])
                tl.store(cols + r[:, None], c2, mask=valid[None, :])
        else:
            c1 = tl.dot(a, b1)  # [BN, 512]
            c2 = tl.dot(a, b2)
            rows = ACC + kid.to(tl.int64)[:, None] * 576
            if MODE == 0:
                tl.atomic_add(rows + d[None, :], c1, mask=valid[:, None], sem="relaxed")
                tl.atomic_add(rows + r[None, :], c2, mask=valid[:, None], sem="relaxed")
            elif MODE == 1:
                tl.store(rows + d[None, :], c1, mask=valid[:, None])
                tl.store(rows + r[None, :], c2, mask=valid[:, None])
            else:  # the products only, and one token-private row so they are not optimised away
                tl.store(ACC + t * 576 + d, tl.sum(c1, 0))


def run(idx: torch.Tensor, mode: int, bn: int, trans: bool, budget_ms: float) -> float:
    T, L = idx.shape
    acc = torch.zeros(T, 576, device=idx.device, dtype=torch.float32)
    a = torch.randn(bn, 64, device=idx.device, dtype=torch.bfloat16)
    b = torch.randn(64, 576, device=idx.device, dtype=torch.bfloat16)
    return timed(lambda: probe_kernel[(T,)](acc, idx, a, b, L, MODE=mode, BN=bn, TRANS=trans, num_warps=4),
                 budget_ms=budget_ms)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--K", type=int, default=2048)
    ap.add_argument("--budget-ms", type=float, default=1000.0)
    ap.add_argument("--out", default="outputs/probe_atomics.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_atomics.py times GPU atomics: it needs a CUDA device")
    res = dict(device=torch.cuda.get_device_name(), T=args.T, K=args.K, triton=triton.__version__, runs={})
    for name, share in (("own far tokens", 1), ("far tokens shared by 64", 64)):
        idx = realistic_selection(args.T, args.K, far_share=share)[0].contiguous()
        nbytes = int((idx >= 0).sum()) * 576 * 4
        for bn in (16, 32):
            for trans in (False, True):
                for mode in (ATOMIC, STORE) if trans else (ATOMIC, STORE, COMPUTE):
                    ms = run(idx, mode, bn, trans, args.budget_ms)
                    key = f"{name}, BN={bn}, {'[576, BN]' if trans else '[BN, 576]'}, {['atomic', 'store', 'compute'][mode]}"
                    res["runs"][key] = dict(ms=ms, TB_per_s=nbytes / ms / 1e9)
                    print(f"{key:60s} {ms:8.2f} ms  {nbytes / ms / 1e9:5.2f} TB/s", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
