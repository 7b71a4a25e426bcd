"""sparse_attention on degenerate inputs, on both backends (the Triton kernels under Triton's CPU
interpreter when there is no GPU): empty batches, queries or keys, meta tensors, zero sizes
(docs/design.md section 4)."""

import pytest
import torch

from hyscale_hf import sparse_attention
from hyscale_hf.kernels.sparse_attn import host

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not host.HAS_TRITON, reason="needs triton"))]


def make(B, S, T, Hq, Hkv, Dqk, Dv, K, seed=0, dtype=torch.float32, v_view=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, Hq, Dqk, generator=g, dtype=dtype).to(DEVICE).requires_grad_()
    k = torch.randn(B, T, Hkv, Dqk, generator=g, dtype=dtype).to(DEVICE).requires_grad_()
    if v_view:
        v = k[..., :Dv]
    else:
        v = torch.randn(B, T, Hkv, Dv, generator=g, dtype=dtype).to(DEVICE).requires_grad_()
    idx = torch.randint(-1, max(T, 1), (B, S, K), generator=g, dtype=torch.int32) if T else torch.full((B, S, K), -1)
    return q, k, v, idx.to(torch.int32).to(DEVICE)


def leaves(q, k, v):
    return [q, k] + ([v] if v.is_leaf else [])


def run(backend, q, k, v, idx, seed=1):
    o, lse = sparse_attention(q, k, v, idx, return_lse=True, backend=backend)
    g = torch.Generator().manual_seed(seed)
    wo = torch.randn(o.shape, generator=g).to(DEVICE)
    wl = torch.randn(lse.shape, generator=g).to(DEVICE)
    loss = (o.float() * wo).sum() + (torch.where(torch.isinf(lse), 0.0, lse) * wl).sum()
    return o, lse, torch.autograd.grad(loss, leaves(q, k, v))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "B,S,T", [(1, 0, 8), (1, 0, 0), (1, 3, 0), (0, 3, 5), (2, 3, 0)], ids=["S0", "S0T0", "T0", "B0", "B2T0"]
)
def test_empty_queries_or_keys_give_zero_outputs_and_minus_inf_lse(backend, B, S, T):
    q, k, v, idx = make(B, S, T, 4, 2, 16, 16, K=3)
    o, lse, grads = run(backend, q, k, v, idx)
    assert o.shape == (B, S, 4, 16) and o.dtype == q.dtype and lse.shape == (B, S, 4) and lse.dtype == torch.float32
    assert bool((o == 0).all()) and bool((lse == -torch.inf).all())
    for g, x in zip(grads, leaves(q, k, v)):
        assert g.shape == x.shape and bool((g == 0).all())


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_meta_inputs_are_checked_by_shape_only(backend):
    # model init / shape propagation on the meta device: no value is read (none exists)
    q = torch.empty(2, 5, 4, 24, device="meta")
    k = torch.empty(2, 9, 2, 24, device="meta")
    v = torch.empty(2, 9, 2, 8, device="meta")
    idx = torch.empty(2, 5, 6, dtype=torch.int32, device="meta")
    o, lse = sparse_attention(q, k, v, idx, return_lse=True, backend=backend)
    assert o.device.type == "meta" and o.shape == (2, 5, 4, 8) and lse.shape == (2, 5, 4)
    with pytest.raises(ValueError, match="indices must have shape"):  # shapes are still checked
        sparse_attention(q, k, v, idx[:, :3], backend=backend)


def test_fake_tensors_are_checked_by_shape_only():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(1, 5, 4, 16)
        k = torch.empty(1, 9, 2, 16)
        idx = torch.empty(1, 5, 6, dtype=torch.int32)
        o = sparse_attention(q, k, k, idx, backend="torch")
    assert o.shape == (1, 5, 4, 16)


def test_triton_backend_on_meta_tensors_is_a_clear_value_error():
    q = torch.empty(1, 2, 2, 16, device="meta")
    idx = torch.empty(1, 2, 3, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="backend='triton' cannot run on meta"):
        sparse_attention(q, q, q, idx, backend="triton")


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_heads_or_zero_head_dims_are_value_errors(backend):
    q, k, v, idx = make(1, 3, 5, 4, 2, 16, 16, K=2)
    q, k, v = q.detach(), k.detach(), v.detach()
    with pytest.raises(ValueError, match=r"q must have Hq >= 1 heads"):
        sparse_attention(q[:, :, :0], k, v, idx, backend=backend)
    with pytest.raises(ValueError, match=r"q must have Dqk >= 1"):
        sparse_attention(q[..., :0], k[..., :0], v, idx, backend=backend)
    with pytest.raises(ValueError, match=r"v must have Dv >= 1"):
        sparse_attention(q, k, v[..., :0], idx, backend=backend)


@pytest.mark.parametrize("scale, error", [("0.5", TypeError), (True, TypeError), (float("nan"), ValueError)])
def test_bad_scale(scale, error):
    q, k, v, idx = make(1, 3, 5, 2, 2, 16, 16, K=2)
    with pytest.raises(error, match="scale"):
        sparse_attention(q, k, v, idx, scale=scale)
