"""hyscale_hf.tiling and the HyScaleConfig fields of sequence tiling and offload."""

from __future__ import annotations

import pytest
import torch

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
    out = tiled_tokens(fn, x, tile)
    torch.testing.assert_close(out, fn(x), rtol=0, atol=1e-12)
    out.square().sum().backward()
    for got, want in zip((x.grad, w1.grad, w2.grad), ref):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_tiles_keep_only_their_inputs_for_backward():
    """Each tile is checkpointed: what autograd keeps is the tiles' inputs, not the hidden activations."""
    (_, _), fn = _mlp(hidden=64)
    x = torch.randn(1, 12, 6, dtype=torch.float64, requires_grad=True)
    kept = []

    def pack(t):
        kept.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        tiled_tokens(fn, x, 4)
    assert kept and all(shape[-1] != 64 for shape in kept if len(shape) == 3), kept  # no [1, 4, 64] activation


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
