"""Sequence tiling: token-wise work in tiles of ``HyScaleConfig.tile_tokens`` (docs/design.md section 11).

A token-wise function (an MLP, a norm) keeps activations for backward in proportion to the tokens it
sees. Two ways of tiling live here:

- ``tiled_tokens`` (one input, one output, known trainable tensors: the MLPs and norms): the tiles run
  forward without a graph, only the input is kept, and backward runs each tile again to take its
  gradients. Inside a checkpointed decoder layer whose last module is the tiled one (the MLP), the
  layer's recompute stops before it, so its tiles run twice per step, as untiled work does.
- ``run_tile`` + ``TileOutput`` (the attention's query tiles: several inputs and outputs): each tile
  under its own non-reentrant ``torch.utils.checkpoint``, keeping its inputs; weight gradients add up
  through autograd. Inside a checkpointed layer the layer's recompute runs each tile's forward once
  more (its output feeds the rest of the layer), so those tiles run three times.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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


def tiled_tokens(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    tile: int | None,
    dim: int = 1,
    params: Callable[[], Sequence[torch.Tensor]] = tuple,
):
    """``fn(x)`` for a token-wise ``fn``, computed ``tile`` tokens at a time along ``dim``.

    Equal to ``fn(x)`` (bit for bit where ``fn``'s kernels do not depend on the number of rows). ``x``
    with at most ``tile`` tokens, or ``tile=None``, runs ``fn(x)`` as it is. ``fn`` must return one
    tensor with the token dimension at ``dim``. ``params()`` lists every tensor ``fn`` reads that may
    need a gradient (a module's ``parameters``); it is called again in backward, where the tensors may be
    other objects of the same shapes (FSDP2 unshards into its own). A leaf that needs a gradient and is
    not listed is an error in backward, not a gradient silently left out.

    Under autograd only ``x`` is kept (through ``_KeepInput``); the tiles run forward without a graph, and
    backward runs each tile again with one and takes its gradients (``_TiledTokens``).
    """
    n = x.shape[dim]
    if tile is None or n <= tile:
        return fn(x)
    bounds = tile_bounds(n, tile)
    grads_for = tuple(p for p in params() if p.requires_grad) if torch.is_grad_enabled() else ()
    if not (torch.is_grad_enabled() and (x.requires_grad or grads_for)):
        return _forward_tiles(fn, x, bounds, dim)
    source = None
    if x.requires_grad:
        x = _KeepInput.apply(x)
        source = x.grad_fn
    return _TiledTokens.apply(fn, params, bounds, dim, source, x, *grads_for)


def _forward_tiles(fn, x: torch.Tensor, bounds, dim: int) -> torch.Tensor:
    """``fn`` over the tiles of ``x``, written into one output (``TileOutput``)."""
    out = TileOutput(x.shape[dim], dim)
    for a, b in bounds:
        y = fn(x.narrow(dim, a, b - a).contiguous())  # a copy only for batch > 1 (modules view the rows flat)
        if not isinstance(y, torch.Tensor):
            raise TypeError(
                f"tile_tokens tiles token-wise modules that return one tensor; {fn!r} returned {type(y).__name__}"
            )
        out.put(a, b, y)
        del y
    return out.tensor


class _KeepInput(torch.autograd.Function):
    """The identity, saving its input: the one tensor a tiled function keeps for backward.

    Saving it here, before the tiles run, rather than in ``_TiledTokens`` (whose saves are packed only
    after its forward returns) matters inside a checkpointed decoder layer: non-reentrant checkpoint
    stops its recompute as soon as every tensor the forward saved is back, so when nothing after the
    tiled function saves anything (the MLP, last in a layer) the recompute stops here and the tiles do
    not run in it at all."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _TiledTokens(torch.autograd.Function):
    """``fn`` over token tiles: forward without a graph; backward runs each tile again under autograd
    and adds up the gradients of the tiles' inputs (written into one ``dx``) and of ``params``."""

    @staticmethod
    def forward(ctx, fn, params, bounds, dim, source, x, *grads_for):
        ctx.fn, ctx.params, ctx.bounds, ctx.dim, ctx.source = fn, params, bounds, dim, source
        ctx.n_params = len(grads_for)
        if source is None:  # x needs no gradient: it has no _KeepInput node, so keep it here
            ctx.save_for_backward(x)
        with torch.no_grad():
            return _forward_tiles(fn, x, bounds, dim)

    @staticmethod
    def backward(ctx, grad):
        x = ctx.source.saved_tensors[0] if ctx.source is not None else ctx.saved_tensors[0]
        live = tuple(p for p in ctx.params() if p.requires_grad)
        if len(live) != ctx.n_params:
            raise RuntimeError(
                f"tile_tokens: the tiled function's trainable tensors changed between forward ({ctx.n_params}) "
                f"and backward ({len(live)})"
            )
        dx = torch.empty_like(x) if ctx.source is not None else None  # x needs a gradient iff it was kept there
        totals = [None] * len(live)
        for i, (a, b) in enumerate(ctx.bounds):
            with torch.enable_grad():
                xt = x.narrow(ctx.dim, a, b - a).detach().contiguous().requires_grad_(dx is not None)
                y = ctx.fn(xt)
                if i == 0:
                    _check_leaves(y, live, xt)
                inputs = ((xt,) if dx is not None else ()) + live
                grads = torch.autograd.grad(y, inputs, grad.narrow(ctx.dim, a, b - a), allow_unused=True)
            if dx is not None:
                tile_dx = dx.narrow(ctx.dim, a, b - a)
                tile_dx.zero_() if grads[0] is None else tile_dx.copy_(grads[0])  # None: fn ignores its input
                grads = grads[1:]
            for j, g in enumerate(grads):
                if g is not None:
                    totals[j] = g if totals[j] is None else totals[j].add_(g)
        return (None, None, None, None, None, dx, *totals)


def _check_leaves(y: torch.Tensor, listed, x: torch.Tensor) -> None:
    """Every leaf of ``y``'s graph that needs a gradient is ``x`` or listed in ``params``."""
    known = {id(t) for t in listed} | {id(x)}
    seen, todo = set(), [y.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)
        if leaf is not None and id(leaf) not in known:
            raise RuntimeError(
                f"tile_tokens: the tiled function reads a tensor that needs a gradient ({tuple(leaf.shape)}) "
                "and is not among its params"
            )
        todo.extend(nxt for nxt, _ in node.next_functions)


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
