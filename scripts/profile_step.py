"""Where one training step's time goes: kernel time by category and the top kernels, from torch.profiler.

The step is bench_e2e.py's (forward + backward + AdamW, gradient checkpointing on every layer, one
sequence of T tokens, bf16) on one arm of a model stack (``hyscale_hf.benchmarking.stacks``). After
a warm-up step, one step runs under the profiler; each GPU kernel's time is summed by name and by
category (matmuls, sparse attention forward / backward, indexer KL, HyTopK, dense attention, tile
bitmaps, elementwise and copies, other). Prints, per T, the step's wall time, the category table and
the top kernels; writes JSON. ``--sites N`` also records Python stacks and lists the N call sites whose
elementwise and copy ops cost most (the torch op, its innermost frame in hyscale_hf, Transformers or
torch.optim, and its time): where the glue comes from. Stacks add host overhead to the profiled step,
so its wall time is then not comparable.

Before the profiled step, ``--host-reps`` unprofiled steps give the step's wall time (``wall_ms``) and the
host's time to issue it (``host_ms``, before the final synchronise), and one more step lists the calls
that made the host wait for the GPU (``syncs``, found with ``torch.cuda.set_sync_debug_mode``) by Python
line. A wall time well above the profiled kernel total means the GPU waited for the host: for Python,
or at those synchronising calls. ``--host-top N`` then runs one more step under cProfile and lists the N
Python functions with the most own time (``host_functions``): where the host's time goes.

    python scripts/profile_step.py --seqlens 65536 131072 --out results/       # glm5, hyscale arm
    python scripts/profile_step.py --stack smollm2 --arm dense --seqlens 32768  # the dense baseline
    python scripts/profile_step.py --tiny --out /tmp/profile                    # CPU smoke run (aten ops)
    python scripts/profile_step.py --seqlens 65536 --sites 25                   # where the glue comes from
    python scripts/profile_step.py --model /tmp/realmodel --seqlens 131072      # a saved converted model, real text
    python scripts/profile_step.py --stack smollm2 --index-share 3 --seqlens 32768  # IndexShare, random init

``--model DIR`` profiles a converted dense model the main job saved (``finetune_long.py --output_dir``)
instead of the random-init smollm2 stack, on real text (as ``bench_e2e.py --model``): the hyscale arm
with its trained indexer, so the sparse kernels run on the selections a trained indexer makes.

On a CPU there are no kernels: the table then sums the aten ops' own CPU time, by the same categories
(the torch paths there, e.g. the CPU flash kernel that sparse attention runs on, fall in other rows).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

import torch

from hyscale_hf.benchmarking.stacks import ARMS, STACKS, make_arm, step_loss, sync
from hyscale_hf.benchmarking.trained import check_saved, saved_dims, text_ids

# First match wins. Kernel names of this package's Triton kernels, cuBLAS / CUTLASS matmuls, flash /
# cuDNN attention, and the aten ops a CPU profile lists.
CATEGORIES = (
    ("sparse attention backward", r"sparse_attn_bwd|mla_backward|scratch_reduce"),
    ("sparse attention forward", r"sparse_attn_fwd|mla_forward|_pv_|_softmax_partition"),
    ("indexer KL", r"indexer_kl|attn_lse_kernel"),
    ("HyTopK", r"hytopk|row_extent|hyscale::hytopk"),
    ("tile bitmaps", r"tile_bit|tile_rank|tile_expand|tile_bitmap"),
    ("dense attention", r"flash|fmha|cudnn|_efficient_attention|scaled_dot_product"),
    ("matmuls", r"gemm|cutlass|cublas|nvjet|xmma|wgmma|aten::(mm|bmm|addmm|matmul|linear)\b"),
    ("elementwise, copies", r"elementwise|vectorized|copy|cat|reduce|index|fill|unrolled|softmax|"
                            r"aten::(copy_|add|mul|sub|div|exp|log|where|fill_|sum|cat|index|neg|silu|pow|rsqrt|mean)"),
)


def category(name: str) -> str:
    for label, pattern in CATEGORIES:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return label
    return "other"


def kernel_times(prof, on_gpu: bool) -> dict[str, float]:
    """Milliseconds per kernel name (GPU) or per aten op's own CPU time (CPU) over the profiled step."""
    out: dict[str, float] = {}
    for event in prof.key_averages():
        if on_gpu:
            us = getattr(event, "self_device_time_total", None)
            if us is None:  # older torch
                us = event.self_cuda_time_total
            is_kernel = getattr(event, "device_type", None) == torch.autograd.DeviceType.CUDA
        else:
            us, is_kernel = event.self_cpu_time_total, event.key.startswith(("aten::", "hyscale::"))
        if is_kernel and us > 0:
            out[event.key] = out.get(event.key, 0.0) + us / 1e3
    return out


