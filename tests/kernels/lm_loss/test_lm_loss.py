"""chunked_cross_entropy against the whole-logits cross-entropy (Transformers' ForCausalLMLoss after
the label shift), on both paths: a plain ``nn.Linear`` head gets its gradients in forward (the torch
code or the Triton kernel, under the interpreter on CPU), any other head runs checkpointed chunks."""

import os

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hyscale_hf.kernels import chunked_cross_entropy
from hyscale_hf.kernels.lm_loss import host
from hyscale_hf.kernels.lm_loss.naive import cross_entropy_reference

# These tests keep their tensors on the CPU: the Triton path runs there under the interpreter, which
# tests/conftest.py turns on on CPU-only hosts (on a GPU host the GPU test below covers the kernel).
needs_interpreter = pytest.mark.skipif(not host.HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="the Triton path on CPU tensors needs TRITON_INTERPRET=1")


class Hooked(nn.Linear):
    """A head that is not a plain nn.Linear (as a LoRA layer is not): the checkpointed path."""


def inputs(n=37, hidden=16, vocab=50, seed=0, bias=False, head_cls=nn.Linear, *, device="cpu", dtype=torch.float32,
           weight_scale=1.0):
    """Hidden states, a head and labels with three ignored rows (drawn on the CPU, then moved)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g).to(device, dtype).requires_grad_()
    head = head_cls(hidden, vocab, bias=bias, device=device, dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=g) * weight_scale)
        if bias:
            head.bias.copy_(torch.randn(vocab, generator=g))
    y = torch.randint(0, vocab, (n,), generator=g)
    y[[3, 10, 11]] = -100
    return h, head, y.to(device)


def loss_and_grads(fn, scale=1.0, **kw):
    h, head, y = inputs(**kw)
    loss = fn(h, head, y)
    params = [p for p in (h, head.weight, head.bias) if p is not None and p.requires_grad]
    return loss.detach(), torch.autograd.grad(loss * scale, params)


PATHS = [pytest.param(dict(), id="fused-auto"),
         pytest.param(dict(backend="triton"), id="fused-triton", marks=needs_interpreter),
         pytest.param(dict(head_cls=Hooked), id="checkpointed")]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("chunk", [1, 8, 37, 1000])
@pytest.mark.parametrize("num_items", [None, 29])
def test_matches_the_whole_logits_loss(path, chunk, num_items):
    path = dict(path)
    kw = dict(head_cls=path.pop("head_cls", nn.Linear), bias=chunk == 8, vocab=50 if chunk != 8 else 3000)
    got, g_got = loss_and_grads(
        lambda h, head, y: chunked_cross_entropy(h, head, y, chunk, num_items_in_batch=num_items, **path), **kw)
    want, g_want = loss_and_grads(lambda h, head, y: cross_entropy_reference(h, head, y, num_items_in_batch=num_items),
                                  **kw)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_fused_gradients_scale_with_the_loss_gradient_and_skip_frozen_weights(backend):
    fused = lambda h, head, y: chunked_cross_entropy(h, head, y, 8, backend=backend)  # noqa: E731
    _, g_got = loss_and_grads(fused, scale=-3.5)
    _, g_want = loss_and_grads(cross_entropy_reference, scale=-3.5)
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)

    h, head, y = inputs()
    head.weight.requires_grad_(False)  # a frozen head (LoRA elsewhere): only the hidden states' gradient
    (dh,) = torch.autograd.grad(fused(h, head, y), [h])
    (want,) = torch.autograd.grad(cross_entropy_reference(h, head, y), [h])
    torch.testing.assert_close(dh, want, atol=1e-6, rtol=1e-5)


def test_fused_head_tied_to_the_embedding_accumulates_both_gradients():
    h, head, y = inputs(hidden=16, vocab=50)
    ids = torch.randint(0, 50, (37,), generator=torch.Generator().manual_seed(1))

    def tied(loss_fn):
        emb = nn.Embedding(50, 16)
        emb.weight = head.weight  # tie_word_embeddings
        x = emb(ids) + h
        loss = loss_fn(x, head, y)
        return torch.autograd.grad(loss, [head.weight, h])

    got = tied(lambda x, head, y: chunked_cross_entropy(x, head, y, 8))
    want = tied(cross_entropy_reference)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_fused_under_autocast_casts_as_autocast_does():
    h, head, y = inputs(vocab=300)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = chunked_cross_entropy(h, head, y, 8)
        g_got = torch.autograd.grad(got, [h, head.weight])
        want = cross_entropy_reference(h, head, y)
        g_want = torch.autograd.grad(want, [h, head.weight])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for a, b in zip(g_got, g_want, strict=True):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=2e-2 * b.abs().max().item(), rtol=2e-2)


class HeadProducts(TorchDispatchMode):
    """Shapes of the matrix products whose output or input has ``vocab`` columns or rows."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab, self.shapes = vocab, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_, torch.ops.aten.bmm):
            a, b = args[-2], args[-1]
            if self.vocab in (*a.shape, *b.shape):
                self.shapes.append(tuple(a.shape))
        return out


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "checkpointed"])
def test_head_products_per_chunk_and_logits_never_beyond_a_chunk(fused):
    h, head, y = inputs(n=64, vocab=500, head_cls=nn.Linear if fused else Hooked)
    with HeadProducts(500) as fwd:
        loss = chunked_cross_entropy(h, head, y, 16)
    with HeadProducts(500) as bwd:
        loss.backward()
    # fused: logits, d hidden, d weight per chunk in forward, nothing in backward; checkpointed: the
    # logits in forward, then their recompute and both gradients in backward.
    assert (len(fwd.shapes), len(bwd.shapes)) == ((12, 0) if fused else (4, 12))
    assert all(min(s) <= 16 for s in fwd.shapes + bwd.shapes)  # one chunk's rows at a time


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_against_the_torch_code(dtype, monkeypatch):
    monkeypatch.setattr(host, "INTERPRET_BLOCK_V", 64)  # several column blocks per row
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(9, 200, generator=g) * 4).to(dtype)
    y = torch.randint(0, 200, (9,), generator=g)
    y[2] = -100
    scale = torch.tensor(0.25)
    a, b = logits.clone(), logits.clone()
    la = host.cross_entropy_grad_(a, y, scale, -100, use_triton=True)
    lb = host.cross_entropy_grad_(b, y, scale, -100, use_triton=False)
    torch.testing.assert_close(la, lb, atol=1e-5, rtol=1e-6)
    assert not a[2].any() and not b[2].any()  # an ignored row has no gradient
    tol = dict(atol=1e-7, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-3, rtol=1e-2)
    torch.testing.assert_close(a, b, **tol)


