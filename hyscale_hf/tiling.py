"""Sequence tiling: token-wise work in tiles of ``HyScaleConfig.tile_tokens`` (docs/design.md section 11).

A token-wise function (an MLP, a query projection) keeps activations for backward in proportion to the
tokens it sees. Run over tiles, each tile under non-reentrant ``torch.utils.checkpoint``, it keeps only
each tile's inputs; a tile's activations exist while that tile runs forward or backward. Weight
gradients add up over the tiles through autograd as usual (no hand-written accumulation, so FSDP2 and
PEFT see ordinary parameter use). Inside a checkpointed decoder layer the tiles nest in the layer's
checkpoint: the layer's recompute runs each tile's forward once more, with nothing kept but its inputs,
and the tile's own recompute runs in backward. That extra forward of the tiled work is the price.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint


def tile_bounds(n: int, tile: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` covering ``range(n)`` in tiles of ``tile`` (the last one shorter)."""
    if not isinstance(tile, int) or isinstance(tile, bool) or tile <= 0:
        raise ValueError(f"tile must be a positive int, got {tile!r}")
    return [(a, min(n, a + tile)) for a in range(0, n, tile)]


def run_tile(fn: Callable, *args):
    """``fn(*args)``, checkpointed when autograd records (so only ``args`` are kept for backward)."""
    if torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


def tiled_tokens(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile: int | None, dim: int = 1):
    """``fn(x)`` for a token-wise ``fn``, computed ``tile`` tokens at a time along ``dim``.

    Equal to ``fn(x)`` (bit for bit where ``fn``'s kernels do not depend on the number of rows). ``x``
    with at most ``tile`` tokens, or ``tile=None``, runs ``fn(x)`` as it is. ``fn`` must return one
    tensor with the token dimension at ``dim``.
    """
    n = x.shape[dim]
    if tile is None or n <= tile:
        return fn(x)
    out = TileOutput(n, dim)
    for a, b in tile_bounds(n, tile):
        y = run_tile(fn, x.narrow(dim, a, b - a).contiguous())  # a copy only for batch > 1 (modules view it flat)
        if not isinstance(y, torch.Tensor):
            raise TypeError(
                f"tile_tokens tiles token-wise modules that return one tensor; {fn!r} returned {type(y).__name__}"
            )
        out.put(a, b, y)
    return out.tensor


class TileOutput:
    """The whole output of tiles, written tile by tile into one tensor allocated at the first tile.

    ``torch.cat`` of the tiles would hold every tile's output and the concatenation at once: twice the
    output (12 GiB more for a 6144-wide bf16 hidden state at 1M tokens). Each ``put`` writes a tile into
    its slice and lets the tile's own output go. Plain ``copy_`` into a slice would cost as much in
    backward (autograd's ``CopySlices`` clones the whole gradient once per tile); ``_WriteTile`` hands
    each tile a view of its slice of the gradient and passes the gradient on as it is.
    """

    def __init__(self, n: int, dim: int = 1) -> None:
        self.n, self.dim = n, dim
        self.tensor = None

    def put(self, a: int, b: int, y: torch.Tensor) -> None:
        if self.tensor is None:
            shape = list(y.shape)
            shape[self.dim] = self.n
            self.tensor = y.new_empty(shape)
        self.tensor = _WriteTile.apply(self.tensor, y, self.dim, a, b)


class _WriteTile(torch.autograd.Function):
    """``out[..., a:b, ...] = y`` in place. Every slice is written once, into a buffer from ``new_empty``:
    the gradient of ``out`` before the write is the incoming gradient itself (the slice it overwrites
    held nothing any tile reads), so backward passes it on without a copy."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, y: torch.Tensor, dim: int, a: int, b: int) -> torch.Tensor:
        out.narrow(dim, a, b - a).copy_(y)
        ctx.mark_dirty(out)
        ctx.dim, ctx.a, ctx.b = dim, a, b
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad.narrow(ctx.dim, ctx.a, ctx.b - ctx.a), None, None, None
