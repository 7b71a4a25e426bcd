"""Developer tool: time the sparse attention kernels under several launch configs (one GPU run).

Passes each candidate as ``sparse_attention(..., config=SparseAttentionConfig(...))`` (block sizes,
warps, stages, query-tile rows) and times the forward and backward of the MLA (64 heads, 576/512)
and GQA (``--gqa-shape``, default 32/8 heads, D = 128; a converted SmolLM2's is 9,3,64) shapes on the
benchmark's realistic selection (``--far-share 64``: far tokens shared by 64 queries, tiles of a few
thousand keys as a trained indexer's on real text). Configs that fail to
compile (shared memory) are reported, not fatal. The winners become the defaults of
``launch_config`` in ``hyscale_hf/kernels/sparse_attn/host.py``.

    python scripts/tune_sparse_attention.py --T 32768 --out results/
    python scripts/tune_sparse_attention.py --only gqa_fwd,gqa_bwd --gqa-shape 9,3,64 --far-share 64
"""

import argparse
import json
import os
import sys
import time

import torch

from hyscale_hf import sparse_attention
from hyscale_hf.benchmarking.inputs import realistic_selection
from hyscale_hf.benchmarking.timing import timed
from hyscale_hf.kernels.sparse_attn import SparseAttentionConfig
from hyscale_hf.kernels.sparse_attn.host import key_lists
from hyscale_hf.kernels.sparse_attn.naive import tile_unions_reference

# (BLOCK_N, num_warps, num_stages); "bwd" of the MLA shape is the split dK/dV kernel, "dq" its dQ
# kernel (SLAB, BLOCK_N, num_warps, num_stages). Candidates fit sm_90's 227 KB of shared memory.
MLA_FWD = [(32, 8, 2), (32, 8, 3), (64, 8, 2)]
MLA_BWD = [(16, 4, 3), (16, 4, 2), (16, 8, 2)]  # num_stages 1 hit an illegal address (H200, Triton 3.6)
MLA_DQ = [(128, 64, 4, 3), (128, 64, 4, 2), (128, 32, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2), (256, 64, 8, 3),
          (64, 128, 4, 3), (128, 128, 4, 3), (64, 32, 4, 4), (128, 64, 4, 4)]
GQA_FWD = [(128, 32, 4, 3), (64, 32, 4, 3), (128, 32, 8, 2), (128, 64, 8, 2), (128, 64, 4, 3), (128, 128, 8, 2),
           (128, 32, 4, 4)]  # tiled: (tile rows, BLOCK_N, warps, stages); the first is the default
GQA_BWD = [(128, 64, 8, 2), (64, 64, 8, 2), (128, 32, 8, 2), (128, 32, 8, 3), (256, 32, 8, 2), (128, 64, 8, 3),
           (128, 64, 4, 2), (128, 128, 8, 2), (128, 32, 4, 3)]


def shapes(name, T, gqa=(32, 8, 128)):
    dt = torch.bfloat16
    if name == "mla":
        q = torch.randn(1, T, 64, 576, device="cuda", dtype=dt, requires_grad=True)
        kv = torch.randn(1, T, 1, 576, device="cuda", dtype=dt, requires_grad=True)
        return q, kv, kv[..., :512], (q, kv)
    hq, hkv, d = gqa
    q = torch.randn(1, T, hq, d, device="cuda", dtype=dt, requires_grad=True)
    k = torch.randn(1, T, hkv, d, device="cuda", dtype=dt, requires_grad=True)
    v = torch.randn(1, T, hkv, d, device="cuda", dtype=dt, requires_grad=True)
    return q, k, v, (q, k, v)


