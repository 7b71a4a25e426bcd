"""Which keys each query of a patched attention layer sees, from what Transformers hands attention.

One builder for every patched layer (native DSA layers and dense layers given an indexer). It turns
the padding mask, the packing kwargs / ``position_ids`` and a sliding window into one ``Visibility``:
key ``s`` is visible to query ``i`` iff ``start <= s <= T - S + i`` (hytopk's window, docs/design.md
section 2) and ``s`` is a real key of its row, counted over the ``T`` keys the layer attends over (a
sliding-window cache keeps only the last ``T`` of the tokens so far; the padding mask covers all of
them):

- Padding: the 2-D mask, the only one the registered mask function (``padding_mask_only``) lets
  through, with any pattern of zeros (left or right padding, generate()'s ones appended after a
  right-padded prompt, holes). It is kept as a key mask; the selection honours it exactly through
  ``_compaction`` (real keys moved next to each other, so that a window holds only them). A mask's
  zeros also mark padding queries, which the indexer loss leaves out.
- Packed sequences: ``cu_seq_lens_q/k`` kwargs (``DataCollatorWithFlattening``, checked on the host:
  the ops validate them there too), or, without a padding mask, ``position_ids`` resets whenever there
  is no cached prefix (``S == T``) -> a per-query window start. A mask given with the positions
  defines the visible keys on its own, as in Transformers (generate() derives the positions of a
  padded batch from its mask).
- A sliding window ``W``: a per-query window start of ``pos - W + 1``.
- A static cache: the layer attends over all its ``T`` slots, the queries sit at the slots the cache
  just wrote (``query_offset``, a device tensor), and the slots not written yet are invisible.

Nothing here reads a tensor's values on the host but one thing: whether ``position_ids`` hold a
reset, read once per positions tensor (so once per forward, for all layers), as Transformers' own
``find_packed_sequence_indices`` reads it, and only in eager runs on a real device. Every training
forward passes plain positions, and knowing they are plain keeps the dense warm-up on causal SDPA
(flash) and hytopk without a per-query window. Everything else follows from which inputs were given
and their shapes, never from their contents, so a forward runs on the meta device and traces under
``torch.compile(fullgraph=True)``; there, and for any input that only might hold padding (an all-ones
mask), the general path runs, whose result is the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.checks import has_values
from ..kernels.windows import query_windows

# Attribute of a positions tensor: (its _version when read, whether it holds a reset).
_RESETS_ATTR = "_hyscale_resets"


def padding_mask_only(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                      attention_mask=None, **kwargs):
    """The mask function registered for hyscale_hf's attention implementation: the 2-D padding mask
    as Transformers passes it (bool ``[B, tokens]``), or None without one; never a ``[B, 1, S, T]``
    tensor. Patched layers read it through ``visibility``."""
    return attention_mask


@dataclass
class Visibility:
    """Each query's visible keys.

    Attributes:
        cu_seqlens: int32 ``[N + 1]`` packed sequences (batch 1, no cached keys), or None.
        window_start: int64 ``[B]`` or ``[B, S]`` first visible key, or None (key 0).
        key_mask: bool ``[B, T]``, False for padding keys (any pattern); None when no mask was given.
        query_real: bool ``[B, S]``, False for padding queries; None when no mask was given.
        query_pos: int64 ``[S]`` key position of each query when it is not ``T - S + i`` (a static
            cache's slots); the key mask then hides every key after the last query.
    """

    cu_seqlens: torch.Tensor | None
    window_start: torch.Tensor | None
    key_mask: torch.Tensor | None
    query_real: torch.Tensor | None
    query_pos: torch.Tensor | None = None

    @property
    def plain(self) -> bool:
        """Causal over every key, nothing else (known without looking at any tensor's values)."""
        return self.cu_seqlens is None and self.window_start is None and self.key_mask is None

    def windows(self, batch: int, queries: int, keys: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(start, end)`` int64 ``[B, S]``: the window of each query, before the key mask."""
        start, end = query_windows(batch, queries, keys, cu_seqlens=self.cu_seqlens, window_start=self.window_start,
                                   device=device)
        if self.query_pos is not None:
            end = self.query_pos.to(device).expand(batch, queries)
        return start, end

    def last_key(self, keys: int, queries: int, last_query: int) -> int:
        """One past the last key any of the first ``last_query`` queries can see (a bound known without
        reading a tensor: all ``keys`` when the queries' positions are a tensor)."""
        return keys if self.query_pos is not None else keys - queries + last_query

    def visible(self, start: torch.Tensor, end: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """``[B, c, hi - lo]`` bool: key ``lo + j`` visible to each query of a chunk with windows
        ``(start, end)`` (``[B, c]``), the key mask included."""
        s = torch.arange(lo, hi, device=start.device)
        seen = (s >= start[..., None]) & (s <= end[..., None])
        if self.key_mask is not None:
            seen = seen & self.key_mask[:, None, lo:hi]
        return seen


def _key_mask(mask, T: int, static: bool = False) -> torch.Tensor:
    """The 2-D padding mask cut to the T keys attention sees, as bool ``[B, T]``. A static cache's keys
    are its slots from 0: the mask covers the written ones and the rest are padding."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(
            f"hyscale_hf patched attention needs a 2-D padding attention_mask [batch, tokens] (or None); got {shape}"
        )
    if static:
        if mask.shape[1] > T:
            raise ValueError(f"attention_mask covers {mask.shape[1]} tokens but the static cache holds {T}")
        return torch.nn.functional.pad(mask.bool(), (0, T - mask.shape[1]))
    if mask.shape[1] < T:
        raise ValueError(f"attention_mask covers {mask.shape[1]} tokens but attention sees {T} keys")
    return mask[:, mask.shape[1] - T :].bool()


def _segment_starts(position_ids: torch.Tensor, B: int, S: int) -> torch.Tensor | None:
    """[B, S] index of each query's packed-sequence start from position_ids resets (Transformers' rule:
    a sequence starts wherever the position does not rise by one; all zeros without a reset), or None
    when the positions do not have the queries' shape."""
    pos = position_ids.expand(B, -1) if position_ids.shape[0] != B else position_ids
    if pos.dim() != 2 or pos.shape[1] != S:
        return None
    is_start = torch.ones_like(pos, dtype=torch.bool)
    is_start[:, 1:] = pos[:, 1:] - pos[:, :-1] != 1
    idx = torch.arange(S, device=pos.device).expand(B, S)
    return torch.where(is_start, idx, 0).cummax(dim=1).values


def _holds_resets(position_ids: torch.Tensor, seg: torch.Tensor) -> bool:
    """Whether ``seg`` (``_segment_starts`` of ``position_ids``) starts a sequence past the first token.
    True (the general path) when the values cannot be read: under tracing, on meta or fake tensors."""
    if torch.compiler.is_compiling() or not has_values(position_ids):
        return True
    # The answer rides on the tensor itself: one forward's layers all get this object, and so does a
    # checkpoint recompute of any of them, which must take the forward's path without reading again
    # (selective checkpointing replays a host read it did not record as an error).
    known = getattr(position_ids, _RESETS_ATTR, None)
    if known is not None and known[0] == position_ids._version:
        return known[1]
    resets = not bool((seg[:, -1] == 0).all())  # the host read, once per positions tensor
    setattr(position_ids, _RESETS_ATTR, (position_ids._version, resets))
    return resets


def _latest_start(parts: list[torch.Tensor], B: int, S: int, device) -> torch.Tensor | None:
    """The elementwise maximum of window starts, each [B] or [B, S] (None for no part)."""
    window_start = None
    for p in parts:
        p = p.to(device=device, dtype=torch.int64)
        if window_start is None:
            window_start = p
            continue
        if window_start.dim() != p.dim():
            window_start = window_start[:, None].expand(B, S) if window_start.dim() == 1 else window_start
            p = p[:, None].expand(B, S) if p.dim() == 1 else p
        window_start = torch.maximum(window_start, p)
    return window_start


def visibility(attention_mask, position_ids, kwargs: dict, batch: int, queries: int, keys: int, *,
               sliding_window: int | None = None, query_offset: torch.Tensor | None = None,
               device=None) -> Visibility:
    """The visibility of ``queries`` queries over the ``keys`` keys a layer attends over (the last of
    them is the last query's own key).

    Args:
        attention_mask: what the layer received as its mask: None or the 2-D padding mask
            ``[B, tokens]`` covering every token so far (its last ``keys`` columns are the keys).
        position_ids: ``[B or 1, S]`` positions of the queries, or None.
        kwargs: the layer's keyword arguments (``cu_seq_lens_q`` / ``cu_seq_lens_k`` are read).
        sliding_window: ``W`` of a sliding-window layer (keys ``pos - W < s <= pos``), else None.
        query_offset: a static cache's slot of the first query (0-dim tensor), else None.
    """
    B, S, T = batch, queries, keys
    parts = []  # window starts, [B] or [B, S]
    key_mask = query_real = cu_seqlens = query_pos = None
    qpos = torch.arange(T - S, T, device=device)
    if query_offset is not None:
        qpos = query_pos = query_offset.to(device) + torch.arange(S, device=device)
        written = torch.arange(T, device=device) <= query_pos[-1]
        key_mask = written.expand(B, T) if attention_mask is None else written & _key_mask(attention_mask, T, True).to(device)
        query_real = key_mask.gather(1, query_pos.expand(B, S))
    elif attention_mask is not None:
        key_mask = _key_mask(attention_mask, T).to(device)
        query_real = key_mask[:, T - S :]
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        if B != 1 or S != T:
            raise ValueError(
                f"cu_seq_lens_q/k (packed sequences) need batch size 1 and no cached keys; got batch {B}, "
                f"{S} queries over {T} keys"
            )
        if cu_q is not None and cu_k is not None and not torch.equal(cu_k.to(cu_q.device), cu_q):
            raise ValueError("cu_seq_lens_q and cu_seq_lens_k differ; hyscale_hf supports causal self-attention "
                             "packing only")
        cu_seqlens = (cu_q if cu_q is not None else cu_k).to(device=device, dtype=torch.int32)
    elif position_ids is not None and attention_mask is None and S == T:
        seg = _segment_starts(position_ids.to(device), B, S)
        if seg is not None and _holds_resets(position_ids, seg):
            parts.append(seg)
    if sliding_window is not None:
        parts.append((qpos - int(sliding_window) + 1).clamp_min(0).expand(B, S))
    return Visibility(cu_seqlens, _latest_start(parts, B, S, device), key_mask, query_real, query_pos)


def query_part(vis: Visibility, a: int, b: int, batch: int, device) -> Visibility:
    """The visibility of queries ``a:b`` of a call whose queries are all its keys (``S == T``: a training
    forward), over the keys ``:b`` they can see: a part that is itself such a call's tail (its queries the
    last of its keys), the shape the ops take. Tiles (``tile_tokens``) and context-parallel chunks run
    their parts with it."""
    if vis.query_pos is not None:
        raise ValueError("query_part cuts the visibility of a training forward (queries = keys), not a cache's")
    parts = []
    if vis.cu_seqlens is not None:  # packed: each query's sequence start, as a window start
        cu = vis.cu_seqlens.to(device=device, dtype=torch.int64)
        pos = torch.arange(a, b, device=device)
        parts.append(cu[torch.searchsorted(cu[1:], pos, right=True)].expand(batch, b - a))
    if vis.window_start is not None:
        parts.append(vis.window_start if vis.window_start.dim() == 1 else vis.window_start[:, a:b])
    return Visibility(None, _latest_start(parts, batch, b - a, device),
                      None if vis.key_mask is None else vis.key_mask[:, :b],
                      None if vis.query_real is None else vis.query_real[:, a:b])


def window_indices(vis: Visibility, window: int, batch: int, queries: int, keys: int, device) -> torch.Tensor:
    """int32 ``[B, S, min(W, T)]``: each query's visible keys among its last ``window``, ascending,
    ``-1`` padded (the selection of a sliding-window layer that has no indexer)."""
    start, end = vis.windows(batch, queries, keys, device)
    first = torch.maximum(start, end - (window - 1))
    idx = first[..., None] + torch.arange(min(window, keys), device=device)
    seen = idx <= end[..., None]
    if vis.key_mask is not None:  # padding keys in the window are skipped
        seen = seen & vis.key_mask.gather(1, idx.clamp_max(keys - 1).flatten(1)).view_as(idx)
    return torch.where(seen, idx, -1).to(torch.int32)
