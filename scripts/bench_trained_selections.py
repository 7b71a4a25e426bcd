"""Benchmark: a converted model's sparse attention and HyTopK on the selections its trained indexer
makes on real text, against the synthetic selections the other benchmarks time, in one run.

The tiled GQA kernels walk the union of a query tile's selected keys, so their cost depends on how
much neighbouring queries agree, which random-init benchmarks cannot show (issue 23). The model is a
folder the main job saved (``finetune_long.py --output_dir DIR``: weights, tokenizer and
``hyscale_config.json``); ``patch_model`` restores its options and trained indexer. The text is the
first T tokens of the Python standard library's source files (``benchmarking.trained.text_ids``).

Per T in ``--seqlens``:
1. one forward of the patched model (no grad) under ``SelectionCapture``: every layer's selection
   and the HyTopK inputs of the layers in ``--layers``;
2. ``sharing`` statistics of every layer's selection, at tiles of 2, 4, 16 and 64 queries and at the
   GQA kernel's own query tile (``SparseAttentionConfig().tile_rows // group``), and for the timed
   layers whether the Triton forward runs over the tiles' unions or per token (its rule: the unions
   at most ``host.TILED_FWD_MAX_UNION`` x K on average);
3. the same statistics of two baselines: ``realistic_selection`` with far tokens drawn per query
   (what ``bench_sparse_attention.py`` times) and the first layer's selection in the random-init
   stack that ``bench_e2e.py --stack smollm2`` times (random tokens);
4. unless ``--no-timing``, at the model's attention shape (random q, k, v; the selection given):
   the sparse attention forward, forward + backward, and forward + backward filling ``HeadProbs``
   (what the sparse stage runs: the indexer KL's target from the backward), for each layer in
   ``--layers`` and both baselines; dense causal SDPA (flash on CUDA) forward + backward at the
   same shape; HyTopK on the captured inputs of each layer in ``--layers`` and of the stack's
   first layer (on a GPU also with other refine slacks: ``REFINE_SLACKS``); the indexer KL from a
   given target (forward + backward) on those inputs, per query and over the attention's query tiles.

Times are wall-clock medians (the device synchronised around each call) after one warm-up call.
Writes ``bench_trained_selections.json`` and a PNG to ``--out``.

    python scripts/bench_trained_selections.py --model /tmp/realmodel --seqlens 32768 131072 --out results/
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics

import torch

from hyscale_hf import sparse_attention
from hyscale_hf.benchmarking import stacks
from hyscale_hf.benchmarking.attention import DENSE_GQA, dense_sdpa
from hyscale_hf.benchmarking.cli import require_positive
from hyscale_hf.benchmarking.inputs import realistic_selection
from hyscale_hf.benchmarking.selections import SelectionCapture, sharing
from hyscale_hf.benchmarking.trained import check_saved, load_saved, text_ids
from hyscale_hf.kernels.indexer_kl import indexer_kl_loss_given_target, tiled
from hyscale_hf.kernels.sparse_attn import HeadProbs, SparseAttentionConfig, host
from hyscale_hf.kernels.sparse_attn.host import union_tiles
from hyscale_hf.kernels.topk import hytopk_triton
from hyscale_hf.kernels.topk.host import pick_config

TILES = (2, 4, 16, 64)


def capture(model, ids: torch.Tensor, inputs_of) -> SelectionCapture:
    """Every HyTopK call of one forward of ``model``'s decoder (no LM head: its logits are not needed)."""
    cap = SelectionCapture(inputs_of)
    with torch.no_grad(), cap:
        model.model(input_ids=ids)
    return cap


def stack_baseline(T: int, topk: int, device, dtype) -> SelectionCapture:
    """The first layer's selection and HyTopK inputs in the random-init smollm2 stack (bench_e2e's,
    one layer), on bench_e2e's random tokens."""
    dims = stacks.STACKS["smollm2"]["dims"]
    model, _ = stacks.make_arm("smollm2", "hyscale", dims, 1, T, device, dtype, topk=topk)
    ids = torch.randint(3, dims["vocab_size"], (1, T), generator=torch.Generator().manual_seed(T)).to(device)
    cap = capture(model.eval(), ids, (0,))
    del model
    return cap


def median_ms(fn, device, reps: int) -> float:
    fn()  # warm-up (compiles)
    return statistics.median(stacks.time_ms(fn, device, reps))


