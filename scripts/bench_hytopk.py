"""Benchmark HyTopK against the baselines of docs/design.md section 10, in one run, on one GPU.

One sequence, H = 32 indexer heads of D = 128 (``--heads``, ``--dim``: the small indexers of converted
dense models, e.g. 2 x 64), topk = 2048, bf16 q/k, fp32 w, causal.
For each T: HyTopK (backend="triton"; its scan runs the Gluon kernel on sm_90 where it applies), the
query-chunked torch baseline (score a chunk of queries with one matmul, ReLU, head-weighted sum,
causal mask, torch.topk: what a careful user writes), the Transformers-style path (fp32 [S, H, T]
scores + torch.topk) where it fits in memory, and the bf16 scoring floor: H * D * T^2 FLOP (2 * H * D
per causal pair; 4096 * T^2 for 32 x 128) at the bf16 matmul rate measured in the same run. Also one
HyTopK run at 1M tokens (--million). Writes JSON and a PNG plot.

    python scripts/bench_hytopk.py --out results/ [--lengths 8192 32768 131072] [--million]
    python scripts/bench_hytopk.py --heads 2 --dim 64 --sweep 32768 131072   # a small indexer's tiles
    python scripts/bench_hytopk.py --heads 2 --dim 64 --sweep 32768 131072 --sweep-refine   # refine slacks
    python scripts/bench_hytopk.py --heads 4 --dim 64 --sweep 32768 --sweep-presample   # threshold pre-pass
    python scripts/bench_hytopk.py --heads 4 --dim 64 --sweep 32768 --sweep-wide   # wider programs, larger chunks
    python scripts/bench_hytopk.py --heads 4 --dim 64 --sweep 32768 131072 --sweep-finalize --inputs plateau
    python scripts/bench_hytopk.py --heads 4 --dim 64 --sweep 32768 --sweep-digits   # radix digits of the selects
    python scripts/bench_hytopk.py --heads 4 --dim 64 --sweep 32768 --sweep-finalize-regs --sweep-lse   # register cap
    python scripts/bench_hytopk.py --heads 4 --dim 64 --sweep 32768 --sweep-finalize-l1 --sweep-lse   # L1 reads
    python scripts/bench_hytopk.py --heads 4 --dim 64 --sweep 32768 --sweep-stages --sweep-lse   # scan key stages
    python scripts/bench_hytopk.py --heads 4 --dim 64 --sweep 32768 --sweep-set BQ=4 refine_warps=2 --sweep-lse

``--sweep T ...`` times tile configurations instead. The tuning aid and the "where the time goes"
columns (scan kernel only, scoring only) go through ``hyscale_hf.kernels.topk.hytopk_triton`` (its
``config``, ``cap`` and ``profile`` arguments). ``ours_kernel_ms``: GPU time per HyTopK kernel in one
call (torch.profiler); ``ours_kernels_per_call``: the kernels a call launches, HyTopK's and torch's.
``ours_ms`` times each call alone (CUDA events, a sync between calls), so it also counts the host's
pacing of the launches; ``ours_host_issue_ms`` is the host's time to issue a call, and
``ours_back_to_back_ms`` a call's time when calls go back to back with the host running ahead (the
sweep prints them as "kernels/call", "host issue" and "back-to-back"); ``ours_graph_ms`` ("graph") a
call replayed from a CUDA graph: the GPU's time alone, which two codes can be compared on whatever the
host's speed (on a slow host the back-to-back time is the host's).
Run from the repository root with the package installed (``pip install -e .``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time

import torch
import triton

from hyscale_hf.benchmarking.timing import cuda_median_ms, graph_replay_ms, host_and_stream_ms
from hyscale_hf.kernels.topk import HyTopKConfig, hytopk, hytopk_stats, hytopk_triton, reset_hytopk_stats
from hyscale_hf.kernels.topk.host import equal_chunk_rows, lane_rows, padded_heads, pick_config, slot_capacity

H, D, TOPK = 32, 128, 2048
SWEEP_LSE = False  # --sweep-lse: the sweep asks for what a training step does (indices + lse, no scores)
INPUTS = "random"  # --inputs: make_inputs' distribution
GiB = 2**30


def peak_extra_bytes(fn) -> int:
    """Peak bytes allocated during ``fn()`` above what was allocated before (outputs included)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak


