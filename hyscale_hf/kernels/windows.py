"""Which keys each query sees, and how the torch paths walk them a query chunk at a time.

Shared by the ops (their host code and torch references) and by the model patches and the training
diagnostics, which build the same windows for their own inputs. Torch only.
"""

from __future__ import annotations

import torch

# Bytes one query chunk may use for its [B, chunk, H, T_window] fp32 block. On a GPU the chunked
# loops are bound by launch and Python overhead long before memory (a 32 MiB block is 64 queries of
# an 8-head, 8K-token, batch-2 indexer: 128 chunks per layer call), so chunks are larger there.
SCORE_CHUNK_BYTES = 32 * 2**20
SCORE_CHUNK_BYTES_CUDA = 512 * 2**20


def chunk_budget_bytes(device) -> int:
    """Bytes a query chunk's fp32 score block may take on ``device``."""
    return SCORE_CHUNK_BYTES_CUDA if torch.device(device).type == "cuda" else SCORE_CHUNK_BYTES


def query_chunk(batch: int, heads: int, window: int, requested: int | None, device) -> int:
    """Queries per chunk: ``requested``, else as many as keep a [B, chunk, H, window] fp32 block
    within ``chunk_budget_bytes(device)`` (at least 1)."""
    if requested is not None:
        return max(1, requested)
    return max(1, chunk_budget_bytes(device) // max(1, 4 * batch * heads * window))


def compute_dtype(*tensors) -> torch.dtype:
    """The dtype the torch paths compute in: fp64 if any input is fp64 (gradcheck), else fp32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def query_windows(batch: int, queries: int, num_keys: int, *, cu_seqlens=None, window_start=None, device=None):
    """Visible key window of each query: key s is visible to query i iff start <= s <= end.

    Query i sits at key position ``T - S + i`` (``end``). ``cu_seqlens`` (packed, B = 1, S = T)
    moves ``start`` to the first token of the query's sequence; ``window_start`` ([B, S] or [B]
    integer, e.g. the first non-pad key with left padding) raises it further.
    Returns ``(start, end)`` as int64 ``[B, S]``.
    """
    end = torch.arange(num_keys - queries, num_keys, device=device, dtype=torch.int64).expand(batch, queries)
    start = torch.zeros(batch, queries, dtype=torch.int64, device=device)
    if cu_seqlens is not None:
        cu = cu_seqlens.to(device=device, dtype=torch.int64)
        pos = torch.arange(queries, device=device, dtype=torch.int64)
        seq_id = torch.searchsorted(cu[1:], pos, right=True)
        start = cu[seq_id].expand(batch, queries)
    if window_start is not None:
        ws = window_start.to(device=device, dtype=torch.int64)
        ws = ws[:, None].expand(batch, queries) if ws.dim() == 1 else ws
        start = torch.maximum(start, ws)
    return start.contiguous(), end.contiguous()


def visible_mask(start, end, lo: int, hi: int) -> torch.Tensor:
    """[B, c, hi - lo] bool: key lo + j visible to each query of a chunk with windows (start, end)."""
    s = torch.arange(lo, hi, device=start.device)
    return (s >= start[..., None]) & (s <= end[..., None])
