"""attach_indexer_loss and indexer_loss_once: the forward value is untouched and backward adds coef * d(indexer loss)."""

import pytest
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


def _indexer_toy(seed=0):
    """An indexer-like Linear on detached inputs, a layer output that does or does not need grad."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 4, generator=g)
    torch.manual_seed(seed)
    proj = torch.nn.Linear(4, 6)
    target = torch.softmax(torch.randn(5, 3, generator=g), -1)

    def loss_fn(q, w):  # a KL-like loss of two indexer outputs
        return -(target * torch.log_softmax(q[:, :3] * w[:, None], -1)).sum(-1).mean()

    return x, proj, loss_fn


def test_loss_once_gives_the_gradients_of_the_loss_in_the_graph():
    from hyscale_hf.indexer import indexer_loss_once

    grads = []
    for once in (False, True):
        x, proj, loss_fn = _indexer_toy()
        state = make_state(0.5)
        base = torch.randn(5, 2, generator=torch.Generator().manual_seed(1), requires_grad=True)
        hidden = base * 2
        out = proj(x)
        index = (out[:, :4], out[:, 4])
        attached = (indexer_loss_once(hidden, index, loss_fn, state) if once
                    else attach_indexer_loss(hidden, loss_fn(*index), state))
        assert torch.equal(attached, hidden)
        attached.sum().backward()
        grads.append((proj.weight.grad, proj.bias.grad, base.grad, state.pop_indexer_loss()))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


def test_loss_once_rides_on_the_output_when_the_layer_needs_no_grad():
    """The dense warm-up with the base frozen: the loss waits in pending_losses for the model output."""
    from hyscale_hf.indexer import indexer_loss_once, sink_pending_losses

    x, proj, loss_fn = _indexer_toy()
    state = make_state(0.5)
    out = proj(x)
    hidden = torch.randn(5, 2)
    assert indexer_loss_once(hidden, (out[:, :4], out[:, 4]), loss_fn, state) is hidden
    (pending,) = state.pending_losses
    output = sink_pending_losses(state, {"loss": torch.tensor(1.0, requires_grad=True)})
    output["loss"].backward()
    fresh = proj(x)
    want = torch.autograd.grad(0.5 * loss_fn(fresh[:, :4], fresh[:, 4]), proj.weight)[0]
    torch.testing.assert_close(proj.weight.grad, want, rtol=0, atol=1e-7)


@pytest.mark.parametrize("replay", [True, False])
def test_loss_once_is_computed_once_under_checkpointing(replay):
    """With the replay context (what patched models checkpoint with) the recompute computes nothing
    for the loss; a checkpoint without it recomputes the loss, and the gradients are the same."""
    from torch.utils.checkpoint import checkpoint

    import hyscale_hf
    from hyscale_hf.indexer import indexer_loss_once

    results = []
    for checkpointed in (False, True):
        x, proj, loss_fn = _indexer_toy()
        state = make_state(1.0)
        calls = []

        def counted(*index, loss_fn=loss_fn, calls=calls):
            calls.append(in_backward())
            return loss_fn(*index)

        base = torch.randn(5, 2, generator=torch.Generator().manual_seed(1), requires_grad=True)

        def layer(b, proj=proj, x=x, state=state, counted=counted):
            out = proj(x)
            y = indexer_loss_once(torch.tanh(b), (out[:, :4], out[:, 4]), counted, state)
            return y * y  # a saved tensor after the loss: the recompute runs past it

        if checkpointed:
            kwargs = {"context_fn": hyscale_hf.replay_context_fn()} if replay else {}
            y = checkpoint(layer, base, use_reentrant=False, **kwargs)
        else:
            y = layer(base)
        y.sum().backward()
        assert calls == ([False, True] if checkpointed and not replay else [False])
        results.append((proj.weight.grad, base.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)


class _FillsTargetInBackward(torch.autograd.Function):
    """A stand-in attention: its backward leaves the target in ``head_probs`` (as mla_sparse_attention's)."""

    @staticmethod
    def forward(ctx, x, head_probs, target):
        ctx.head_probs, ctx.target = head_probs, target
        return x * 2

    @staticmethod
    def backward(ctx, g):
        ctx.head_probs.value = ctx.target.clone()
        return g * 2, None, None


@pytest.mark.parametrize("checkpointed", [False, True])
def test_deferred_loss_runs_after_the_attention_with_the_gradient_of_the_loss(checkpointed):
    """deferred_indexer_loss: nothing is computed or recorded in forward (or in a recompute); in backward,
    after the attention that fills the target, the loss runs once, is recorded, and its gradient (times the
    coefficient) reaches the indexer, the same as the loss computed in forward with that target."""
    from torch.utils.checkpoint import checkpoint

    import hyscale_hf
    from hyscale_hf.indexer import deferred_indexer_loss, indexer_loss_once
    from hyscale_hf.kernels.sparse_attn import HeadProbs

    target = torch.rand(5, 3, generator=torch.Generator().manual_seed(2))
    indices = torch.arange(3, dtype=torch.int32).expand(5, 3)
    results = []
    for deferred in (False, True):
        x, proj, loss_fn = _indexer_toy()
        state = make_state(0.5)
        calls = []

        def with_target(t, idx, q, w, calls=calls, loss_fn=loss_fn, tiles=None):
            calls.append((in_backward(), torch.equal(t, target), torch.equal(idx, indices), tiles))
            return loss_fn(q, w) * t.sum()

        base = torch.randn(5, 2, generator=torch.Generator().manual_seed(1), requires_grad=True)

        def layer(b, proj=proj, x=x, state=state, deferred=deferred, with_target=with_target):
            out = proj(x)
            index = (out[:, :4], out[:, 4])
            h = torch.tanh(b)
            if not deferred:
                y = _FillsTargetInBackward.apply(h, HeadProbs(), target)
                return indexer_loss_once(y, index, lambda q, w: with_target(target, indices, q, w), state)
            head_probs = HeadProbs()
            h, carrier = deferred_indexer_loss(h, head_probs, with_target, indices, index, state)
            y = _FillsTargetInBackward.apply(h, head_probs, target)
            return attach_indexer_loss(y * y, carrier, state, record=False)

        if checkpointed:
            y = checkpoint(layer, base, use_reentrant=False, context_fn=hyscale_hf.replay_context_fn())
        else:
            y = layer(base)
        if deferred:
            assert not calls and state.pop_indexer_loss() is None  # nothing in forward
        y.sum().backward()
        assert calls == [(deferred, True, True, None)]  # the toy attention walks no query tiles
        results.append((proj.weight.grad, proj.bias.grad, state.pop_indexer_loss()))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_head_probs_taken_before_the_attention_backward_is_an_error():
    from hyscale_hf.kernels.sparse_attn import HeadProbs

    slot = HeadProbs()
    with pytest.raises(RuntimeError, match="has not run its backward"):
        slot.take()
    slot.value = torch.ones(1)
    assert torch.equal(slot.take(), torch.ones(1)) and slot.value is None
    slot.tiles = "lists"
    assert slot.take_tiles() == "lists" and slot.take_tiles() is None
