"""CUDA-event timing shared by the kernel benchmarks (scripts/bench_hytopk.py, bench_sparse_attention.py,
bench_indexer_loss.py, tune_sparse_attention.py). Whole training steps are timed by wall clock
instead (``glm5.time_ms``): they synchronise with the host anyway."""

from __future__ import annotations

import statistics
import time

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


def host_and_stream_ms(fn, calls: int) -> tuple[float, float]:
    """Per call of ``fn`` over ``calls`` calls issued back to back (no sync between them): the host's
    time to issue a call, and the wall time a call takes until the device is done with all of them.

    The second is the op's time where the host runs ahead of the GPU, as in a training step; the per-call
    CUDA-event time (``cuda_times``) also counts the host's pacing of the launches. When the first
    is close to the second, the host's launches, not the kernels, set the time."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) * 1e3 / calls, (t2 - t0) * 1e3 / calls


def graph_replay_ms(fn, reps: int) -> float:
    """Median milliseconds of one call of ``fn`` replayed from a CUDA graph: the device's time for the
    call with no host launch cost (the captured kernels replay from one launch). Where the host issues
    an op's many small launches about as fast as the GPU runs them (``host_and_stream_ms``), this is
    the op's GPU time alone, so two codes compare on any host. ``fn`` must be capturable (no host
    sync, no host-side reads of device results); capture raises otherwise."""
    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # a warm call off the default stream, as graph capture wants
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    try:
        return cuda_median_ms(graph.replay, reps)
    finally:
        del graph  # its memory pool (the call's outputs and scratch) goes back before the caller's next run
