"""The KL target as a pass of its own (``attention_prob_sum``) and the loss from a given target
(``indexer_kl_loss_given_target``): torch reference and Triton kernels (CPU interpreter in CI)
against ``indexer_kl_loss``, which computes the target itself."""

from __future__ import annotations

import pytest
import torch

from hyscale_hf.benchmarking.inputs import causal_indices, loss_inputs
from hyscale_hf.kernels.checks import triton_usable
from hyscale_hf.kernels.indexer_kl import attention_prob_sum, indexer_kl_loss, indexer_kl_loss_given_target
from hyscale_hf.kernels.indexer_kl.op import indexer_kl_forward_triton
from hyscale_hf.kernels.sparse_attn.naive import sparse_attention_reference

needs_interpreter = pytest.mark.skipif(not triton_usable(torch.device("cpu")), reason="needs TRITON_INTERPRET=1")
BACKENDS = ["torch", pytest.param("triton", marks=needs_interpreter)]
ATTN_SHAPES = {"gqa": (4, 2, 16), "mla": (4, 1, 36)}  # (Hq, Hkv, Dqk), as in test_triton.py
SCALE = 0.3


def _case(attn, *, dtype=torch.float32, seed=0, B=2, S=5, T=40, H=3, D=16, K=37):
    Hq, Hkv, Dqk = ATTN_SHAPES[attn]
    g = torch.Generator().manual_seed(seed)
    tensors = loss_inputs(B, S, T, H, D, Hq, Hkv, Dqk, dtype=dtype, generator=g, attn_sharpness=2.0)
    idx = causal_indices(B, S, T, K, generator=g, local=4, sinks=2, empty_rows=(1,))
    aq, ak = tensors[3:]
    lse = sparse_attention_reference(aq.float(), ak.float(), ak.float(), idx, SCALE)[1]
    return tensors, idx, lse


def _loss_and_grads(fn, tensors, reduction):
    leaves = [t.clone().requires_grad_() for t in tensors[:3]]
    out = fn(*leaves, reduction)
    weight = torch.rand(out.shape, generator=torch.Generator().manual_seed(9)) + 0.5
    (out * weight).sum().backward()
    return [out.detach()] + [t.grad for t in leaves]


@needs_interpreter
@pytest.mark.parametrize("attn", ["gqa", "mla"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prob_sum_kernel_matches_the_reference_and_the_loss_kernels_target(attn, dtype):
    (_, _, _, aq, ak), idx, lse = _case(attn, dtype=dtype)
    got = attention_prob_sum(aq, ak, idx, lse, SCALE, backend="triton")
    want = attention_prob_sum(aq, ak, idx, lse, SCALE, backend="torch")
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert torch.equal(got[:, 1], torch.zeros_like(got[:, 1]))  # the query without keys
    iq, ik, iw = _case(attn, dtype=dtype)[0][:3]
    stored = indexer_kl_forward_triton(iq, ik, iw, aq, ak, idx, lse, SCALE, True)[1]
    assert torch.equal(got, stored)  # one way to sum the heads: the same helper in both kernels


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("attn", ["gqa", "mla"])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_given_target_is_the_loss_that_computes_it(backend, attn, reduction):
    tensors, idx, lse = _case(attn, seed=1)
    aq, ak = tensors[3:]
    target = attention_prob_sum(aq, ak, idx, lse, SCALE, backend=backend)
    got = _loss_and_grads(lambda q, k, w, r: indexer_kl_loss_given_target(q, k, w, idx, target, reduction=r,
                                                                          backend=backend), tensors, reduction)
    want = _loss_and_grads(lambda q, k, w, r: indexer_kl_loss(q, k, w, aq, ak, idx, attn_lse=lse, scale=SCALE,
                                                              reduction=r, backend=backend), tensors, reduction)
    for name, a, b in zip(("kl", "index_q", "index_k", "index_w"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_query_masked_to_minus_one_drops_out_whatever_its_target(backend):
    tensors, idx, lse = _case("gqa", seed=2)
    target = torch.rand(idx.shape, generator=torch.Generator().manual_seed(3)) + 0.1
    masked = idx.clone()
    masked[0, 3] = -1
    kl, dq, dk, dw = _loss_and_grads(lambda q, k, w, r: indexer_kl_loss_given_target(
        q, k, w, masked, target, reduction=r, backend=backend), tensors, "none")
    assert kl[0, 3] == 0 and dq[0, 3].abs().max() == 0 and dw[0, 3].abs().max() == 0
    assert kl[0, 2] > 0


def test_reference_in_float64_is_the_kl_formula():
    tensors, idx, _ = _case("mla", dtype=torch.float64, seed=4)
    iq, ik, iw = tensors[:3]
    target = torch.rand(idx.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    kl = indexer_kl_loss_given_target(iq, ik, iw, idx, target, relu=False, reduction="none", backend="torch")
    b, s = 0, 2
    keys = idx[b, s][idx[b, s] >= 0].long()
    logits = (torch.einsum("hd,kd->hk", iq[b, s], ik[b, keys]) * iw[b, s][:, None]).sum(0)
    p = target[b, s][idx[b, s] >= 0]
    p = p / p.sum()
    want = (p * (p.log() - torch.log_softmax(logits, 0))).sum()
    torch.testing.assert_close(kl[b, s], want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("change, error, match", [
    (lambda a: a.update(target=a["target"][..., :-1]), ValueError, "target has K"),
    (lambda a: a.update(target=a["target"].half()), TypeError, "target"),
    (lambda a: a.update(target=a["target"][:, :-1]), ValueError, "target"),
    (lambda a: a.update(reduction="avg"), ValueError, "reduction"),
])
def test_bad_input_names_the_argument(change, error, match):
    tensors, idx, _ = _case("gqa")
    args = dict(target=torch.rand(idx.shape), reduction="mean")
    change(args)
    with pytest.raises(error, match=match):
        indexer_kl_loss_given_target(*tensors[:3], idx, args["target"], reduction=args["reduction"])


def test_prob_sum_bad_lse_names_the_argument():
    (_, _, _, aq, ak), idx, lse = _case("gqa")
    with pytest.raises(ValueError, match="lse"):
        attention_prob_sum(aq, ak, idx, lse[..., :-1], SCALE)
