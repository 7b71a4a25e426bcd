"""The selections HyTopK makes inside a model's forward, and how much neighbouring queries share them.

The tiled GQA sparse attention kernels walk the sorted union of a query tile's selected keys (docs/
design.md section 6): their cost follows the union's size, not the pairs', so whether a converted
model trains faster than dense depends on how much neighbouring queries agree. These helpers measure
that on any selection:

- ``SelectionCapture``: a dispatch mode keeping the indices (and, for chosen calls, the inputs) of
  every ``hyscale::hytopk`` call made inside it, in call order (one call per DSA layer and forward).
- ``sharing(idx, tiles)``: per tile size G (G consecutive queries), the tile unions over the pairs,
  the share of pairs whose key half the tile selected, the widest and mean union, and the share of
  pairs within the query's last 1024 positions.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..kernels.topk import hytopk_op

RECENT = 1024  # "in_last_1024": pairs whose key lies within this many positions of the query


class SelectionCapture(TorchDispatchMode):
    """Keeps a copy of the indices of every HyTopK call made inside the mode (``indices``, in call
    order) and the arguments of the calls numbered in ``inputs_of`` (``inputs``: call number ->
    ``(args, kwargs)`` of ``torch.ops.hyscale.hytopk``, tensors copied), so the op can be timed on
    what a model actually feeds it."""

    def __init__(self, inputs_of: tuple[int, ...] = ()):
        super().__init__()
        self.inputs_of = set(inputs_of)
        self.indices: list[torch.Tensor] = []
        self.inputs: dict[int, tuple] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is hytopk_op._opoverload:
            call = len(self.indices)
            if call in self.inputs_of:
                self.inputs[call] = (tuple(_copy(a) for a in args), {n: _copy(a) for n, a in (kwargs or {}).items()})
            self.indices.append(out[0].detach().clone())
        return out


def _copy(value):
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def sharing(idx: torch.Tensor, tiles=(2, 4, 16, 64)) -> dict:
    """Statistics of one ``[S, K]`` selection (-1 = empty slot; query i sits at position i).

    Per G in ``tiles`` (key ``"G=<G>"``): ``union_over_pairs`` (distinct keys of each tile of G
    consecutive queries, summed over tiles, over the tiles' pairs: 1/G when all share, 1 when none
    does), ``shared`` (the share of pairs whose key at least G/2 of the tile's queries selected),
    ``max_union`` and ``mean_union`` (keys in the widest and the average tile union).
    """
    if idx.dim() != 2:
        raise ValueError(f"idx must be [S, K], got shape {tuple(idx.shape)}")
    S, K = idx.shape
    pos = torch.arange(S, device=idx.device)[:, None]
    valid = idx >= 0
    pairs = int(valid.sum())
    if pairs == 0:
        raise ValueError("idx holds no selected key")
    out = {"pairs": pairs, "in_last_1024": float(((pos - idx < RECENT) & valid).sum()) / pairs}
    for g in tiles:
        if g < 1:
            raise ValueError(f"tiles must be positive sizes, got {g}")
        n = -(-S // g)
        padded = torch.full((n * g, K), -1, dtype=torch.int64, device=idx.device)
        padded[:S] = idx
        t = padded.reshape(n, g * K).sort(-1).values
        new = torch.ones_like(t, dtype=torch.bool)
        new[:, 1:] = t[:, 1:] != t[:, :-1]
        first = new & (t >= 0)  # the first entry of each distinct key of a tile
        unions = first.sum(-1)
        # run lengths of equal keys: a pair is shared if its key's run in the tile is >= g / 2
        starts = new.flatten().nonzero().squeeze(1)
        lengths = torch.diff(torch.cat([starts, torch.tensor([t.numel()], device=t.device)]))
        keys = t.flatten()[starts]
        shared = int(lengths[(lengths >= max(2, g // 2)) & (keys >= 0)].sum())
        out[f"G={g}"] = {"union_over_pairs": int(unions.sum()) / pairs, "shared": shared / pairs,
                         "max_union": int(unions.max()), "mean_union": float(unions.float().mean())}
    return out
