"""Benchmark: Triton sparse attention vs dense SDPA (flash) on one GPU, in one run (docs/design.md section 10).

Selections are what a trained DSA indexer tends to pick (``hyscale_hf.benchmarking.inputs.
realistic_selection``): a few attention-sink tokens, a local window and far tokens spread over the
rest of the past. ``--far-share 1`` draws the far tokens independently for every query (worst case:
no reuse between neighbouring queries); ``--far-share N`` gives each block of N consecutive queries
the same far tokens (keys that many neighbouring queries attend to).

Measured (bf16, B = 1, one sequence of T tokens, S = T queries, K selected keys):
  - GQA (32 query heads, 8 KV heads, D = 128): sparse forward, forward+backward (default and
    deterministic backward), and dense causal SDPA (flash backend) forward+backward; the ratio.
  - MLA absorbed (64 heads, Dqk 576 = 512 + 64, Dv 512, v = k[..., :512]): forward and backward
    time and TFLOP/s (forward 2*H*pairs*(Dqk+Dv), backward 2*H*pairs*(3*Dqk+2*Dv), pairs = valid
    selected (query, key) pairs). Where the forward runs the Gluon kernel (sm_90), the Triton
    forward is timed too as the same-run baseline (``triton_fwd_*``, through
    ``config=SparseAttentionConfig(mla_gluon=False)``), and likewise the Triton dS + dK/dV kernel
    where the backward runs the Gluon one (``triton_bwd_*``, ``mla_gluon_bwd=False``).

    python scripts/bench_sparse_attention.py --out results/       # JSON (+ PNG if matplotlib)
    python scripts/bench_sparse_attention.py --plot results/bench_sparse_attention.json
"""

import argparse
import json
import os
import platform
import time

import torch

from hyscale_hf import sparse_attention
from hyscale_hf.benchmarking.attention import DENSE_GQA, dense_sdpa
from hyscale_hf.benchmarking.inputs import realistic_selection
from hyscale_hf.benchmarking.timing import timed
from hyscale_hf.kernels.sparse_attn import SparseAttentionConfig, host


