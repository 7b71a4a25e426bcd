"""attach_indexer_loss: the forward value is untouched and backward adds coef * d(indexer loss)."""

import torch

from hyscale_hf import HyScaleConfig
from hyscale_hf.families import ModelFamily
from hyscale_hf.indexer import attach_indexer_loss
from hyscale_hf.state import PatchState, in_backward


def make_state(coef):
    return PatchState(HyScaleConfig(indexer_loss_coef=coef), ModelFamily("toy", lambda m, s: None, "dense"))


def test_gradient_of_the_attached_loss_is_scaled_and_forward_is_unchanged():
    state = make_state(0.25)
    base = torch.randn(4, requires_grad=True)
    idx_param = torch.randn(3, requires_grad=True)
    hidden = base * 3
    loss = (idx_param**2).sum()
    out = attach_indexer_loss(hidden, loss, state)
    assert torch.equal(out, hidden)
    out.sum().backward()
    assert torch.allclose(base.grad, torch.full((4,), 3.0))
    assert torch.allclose(idx_param.grad, 0.25 * 2 * idx_param.detach())
    assert abs(state.pop_indexer_loss() - loss.item()) < 1e-6
    assert state.pop_indexer_loss() is None


def test_zero_coefficient_only_records():
    state = make_state(0.0)
    p = torch.randn(3, requires_grad=True)
    hidden = torch.randn(2, requires_grad=True)
    out = attach_indexer_loss(hidden, (p**2).sum(), state)
    assert out is hidden
    out.sum().backward()
    assert p.grad is None
    assert state.pop_indexer_loss() is not None


def test_in_backward_is_true_only_inside_backward():
    seen = []
    x = torch.randn(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: seen.append(in_backward()) or g)
    assert not in_backward()
    y.sum().backward()
    assert seen == [True]
