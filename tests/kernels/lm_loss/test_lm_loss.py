"""chunked_cross_entropy against the whole-logits cross-entropy (Transformers' ForCausalLMLoss after
the label shift)."""

import pytest
import torch
from torch import nn

from hyscale_hf.kernels import chunked_cross_entropy
from hyscale_hf.kernels.lm_loss.naive import cross_entropy_reference


def inputs(n=37, hidden=16, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g).requires_grad_()
    head = nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=g))
    y = torch.randint(0, vocab, (n,), generator=g)
    y[[3, 10, 11]] = -100
    return h, head, y


def loss_and_grads(fn):
    h, head, y = inputs()
    loss = fn(h, head, y)
    return loss.detach(), torch.autograd.grad(loss, (h, head.weight))


@pytest.mark.parametrize("chunk", [1, 8, 37, 1000])
@pytest.mark.parametrize("num_items", [None, 29])
def test_matches_the_whole_logits_loss(chunk, num_items):
    got, g_got = loss_and_grads(lambda h, head, y: chunked_cross_entropy(h, head, y, chunk, num_items_in_batch=num_items))
    want, g_want = loss_and_grads(lambda h, head, y: cross_entropy_reference(h, head, y, num_items_in_batch=num_items))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_never_holds_more_than_one_chunk_of_logits():
    h, head, y = inputs(n=64, vocab=500)
    shapes = []
    head.register_forward_hook(lambda m, i, o: shapes.append(tuple(o.shape)))
    chunked_cross_entropy(h, head, y, 16).backward()
    assert shapes and all(s[0] <= 16 for s in shapes)  # forward chunks and their recompute in backward


def test_all_rows_ignored_gives_nan_like_torch_and_no_grad_mode_works():
    h, head, y = inputs()
    y[:] = -100
    assert torch.isnan(chunked_cross_entropy(h, head, y, 8))
    h, head, y = inputs()
    with torch.no_grad():
        torch.testing.assert_close(chunked_cross_entropy(h, head, y, 8), cross_entropy_reference(h, head, y))


def test_bad_arguments_are_named():
    h, head, y = inputs()
    with pytest.raises(ValueError, match="chunk"):
        chunked_cross_entropy(h, head, y, 0)
    with pytest.raises(ValueError, match="labels"):
        chunked_cross_entropy(h, head, y[:-1], 8)
