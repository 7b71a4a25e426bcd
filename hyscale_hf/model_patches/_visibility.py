"""Which keys each query of a patched attention layer sees, from what Transformers hands attention.

One builder for every patched layer (native DSA layers and dense layers given an indexer). It turns
the padding mask, the packing kwargs / ``position_ids`` and a sliding window into hytopk's visibility
contract (key ``s`` visible to query ``i`` iff ``start <= s <= T - S + i``, docs/design.md section
2), counted over the ``T`` keys the layer attends over (a sliding-window cache keeps only the last
``T`` of the tokens so far; the padding mask covers all of them):

- Padding: the 2-D mask, the only one the registered mask function (``padding_mask_only``) lets
  through. Left padding -> ``window_start`` (each row's first real key). Right padding cannot be a
  window start: ``key_end`` is each row's last real key (only the padding queries after it could
  reach keys past it) and ``query_real`` marks the real queries (the indexer loss leaves the padding
  ones out). A row with holes cannot be expressed as a key window and is refused.
- Packed sequences: ``cu_seq_lens_q/k`` kwargs (``DataCollatorWithFlattening``), or ``position_ids``
  resets whenever there is no cached prefix (``S == T``) -> ``cu_seqlens`` (batch 1) or a per-query
  ``window_start`` (batch > 1). Transformers looks for resets only without a cache object and
  without a padding mask, so an unpatched model run with ``use_cache=True`` on a packed batch
  attends across sequences; a patched one never selects across a boundary.
- A sliding window ``W``: a per-query ``window_start`` of ``pos - W + 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.windows import query_windows


def padding_mask_only(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                      attention_mask=None, **kwargs):
    """The mask function registered for hyscale_hf's attention implementation: the 2-D padding mask
    as Transformers passes it (bool ``[B, tokens]``), or None when nothing is padded; never a
    ``[B, 1, S, T]`` tensor. Patched layers read it through ``visibility``."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    return attention_mask


@dataclass
class Visibility:
    """Each query's visible keys, as hytopk takes them plus what it cannot express (right padding).

    Attributes:
        cu_seqlens: int32 ``[N + 1]`` packed sequences (batch 1, no cached keys), or None.
        window_start: int64 ``[B]`` or ``[B, S]`` first visible key, or None (key 0).
        key_end: int64 ``[B]`` last real key of each row when some row is right-padded, else None.
        query_real: bool ``[B, S]``, False for padding queries; None when every query is real.
    """

    cu_seqlens: torch.Tensor | None
    window_start: torch.Tensor | None
    key_end: torch.Tensor | None
    query_real: torch.Tensor | None

    def windows(self, batch: int, queries: int, keys: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(start, end)`` int64 ``[B, S]``: key ``s`` is visible to query ``i`` iff start <= s <= end."""
        start, end = query_windows(batch, queries, keys, cu_seqlens=self.cu_seqlens, window_start=self.window_start,
                                   device=device)
        if self.key_end is not None:
            end = torch.minimum(end, self.key_end[:, None])
        return start, end


def _padding_bounds(mask, T: int):
    """(mask cut to the T keys attention sees [B, T] bool, first real key [B], last real key [B]) of
    a 2-D padding mask; a row without a real key has first T and last -1."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(
            f"hyscale_hf patched attention needs a 2-D padding attention_mask [batch, tokens] (or None); got {shape}"
        )
    if mask.shape[1] < T:
        raise ValueError(f"attention_mask covers {mask.shape[1]} tokens but attention sees {T} keys")
    m = mask[:, mask.shape[1] - T :].bool()
    count = m.sum(1)
    pos = torch.arange(T, device=m.device)
    first = torch.where(m, pos, T).amin(1)
    last = torch.where(m, pos, -1).amax(1)
    if bool(((count > 0) & (count != last - first + 1)).any()):
        raise ValueError(
            "attention_mask has padding inside a row (zeros between ones); hyscale_hf supports left and right "
            "padding (each row one block of ones; use left padding for batched generate()). For several "
            "sequences in one row use packing (position_ids resets or cu_seq_lens_q/k)"
        )
    return m, first, last


def _segment_starts(position_ids: torch.Tensor, B: int, S: int) -> torch.Tensor | None:
    """[B, S] index of each query's packed-sequence start from position_ids resets (Transformers' rule:
    a sequence starts wherever the position does not rise by one), or None if there is no reset."""
    pos = position_ids.expand(B, -1) if position_ids.shape[0] != B else position_ids
    if pos.dim() != 2 or pos.shape[1] != S:
        return None
    is_start = torch.ones_like(pos, dtype=torch.bool)
    is_start[:, 1:] = pos[:, 1:] - pos[:, :-1] != 1
    if not bool(is_start[:, 1:].any()):
        return None
    idx = torch.arange(S, device=pos.device).expand(B, S)
    return torch.where(is_start, idx, 0).cummax(dim=1).values


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
               sliding_window: int | None = None, device=None) -> Visibility:
    """The visibility of ``queries`` queries over the ``keys`` keys a layer attends over (the last of
    them is the last query's own key).

    Args:
        attention_mask: what the layer received as its mask: None or the 2-D padding mask
            ``[B, tokens]`` covering every token so far (its last ``keys`` columns are the keys).
        position_ids: ``[B or 1, S]`` positions of the queries, or None.
        kwargs: the layer's keyword arguments (``cu_seq_lens_q`` / ``cu_seq_lens_k`` are read).
        sliding_window: ``W`` of a sliding-window layer (keys ``pos - W < s <= pos``), else None.
    """
    B, S, T = batch, queries, keys
    parts = []  # window starts, [B] or [B, S]
    key_end = query_real = cu_seqlens = None
    if attention_mask is not None:
        m, first, last = _padding_bounds(attention_mask, T)
        if bool(first.any()):
            parts.append(first)
        if bool((last < T - 1).any()):
            key_end = last
        query_real = m[:, T - S :]
        if bool(query_real.all()):
            query_real = None
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
    elif position_ids is not None and S == T:
        seg = _segment_starts(position_ids.to(device), B, S)
        if seg is not None:
            if B == 1:
                starts = torch.unique(seg[0])
                cu_seqlens = torch.cat([starts, starts.new_tensor([T])]).to(torch.int32)
            else:
                parts.append(seg)
    if sliding_window is not None:
        qpos = torch.arange(T - S, T, device=device)
        parts.append((qpos - int(sliding_window) + 1).clamp_min(0).expand(B, S))
    return Visibility(cu_seqlens, _latest_start(parts, B, S, device), key_end, query_real)


def window_indices(vis: Visibility, window: int, batch: int, queries: int, keys: int, device) -> torch.Tensor:
    """int32 ``[B, S, min(W, T)]``: each query's visible keys among its last ``window``, ascending,
    ``-1`` padded (the selection of a sliding-window layer that has no indexer)."""
    start, end = vis.windows(batch, queries, keys, device)
    first = torch.maximum(start, end - (window - 1))
    idx = first[..., None] + torch.arange(min(window, keys), device=device)
    return torch.where(idx <= end[..., None], idx, -1).to(torch.int32)
