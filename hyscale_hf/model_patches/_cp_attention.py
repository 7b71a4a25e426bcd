"""A patched attention layer under context parallelism (``hyscale_hf.context_parallel``).

The layer has computed its queries, its indexer outputs and its keys for this rank's tokens: two
chunks of the sequence (head and tail). It all-gathers the keys (``gather_tokens``), then runs the DSA
step (``_dsa_step.dsa_attention``) once per chunk: the chunk's queries against the keys ``:end`` of the
whole sequence that its last query can see, so each call has the shape the ops know (the queries are
the last of the keys), with the visibility of the whole sequence cut to it (padding, packed sequences,
sliding windows). The indexer KL of both chunks is summed over the whole sequence's count
(``ContextBatch.loss_count``) and joined once per layer (``TiledIndexerLoss``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from ..context_parallel import ContextBatch
from ..indexer import TiledIndexerLoss
from ..state import PatchState
from ._dsa_step import dsa_attention
from ._visibility import Visibility, query_part, visibility


def chunk_visibility(batch: ContextBatch, start: int, end: int, B: int, window: int | None, device) -> Visibility:
    """The visibility of the queries ``start:end`` of the whole sequence over its keys ``:end``: the whole
    sequence's (built once per forward and window, as one process builds it) cut to them."""
    key = ("visibility", window)
    if key not in batch.cache:
        kwargs = {} if batch.cu_seqlens is None else {"cu_seq_lens_q": batch.cu_seqlens}
        batch.cache[key] = visibility(batch.attention_mask, batch.position_ids, kwargs, B, batch.T, batch.T,
                                      sliding_window=window, device=device)
    return query_part(batch.cache[key], start, end, B, device)


def cp_attention(chunk_attention: Callable, state: PatchState, batch: ContextBatch, *, batch_size: int, index,
                 shared: bool, prev_indices, window: int | None, training: bool, device,
                 finish: Callable | None = None):
    """The DSA step of this rank's queries. ``chunk_attention(a, b, end)`` builds the attention form of the
    local queries ``a:b`` over the gathered keys ``:end``; ``index`` is ``(q [B, 2L, H, D] local, k [B, T, D]
    gathered, w [B, 2L, H] local)`` or None; ``finish(a, b)`` the output map of those queries (or None).
    Returns ``(output [B, 2L, ...], indices int32 [B, 2L, K] of the whole sequence's keys, or None)``."""
    cfg = state.config
    loss = None
    if index is not None and training and torch.is_grad_enabled() and float(cfg.indexer_loss_coef) > 0:
        loss = TiledIndexerLoss(index[1], state)
    outs, selections = [], []
    for (a, b), (start, end) in batch.local_chunks():
        vis = chunk_visibility(batch, start, end, batch_size, window, device)
        part = None if index is None else (index[0][:, a:b], index[1][:, :end], index[2][:, a:b])
        out, indices, _ = dsa_attention(
            chunk_attention(a, b, end), state, vis, index=part, shared=shared,
            prev_indices=None if prev_indices is None else prev_indices[:, a:b], window=window, training=training,
            finish=None if finish is None else finish(a, b),
            loss_sink=None if loss is None else partial(loss.add, part), loss_count=batch.loss_count,
        )
        outs.append(out)
        selections.append(indices)
    out = torch.cat(outs, dim=1)
    indices = None
    if selections[0] is not None:  # an early chunk sees fewer keys than top-k: -1 pads it to the whole's width
        width = max(s.shape[-1] for s in selections)
        indices = torch.cat([torch.nn.functional.pad(s, (0, width - s.shape[-1]), value=-1) for s in selections], 1)
    return (out if loss is None else loss.join(out)), indices
