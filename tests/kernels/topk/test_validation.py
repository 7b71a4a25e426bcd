"""hytopk rejects bad input with an error that names the argument."""

import pytest
import torch

from hyscale_hf.kernels import hytopk


def good(B=1, S=4, T=6, H=2, D=8):
    return torch.randn(B, S, H, D), torch.randn(B, T, D), torch.rand(B, S, H)


@pytest.mark.parametrize(
    "mutate, error, match",
    [
        (lambda q, k, w: (q[0], k, w), ValueError, r"q must have rank 4"),
        (lambda q, k, w: (q, k[0], w), ValueError, r"k must have rank 3"),
        (lambda q, k, w: (q, k, w[0]), ValueError, r"w must have rank 3"),
        (lambda q, k, w: (q, k[..., :4], w), ValueError, r"k must have shape \[B=1, T, D=8\]"),
        (lambda q, k, w: (q, torch.cat([k, k]), w), ValueError, r"k must have shape"),
        (lambda q, k, w: (q, k, w[..., :1]), ValueError, r"w must have shape \[B=1, S=4, H=2\]"),
        (lambda q, k, w: (q, k, w[:, :2]), ValueError, r"w must have shape"),
        (lambda q, k, w: (q, k, w.half()), TypeError, r"w must have dtype"),
        (lambda q, k, w: (q.int(), k, w), TypeError, r"q must have dtype"),
        (lambda q, k, w: ("q", k, w), TypeError, r"q must be a torch.Tensor"),
        (lambda q, k, w: (q, k[:, :3], w), ValueError, r"need S <= T"),
        (lambda q, k, w: (q, k.to("meta"), w), ValueError, r"k is on meta but q is on cpu"),
    ],
)
def test_bad_tensors(mutate, error, match):
    q, k, w = mutate(*good())
    with pytest.raises(error, match=match):
        hytopk(q, k, w, 3)


@pytest.mark.parametrize("topk, error", [(0, ValueError), (-2, ValueError), (2.0, TypeError), (True, TypeError)])
def test_bad_topk(topk, error):
    with pytest.raises(error, match="topk"):
        hytopk(*good(), topk)


def test_bad_cu_seqlens():
    q, k, w = good(S=6, T=6)
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0 to T = 6"):
        hytopk(q, k, w, 2, cu_seqlens=torch.tensor([0, 3, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens .* needs batch size B = 1"):
        hytopk(*good(B=2, S=6, T=6), 2, cu_seqlens=torch.tensor([0, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens needs S == T"):
        hytopk(*good(S=4, T=6), 2, cu_seqlens=torch.tensor([0, 6], dtype=torch.int32))
    with pytest.raises(TypeError, match="cu_seqlens must have dtype"):
        hytopk(q, k, w, 2, cu_seqlens=torch.tensor([0.0, 6.0]))


def test_bad_window_start_and_backend():
    q, k, w = good()
    with pytest.raises(ValueError, match=r"window_start must have shape \[B=1\] or \[B=1, S=4\]"):
        hytopk(q, k, w, 2, window_start=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="backend must be"):
        hytopk(q, k, w, 2, backend="cuda")