def peak_mib(fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def fwd_bwd(fn, inputs, grad_out):
    def run():
        for x in inputs:
            x.grad = None
        fn().backward(grad_out)

    return run


def bench_gqa(T, K, idx, args, dense=True):
    Hq, Hkv, D = 32, 8, 128
    dt = torch.bfloat16
    q = torch.randn(1, T, Hq, D, device="cuda", dtype=dt, requires_grad=True)
    k = torch.randn(1, T, Hkv, D, device="cuda", dtype=dt, requires_grad=True)
    v = torch.randn(1, T, Hkv, D, device="cuda", dtype=dt, requires_grad=True)
    do = torch.randn(1, T, Hq, D, device="cuda", dtype=dt)
    pairs = int((idx >= 0).sum())
    res = dict(T=T, K=K, Hq=Hq, Hkv=Hkv, D=D, pairs=pairs)

    def sparse(det):
        return lambda: sparse_attention(q, k, v, idx, deterministic=det)

    with torch.no_grad():
        res["sparse_fwd_ms"] = timed(sparse(False), budget_ms=args.budget_ms)
    res["sparse_fwd_bwd_ms"] = timed(fwd_bwd(sparse(False), (q, k, v), do), budget_ms=args.budget_ms)
    res["sparse_fwd_bwd_peak_mib"] = peak_mib(fwd_bwd(sparse(False), (q, k, v), do))
    if args.deterministic and T <= args.det_max_T:
        res["sparse_det_fwd_bwd_ms"] = timed(fwd_bwd(sparse(True), (q, k, v), do), budget_ms=args.budget_ms)
    res["sparse_fwd_bwd_tflops"] = 2 * Hq * pairs * (4 * D + 3 * D) / res["sparse_fwd_bwd_ms"] / 1e9
    if dense:
        causal_pairs = T * (T + 1) // 2
        run = fwd_bwd(lambda: dense_sdpa(q, k, v), (q, k, v), do)
        res["dense_fwd_bwd_ms"] = timed(run, max_reps=5, budget_ms=args.budget_ms)
        res["dense_fwd_bwd_peak_mib"] = peak_mib(run)
        res["dense_fwd_bwd_tflops"] = 2 * Hq * causal_pairs * 7 * D / res["dense_fwd_bwd_ms"] / 1e9
        res["speedup_vs_dense"] = res["dense_fwd_bwd_ms"] / res["sparse_fwd_bwd_ms"]
    return res


def _gluon_runs(module, name, run):
    """Whether ``run()`` launches the Gluon kernel ``module.name`` (counts its launches)."""
    if module is None:
        return False
    calls, real = [], getattr(module, name)
    setattr(module, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    try:
        run()
    finally:
        setattr(module, name, real)
    return bool(calls)


def bench_mla(T, K, idx, args):
    H, Dqk, Dv = 64, 576, 512
    dt = torch.bfloat16
    q = torch.randn(1, T, H, Dqk, device="cuda", dtype=dt, requires_grad=True)
    kv = torch.randn(1, T, 1, Dqk, device="cuda", dtype=dt, requires_grad=True)
    do = torch.randn(1, T, H, Dv, device="cuda", dtype=dt)
    pairs = int((idx >= 0).sum())
    res = dict(T=T, K=K, H=H, Dqk=Dqk, Dv=Dv, pairs=pairs)
    fwd_flop = 2 * H * pairs * (Dqk + Dv)
    bwd_flop = 2 * H * pairs * (3 * Dqk + 2 * Dv)

    def sparse(det, config=None):
        return lambda: sparse_attention(q, kv, kv[..., :Dv], idx, deterministic=det, config=config)

    with torch.no_grad():
        res["fwd_ms"] = timed(sparse(False), budget_ms=args.budget_ms)
        if _gluon_runs(host.mla_forward_gluon, "mla_forward", sparse(False)):
            triton_forward = SparseAttentionConfig(mla_gluon=False)
            res["triton_fwd_ms"] = timed(sparse(False, triton_forward), budget_ms=args.budget_ms)
            res["triton_fwd_tflops"] = fwd_flop / res["triton_fwd_ms"] / 1e9
    o = sparse(False)()
    gluon_bwd = _gluon_runs(host.mla_backward_gluon, "mla_backward_dkv", lambda o=o: o.backward(do, retain_graph=True))
    del o
    runs = [("", False, None), ("det_", True, None)]
    if gluon_bwd:  # the same-run baseline: the Triton dS + dK/dV kernel
        runs.append(("triton_", False, SparseAttentionConfig(mla_gluon_bwd=False)))
    for name, det, config in runs:
        if det and not (args.deterministic and T <= args.det_max_T):
            continue
        o = sparse(det, config)()

        def bwd(o=o):
            q.grad = kv.grad = None
            o.backward(do, retain_graph=True)

        res[f"{name}bwd_ms"] = timed(bwd, budget_ms=args.budget_ms)
        del o
    res["fwd_bwd_peak_mib"] = peak_mib(fwd_bwd(sparse(False), (q, kv), do))
    res["fwd_tflops"] = fwd_flop / res["fwd_ms"] / 1e9
    res["bwd_tflops"] = bwd_flop / res["bwd_ms"] / 1e9
    for name in ("det_", "triton_"):
        if f"{name}bwd_ms" in res:
            res[f"{name}bwd_tflops"] = bwd_flop / res[f"{name}bwd_ms"] / 1e9
    return res


def plot(path_json, path_png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path_json) as f:
        data = json.load(f)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, rows in data["gqa"].items():
        Ts = [r["T"] for r in rows]
        ax1.plot(Ts, [r["sparse_fwd_bwd_ms"] for r in rows], "o-", label=f"sparse fwd+bwd ({key})")
        if all("dense_fwd_bwd_ms" in r for r in rows) and key == next(iter(data["gqa"])):
            ax1.plot(Ts, [r["dense_fwd_bwd_ms"] for r in rows], "s--", label="dense SDPA flash fwd+bwd")
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xlabel("T (tokens)")
    ax1.set_ylabel("ms")
    ax1.set_title("GQA 32/8 heads, D=128, K=2048, bf16")
    if data["gqa"]:  # with --skip gqa the panel is empty (a legend of nothing warns)
        ax1.legend(fontsize=8)
    rows = data["mla"]
    x = range(len(rows))
    ax2.bar([i - 0.2 for i in x], [r["fwd_tflops"] for r in rows], 0.4, label="forward")
    ax2.bar([i + 0.2 for i in x], [r["bwd_tflops"] for r in rows], 0.4, label="backward")
    if all("triton_fwd_tflops" in r for r in rows) and rows:
        ax2.plot([i - 0.2 for i in x], [r["triton_fwd_tflops"] for r in rows], "k_", ms=20, mew=2,
                 label="forward, Triton kernel")
    if all("triton_bwd_tflops" in r for r in rows) and rows:
        ax2.plot([i + 0.2 for i in x], [r["triton_bwd_tflops"] for r in rows], "r_", ms=20, mew=2,
                 label="backward, Triton dK/dV kernel")
    ax2.set_xticks(list(x), [f"T={r['T'] // 1024}K" for r in rows])
    ax2.set_ylabel("TFLOP/s")
    ax2.set_title("MLA absorbed, 64 heads, 576/512, K=2048, bf16")
    ax2.legend(fontsize=8)
    fig.suptitle(data.get("device", ""))
    fig.tight_layout()
    fig.savefig(path_png, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--T", default="8192,32768,131072")
    ap.add_argument("--K", type=int, default=2048)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--far-share", default="1,64", help="comma list: 1 = independent far tokens per query")
    ap.add_argument("--budget-ms", type=float, default=3000.0, help="timing budget per measurement")
    ap.add_argument("--no-deterministic", dest="deterministic", action="store_false")
    ap.add_argument("--det-max-T", type=int, default=32768, help="time the deterministic backward up to this T")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: gqa, mla, dense")
    ap.add_argument("--plot", default=None, help="only draw the PNG from this JSON")
    args = ap.parse_args()
    if args.plot:
        plot(args.plot, os.path.splitext(args.plot)[0] + ".png")
        return
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_sparse_attention.json")
    skip = set(filter(None, args.skip.split(",")))
    data = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=__import__("triton").__version__,
        python=platform.python_version(),
        selection=dict(K=args.K, sinks=args.sinks, window=args.window, far=args.K - args.sinks - args.window),
        gqa={},
        mla=[],
    )
    shares = [int(s) for s in args.far_share.split(",")]
    for T in [int(t) for t in args.T.split(",")]:
        for share in shares:
            torch.manual_seed(0)
            idx = realistic_selection(T, args.K, sinks=args.sinks, window=args.window, far_share=share)
            t0 = time.time()
            if "gqa" not in skip:
                res = bench_gqa(T, args.K, idx, args, dense=("dense" not in skip and share == shares[0]))
                data["gqa"].setdefault(f"far_share={share}", []).append(res)
                print(json.dumps(res), flush=True)
            if "mla" not in skip and share == shares[0]:
                res = bench_mla(T, args.K, idx, args)
                res["far_share"] = share
                data["mla"].append(res)
                print(json.dumps(res), flush=True)
            print(f"T={T} share={share}: {time.time() - t0:.1f} s", flush=True)
            del idx
            torch.cuda.empty_cache()
            with open(path, "w") as f:
                json.dump(data, f, indent=1)
    data["dense_gqa"] = dict(DENSE_GQA)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    print_table(data)
    try:
        plot(path, os.path.splitext(path)[0] + ".png")
    except ImportError:
        print("matplotlib missing: run with --plot to draw the PNG elsewhere")


def print_table(data):
    print("\nGQA (32q/8kv, D=128) fwd+bwd ms")
    for key, rows in data["gqa"].items():
        for r in rows:
            dense = r.get("dense_fwd_bwd_ms")
            print(
                f"  {key:14s} T={r['T']:>6d} sparse fwd {r['sparse_fwd_ms']:8.2f} fwd+bwd {r['sparse_fwd_bwd_ms']:8.2f}"
                f" det {r.get('sparse_det_fwd_bwd_ms', float('nan')):8.2f}"
                f" dense {dense if dense else float('nan'):9.2f} x{r.get('speedup_vs_dense', float('nan')):6.2f}"
            )
    print("MLA (64 heads, 576/512): ms and TFLOP/s")
    for r in data["mla"]:
        print(
            f"  T={r['T']:>6d} fwd {r['fwd_ms']:8.2f} ({r['fwd_tflops']:6.1f}) bwd {r['bwd_ms']:8.2f} ({r['bwd_tflops']:6.1f})"
            f" det bwd {r.get('det_bwd_ms', float('nan')):8.2f}"
            f" Triton fwd {r.get('triton_fwd_ms', float('nan')):8.2f} ({r.get('triton_fwd_tflops', float('nan')):6.1f})"
            f" Triton bwd {r.get('triton_bwd_ms', float('nan')):8.2f} ({r.get('triton_bwd_tflops', float('nan')):6.1f})"
            f" bwd speed-up x{r['triton_bwd_ms'] / r['bwd_ms'] if 'triton_bwd_ms' in r else float('nan'):5.2f}"
        )


if __name__ == "__main__":
    main()