# Frames that name a call site: this package, Transformers, the optimizer (torch internals are skipped).
_SITE_FRAMES = ("hyscale_hf/", "transformers/", "torch/optim/")


def call_site(stack) -> str:
    """The innermost frame of ``stack`` in this package, Transformers or torch.optim, and the innermost
    module around it (``in GlmMoeDsaRMSNorm``, the same row for every layer's). Ops the autograd engine runs in backward carry the
    Python stack live at the time: the ``backward()`` call, or the custom backward or checkpoint recompute
    that set them off."""
    site = None
    for frame in stack:
        if site is None:
            for root in _SITE_FRAMES:
                if root in frame:
                    site = root + frame.split(root, 1)[1]
                    break
        elif frame.startswith("nn.Module: "):  # "nn.Module: GlmMoeDsaMLP_1": one row for every layer's MLP
            return f"{site} in {re.sub(r'_[0-9]+$', '', frame[len('nn.Module: '):])}"
    if site is not None:
        return site
    return "(no Python frame)" if not stack else "(other) " + stack[0]


def glue_sites(prof, on_gpu: bool, n: int) -> list[dict]:
    """The ``n`` costliest (torch op, call site) pairs among the elementwise and copy ops: each op's own
    kernel time on the GPU (its own CPU time on a CPU), over the profiled step."""
    sites: dict[tuple[str, str], list] = {}
    for event in prof.key_averages(group_by_stack_n=12):
        if not event.key.startswith("aten::") or category(event.key) != "elementwise, copies":
            continue
        us = (getattr(event, "self_device_time_total", None) or 0.0) if on_gpu else event.self_cpu_time_total
        if us <= 0:
            continue
        entry = sites.setdefault((event.key, call_site(event.stack)), [0.0, 0])
        entry[0] += us / 1e3
        entry[1] += event.count
    ranked = sorted(sites.items(), key=lambda kv: -kv[1][0])[:n]
    return [{"op": op, "site": site, "ms": ms, "calls": calls} for (op, site), (ms, calls) in ranked]


def host_timing(step, device, reps: int) -> dict:
    """Median over ``reps`` unprofiled steps of the host's time to issue the step (``host_ms``: it
    includes every wait at a synchronising call) and the step's wall time (``wall_ms``); on a GPU one
    more step, untimed, lists the synchronising calls (``syncs``) and the Python lines that made them
    (``sync_sites``: [file:line, count], most frequent first)."""
    import statistics
    import warnings

    host, wall = [], []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        step()
        host.append((time.perf_counter() - t0) * 1e3)
        sync(device)
        wall.append((time.perf_counter() - t0) * 1e3)
    sites = []
    if device.type == "cuda":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        sync(device)
        sites = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
    return {"host_ms": statistics.median(host), "wall_ms": statistics.median(wall),
            "syncs": len(sites) if device.type == "cuda" else None,
            "sync_sites": sorted(((s, sites.count(s)) for s in set(sites)), key=lambda kv: -kv[1])[:10]}


