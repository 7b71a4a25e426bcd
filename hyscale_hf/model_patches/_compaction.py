"""Exact selection under a key-padding mask of any pattern, with hytopk's windows.

hytopk (and the dense indexer KL) see key ``s`` of query ``i`` iff ``start <= s <= T - S + i``: one
window per query, no holes. A padding mask can have holes anywhere (right padding, then the tokens
generate() appends; random masks). ``Compaction`` reorders each row so that a window holds exactly
the visible keys:

- keys: the row's ``n`` real keys move, in order, to the last ``n`` positions ``[T - n, T)``; the
  padding keys fill ``[0, T - n)``, before every window's start.
- queries: the row's ``m`` real queries (the last ``S`` tokens whose own mask bit is set) move, in
  order, to the last ``m`` query slots. Real query ``r`` (0-based) then sits at slot ``S - m + r``,
  whose window ends at compacted key ``T - m + r``, which is where real key ``n - m + r`` (its own)
  landed: it sees exactly the real keys up to itself. Its start moves to
  ``T - n + (real keys before its start)``, so packing and sliding windows carry over.

The selection in compacted space is then hytopk's exact top-k among each real query's visible keys;
``to_original`` maps it back (the compaction keeps order, so rows stay ascending). A padding query has
the visible keys of the last real query before it (or, without one in this call, those of the keys
before the call), which the slot just before the first real query sees: it takes that slot's
selection, cut to its own window. That is every visible key when topk covers them (as unpatched
attention), and otherwise a selection made from the same keys by a neighbour's scores; padding
queries carry no loss. Everything is gathers and scatters on the device (no host sync).
"""

from __future__ import annotations

import torch


def _places(mask: torch.Tensor, count: torch.Tensor, width: int) -> torch.Tensor:
    """Compacted place of each entry of a bool ``[B, L]`` row: True entries, in order, to the last
    ``count`` places; False entries, in reverse order, to the first ``width - count`` (so the first
    padding query sits right before the real ones: see ``Compaction.slot``)."""
    real_rank = mask.cumsum(1) - 1
    pad_rank = (~mask).cumsum(1) - 1
    return torch.where(mask, width - count[:, None] + real_rank, width - count[:, None] - 1 - pad_rank)


def _inverse(places: torch.Tensor) -> torch.Tensor:
    """``perm`` with ``perm[b, places[b, j]] = j`` (places is a permutation of each row)."""
    idx = torch.arange(places.shape[1], device=places.device).expand_as(places)
    return torch.empty_like(places).scatter_(1, places, idx)


def _take(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """``x[b, perm[b, j], ...]``: rows of ``x [B, L, ...]`` gathered along dim 1."""
    index = perm.view(*perm.shape, *([1] * (x.dim() - 2))).expand(*perm.shape, *x.shape[2:])
    return x.gather(1, index)


class Compaction:
    """The reordering of one layer call's ``T`` keys and ``S`` queries under ``key_mask [B, T]``.

    ``start`` ``[B, S]`` is each query's window start before the mask (packing, sliding window);
    ``query_pos`` ``[S]`` the queries' key positions when they are not the last ``S`` (a static cache,
    whose mask hides every key after them).
    """

    def __init__(self, key_mask: torch.Tensor, start: torch.Tensor, queries: int,
                 query_pos: torch.Tensor | None = None) -> None:
        B, T = key_mask.shape
        S = queries
        m = key_mask
        n = m.sum(1)  # real keys per row
        self.key_perm = _inverse(_places(m, n, T))  # compacted key c <- original key key_perm[b, c]
        qm = m[:, T - S :] if query_pos is None else m.gather(1, query_pos.expand(B, S))
        mq = qm.sum(1)  # real queries per row
        self.query_perm = _inverse(_places(qm, mq, S))  # slot j <- original query query_perm[b, j]
        # The slot each original query reads its selection from: S - m + (real queries up to and
        # including it) - 1. That is its own for a real query; for a padding query, the slot of the
        # last real query before it, or, with none before it in this call, slot S - m - 1: the first
        # padding query's, whose window (the keys before the call from the earliest start) holds
        # every later such query's.
        self.slot = S - mq[:, None] + qm.cumsum(1) - 1
        self.start = start
        real_before = m.cumsum(1) - m.long()  # real keys before each key
        start_c = T - n[:, None] + real_before.gather(1, start.clamp(0, T - 1))
        self.window_start = start_c.gather(1, self.query_perm)  # per slot, in compacted key space
        self.real_slot = torch.arange(S, device=m.device) >= (S - mq)[:, None]  # [B, S] slots holding real queries

    def keys(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, ...]`` in compacted key order."""
        return _take(x, self.key_perm)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, S, ...]`` in slot order."""
        return _take(x, self.query_perm)

    def rows_to_original(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, S]`` values per slot (as ``hytopk``'s lse) -> per original query: the row of the slot it
        reads its selection from (``slot``)."""
        return x.gather(1, self.slot)

    def to_original(self, indices: torch.Tensor) -> torch.Tensor:
        """int32 ``[B, S, K]`` compacted selections per slot -> original key indices per original query
        (``-1`` where nothing is selected)."""
        B, S, K = indices.shape
        valid = indices >= 0
        keys = self.key_perm.gather(1, indices.clamp_min(0).long().flatten(1)).view(B, S, K)
        keys = torch.where(valid, keys, -1)
        rows = keys.gather(1, self.slot[..., None].expand(B, S, K))
        # A padding query borrows a neighbour's selection: keep what lies in its own window.
        return torch.where(rows >= self.start[..., None], rows, -1).to(torch.int32)
