"""CUDA-event timing shared by the kernel benchmarks (scripts/bench_hytopk.py, bench_sparse_attention.py,
bench_indexer_loss.py, tune_sparse_attention.py). Whole training steps are timed by wall clock
instead (``glm5.time_ms``): they synchronise with the host anyway."""

from __future__ import annotations

import statistics

import torch


def cuda_times(fn, reps: int, *, warmup: int = 1, budget_ms: float | None = None) -> list[float]:
    """Milliseconds of each timed call of ``fn`` (CUDA events around it), after ``warmup`` calls.

    ``reps`` calls, or with ``budget_ms`` as many as fit the budget at the first call's time (at
    least 3, at most ``reps``), so slow baselines are not timed ten times over.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times: list[float] = []
    want = reps
    while len(times) < want:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        if budget_ms is not None and len(times) == 1:
            want = max(3, min(reps, int(budget_ms / max(times[0], 1e-3))))
    return times


def cuda_median_ms(fn, reps: int, *, warmup: int = 1, budget_ms: float | None = None) -> float:
    """Median of ``cuda_times``."""
    return statistics.median(cuda_times(fn, reps, warmup=warmup, budget_ms=budget_ms))


def timed(fn, *, warmup: int = 1, max_reps: int = 10, budget_ms: float = 4000.0) -> float:
    """Median milliseconds of ``fn()`` by CUDA events, after warm-up; reps scaled to the budget."""
    return cuda_median_ms(fn, max_reps, warmup=warmup, budget_ms=budget_ms)
