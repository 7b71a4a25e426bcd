"""Which keys each query may see in a patched dense layer, from what Transformers passes to attention.

Everything becomes the ``hytopk`` visibility contract (key ``s`` visible to query ``i`` iff
``start <= s <= T - S + i``): left padding -> ``window_start`` (first real key of the row), packed
sequences (``cu_seq_lens_q`` kwargs, or ``position_ids`` resets without a 2-D mask or cached keys) ->
``cu_seqlens`` (batch 1) or a per-query ``window_start`` (batch > 1), a sliding window -> a per-query
``window_start`` of ``pos - window + 1``. Right padding cannot be a window start: ``key_end`` is the
last real key of each row, and only the padding queries after it could select keys past it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Visibility:
    cu_seqlens: torch.Tensor | None  # packed sequences, B = 1, no cached keys
    window_start: torch.Tensor | None  # [B] or [B, S] first visible key
    key_end: torch.Tensor | None  # [B] last real key when a row is right-padded, else None
    query_real: torch.Tensor | None  # [B, S] bool, False for padding queries (None: all real)


def _padding_bounds(mask: torch.Tensor, T: int):
    """First and last real key per row of a 2-D padding mask cut to the T keys attention sees."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(
            f"hyscale_hf dense attention needs a 2-D padding attention_mask [batch, tokens] (or None); got {shape}"
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
            "padding (each row one block of ones). For several sequences in one row use packing "
            "(position_ids resets or cu_seq_lens_q/k)"
        )
    return m, first, last


def _segment_starts(position_ids: torch.Tensor, B: int, S: int) -> torch.Tensor | None:
    """[B, S] index of each query's packed-sequence start from position_ids resets, or None if none."""
    pos = position_ids.expand(B, -1) if position_ids.shape[0] != B else position_ids
    if pos.dim() != 2 or pos.shape[1] != S:
        return None
    is_start = torch.ones_like(pos, dtype=torch.bool)
    is_start[:, 1:] = pos[:, 1:] - pos[:, :-1] != 1
    if not bool(is_start[:, 1:].any()):
        return None
    idx = torch.arange(S, device=pos.device).expand(B, S)
    return torch.where(is_start, idx, 0).cummax(dim=1).values


def visibility(attention_mask, kwargs: dict, B: int, S: int, T: int, sliding_window, device) -> Visibility:
    parts = []  # window_start pieces, [B] or [B, S]
    key_end = query_real = cu_seqlens = None
    if attention_mask is not None:
        m, first, last = _padding_bounds(attention_mask, T)
        parts.append(first)
        if bool((last < T - 1).any()):
            key_end = last
        query_real = m[:, T - S :]
        if bool(query_real.all()):
            query_real = None
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        if B != 1 or S != T:
            raise ValueError(
                f"cu_seq_lens_q (packed sequences) needs batch size 1 and no cached keys; got batch {B}, "
                f"{S} queries over {T} keys"
            )
        cu_k = kwargs.get("cu_seq_lens_k")
        if cu_k is not None and not torch.equal(cu_k.to(cu.device), cu):
            raise ValueError("cu_seq_lens_q and cu_seq_lens_k differ; hyscale_hf supports self-attention packing only")
        cu_seqlens = cu.to(device)
    elif attention_mask is None and S == T and kwargs.get("position_ids") is not None:
        seg = _segment_starts(kwargs["position_ids"].to(device), B, S)
        if seg is not None:
            if B == 1:
                starts = torch.unique(seg[0])
                cu_seqlens = torch.cat([starts, starts.new_tensor([T])]).to(torch.int32)
            else:
                parts.append(seg)
    if sliding_window is not None:
        qpos = torch.arange(T - S, T, device=device)
        parts.append((qpos - int(sliding_window) + 1).clamp_min(0).expand(B, S))
    window_start = None
    for p in parts:
        p = p.to(device=device, dtype=torch.int64)
        if window_start is None:
            window_start = p
        else:
            if window_start.dim() != p.dim():
                window_start = window_start[:, None].expand(B, S) if window_start.dim() == 1 else window_start
                p = p[:, None].expand(B, S) if p.dim() == 1 else p
            window_start = torch.maximum(window_start, p)
    return Visibility(cu_seqlens, window_start, key_end, query_real)
