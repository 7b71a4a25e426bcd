"""Device and pinned-host memory figures, and out-of-memory handling, shared by the benchmark scripts."""

from __future__ import annotations

import gc

import torch


def free(device) -> None:
    """Return cached device memory, and cached pinned host memory (the offload arm's), between lengths."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
        empty_host = getattr(torch._C, "_accelerator_emptyHostCache", None) or getattr(torch._C, "_host_emptyCache", None)
        if empty_host is not None:
            empty_host()


def host_pinned_gib(key: str = "allocated_bytes.peak") -> float | None:
    """A figure of the caching host allocator's pinned memory (default: its peak since the last reset;
    blocks are rounded up). None where this torch has no host memory statistics."""
    stats_fn = getattr(torch.cuda, "host_memory_stats", None)  # newer torch only
    stats = stats_fn() if stats_fn is not None and torch.cuda.is_available() else {}
    value = stats.get(key)
    return None if value is None else value / 2**30


def is_oom(err: BaseException) -> bool:
    """Device memory or pinned host memory ran out (the host allocator raises a plain RuntimeError)."""
    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower()


def oom_message(err: BaseException) -> str:
    """The first line of an out-of-memory error, which says which memory ran out and how much was asked."""
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else type(err).__name__