def sweep(name, kind, configs, T, idx, budget_ms, gqa=(32, 8, 128)):
    q, k, v, leaves = shapes(name, T, gqa)
    do = torch.randn(*q.shape[:3], v.shape[-1], device="cuda", dtype=q.dtype)
    rows = []
    for cfg in configs:
        *first, bn, warps, stages = cfg
        over = dict(BLOCK_N=bn, num_warps=warps, num_stages=stages)
        key = "bwd_dq" if kind == "dq" else kind
        tile = {}
        if first and name == "mla":
            over["SLAB"] = first[0]
        elif first:  # GQA runs the tiled kernels; first = tile rows
            tile = dict(tile_rows=first[0])
            key += "_tiled"
        config = SparseAttentionConfig(**{key: over}, **tile)
        row = dict(shape=name, kind=kind, tile_rows=first[0] if first and name != "mla" else None, **over)
        t0 = time.time()
        try:
            if kind == "fwd":  # "bwd" and "dq" both time the whole backward
                with torch.no_grad():
                    row["ms"] = timed(lambda config=config: sparse_attention(q, k, v, idx, config=config), budget_ms=budget_ms)
            else:
                o = sparse_attention(q, k, v, idx, config=config)

                def bwd(o=o):
                    for x in leaves:
                        x.grad = None
                    o.backward(do, retain_graph=True)

                row["ms"] = timed(bwd, budget_ms=budget_ms)
                del o
        except torch.AcceleratorError as e:  # a device fault poisons the CUDA context: nothing after it can run
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
            raise ContextLost(rows) from e
        except Exception as e:  # noqa: BLE001 - a config that does not fit is a result, not a crash
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        row["wall_s"] = round(time.time() - t0, 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


class ContextLost(RuntimeError):
    """A config faulted on the device; carries the rows measured before it."""

    def __init__(self, rows):
        super().__init__("CUDA context lost")
        self.rows = rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--K", type=int, default=2048)
    ap.add_argument("--out", default=".")
    ap.add_argument("--budget-ms", type=float, default=1500.0)
    ap.add_argument("--only", default="mla_fwd,mla_bwd,mla_dq,gqa_fwd,gqa_bwd")
    ap.add_argument("--far-share", type=int, default=1)
    ap.add_argument("--gqa-shape", default="32,8,128", help="query heads, KV heads, head dim of the GQA shape")
    args = ap.parse_args()
    gqa = tuple(int(x) for x in args.gqa_shape.split(","))
    if len(gqa) != 3 or gqa[0] % gqa[1]:
        raise SystemExit(f"--gqa-shape wants Hq,Hkv,D with Hq a multiple of Hkv, got {args.gqa_shape}")
    idx = realistic_selection(args.T, args.K, far_share=args.far_share)
    for rows in (64, 128):  # the query-tile union build (Triton) that the tiled GQA forward includes
        config = SparseAttentionConfig(tile_rows=rows)
        ms = timed(lambda config=config: key_lists(idx, args.T, 4, False, config), budget_ms=args.budget_ms)
        torch_ms = timed(lambda rows=rows: tile_unions_reference(idx, rows // 4, args.T), budget_ms=args.budget_ms)
        lists = key_lists(idx, args.T, 4, False, config)
        print(json.dumps(dict(union_build_rows=rows, ms=ms, torch_reference_ms=torch_ms,
                              max_union=lists.idx.shape[2], mean_union=float(lists.num.float().mean()))), flush=True)
    table = dict(mla_fwd=MLA_FWD, mla_bwd=MLA_BWD, mla_dq=MLA_DQ, gqa_fwd=GQA_FWD, gqa_bwd=GQA_BWD)
    results = []
    lost = None
    device = torch.cuda.get_device_name()  # read now: after a device fault CUDA calls fail
    for part in filter(None, args.only.split(",")):
        name, kind = part.split("_")
        try:
            results += sweep(name, kind, table[part], args.T, idx, args.budget_ms, gqa)
        except ContextLost as e:
            results += e.rows
            lost = part
        with open(os.path.join(args.out, "tune_sparse_attention.json"), "w") as f:
            json.dump(dict(T=args.T, K=args.K, far_share=args.far_share, gqa_shape=gqa, device=device, rows=results), f,
                      indent=1)
        if lost:  # later configs would all fail with the same sticky error
            sys.exit(f"stopped in {lost}: the last config faulted on the device; rerun the rest without it")


if __name__ == "__main__":
    main()