def test_all_rows_ignored_gives_nan_like_torch_and_no_grad_mode_works():
    for head_cls in (nn.Linear, Hooked):
        h, head, y = inputs(head_cls=head_cls)
        y[:] = -100
        assert torch.isnan(chunked_cross_entropy(h, head, y, 8))
        h, head, y = inputs(head_cls=head_cls)
        with torch.no_grad():
            torch.testing.assert_close(chunked_cross_entropy(h, head, y, 8), cross_entropy_reference(h, head, y))


def test_bad_arguments_are_named():
    h, head, y = inputs()
    with pytest.raises(ValueError, match="chunk"):
        chunked_cross_entropy(h, head, y, 0)
    with pytest.raises(ValueError, match="labels"):
        chunked_cross_entropy(h, head, y[:-1], 8)
    with pytest.raises(ValueError, match=r"labels must be in \[0, 50\)"):
        chunked_cross_entropy(h, head, torch.full_like(y, 50), 8)
    with pytest.raises(ValueError, match="backend"):
        chunked_cross_entropy(h, head, y, 8, backend="cuda")


@pytest.mark.gpu
def test_gpu_glm5_vocabulary_against_the_whole_logits_loss():
    """GLM-5's vocabulary (154880) in bf16 on the Triton kernel: loss and gradients of the whole-logits
    reference within bf16 rounding."""
    h, head, y = inputs(3000, 1024, 154880, device="cuda", dtype=torch.bfloat16, weight_scale=1024**-0.5)
    got = chunked_cross_entropy(h, head, y, 1024)
    g_got = torch.autograd.grad(got, [h, head.weight])
    want = cross_entropy_reference(h, head, y)
    g_want = torch.autograd.grad(want, [h, head.weight])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2 * b.abs().max().item(), rtol=2e-2)
