"""Sparse-stage indexer KL loss, forward + backward: Triton kernels vs the torch reference path.

One causal sequence (B = 1, S = T), bf16, indexer H = 32, D = 128, K = 2048, with the attention's
lse given (the sparse stage has it from sparse_attention) and, for ours, also without it. Baselines
run in the same process on the same inputs: the torch reference in one call (it gathers
[S, K, Hkv, Dqk] and runs out of memory at these sizes) and the same reference a query chunk at a
time (what a careful user writes). Writes JSON (``--out``); ``--sweep`` also times launch tiles
(``IndexerKLConfig``).

    python scripts/bench_indexer_loss.py --out bench_indexer_loss.json [--sweep]
    python scripts/bench_indexer_loss.py --tiles --sizes 32768 131072 --out kl_tiles.json

``--tiles`` times the GQA sparse stage's loss instead: the target given (as the attention's backward
leaves it), a converted SmolLM2's indexer (2 heads x 64; ``--index-shape H,D`` for another) and query
tiles (42 queries: its 9 / 3 heads in 128-row tiles), per query and over the tiles, each as forward +
backward and as the one pass (the selection's lse given, as hytopk's ``return_lse`` hands it to the
patched models), on two selections: a 1024-key local window + 16 sinks + random far keys, and the same
with the far keys shared by each block of 64 queries. Indexers wider than one tile program holds
(``tiled.tile_shape``) are timed per query only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from hyscale_hf.benchmarking.inputs import causal_indices, loss_inputs, realistic_selection
from hyscale_hf.benchmarking.timing import cuda_median_ms
from hyscale_hf.kernels import indexer_kl_loss
from hyscale_hf.kernels.indexer_kl import IndexerKLConfig, indexer_kl_loss_given_target, tiled
from hyscale_hf.kernels.indexer_kl.naive import indexer_kl_loss_reference
from hyscale_hf.kernels.indexer_kl.op import (
    attention_lse_triton,
    indexer_kl_backward_triton,
    indexer_kl_forward_triton,
)
from hyscale_hf.kernels.sparse_attn.host import union_tiles

H, D, K = 32, 128, 2048
DEVICE = "cuda"
SWEEP_T = 16384
ATTN = {"mla": (64, 1, 576), "gqa": (32, 8, 128)}


def measure(name, fn, iters):
    """Peak memory above the inputs (first run, which is also the warm-up), then the median time."""
    try:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        gib = (torch.cuda.max_memory_allocated() - base) / 2**30
        ms = cuda_median_ms(fn, iters, warmup=0)
        return {"ms": round(ms, 3), "peak_gib": round(gib, 3)}
    except torch.OutOfMemoryError as e:
        return {"error": "OutOfMemoryError", "detail": str(e).splitlines()[0][:200]}
    finally:
        torch.cuda.empty_cache()
        print(name, flush=True)


def setup(T, attn):
    Hq, Hkv, Dqk = ATTN[attn]
    g = torch.Generator(device=DEVICE).manual_seed(T)
    tensors = loss_inputs(1, T, T, H, D, Hq, Hkv, Dqk, dtype=torch.bfloat16, device=DEVICE, generator=g,
                          attn_sharpness=3.0)
    idx = causal_indices(1, T, T, K, generator=g, device=DEVICE, local=256, sinks=16)
    scale = Dqk**-0.5
    lse = attention_lse_triton(tensors[3], tensors[4], idx, scale)
    leaves = [t.clone().requires_grad_() for t in tensors[:3]]
    return leaves, tensors[3:], idx, lse, scale


def ours(leaves, attn, idx, lse, scale, backward=True):
    loss = indexer_kl_loss(*leaves, *attn, idx, attn_lse=lse, scale=scale, backend="triton")
    if backward:
        loss.backward()
        for t in leaves:
            t.grad = None


def reference(leaves, attn, idx, lse, scale, chunk=None):
    S = idx.shape[1]
    chunk = chunk or S
    count = (idx >= 0).any(-1).sum().clamp_min(1)
    for c in range(0, S, chunk):
        part = slice(c, c + chunk)
        kl = indexer_kl_loss_reference(leaves[0][:, part], leaves[1], leaves[2][:, part], attn[0][:, part],
                                       attn[1], idx[:, part], attn_lse=lse[:, part], scale=scale,
                                       reduction="sum")
        (kl / count).backward()
    for t in leaves:
        t.grad = None


def sweep_shape(attn, rows):
    """Time launch tiles of the forward (and, once, the backward and the given-target forward: they
    read no attention) at T = SWEEP_T."""
    fwd = [(64, 4, 2, 64), (64, 4, 3, 64), (64, 4, 4, 64), (32, 4, 3, 64), (128, 4, 3, 64), (128, 8, 3, 64)]
    if attn == "gqa":
        fwd += [(64, 4, 3, 128), (32, 4, 3, 128)]
    # the backward and the given-target forward read no attention: timed once (with the MLA rows)
    indexer_only = [(64, 4, 2), (64, 4, 3), (64, 2, 2), (128, 4, 2), (128, 4, 3), (256, 8, 2)] if attn == "mla" else []
    lse_tiles = [(64, 4, 2), (64, 4, 3), (32, 4, 3)]
    leaves, attn_t, idx, lse, scale = setup(SWEEP_T, attn)
    args = (*[t.detach() for t in leaves], *attn_t, idx, lse, scale, True)
    for bk, nw, ns, da in fwd:
        config = IndexerKLConfig(fwd={"BLOCK_K": bk, "BLOCK_DA": da, "num_warps": nw, "num_stages": ns})
        ms = cuda_median_ms(lambda config=config: indexer_kl_forward_triton(*args, config=config), 5)
        rows.append({"kernel": "fwd", "attn": attn, "BLOCK_K": bk, "num_warps": nw, "num_stages": ns,
                     "BLOCK_DA": da, "ms": round(ms, 3)})
        print(rows[-1], flush=True)
    for bk, nw, ns in lse_tiles:
        config = IndexerKLConfig(lse={"BLOCK_K": bk, "BLOCK_DA": 64, "num_warps": nw, "num_stages": ns})
        ms = cuda_median_ms(lambda config=config: attention_lse_triton(attn_t[0], attn_t[1], idx, scale, config=config), 5)
        rows.append({"kernel": "lse", "attn": attn, "BLOCK_K": bk, "num_warps": nw, "num_stages": ns,
                     "ms": round(ms, 3)})
        print(rows[-1], flush=True)
    _, target, z, lse_i = indexer_kl_forward_triton(*args)
    g = torch.ones(1, SWEEP_T, device=DEVICE)
    for bk, nw, ns in indexer_only:
        tiles = {"BLOCK_K": bk, "num_warps": nw, "num_stages": ns}
        config = IndexerKLConfig(bwd=tiles)
        ms = cuda_median_ms(
            lambda config=config: indexer_kl_backward_triton(g, *args[:3], idx, target, z, lse_i, True, config=config), 5
        )
        rows.append({"kernel": "bwd", **tiles, "ms": round(ms, 3)})
        print(rows[-1], flush=True)
        config = IndexerKLConfig(fwd_given=tiles)
        ms = cuda_median_ms(lambda config=config: indexer_kl_forward_triton(
            *args[:3], None, None, idx, None, 1.0, True, target=target, config=config), 5)
        rows.append({"kernel": "fwd_given", **tiles, "ms": round(ms, 3)})
        print(rows[-1], flush=True)


def sweep(results, out):
    results["sweep"] = []
    for attn in ATTN:
        sweep_shape(attn, results["sweep"])
        torch.cuda.empty_cache()
        out.write_text(json.dumps(results, indent=1))


def bench_one(T, attn, chunk):
    leaves, attn_t, idx, lse, scale = setup(T, attn)
    Hq, _, Dqk = ATTN[attn]
    row = {"T": T, "attn": attn, "Hq": Hq, "Dqk": Dqk,
           "gflop_fwd": round(2 * T * K * (H * D + Hq * Dqk) / 1e9, 1),
           "gflop_bwd": round(6 * T * K * H * D / 1e9, 1)}
    row["ours_fwd"] = measure("ours fwd", lambda: ours(leaves, attn_t, idx, lse, scale, False), 10)
    row["ours_fwd_bwd"] = measure("ours fwd+bwd", lambda: ours(leaves, attn_t, idx, lse, scale), 10)
    row["ours_fwd_bwd_lse_none"] = measure("ours fwd+bwd, lse=None", lambda: ours(leaves, attn_t, idx, None, scale), 5)
    row["torch_ref_fwd_bwd"] = measure("torch reference", lambda: reference(leaves, attn_t, idx, lse, scale), 1)
    row[f"torch_ref_chunk{chunk}_fwd_bwd"] = measure(
        "torch reference chunked", lambda: reference(leaves, attn_t, idx, lse, scale, chunk), 3)
    ref_ms = row[f"torch_ref_chunk{chunk}_fwd_bwd"].get("ms")
    if ref_ms and "ms" in row["ours_fwd_bwd"]:
        row["speedup_vs_chunked_ref"] = round(ref_ms / row["ours_fwd_bwd"]["ms"], 2)
    return row


def bench_tiles(T: int, heads=2, dim=64, tile_q=128 // 3, far_shares=(1, 64)) -> list[dict]:
    """Given-target KL per query and over query tiles, forward + backward and in one pass, same inputs."""
    g = torch.Generator(device=DEVICE).manual_seed(T)
    index = (torch.randn(1, T, heads, dim, device=DEVICE, generator=g).to(torch.bfloat16),
             torch.randn(1, T, dim, device=DEVICE, generator=g).to(torch.bfloat16),
             torch.rand(1, T, heads, device=DEVICE, generator=g) + 0.2)
    rows = []
    for far_share in far_shares:
        idx = realistic_selection(T, K, sinks=16, window=1024, far_share=far_share, device=DEVICE)
        target = torch.where(idx >= 0, torch.rand(idx.shape, device=DEVICE, generator=g) + 0.05, 0.0)
        tiles = union_tiles(idx, tile_q, T, unique=True)
        # the selection's lse as hytopk's return_lse gives it: the forward kernel's lse of the same logits
        index_lse = indexer_kl_forward_triton(*index, None, None, idx, None, None, True, target=target)[3]
        row = {"T": T, "heads": heads, "dim": dim, "tile_q": tile_q, "far_share": far_share,
               "union_over_pairs": round(float(tiles.num.sum()) / float((idx >= 0).sum()), 4)}
        paths = [("per_query", None)] + ([("tiled", tiles)] if tiled.tile_shape(tile_q, heads, dim) else [])
        for name, given in paths:
            for mode, lse in (("fwd_bwd", None), ("one_pass", index_lse)):
                leaves = [t.clone().requires_grad_() for t in index]

                def run(leaves=leaves, given=given, idx=idx, target=target, lse=lse):
                    for t in leaves:
                        t.grad = None
                    indexer_kl_loss_given_target(*leaves, idx, target, backend="triton", check_range=False,
                                                 tiles=given, index_lse=lse).backward()

                row[f"{name}_{mode}"] = measure(f"T={T} far_share={far_share} {name} {mode}", run, 5)
            row[f"{name}_one_pass_speedup"] = round(row[f"{name}_fwd_bwd"]["ms"] / row[f"{name}_one_pass"]["ms"], 2)
        if len(paths) == 2:
            row["tiled_speedup"] = round(row["per_query_fwd_bwd"]["ms"] / row["tiled_fwd_bwd"]["ms"], 2)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench_indexer_loss.json"))
    ap.add_argument("--sizes", type=int, nargs="*", default=[16384, 32768])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--chunk", type=int, default=1024, help="query chunk of the chunked torch baseline")
    ap.add_argument("--tiles", action="store_true", help="the given-target loss per query against over query tiles")
    ap.add_argument("--index-shape", default="2,64", help="--tiles: the indexer's heads,dim")
    ap.add_argument("--far-shares", type=int, nargs="+", default=[1, 64],
                    help="--tiles: how many neighbouring queries share each far key (wider unions below 64)")
    a = ap.parse_args()
    if a.tiles:
        # the tiles at every union width, not only where the rules take them
        tiled.TILES_AT_ANY_UNION = True
        heads, dim = (int(x) for x in a.index_shape.split(","))
        rows = [r for T in a.sizes for r in bench_tiles(T, heads, dim, far_shares=a.far_shares)]
        a.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "K": K, "rows": rows}, indent=1))
        return
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "triton": __import__("triton").__version__, "H": H, "D": D, "K": K,
               "tiles": dataclasses.asdict(IndexerKLConfig()), "rows": []}
    for T in a.sizes:
        for attn in ATTN:
            row = bench_one(T, attn, a.chunk)
            results["rows"].append(row)
            a.out.write_text(json.dumps(results, indent=1))
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    if a.sweep:
        sweep(results, a.out)
    print(f"{'T':>6} {'attn':>4} {'fwd ms':>8} {'fwd+bwd':>8} {'lse=None':>9} {'ref chunked':>11} {'ref full':>9} {'x':>6}")
    for r in results["rows"]:
        full = r["torch_ref_fwd_bwd"].get("ms", "OOM")
        print(f"{r['T']:>6} {r['attn']:>4} {r['ours_fwd'].get('ms', 'OOM'):>8} {r['ours_fwd_bwd'].get('ms', 'OOM'):>8} "
              f"{r['ours_fwd_bwd_lse_none'].get('ms', 'OOM'):>9} "
              f"{r[f'torch_ref_chunk{a.chunk}_fwd_bwd'].get('ms', 'OOM'):>11} {full:>9} "
              f"{r.get('speedup_vs_chunked_ref', '-'):>6}")


if __name__ == "__main__":
    main()