def host_functions(step, device, n: int) -> list[dict]:
    """One step under cProfile: the ``n`` Python functions with the most own time (ms, calls), the
    waits at synchronising calls included (they show as the builtin that waited)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    sync(device)
    profiler.enable()
    step()
    sync(device)
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive, own s, cumulative s, callers)
    ranked = sorted(stats.items(), key=lambda kv: -kv[1][2])[:n]
    return [{"function": f"{file.split('site-packages/')[-1]}:{line}({name})", "own_ms": own * 1e3,
             "cum_ms": cum * 1e3, "calls": calls} for (file, line, name), (calls, _, own, cum, _) in ranked]


def profile_one(args, T: int, device, dtype, dims) -> dict:
    from torch.profiler import ProfilerActivity, profile

    share = {} if args.index_share is None else {"index_share": args.index_share}
    model, optimizer = make_arm(args.stack, args.arm, dims, args.layers, T, device, dtype, saved=args.model, **share)
    if args.tokenizer is not None:
        ids = text_ids(args.tokenizer, T).to(device)
    else:
        ids = torch.randint(3, dims["vocab_size"], (1, T), generator=torch.Generator().manual_seed(T)).to(device)

    def step():
        optimizer.zero_grad(set_to_none=True)
        step_loss(model, ids, args.loss_chunk).backward()
        optimizer.step()

    try:
        step()  # warm-up: compilation, autotuning, allocator
        host = host_timing(step, device, args.host_reps) if args.host_reps else None
        if args.host_top:
            host = {**(host or {}), "host_functions": host_functions(step, device, args.host_top)}
        on_gpu = device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
        sync(device)
        t0 = time.perf_counter()
        stacks = {}
        if args.sites:  # Python stacks on every op: verbose is what fills them in on this torch
            stacks = {"with_stack": True,
                      "experimental_config": torch._C._profiler._ExperimentalConfig(verbose=True)}
        with profile(activities=activities, **stacks) as prof:
            step()
            sync(device)
        wall_ms = (time.perf_counter() - t0) * 1e3
    finally:
        model = optimizer = None  # free the arm before the next T is built
        if device.type == "cuda":
            torch.cuda.empty_cache()
    kernels = kernel_times(prof, on_gpu)
    total = sum(kernels.values())
    by_category: dict[str, float] = {}
    for name, ms in kernels.items():
        by_category[category(name)] = by_category.get(category(name), 0.0) + ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[: args.top]
    row = {
        "T": T, "profiled_step_wall_ms": wall_ms, "kernel_ms_total": total, "host": host,
        "categories": [{"category": c, "ms": ms, "share": ms / total if total else 0.0}
                       for c, ms in sorted(by_category.items(), key=lambda kv: -kv[1])],
        "top_kernels": [{"name": n, "ms": ms, "category": category(n)} for n, ms in top],
    }
    if args.sites:
        row["glue_sites"] = glue_sites(prof, on_gpu, args.sites)
    return row


def report(row: dict, unit: str) -> str:
    lines = [f"T={row['T']}: profiled step {row['profiled_step_wall_ms']:.0f} ms wall, "
             f"{row['kernel_ms_total']:.0f} ms of {unit}"]
    host = row.get("host") or {}
    if "wall_ms" in host:
        syncs = "" if host["syncs"] is None else f", {host['syncs']} synchronising calls"
        lines.append(f"  unprofiled step {host['wall_ms']:.0f} ms wall, issued by the host in {host['host_ms']:.0f} ms{syncs}")
        lines += [f"    {n}x at {site}" for site, n in host["sync_sites"]]
    lines.append(f"  {'category':<28} {'ms':>9} {'share':>6}")
    lines += [f"  {c['category']:<28} {c['ms']:>9.1f} {100 * c['share']:>5.1f}%" for c in row["categories"]]
    lines.append(f"  top {len(row['top_kernels'])}:")
    lines += [f"  {k['ms']:>9.1f} ms  {k['name'][:90]}  [{k['category']}]" for k in row["top_kernels"]]
    if "glue_sites" in row:
        lines.append(f"  elementwise and copy ops by call site (top {len(row['glue_sites'])}):")
        lines += [f"  {g['ms']:>9.1f} ms {g['calls']:>6}x  {g['op']:<22} {g['site']}" for g in row["glue_sites"]]
    if host.get("host_functions"):
        lines.append("  host functions by own time (one step under cProfile):")
        lines += [f"  {f['own_ms']:>9.1f} ms own {f['cum_ms']:>9.1f} cum {f['calls']:>7}x  {f['function'][-90:]}"
                  for f in host["host_functions"]]
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stack", choices=sorted(STACKS), default=None, help="model stack (default: glm5; smollm2 with --model)")
    p.add_argument("--model", default=None,
                   help="a converted dense model saved by finetune_long.py (its --output_dir), profiled on real text "
                        "instead of the random-init smollm2 stack")
    p.add_argument("--arm", choices=ARMS, default="hyscale")
    p.add_argument("--seqlens", nargs="+", type=int, default=None, help="default: 65536 131072 (GPU), 32 (--tiny)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the stack's, as in bench_e2e)")
    p.add_argument("--loss-chunk", type=int, default=0,
                   help="tokens per LM-head/cross-entropy chunk, as bench_e2e (0: the model's own loss over whole logits)")
    p.add_argument("--top", type=int, default=15, help="kernels listed by time")
    p.add_argument("--sites", type=int, default=0,
                   help="also list the N costliest call sites of elementwise and copy ops (records Python stacks)")
    p.add_argument("--index-share", type=int, default=None,
                   help="smollm2 stack: an indexer on every N-th layer, as bench_e2e.py --index-share")
    p.add_argument("--host-reps", type=int, default=2,
                   help="unprofiled steps that time the host against the GPU before the profiled one (0: none)")
    p.add_argument("--host-top", type=int, default=0,
                   help="one more step under cProfile: list the N Python functions with the most own time")
    p.add_argument("--tiny", action="store_true", help="toy dims on the CPU (smoke test)")
    p.add_argument("--out", default="outputs/profile_step", help="folder for profile_step.json")
    args = p.parse_args(argv)
    if args.model is not None:
        if reason := check_saved(args.model):
            p.error(f"--model {args.model}: {reason}")
        if args.stack not in (None, "smollm2") or args.tiny or args.layers:
            p.error("--model: the saved model is the smollm2 stack with its own dims and layers "
                    "(drop --stack / --tiny / --layers)")
    args.stack = args.stack or ("smollm2" if args.model else "glm5")
    if args.index_share is not None and (args.index_share <= 0 or args.stack != "smollm2" or args.model is not None
                                         or args.arm == "dense"):
        p.error(f"--index-share {args.index_share}: a positive N, for a patched arm of the random-init smollm2 stack "
                "(a saved --model keeps its own indexer layers)")
    if args.stack == "smollm2" and args.arm == "native":
        p.error("--arm native: the smollm2 stack is a dense model (its unpatched arm is 'dense')")
    if args.top < 1 or min(args.sites, args.loss_chunk, args.host_reps, args.host_top) < 0 or any(
            T < 2 for T in args.seqlens or [2]):
        p.error("--top must be >= 1, --sites, --loss-chunk, --host-reps and --host-top >= 0 and every --seqlens "
                "entry >= 2")
    stack = STACKS[args.stack]
    args.layers = args.layers or stack["layers"]
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    dims = stack["tiny"] if args.tiny else stack["dims"]
    args.tokenizer = None
    if args.model is not None:
        dims, args.layers, args.tokenizer = saved_dims(args.model, stack["dims"])
    args.seqlens = args.seqlens or ([32] if args.tiny else [65536, 131072])
    unit = "GPU kernel time" if device.type == "cuda" else "aten op CPU time"
    result = {"stack": args.stack, "model": args.model, "arm": args.arm, "layers": args.layers,
              "index_share": args.index_share,
              "loss_chunk": args.loss_chunk, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "dtype": str(dtype), "unit": unit, "rows": []}
    os.makedirs(args.out, exist_ok=True)
    for T in args.seqlens:
        row = profile_one(args, T, device, dtype, dims)
        print(report(row, unit), flush=True)
        result["rows"].append(row)
        with open(os.path.join(args.out, "profile_step.json"), "w") as f:  # rewritten per T
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
