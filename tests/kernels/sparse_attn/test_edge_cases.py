"""sparse_attention on degenerate inputs, on both backends (the Triton kernels under Triton's CPU
interpreter when there is no GPU): empty batches, queries or keys, meta tensors, head dims the
kernels do not tile natively (padded), zero sizes (docs/design.md section 4)."""

import pytest
import torch

from hyscale_hf import sparse_attention
from hyscale_hf.kernels.sparse_attn import host, op
from hyscale_hf.kernels.sparse_attn.naive import sparse_attention_reference

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


HEAD_DIMS = [(24, 16), (16, 8), (80, 80), (96, 96), (112, 112), (8, 40), (1, 3), (40, 24)]


@pytest.mark.skipif(not host.HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("Dqk,Dv", HEAD_DIMS, ids=[f"{a}x{b}" for a, b in HEAD_DIMS])
def test_triton_takes_every_head_dim_by_zero_padding(Dqk, Dv):
    # Dqk 24 -> 32, Dv 8 -> 16, 80 = 64 + 16 (native) with Dv 80 -> 128, 112 -> 128, ...
    q, k, v, idx = make(1, 5, 9, 4, 2, Dqk, Dv, K=6, seed=Dqk)
    o, lse, grads = run("triton", q, k, v, idx)
    o_ref, lse_ref, grads_ref = run("torch", q, k, v, idx)
    assert o.shape == (1, 5, 4, Dv)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, lse_ref, atol=1e-5, rtol=1e-5)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not host.HAS_TRITON, reason="needs triton")
def test_padded_head_dims_with_v_a_view_of_k():
    # MLA-like v = k[..., :Dv] with a key width the kernels cannot tile (40 = 32 + 8): both pads
    # are new tensors, and autograd adds both gradients back into k.
    q, k, v, idx = make(1, 6, 10, 4, 1, 40, 24, K=7, v_view=True)
    o, lse, grads = run("triton", q, k, v, idx)
    o_ref, lse_ref, grads_ref = run("torch", q, k, v, idx)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "Dqk,Dv,padded",
    [(16, 16, (16, 16)), (24, 8, (32, 16)), (80, 80, (80, 128)), (96, 96, (96, 128)), (112, 112, (128, 128)),
     (576, 512, (576, 512)), (200, 100, (256, 128)), (1, 1, (16, 16))],
)
def test_padded_head_dims(Dqk, Dv, padded):
    assert host.padded_head_dims(Dqk, Dv) == padded
    assert host._split_key_dim(padded[0])[0] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("D", [80, 96, 112, 24])
def test_auto_takes_the_triton_path_for_common_head_dims_on_cuda(D, monkeypatch):
    calls = []
    real = op.triton_sparse_attention
    monkeypatch.setattr(op, "triton_sparse_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 64, h, D, generator=g, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2))
    idx = torch.randint(-1, 64, (1, 64, 16), generator=g, device="cuda", dtype=torch.int32)
    o = sparse_attention(q, k, v, idx)  # backend="auto"
    assert calls == [1]
    ref, _ = sparse_attention_reference(q.float(), k.float(), v.float(), idx, D**-0.5)
    torch.testing.assert_close(o.float(), ref, atol=2e-2, rtol=2e-2)


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "k0,k1,o_want,lse_want",
    [(NAN, 1.0, NAN, NAN), (INF, 1.0, NAN, NAN), (INF, INF, NAN, NAN), (-INF, 1.0, 1.0, 4.0), (-INF, -INF, 0.0, -INF)],
    ids=["nan", "inf", "inf-inf", "one-minus-inf", "all-minus-inf"],
)
def test_non_finite_logits_follow_one_rule(backend, k0, k1, o_want, lse_want):
    # NaN or +inf among a query's logits: o and lse NaN (the kernels said lse = -inf, "no key");
    # only -inf logits: a query without keys, o = 0 and lse = -inf (the reference said o = NaN)
    q = torch.ones(1, 1, 1, 16, device=DEVICE)
    k = torch.ones(1, 2, 1, 16, device=DEVICE)
    k[0, 0, 0, 0], k[0, 1, 0, 0] = k0, k1  # logits (15 + k) / 4
    v = torch.ones(1, 2, 1, 16, device=DEVICE)
    idx = torch.tensor([[[0, 1]]], dtype=torch.int32, device=DEVICE)
    o, lse = sparse_attention(q, k, v, idx, return_lse=True, backend=backend)
    torch.testing.assert_close(o.cpu(), torch.full((1, 1, 1, 16), o_want), equal_nan=True)
    torch.testing.assert_close(lse.cpu(), torch.full((1, 1, 1), lse_want), equal_nan=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_values_of_keys_a_query_skips_never_reach_it(backend):
    # -1 slots: the reference gathered key row 0 as a stand-in and 0 * NaN leaked into o
    q, k, v, _ = make(1, 3, 4, 2, 1, 16, 16, K=3)
    v = v.detach().clone()
    k = k.detach().clone()
    v[0, 0, 0, 3] = NAN
    k[0, 0, 0, 5] = INF
    idx = torch.tensor([[[1, -1, 2], [-1, -1, -1], [3, 3, -1]]], dtype=torch.int32, device=DEVICE)
    o, lse = sparse_attention(q.detach(), k, v, idx, return_lse=True, backend=backend)
    assert bool(torch.isfinite(o).all()) and bool(torch.isfinite(lse[0, [0, 2]]).all())
    assert bool((o[0, 1] == 0).all()) and bool((lse[0, 1] == -INF).all())


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