def kernel_ms(fn, reps: int) -> tuple[dict, float]:
    """GPU milliseconds per HyTopK kernel (summed over its launches) in one call of ``fn``, the mean
    over ``reps`` calls (torch.profiler): the scan, the refines between its launches, the final
    selection; and the kernels a call launches, HyTopK's and torch's (fills, zeroing, counters)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out: dict = {}
    n_kernels = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            n_kernels += 1
            if e.name.startswith("hytopk_"):
                out[e.name] = out.get(e.name, 0.0) + e.device_time / 1e3 / reps
    return out, n_kernels / reps


def graph_ms(fn, reps: int) -> float:
    """``graph_replay_ms``, or NaN (with the reason printed) where the call cannot be captured, so the
    entry's other figures still come out."""
    try:
        return graph_replay_ms(fn, reps)
    except Exception as e:  # noqa: BLE001 - capture errors come from torch and the driver alike
        print(f"graph capture failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        torch.cuda.synchronize()
        return math.nan


def bf16_matmul_tflops(n: int = 8192) -> float:
    """bf16 GEMM rate on random data (several operand sets so L2 does not flatter it)."""
    mats = [(torch.randn(n, n, device="cuda").bfloat16(), torch.randn(n, n, device="cuda").bfloat16()) for _ in range(3)]
    i = [0]

    def mm():
        a, b = mats[i[0] % 3]
        i[0] += 1
        return a @ b

    ms = cuda_median_ms(mm, 30, warmup=5)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def make_inputs(T: int, seed: int = 0):
    """Random q, k, w. ``INPUTS == "plateau"``: q biased negative and head weights of either sign, so
    most keys' heads all fall below ReLU's zero and score exactly 0: a row with fewer than K positive
    scores ties at 0 at its K-th key, a plateau that the threshold pre-pass's estimate can sit on."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    if INPUTS == "plateau":
        q.div_(8).sub_(0.3)
        w = torch.randn(1, T, H, device="cuda", generator=g)
    else:
        q.mul_(D**-0.5)
        w = torch.rand(1, T, H, device="cuda", generator=g) / H
    return q, k, w


def chunked_torch_topk(q, k, w, topk, chunk_bytes=4 * GiB):
    """Query-chunked torch baseline: one bf16 matmul per chunk, ReLU, head-weighted sum, mask, topk."""
    B, S, _, _ = q.shape
    T = k.shape[1]
    chunk = max(1, chunk_bytes // (2 * B * H * T))
    out = torch.empty(B, S, topk, dtype=torch.int64, device=q.device)
    for c0 in range(0, S, chunk):
        c1 = min(S, c0 + chunk)
        hi = T - S + c1  # keys visible to the chunk's last query
        logits = torch.einsum("bchd,btd->bcht", q[:, c0:c1], k[:, :hi]).relu_()
        scores = torch.einsum("bcht,bch->bct", logits, w[:, c0:c1].to(logits.dtype)).float()
        pos = torch.arange(T - S + c0, T - S + c1, device=q.device)
        scores.masked_fill_(torch.arange(hi, device=q.device) > pos[:, None], float("-inf"))
        kk = min(topk, hi)
        out[:, c0:c1, :kk] = scores.topk(kk, dim=-1).indices
        if kk < topk:
            out[:, c0:c1, kk:] = -1
    return out


def transformers_style_topk(q, k, w, topk):
    """The Transformers GLM indexer path: fp32 [B, S, H, T] scores, weighted head sum, mask, topk."""
    T = k.shape[1]
    scores = torch.einsum("bshd,btd->bsht", q.float(), k.float()).relu_()
    scores = (scores * w[..., None]).sum(2)
    scores.masked_fill_(torch.ones(T, T, dtype=torch.bool, device=q.device).triu_(1), float("-inf"))
    return scores.topk(min(topk, T), dim=-1).indices


def bench_lengths(lengths, reps, tflops):
    rows = []
    for T in lengths:
        rows.append(bench_one(T, reps, tflops))
        torch.cuda.empty_cache()
    return rows


def bench_one(T, reps, tflops):
    q, k, w = make_inputs(T)
    floor_ms = H * D * T**2 / (tflops * 1e12) * 1e3
    r = {"T": T, "floor_ms": floor_ms}
    n = reps if T <= 32768 else max(2, reps // 2)
    ours = lambda: hytopk(q, k, w, TOPK, backend="triton")  # noqa: E731
    reset_hytopk_stats()
    r["ours_ms"] = cuda_median_ms(ours, n)
    st = hytopk_stats()
    r["rows_refined_per_call"] = st["rows_refined"] / st["calls"]
    r["rows_rescued_per_call"] = st["rows_rescued"] / st["calls"]
    r["refines_per_call"] = st["refines"] / st["calls"]
    r["ours_peak_extra_gib"] = peak_extra_bytes(ours) / GiB
    r["outputs_gib"] = T * TOPK * 4 / GiB
    # where the time goes: the scan kernel without the final per-row selection, and scoring alone
    scan_only = lambda: hytopk_triton(q, k, w, TOPK, profile="scan")  # noqa: E731
    r["ours_scan_only_ms"] = cuda_median_ms(scan_only, n)
    score_only = lambda: hytopk_triton(q, k, w, TOPK, profile="scoring")  # noqa: E731
    r["ours_scoring_only_ms"] = cuda_median_ms(score_only, n)
    r["ours_kernel_ms"], r["ours_kernels_per_call"] = kernel_ms(ours, 2)
    # the host's time to issue a call, and a call's time when calls go back to back (the host ahead)
    r["ours_host_issue_ms"], r["ours_back_to_back_ms"] = host_and_stream_ms(ours, n)
    r["ours_graph_ms"] = graph_ms(ours, n)  # the GPU's time alone (one CUDA graph launch)
    chunked = lambda: chunked_torch_topk(q, k, w, TOPK)  # noqa: E731
    r["chunked_torch_ms"] = cuda_median_ms(chunked, n)
    r["chunked_torch_peak_extra_gib"] = peak_extra_bytes(chunked) / GiB
    if 4 * T * H * T * 1.5 < 100 * GiB:
        tf = lambda: transformers_style_topk(q, k, w, TOPK)  # noqa: E731
        try:
            r["transformers_style_ms"] = cuda_median_ms(tf, n)
            r["transformers_style_peak_extra_gib"] = peak_extra_bytes(tf) / GiB
        except torch.OutOfMemoryError:
            r["transformers_style_ms"] = None
            torch.cuda.empty_cache()
    else:
        r["transformers_style_ms"] = None  # would need > 100 GiB for its [S, H, T] fp32 table
    r["speedup_vs_chunked"] = r["chunked_torch_ms"] / r["ours_ms"]
    if r["transformers_style_ms"]:
        r["speedup_vs_transformers"] = r["transformers_style_ms"] / r["ours_ms"]
    r["ours_over_floor"] = r["ours_ms"] / floor_ms
    r["ours_tflops"] = H * D * T**2 / (r["ours_ms"] * 1e-3) / 1e12
    print(json.dumps(r), flush=True)
    return r


def bench_million(T, tflops):
    q, k, w = make_inputs(T)
    # A whole untimed call first: the timed one then compiles nothing (Triton specialises the
    # kernels on integer arguments such as the chunk size, so a smaller warm-up call can miss
    # variants; one compile inside the timed call added seconds).
    hytopk(q, k, w, TOPK, backend="triton")  # the result is dropped (freed) before the timed call
    reset_hytopk_stats()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    idx = hytopk(q, k, w, TOPK, backend="triton")
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3
    peak = torch.cuda.max_memory_allocated() - base
    st = hytopk_stats()
    ok = bool((idx[0, -1] >= 0).all()) and int(idx[0, 0, 1]) == -1
    out_gib = idx.numel() * 4 / GiB
    r = {
        "T": T, "ours_ms": ms, "floor_ms": H * D * T**2 / (tflops * 1e12) * 1e3,
        "ours_peak_extra_gib": peak / GiB, "outputs_gib": out_gib, "scratch_and_temps_gib": peak / GiB - out_gib,
        "inputs_gib": (q.numel() * 2 + k.numel() * 2 + w.numel() * 4) / GiB,
        "rows_refined": st["rows_refined"], "refines": st["refines"], "sane_output": ok,
    }  # fmt: skip
    r["ours_over_floor"] = ms / r["floor_ms"]
    print(json.dumps(r), flush=True)
    return r


def sweep(T, tflops, reps, configs):
    """Time (config, cap[, chunk_rows]) entries: full op, scan kernel only, scoring only. Returns [(full_ms,
    config, cap, chunk_rows)]."""
    q, k, w = make_inputs(T)
    ref = hytopk(q, k, w, TOPK, backend="triton")
    print(f"sweep T={T}: floor {H * D * T**2 / (tflops * 1e12) * 1e3:.2f} ms", flush=True)
    results = []
    for c, cap, *rows in configs:
        rows = rows[0] if rows else None
        run = lambda c=c, cap=cap, rows=rows, **kw: hytopk_triton(  # noqa: E731
            q, k, w, TOPK, config=c, cap=cap, chunk_rows=rows, return_scores=not SWEEP_LSE, return_lse=SWEEP_LSE, **kw)
        try:
            t0 = time.perf_counter()
            same = torch.equal(run()[0], ref)
            torch.cuda.synchronize()
            comp = time.perf_counter() - t0
            reset_hytopk_stats()
            full = cuda_median_ms(run, reps)
            st = hytopk_stats()
            scan = cuda_median_ms(lambda run=run: run(profile="scan"), reps)
            so = cuda_median_ms(lambda run=run: run(profile="scoring"), reps)
            per_name, n_kernels = kernel_ms(run, 2)
            per_kernel = "  ".join(f"{name[7:-7]} {ms:.2f}" for name, ms in per_name.items())
            host, b2b = host_and_stream_ms(run, reps)
            graph = graph_ms(run, reps)
            print(
                f"{c} cap={cap} chunk_rows={rows}: full {full:.2f} ms  scan {scan:.2f}  scoring-only {so:.2f}  [{per_kernel}]  "
                f"kernels/call {n_kernels:.0f}  host issue {host:.2f} back-to-back {b2b:.2f} graph {graph:.2f}  same={same}  "
                f"refined rows/call {st['rows_refined'] / st['calls']:.0f} refines/call {st['refines'] / st['calls']:.0f}  "
                f"rescued rows/call {st['rows_rescued'] / st['calls']:.1f}  "
                f"first call {comp:.1f}s",
                flush=True,
            )
            results.append((full, c, cap, rows))
        except Exception as e:  # a config that does not compile or fit: report and go on
            print(f"{c} cap={cap} chunk_rows={rows}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    return sorted(results, key=lambda r: r[0])


def refine_configs():
    """The default tiles with other refine slacks (``HyTopKConfig.refine_slack``)."""
    base = pick_config(H, D, torch.bfloat16, torch.device("cuda"))
    return [(dataclasses.replace(base, refine_slack=slack), None) for slack in (0.5, 0.25, 0.1, 0.0)]


def presample_configs():
    """The default tiles without the threshold pre-pass (``HyTopKConfig.presample = 0``, the before) and
    with other sample strides and margins, and the default pre-pass with a 4 x K candidate buffer (it
    appends about K + z * sqrt(K * stride) keys a row, so a smaller buffer fits more rows per chunk)."""
    base = pick_config(H, D, torch.bfloat16, torch.device("cuda"))
    variants = [dict(presample=0), dict(), dict(presample=8), dict(presample=16), dict(presample_z=4.0),
                dict(buffer_k=4)]
    return [(dataclasses.replace(base, **v), None) for v in variants]


def chunk_configs(T):
    """The default tiles with larger query chunks: rows per launch are what ``SCRATCH_BYTES`` holds per
    lane by default (about 4K rows for K = 2048, whose buffers take 128 KB a row); 2 and 4 times that
    (fewer, fuller scan launches, 2 and 4 times the scratch memory), and one lane with twice the rows
    (the same scratch as the default)."""
    base = pick_config(H, D, torch.bfloat16, torch.device("cuda"))
    rows = lane_rows(slot_capacity(TOPK, base.BN, base.buffer_k), base.BN, 1, base.lanes, base.BQ)

    def equal(limit):  # equal chunks of at most about ``limit`` rows, as the host cuts its default ones
        return equal_chunk_rows(T, limit, base.BQ)

    return [(base, None, None), (base, None, equal(2 * rows)), (base, None, equal(4 * rows)),
            (dataclasses.replace(base, lanes=1), None, equal(2 * rows))]


def digit_configs():
    """The default tiles with radix digits of 4-8 bits (``HyTopKConfig.select_bits``) in every radix
    select (the pre-pass refine, the second chance, the final selection), the default first and last:
    fewer buckets make a level's histogram cheaper (Triton builds it from one warp ballot per digit bit
    and key: the final selection's sm_90 code holds 128 of them at 7 bits) but take more levels."""
    base = pick_config(H, D, torch.bfloat16, torch.device("cuda"))
    return [(base, None)] + [(dataclasses.replace(base, select_bits=b), None) for b in (4, 5, 6, 8)] + [(base, None)]


def knob_ab_configs(field, off):
    """The default tiles with ``HyTopKConfig.<field>`` at ``off`` and at its default, twice each (off
    first): an A/B in one run. A package without the field (an A/B's old tree) times its default twice."""
    base = pick_config(H, D, torch.bfloat16, torch.device("cuda"))
    if not hasattr(base, field):
        return [(base, None), (base, None)]
    other = dataclasses.replace(base, **{field: off})
    return [(other, None), (base, None), (other, None), (base, None)]


def override_configs(specs):
    """The default tiles with each spec's ``HyTopKConfig`` fields changed ("BQ=4,num_warps=2": ints,
    floats, True/False/None as written), bracketed by the default first and last (drift over the run
    shows in the default's two entries). A bad field or value fails before anything runs."""
    base = pick_config(H, D, torch.bfloat16, torch.device("cuda"))
    fields = {f.name for f in dataclasses.fields(HyTopKConfig)}
    variants = []
    for spec in specs:
        changes = {}
        for item in spec.split(","):
            name, eq, value = item.partition("=")
            if not eq or name not in fields:
                raise SystemExit(f"--sweep-set: {item!r} is not FIELD=VALUE with a HyTopKConfig field")
            changes[name] = _config_value(value)
        variants.append(dataclasses.replace(base, **changes))  # __post_init__ checks the values
    return [(base, None)] + [(c, None) for c in variants] + [(base, None)]


def _config_value(text):
    """A config value as written on the command line: None, True, False, an int or a float."""
    consts = {"None": None, "True": True, "False": False}
    if text in consts:
        return consts[text]
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            raise SystemExit(f"--sweep-set: value {text!r} is not None, True, False, an int or a float") from None


def stage_configs():
    """The default tiles with 3 and 4 key-tile stages in the scan, 16 query rows a program over 8 warps
    (two warpgroups share each key tile) at 2-4 stages, and the warp-specialised Gluon scan at 64
    product columns a warpgroup (``HyTopKConfig.gluon_columns``: a load warp's ring of 4 key tiles
    feeding 2 * 64 / H queries), the default first and last. Nsight Compute on the 4 x 64 scan at 32K
    (2 stages): 56% of its warps' stall samples wait for the next key tile's copy, and each tile
    serves only its program's 8 queries."""
    base = pick_config(H, D, torch.bfloat16, torch.device("cuda"))
    variants = [dict(num_stages=3), dict(num_stages=4)] + [dict(BQ=16, num_warps=8, num_stages=s) for s in (2, 3, 4)]
    variants.append(dict(gluon_columns=64))
    return [(base, None)] + [(dataclasses.replace(base, **v), None) for v in variants] + [(base, None)]


def wide_configs(T):
    """Small indexers under the threshold pre-pass: more query rows per scan program (each program
    reads its rows' whole key window, so BQ rows share one read of the keys) with the smaller buffers
    the pre-pass allows (a row appends about 1.6 x K keys) and the larger query chunks those buffers
    fit: the default tiles, then (BQ, warps, buffer_k) at half or all of the sequence's rows a chunk."""
    base = pick_config(H, D, torch.bfloat16, torch.device("cuda"))
    variants = [(8, 4, 4, 2), (8, 4, 4, 1), (16, 4, 4, 2), (16, 8, 4, 2), (32, 8, 4, 2), (16, 8, 2, 2), (32, 8, 2, 2),
                (32, 8, 4, 4)]  # (BQ, num_warps, buffer_k, chunks a sequence)
    return [(base, None, None)] + [
        (dataclasses.replace(base, BQ=bq, num_warps=nw, buffer_k=bk), None, equal_chunk_rows(T, triton.cdiv(T, n), bq))
        for bq, nw, bk, n in variants
    ]


def sweep_configs():
    cfg = HyTopKConfig
    hp = padded_heads(H)
    if hp < 16:
        # Small indexers (pick_config's own rule): the scan's rows per program and warps (its
        # registers allow 4 programs of 4 warps per SM at BQ = 8, 2 x 64 or 4 x 64: 104 registers a
        # thread, 59 with 8 warps; sm_90 ptxas), and the candidate buffer's size, which bounds the
        # query rows per chunk (the scan's programs per launch) and how many keys each row stores
        # before its first refine (what the refines and final selection read).
        base = pick_config(H, D, torch.bfloat16, torch.device("cuda"))
        variants = [  # (BQ, num_warps, num_stages, buffer_k)
            (8, 4, 2, 8), (8, 4, 3, 8), (8, 4, 4, 8), (8, 8, 2, 8), (8, 8, 3, 8), (16, 8, 2, 8), (8, 4, 2, 4), (8, 8, 2, 4),
            (16, 4, 2, 4), (16, 8, 2, 4), (16, 8, 2, 2), (32, 8, 2, 2),
        ]
        return [
            (dataclasses.replace(base, BQ=bq, num_warps=nw, num_stages=st, buffer_k=bk), None)
            for bq, nw, st, bk in variants
        ] + [
            (dataclasses.replace(base, **kw), None)
            # 128-key tiles: the scan loop's fixed cost per tile (the TMA issue, barriers, moves to uniform
            # registers) over twice the scores
            for kw in (dict(finalize_warps=8), dict(lanes=3), dict(lanes=4), dict(BN=128), dict(BN=128, num_warps=8))
        ]
    return [
        (cfg(4, 64, 4, 2), None), (cfg(4, 64, 4, 2, finalize_warps=8), None), (cfg(4, 64, 4, 2, refine_warps=2), None),
        (cfg(4, 64, 4, 2, refine_warps=8), None), (cfg(4, 64, 4, 2, maxnreg=168), None), (cfg(4, 64, 4, 3), None),
        (cfg(8, 64, 4, 2), None), (cfg(4, 64, 4, 2), 4 * TOPK), (cfg(4, 64, 4, 2), 16 * TOPK),
        *((cfg(4, 64, 4, 2, select_bits=bits), None) for bits in (8, 6, 5, 4)),
        (cfg(4, 64, 4, 2, CH=512), None), (cfg(4, 64, 4, 2, CH=2048), None), (cfg(8, 64, 8, 2), None),
        (cfg(4, 64, 4, 2, tma=False), None), (cfg(4, 64, 4, 3, tma=False), None), (cfg(4, 64, 4, 2, lanes=1), None),
        (cfg(4, 64, 4, 2, gluon_scan=False), None), (cfg(4, 64, 4, 2, gluon_stages=3), None),
    ]  # fmt: skip


def plot(rows, million, path, tflops):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    Ts = [r["T"] for r in rows]
    ax.plot(Ts, [r["ours_ms"] for r in rows], "o-", label="HyTopK")
    ax.plot(Ts, [r["chunked_torch_ms"] for r in rows], "s-", label="query-chunked torch + topk")
    tf = [(r["T"], r["transformers_style_ms"]) for r in rows if r.get("transformers_style_ms")]
    if tf:
        ax.plot(*zip(*tf), "^-", label="Transformers-style fp32 [S,H,T] + topk")
    allT = Ts + ([million["T"]] if million else [])
    ax.plot(allT, [H * D * t**2 / (tflops * 1e12) * 1e3 for t in allT], "k--", label=f"bf16 scoring floor ({tflops:.0f} TFLOP/s)")
    if million:
        ax.plot([million["T"]], [million["ours_ms"]], "o", color="C0")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens T (one sequence, causal)")
    ax.set_ylabel("ms per indexer layer")
    ax.set_title(f"Indexer scoring + exact top-{TOPK}, H={H}, D={D}, bf16, {torch.cuda.get_device_name()}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--lengths", type=int, nargs="*", default=[8192, 32768, 131072])
    p.add_argument("--million", action="store_true", help="also one HyTopK run at 2**20 tokens")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--heads", type=int, default=32, help="indexer heads")
    p.add_argument("--dim", type=int, default=128, help="indexer head dim")
    p.add_argument("--sweep", type=int, nargs="*", default=[], help="time tile configs at these T instead")
    p.add_argument("--lengths-after-sweep", type=int, nargs="*", default=[], help="then benchmark these T")
    p.add_argument("--sweep-refine", action="store_true",
                   help="the sweep times the default tiles with other refine slacks instead of other tiles")
    p.add_argument("--sweep-presample", action="store_true",
                   help="the sweep times the default tiles without the threshold pre-pass and with other strides")
    p.add_argument("--sweep-chunks", action="store_true",
                   help="the sweep times the default tiles with larger query chunks (more scratch memory)")
    p.add_argument("--sweep-digits", action="store_true",
                   help="the sweep times the default tiles with radix digits of 4-8 bits in the selects")
    p.add_argument("--sweep-finalize", action="store_true",
                   help="the sweep times the default tiles with and without the final selection's bucket copy")
    p.add_argument("--sweep-finalize-regs", action="store_true",
                   help="the sweep times the default tiles with and without the final selection's register cap")
    p.add_argument("--sweep-finalize-l1", action="store_true",
                   help="the sweep times the default tiles with the final selection's reads through L1 and L2 only")
    p.add_argument("--sweep-stages", action="store_true",
                   help="the sweep times the scan with 3-4 key-tile stages, 16 query rows a program over 8 warps, "
                        "and the Gluon scan at 64 columns a warpgroup")
    p.add_argument("--sweep-wide", action="store_true",
                   help="the sweep times small indexers' wider scan programs with smaller buffers and larger chunks")
    p.add_argument("--sweep-set", nargs="+", default=[], metavar="FIELD=VALUE[,...]",
                   help="the sweep times the default tiles with these HyTopKConfig changes, one config per "
                        "argument, e.g. BQ=4 refine_warps=2 (the default first and last)")
    p.add_argument("--inputs", choices=["random", "plateau"], default="random",
                   help="plateau: ReLU-zero ties at many rows' K-th key (make_inputs)")
    p.add_argument("--sweep-lse", action="store_true",
                   help="the sweep's calls return indices and lse, as a training step's do (default: indices, scores)")
    a = p.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    global H, D, SWEEP_LSE, INPUTS
    H, D, SWEEP_LSE, INPUTS = a.heads, a.dim, a.sweep_lse, a.inputs
    tflops = bf16_matmul_tflops()
    print(f"device {torch.cuda.get_device_name()}, bf16 matmul {tflops:.0f} TFLOP/s", flush=True)
    if a.sweep:  # the first T: every config; later T: the three fastest so far, fewer reps
        every_t = (a.sweep_refine or a.sweep_presample or a.sweep_wide or a.sweep_finalize or a.sweep_finalize_regs
                   or a.sweep_finalize_l1 or a.sweep_digits or a.sweep_stages or a.sweep_set)  # every entry at every T
        if a.sweep_set:
            configs = override_configs(a.sweep_set)
        elif a.sweep_chunks:
            configs = chunk_configs(a.sweep[0])
        elif a.sweep_digits:
            configs = digit_configs()
        elif a.sweep_finalize:  # the final selection's bucket copy
            configs = knob_ab_configs("finalize_copy", False)
        elif a.sweep_finalize_regs:  # its register cap
            configs = knob_ab_configs("finalize_maxnreg", None)
        elif a.sweep_finalize_l1:  # its buffer reads through L1
            configs = knob_ab_configs("finalize_l1", False)
        elif a.sweep_stages:
            configs = stage_configs()
        elif a.sweep_wide:
            configs = wide_configs(a.sweep[0])
        elif a.sweep_presample:
            configs = presample_configs()
        else:
            configs = refine_configs() if a.sweep_refine else sweep_configs()
        ranked = sweep(a.sweep[0], tflops, a.reps, configs)
        for T in a.sweep[1:]:
            torch.cuda.empty_cache()
            sweep(T, tflops, 2, configs if every_t else [(c, cap, r) for _, c, cap, r in ranked[:3]])
        if not a.lengths_after_sweep:
            return
        a.lengths = a.lengths_after_sweep
    rows = bench_lengths(a.lengths, a.reps, tflops)
    million = bench_million(2**20, tflops) if a.million else None
    os.makedirs(a.out, exist_ok=True)
    result = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton.__version__, "H": H, "D": D, "topk": TOPK,
        "bf16_matmul_tflops": tflops, "rows": rows, "million": million,
    }  # fmt: skip
    name = "bench_hytopk" if (H, D) == (32, 128) else f"bench_hytopk_h{H}d{D}"
    with open(os.path.join(a.out, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(rows, million, os.path.join(a.out, f"{name}.png"), tflops)
    print(f"{'T':>8} {'ours':>9} {'chunked':>9} {'tf-style':>9} {'floor':>8} {'x chunk':>7} {'/floor':>6} {'GiB':>6} {'refined':>8}")
    for r in rows + ([million] if million else []):
        tf = r.get("transformers_style_ms")
        ch = r.get("chunked_torch_ms")
        print(
            f"{r['T']:>8} {r['ours_ms']:>9.2f} {ch if ch else math.nan:>9.2f} {tf if tf else math.nan:>9.2f} "
            f"{r['floor_ms']:>8.2f} {(ch / r['ours_ms']) if ch else math.nan:>7.2f} {r['ours_over_floor']:>6.2f} "
            f"{r['ours_peak_extra_gib']:>6.2f} {r.get('rows_refined_per_call', r.get('rows_refined')):>8}"
        )


if __name__ == "__main__":
    main()
