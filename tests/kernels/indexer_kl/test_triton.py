"""Sparse-stage indexer loss: the Triton kernels (CPU interpreter in CI) against the torch reference.

Interpreter tiles are 16 keys and 16 Dqk columns, so the shapes here cross several key tiles (with a
partial last tile) and several Dqk slices. bf16 is covered by the GPU tests only: the interpreter
multiplies bf16 bit patterns in ``tl.dot`` (triton-lang/triton issue 11584).
"""

from __future__ import annotations

import pytest
import torch

from hyscale_hf.benchmarking.inputs import causal_indices, loss_inputs
from hyscale_hf.kernels import indexer_kl_loss
from hyscale_hf.kernels.checks import triton_usable
from hyscale_hf.kernels.indexer_kl.op import attention_lse_triton
from hyscale_hf.kernels.sparse_attn.naive import sparse_attention_reference

pytestmark = pytest.mark.skipif(not triton_usable(torch.device("cpu")), reason="needs TRITON_INTERPRET=1")

# (Hq, Hkv, Dqk): GQA with 2 query heads per KV head, and MLA-like (one shared latent row, Dqk not
# a power of two).
ATTN_SHAPES = {"gqa": (4, 2, 16), "mla": (4, 1, 36)}


def _case(attn, *, B=2, S=5, T=40, H=3, D=16, K=37, dtype=torch.float32, seed=0, empty_rows=(1,)):
    Hq, Hkv, Dqk = ATTN_SHAPES[attn]
    g = torch.Generator().manual_seed(seed)
    tensors = loss_inputs(B, S, T, H, D, Hq, Hkv, Dqk, dtype=dtype, generator=g, attn_sharpness=2.0)
    idx = causal_indices(B, S, T, K, generator=g, local=4, sinks=2, empty_rows=empty_rows)
    return tensors, idx


def _run(backend, tensors, idx, reduction="none", **kw):
    leaves = [t.clone().requires_grad_() for t in tensors[:3]]
    out = indexer_kl_loss(*leaves, *tensors[3:], idx, backend=backend, reduction=reduction, **kw)
    upstream = torch.rand(out.shape, generator=torch.Generator().manual_seed(9)) + 0.5
    (out * upstream).sum().backward()
    return out.detach(), [t.grad for t in leaves]


def _assert_matches(tensors, idx, rtol=1e-5, atol=1e-6, grad_tol=2e-5, **kw):
    out, grads = _run("triton", tensors, idx, **kw)
    ref_out, ref_grads = _run("torch", tensors, idx, **kw)
    torch.testing.assert_close(out, ref_out, rtol=rtol, atol=atol)
    for name, a, b in zip(("index_q", "index_k", "index_w"), grads, ref_grads):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        err = ((a.double() - b.double()).norm() / b.double().norm()).item()
        assert err < grad_tol, f"d{name}: relative error {err:.2e}"


@pytest.mark.parametrize("attn", ["gqa", "mla"])
@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("lse_given", [False, True])
def test_kernel_matches_reference(attn, relu, lse_given):
    tensors, idx = _case(attn, seed=int(relu) + 2 * int(lse_given))
    lse = None
    if lse_given:
        aq, ak = tensors[3:]
        lse = sparse_attention_reference(aq, ak, ak, idx, 0.3)[1]
    _assert_matches(tensors, idx, attn_lse=lse, scale=0.3, relu=relu)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_reductions_match_reference(reduction):
    tensors, idx = _case("gqa", K=20, empty_rows=(0, 3))
    _assert_matches(tensors, idx, reduction=reduction)


def test_attention_lse_pass_matches_reference():
    for attn in ATTN_SHAPES:
        (_, _, _, aq, ak), idx = _case(attn, empty_rows=(2,))
        got = attention_lse_triton(aq, ak, idx, 0.25)
        want = sparse_attention_reference(aq, ak, ak, idx, 0.25)[1]
        torch.testing.assert_close(got, want)  # -inf where a query has no key


def test_relu_gradient_at_exact_zero_follows_reference():
    """Integer-valued inputs: many index_q . index_k products are exactly 0, where the reference's
    clamp_min passes the gradient; every logit is exact in fp32, so the kernels must agree tightly."""
    tensors, idx = _case("mla", seed=5)
    g = torch.Generator().manual_seed(6)
    ints = [torch.randint(-2, 3, t.shape, generator=g).float() for t in tensors]
    for i in (0, 1):  # sparse index_q / index_k rows: many products land exactly on 0
        ints[i] = ints[i] * (torch.rand(ints[i].shape, generator=g) < 0.3)
    ints[2] = ints[2] / 4  # index_w
    dots = torch.einsum("bshd,btd->bsht", ints[0], ints[1])
    assert (dots == 0).float().mean() > 0.05
    _assert_matches(ints, idx, scale=0.2, grad_tol=1e-5)


def test_float16_inputs():
    tensors, idx = _case("gqa", dtype=torch.float16)
    # the backward feeds dI * w to the tensor cores in the input dtype: fp16 rounding on the grads
    _assert_matches(tensors, idx, rtol=1e-4, atol=1e-5, grad_tol=3e-3)


def test_strided_mla_latent_view_and_no_grad_forward():
    """attn_k as a view into a wider latent buffer (MLA: k = c, v = c[..., :512]), and a forward
    under no_grad (no target saved for backward)."""
    (iq, ik, iw, aq, ak), idx = _case("mla")
    wide = torch.randn(*ak.shape[:3], ak.shape[3] + 8)
    wide[..., : ak.shape[3]] = ak
    view = wide[..., : ak.shape[3]]
    assert not view.is_contiguous()
    with torch.no_grad():
        got = indexer_kl_loss(iq, ik, iw, aq, view, idx, backend="triton", reduction="none")
    want = indexer_kl_loss(iq, ik, iw, aq, ak, idx, backend="torch", reduction="none")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_no_gradient_reaches_the_attention():
    (iq, ik, iw, aq, ak), idx = _case("gqa", S=3, K=12)
    leaves = [t.clone().requires_grad_() for t in (iq, ik, iw, aq, ak)]
    indexer_kl_loss(*leaves, idx, backend="triton").backward()
    assert all(t.grad is not None for t in leaves[:3])
    assert leaves[3].grad is None and leaves[4].grad is None