def time_attention(idx: torch.Tensor, shape: tuple[int, int, int], device, dtype, reps: int) -> dict:
    """Sparse attention forward, forward + backward, and forward + backward with ``HeadProbs``."""
    Hq, Hkv, D = shape
    T = idx.shape[1]
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*s, grad=True):
        return torch.randn(*s, generator=gen, device=device, dtype=dtype).requires_grad_(grad)

    q, k, v, do = randn(1, T, Hq, D), randn(1, T, Hkv, D), randn(1, T, Hkv, D), randn(1, T, Hq, D, grad=False)

    def run(grad: bool, head_probs: bool):
        def call():
            hp = HeadProbs() if head_probs else None
            with torch.set_grad_enabled(grad):
                o = sparse_attention(q, k, v, idx, check_range=False, unique_indices=True, head_probs=hp)
            if grad:
                q.grad = k.grad = v.grad = None
                o.backward(do)
            if hp is not None:
                hp.take()

        return call

    return {"fwd_ms": median_ms(run(False, False), device, reps),
            "fwd_bwd_ms": median_ms(run(True, False), device, reps),
            "fwd_bwd_head_probs_ms": median_ms(run(True, True), device, reps)}


def time_dense(T: int, shape, device, dtype, reps: int) -> float:
    Hq, Hkv, D = shape
    q = torch.randn(1, T, Hq, D, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(1, T, Hkv, D, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(1, T, Hkv, D, device=device, dtype=dtype, requires_grad=True)
    do = torch.randn(1, T, Hq, D, device=device, dtype=dtype)

    def step():
        q.grad = k.grad = v.grad = None
        dense_sdpa(q, k, v).backward(do)

    return median_ms(step, device, reps)


def time_hytopk(inputs: tuple, device, reps: int) -> float:
    args, kwargs = inputs
    op = torch.ops.hyscale.hytopk
    return median_ms(lambda: op(*args, **kwargs), device, reps)


# Refine slacks of the Triton HyTopK timed on the captured inputs (GPU): ``HyTopKConfig.refine_slack``
REFINE_SLACKS = (0.5, 0.25, 0.1)


def time_refine_slacks(inputs: tuple, device, reps: int) -> dict:
    """HyTopK (Triton, the default tiles) on a layer's captured inputs with each of REFINE_SLACKS:
    ``{"slack=<share>": ms}``. The op's arguments: q, k, w, topk, cu_seqlens, window_start, relu."""
    (q, k, w, topk, cu_seqlens, window_start, relu, *_), _ = inputs
    base = pick_config(q.shape[2], q.shape[3], q.dtype, q.device)
    out = {}
    for slack in REFINE_SLACKS:
        cfg = dataclasses.replace(base, refine_slack=slack)
        run = lambda cfg=cfg: hytopk_triton(q, k, w, topk, cu_seqlens=cu_seqlens, window_start=window_start,  # noqa: E731
                                            relu=relu, return_scores=False, config=cfg)
        out[f"slack={slack}"] = median_ms(run, device, reps)
    return out


def time_kl(idx: torch.Tensor, inputs: tuple, tile_q: int, device, reps: int) -> dict:
    """The sparse stage's indexer KL from a given target (forward + backward) on a selection, with the
    indexer tensors HyTopK got for it: per query (``per_query_ms``) and over the attention's query tiles
    of ``tile_q`` queries (``tiled_ms``; on a GPU whatever the union: ``tiled.TILES_AT_ANY_UNION`` while
    it runs)."""
    (q, k, w, *_), _ = inputs
    target = torch.where(idx >= 0, torch.rand(idx.shape, device=idx.device, generator=torch.Generator(
        device=idx.device).manual_seed(0)) + 0.05, 0.0)
    tiles = union_tiles(idx, tile_q, k.shape[1], unique=True)
    out = {}
    for name, given in (("per_query_ms", None), ("tiled_ms", tiles)):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, w)]

        def run(leaves=leaves, given=given):
            for t in leaves:
                t.grad = None
            indexer_kl_loss_given_target(*leaves, idx, target, check_range=False, tiles=given).backward()

        before, tiled.TILES_AT_ANY_UNION = tiled.TILES_AT_ANY_UNION, True
        try:
            out[name] = median_ms(run, device, reps)
        finally:
            tiled.TILES_AT_ANY_UNION = before
    return out


