"""hyscale_hf.tiling and the HyScaleConfig fields of sequence tiling and offload."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from hyscale_hf import HyScaleConfig
from hyscale_hf.tiling import tile_bounds, tiled_tokens


def test_tile_bounds_cover_the_tokens_in_order():
    assert tile_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert tile_bounds(8, 4) == [(0, 4), (4, 8)]
    assert tile_bounds(3, 8) == [(0, 3)]


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, None])
def test_tile_bounds_refuse_a_bad_tile(bad):
    with pytest.raises(ValueError, match="tile"):
        tile_bounds(10, bad)


def _mlp(width=6, hidden=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(width, hidden, generator=g, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(hidden, width, generator=g, dtype=torch.float64, requires_grad=True)
    return (w1, w2), lambda x: torch.relu(x @ w1) @ w2


@pytest.mark.parametrize("tile", [1, 3, 7, 50])
def test_tiled_tokens_equal_the_whole_computation_with_gradients(tile):
    (w1, w2), fn = _mlp()
    x = torch.randn(2, 11, 6, dtype=torch.float64, requires_grad=True)
    fn(x).square().sum().backward()
    ref = [t.grad.clone() for t in (x, w1, w2)]
    for t in (x, w1, w2):
        t.grad = None
    out = tiled_tokens(fn, x, tile, params=lambda: (w1, w2))
    torch.testing.assert_close(out, fn(x), rtol=0, atol=1e-12)
    out.square().sum().backward()
    for got, want in zip((x.grad, w1.grad, w2.grad), ref):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_tiles_keep_only_their_input_for_backward():
    """The tiles run without a graph: what autograd keeps is the input, not the hidden activations."""
    (w1, w2), fn = _mlp(hidden=64)
    x = torch.randn(1, 12, 6, dtype=torch.float64, requires_grad=True)
    kept = []

    def pack(t):
        kept.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        tiled_tokens(fn, x, 4, params=lambda: (w1, w2))
    assert kept == [(1, 12, 6)], kept  # x alone, no [1, 4, 64] activation


def test_a_trainable_tensor_left_out_of_params_is_an_error_in_backward():
    (w1, w2), fn = _mlp()
    x = torch.randn(1, 9, 6, dtype=torch.float64, requires_grad=True)
    out = tiled_tokens(fn, x, 4, params=lambda: (w1,))
    with pytest.raises(RuntimeError, match="not among its params"):
        out.sum().backward()


def test_gradients_of_params_alone_when_the_input_needs_none():
    (w1, w2), fn = _mlp()
    x = torch.randn(1, 9, 6, dtype=torch.float64)
    fn(x).sum().backward()
    want = [w1.grad.clone(), w2.grad.clone()]
    w1.grad = w2.grad = None
    tiled_tokens(fn, x, 4, params=lambda: (w1, w2)).sum().backward()
    for got, ref in zip((w1.grad, w2.grad), want):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


def test_inside_a_checkpoint_whose_last_op_it_is_the_tiles_do_not_run_in_the_recompute():
    """A checkpointed block ending in a tiled function: the recompute stops once the tiled function's input
    is back (non-reentrant checkpoint's early stop), so each tile runs once in forward and once in
    backward, and the gradients are those of the plain block."""
    (w1, w2), mlp = _mlp()
    runs = []

    def counted(x):
        runs.append(x.shape[1])
        return mlp(x)

    def block(x, tiled):
        h = torch.tanh(x) * 2
        y = tiled_tokens(counted, h, 4, params=lambda: (w1, w2)) if tiled else mlp(h)
        return x + y

    x = torch.randn(1, 10, 6, dtype=torch.float64, requires_grad=True)
    grads = []
    for tiled in (False, True):
        for t in (x, w1, w2):
            t.grad = None
        checkpoint(block, x, tiled, use_reentrant=False).square().sum().backward()
        grads.append([t.grad.clone() for t in (x, w1, w2)])
    assert runs == [4, 4, 2] * 2  # forward, then backward's tiles; none in the recompute
    for got, want in zip(*grads[::-1]):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_a_tile_function_must_return_one_tensor():
    with pytest.raises(TypeError, match="one tensor"):
        tiled_tokens(lambda x: (x, x), torch.zeros(1, 5, 2), 2)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "64"])
def test_config_refuses_a_bad_tile_tokens(bad):
    with pytest.raises(ValueError, match="tile_tokens"):
        HyScaleConfig(tile_tokens=bad)


def test_config_offload_needs_a_bool_and_selection_replay():
    with pytest.raises(ValueError, match="offload_activations"):
        HyScaleConfig(offload_activations=1)
    with pytest.raises(ValueError, match="offload_activations=True needs selection_replay"):
        HyScaleConfig(offload_activations=True, selection_replay=False)
    assert HyScaleConfig(tile_tokens=64, offload_activations=True).tile_tokens == 64


def test_a_function_that_ignores_its_input_gives_a_zero_input_gradient():
    w = torch.ones(3, dtype=torch.float64, requires_grad=True)
    x = torch.randn(1, 5, 3, dtype=torch.float64, requires_grad=True)
    tiled_tokens(lambda t: torch.ones_like(t) * w, x, 2, params=lambda: (w,)).sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x)) and torch.equal(w.grad, torch.full((3,), 5.0, dtype=torch.float64))
