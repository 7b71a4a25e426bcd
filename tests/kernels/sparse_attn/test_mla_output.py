"""absorbed_output: the einsum's value, gradients and bits (CPU), a contiguous result, clear errors."""

import pytest
import torch

from hyscale_hf.kernels.sparse_attn.mla_output import absorbed_output


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_matches_einsum(dtype):
    g = torch.Generator().manual_seed(0)
    o = torch.randn(2, 5, 3, 8, generator=g).to(dtype).requires_grad_()
    w = torch.randn(3, 6, 8, generator=g).to(dtype).requires_grad_()
    dy = torch.randn(2, 5, 3, 6, generator=g).to(dtype)
    y = absorbed_output(o, w)
    assert y.is_contiguous() and y.shape == (2, 5, 3, 6)
    do, dw = torch.autograd.grad(y, (o, w), dy)
    o2, w2 = o.detach().requires_grad_(), w.detach().requires_grad_()
    y2 = torch.einsum("bshc,hvc->bshv", o2, w2)
    do2, dw2 = torch.autograd.grad(y2, (o2, w2), dy)
    tol = dict(atol=0, rtol=0) if dtype == torch.float64 else {}
    torch.testing.assert_close(y, y2, **tol)
    torch.testing.assert_close(do, do2, **tol)
    torch.testing.assert_close(dw, dw2, **tol)


def test_only_the_gradients_asked_for():
    o = torch.randn(1, 2, 2, 4, requires_grad=True)
    w = torch.randn(2, 3, 4)
    (do,) = torch.autograd.grad(absorbed_output(o, w).sum(), (o,))
    assert do.shape == o.shape


@pytest.mark.parametrize("o_shape, w_shape, dtype, match", [
    ((1, 2, 3, 4), (2, 5, 4), torch.float32, r"o_latent must be \[B, S, H, C\]"),
    ((1, 2, 3, 4), (3, 5, 6), torch.float32, r"w_uv \[H, V, C\]"),
    ((1, 2, 3, 4), (3, 5, 4), torch.float64, "share one dtype"),
])
def test_errors(o_shape, w_shape, dtype, match):
    with pytest.raises(ValueError, match=match):
        absorbed_output(torch.zeros(o_shape), torch.zeros(w_shape, dtype=dtype))