def synthetic_layout(K: int) -> dict:
    """Sinks and local window of the synthetic baseline: bench_sparse_attention's 4 sinks and 1024
    window at K = 2048 (1020 far tokens); for small K (tests) fewer, so that far tokens remain."""
    sinks = min(4, K // 4)
    window = min(1024, K // 2) if K // 2 + sinks < K else K // 4
    return {"sinks": sinks, "window": window}


def attention_shape(config) -> tuple[int, int, int]:
    if getattr(config, "kv_lora_rank", None):
        raise SystemExit(f"error: --model is an MLA model ({config.model_type}); this benchmark times the GQA "
                         "sparse attention of converted dense models (bench_sparse_attention.py times MLA)")
    heads = config.num_attention_heads
    return heads, config.num_key_value_heads, getattr(config, "head_dim", None) or config.hidden_size // heads


def bench_length(model, tokenizer, T: int, args, device, dtype) -> dict:
    shape = attention_shape(model.config)
    kernel_tile = SparseAttentionConfig().tile_rows // (shape[0] // shape[1])
    tiles = tuple(sorted({*TILES, kernel_tile}))
    trained = capture(model, text_ids(tokenizer, T, args.seed).to(device), tuple(args.layers))
    K = trained.indices[0].shape[-1]
    res = {"T": T, "K": K, "attention_shape": shape, "kernel_tile_q": kernel_tile,
           "layers": [sharing(idx[0], tiles) for idx in trained.indices]}
    print(f"T={T}: {len(trained.indices)} layers, K={K}, kernel tile {kernel_tile} queries", flush=True)
    for layer, s in enumerate(res["layers"]):
        tile = s[f"G={kernel_tile}"]
        print(f"  layer {layer:2d}: last-{1024} {s['in_last_1024']:.3f}  union/pairs at G={kernel_tile} "
              f"{tile['union_over_pairs']:.3f} (widest {tile['max_union']}, mean {tile['mean_union']:.0f})", flush=True)
    baseline = stack_baseline(T, K, device, dtype)
    # (name, selection, HyTopK's inputs that made it or None)
    runs = [(f"trained layer {layer}", trained.indices[layer], trained.inputs[layer]) for layer in args.layers]
    runs.append(("stack (random init), layer 0", baseline.indices[0], baseline.inputs[0]))
    synthetic = realistic_selection(T, K, **synthetic_layout(K), device=device)
    runs.append(("realistic_selection", synthetic, None))
    res["selections"] = {}
    for name, idx, hytopk_inputs in runs:
        row = res["selections"][name] = {"sharing": sharing(idx[0], tiles)}
        tile = row["sharing"][f"G={kernel_tile}"]
        # the Triton forward's own choice (host.forward_plan): tiles unless the unions are too wide on average
        row["tiled_forward"] = tile["mean_union"] <= host.TILED_FWD_MAX_UNION * K
        line = (f"  {name:30s} union/pairs {tile['union_over_pairs']:.3f} (widest {tile['max_union']}, mean "
                f"{tile['mean_union']:.0f}; forward {'tiled' if row['tiled_forward'] else 'per token'})")
        if not args.no_timing:
            row |= time_attention(idx, shape, device, dtype, args.reps)
            if hytopk_inputs is not None:
                row["hytopk_ms"] = time_hytopk(hytopk_inputs, device, args.reps)
                row["indexer_kl"] = time_kl(idx, hytopk_inputs, kernel_tile, device, args.reps)
                if device.type == "cuda":
                    row["hytopk_refine_slacks_ms"] = time_refine_slacks(hytopk_inputs, device, args.reps)
            kl = row.get("indexer_kl", {})
            line += (f"  fwd {row['fwd_ms']:.2f} fwd+bwd {row['fwd_bwd_ms']:.2f} with head sums "
                     f"{row['fwd_bwd_head_probs_ms']:.2f} ms  HyTopK {row.get('hytopk_ms', float('nan')):.2f} ms  "
                     f"KL per query {kl.get('per_query_ms', float('nan')):.2f} tiled {kl.get('tiled_ms', float('nan')):.2f} ms")
        print(line, flush=True)
    if args.no_timing:
        return res
    res["dense_fwd_bwd_ms"] = time_dense(T, shape, device, dtype, args.reps)
    print(f"  dense SDPA fwd+bwd {res['dense_fwd_bwd_ms']:.2f} ms", flush=True)
    return res


def plot(data: dict, path: str) -> None:
    """Left: each layer's mean and widest tile union (in units of K) beside the baselines' and the
    tiled forward's limit; right: the timed attention against dense (with timing)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["lengths"]
    timed = [r for r in rows if "dense_fwd_bwd_ms" in r]
    fig, axes = plt.subplots(1, 2 if timed else 1, figsize=(12 if timed else 7, 4.5), squeeze=False)
    ax = axes[0][0]
    for r in rows:
        g, K = f"G={r['kernel_tile_q']}", r["K"]
        line = ax.plot([s[g]["mean_union"] / K for s in r["layers"]], "o-", label=f"T={r['T']}: mean")[0]
        ax.plot([s[g]["max_union"] / K for s in r["layers"]], "^:", color=line.get_color(), label=f"T={r['T']}: widest")
        for name, sel in r["selections"].items():
            if not name.startswith("trained"):
                ax.axhline(sel["sharing"][g]["mean_union"] / K, ls="--", lw=1, color=line.get_color(), alpha=0.5)
                ax.text(len(r["layers"]) - 1, sel["sharing"][g]["mean_union"] / K, f"{name}: mean", fontsize=7,
                        ha="right", va="bottom")
    ax.axhline(host.TILED_FWD_MAX_UNION, color="k", lw=1)
    ax.text(0, host.TILED_FWD_MAX_UNION, "tiled forward's limit on the mean", fontsize=7, va="bottom")
    ax.set_xlabel("layer")
    ax.set_ylabel("tile union / K (kernel's query tile)")
    ax.set_title("trained indexer on real text")
    ax.legend(fontsize=8, loc="center left")
    if timed:
        ax = axes[0][1]
        names = list(timed[0]["selections"])
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            ax.bar([j + i * width for j in range(len(timed))],
                   [r["selections"][name]["fwd_bwd_head_probs_ms"] for r in timed], width, label=name)
        ax.plot([j + 0.4 - width / 2 for j in range(len(timed))], [r["dense_fwd_bwd_ms"] for r in timed],
                "k_", ms=30, mew=2, label="dense SDPA")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(timed))], [f"T={r['T']}" for r in timed])
        ax.set_yscale("log")
        ax.set_ylabel("sparse attention fwd + bwd (+ head sums), ms")
        ax.legend(fontsize=7)
    fig.suptitle(f"{data['model']} on {data['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a folder saved by finetune_long.py (with hyscale_config.json)")
    ap.add_argument("--plot", metavar="JSON", help="only draw the PNG of this script's JSON, beside it")
    ap.add_argument("--seqlens", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--layers", type=int, nargs="+", default=[0, 15, 29], help="layers whose selections are timed")
    ap.add_argument("--topk", type=int, default=None, help="keys per query (default: the saved hyscale_config's)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0, help="order of the standard library's documents")
    ap.add_argument("--no-timing", action="store_true", help="selection statistics only")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    if args.plot:
        return args
    if args.model is None:
        ap.error("--model is required (or --plot JSON)")
    if reason := check_saved(args.model):
        ap.error(f"--model {args.model}: {reason}")
    require_positive(ap, args, "reps")
    for name in ("seqlens", "layers"):
        if min(getattr(args, name)) < (1 if name == "seqlens" else 0):
            ap.error(f"--{name} must be {'positive' if name == 'seqlens' else 'non-negative'}: {getattr(args, name)}")
    if args.topk is not None and args.topk <= 0:
        ap.error(f"--topk must be positive, got {args.topk}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.plot:
        with open(args.plot) as f:
            data = json.load(f)
        plot(data, os.path.splitext(args.plot)[0] + ".png")
        return data
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, tokenizer = load_saved(args.model, device, dtype, **({"topk": args.topk} if args.topk else {}))
    model.eval()
    attention_shape(model.config)  # an MLA model is refused before any forward
    if max(args.layers) >= model.config.num_hidden_layers:
        raise SystemExit(f"error: --layers {args.layers}: the model has {model.config.num_hidden_layers} layers")
    data = {"model": args.model, "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor()
            or "cpu", "torch": torch.__version__, "dtype": str(dtype), "lengths": []}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_trained_selections.json")
    for T in args.seqlens:
        data["lengths"].append(bench_length(model, tokenizer, T, args, device, dtype))
        data["dense_gqa"] = dict(DENSE_GQA)
        with open(path, "w") as f:  # after each length: a later length's failure loses nothing
            json.dump(data, f, indent=1)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    try:
        plot(data, os.path.splitext(path)[0] + ".png")
    except ImportError:
        print("matplotlib missing: no PNG")
    return data


if __name__ == "__main__":
    main()
