"""Sparse-stage indexer loss on the GPU at GLM-5 shapes against the fp32 torch reference.

Indexer H = 32, D = 128, K = 2048; attention MLA absorbed (64 heads, Dqk = 576, Hkv = 1) and GQA
(32 query / 8 KV heads, D = 128); one causal sequence of T tokens (S = T), bf16 inputs. The
reference runs on the same values upcast to fp32, a query chunk at a time (it gathers [chunk, K, ...]).
"""

from __future__ import annotations

import pytest
import torch

from hyscale_hf.benchmarking.inputs import causal_indices, loss_inputs
from hyscale_hf.kernels import indexer_kl_loss
from hyscale_hf.kernels.indexer_kl.naive import indexer_kl_loss_reference
from hyscale_hf.kernels.sparse_attn.naive import sparse_attention_reference

pytestmark = pytest.mark.gpu

H, D, K = 32, 128, 2048
DEVICE = "cuda"
ATTN = {"mla": (64, 1, 576), "gqa": (32, 8, 128)}


def _setup(T, attn, dtype=torch.bfloat16, seed=0):
    Hq, Hkv, Dqk = ATTN[attn]
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    tensors = loss_inputs(1, T, T, H, D, Hq, Hkv, Dqk, dtype=dtype, device=DEVICE, generator=g,
                          attn_sharpness=3.0)
    idx = causal_indices(1, T, T, K, generator=g, device=DEVICE, local=256, sinks=16)
    return tensors, idx, Dqk**-0.5


def _reference_lse(aq, ak, idx, scale, chunk=512):
    Dv = ak.shape[-1] if ak.shape[2] > 1 else 512  # MLA: v = the first 512 latent dims
    return torch.cat([
        sparse_attention_reference(aq[:, c:c + chunk].float(), ak.float(), ak[..., :Dv].float(),
                                   idx[:, c:c + chunk], scale)[1]
        for c in range(0, aq.shape[1], chunk)
    ], dim=1)


def _reference(tensors, idx, lse, scale, chunk=256):
    """fp32 reference per-query KL and the gradients of the "mean" loss, a query chunk at a time."""
    iq, ik, iw, aq, ak = (t.float() for t in tensors)
    leaves = [t.clone().requires_grad_() for t in (iq, ik, iw)]
    count = (idx >= 0).any(-1).sum().clamp_min(1)
    kls = []
    for c in range(0, iq.shape[1], chunk):
        part = slice(c, c + chunk)
        kl = indexer_kl_loss_reference(
            leaves[0][:, part], leaves[1], leaves[2][:, part], aq[:, part], ak, idx[:, part],
            attn_lse=None if lse is None else lse[:, part], scale=scale, relu=True, reduction="none")
        (kl.sum() / count).backward()
        kls.append(kl.detach())
    return torch.cat(kls, dim=1), (torch.cat(kls, dim=1).sum() / count), [t.grad for t in leaves]


def _triton(tensors, idx, lse, scale):
    leaves = [t.clone().requires_grad_() for t in tensors[:3]]
    per_query = indexer_kl_loss(*leaves, *tensors[3:], idx, attn_lse=lse, scale=scale, reduction="none",
                                backend="triton")
    loss = indexer_kl_loss(*leaves, *tensors[3:], idx, attn_lse=lse, scale=scale, backend="triton")
    loss.backward()
    return per_query.detach(), loss.detach(), [t.grad for t in leaves]


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize(
    "T, attn, lse_given",
    [(4096, "mla", False), (4096, "mla", True), (4096, "gqa", False), (4096, "gqa", True),
     (16384, "mla", True), (16384, "gqa", False)],
)
def test_bf16_matches_fp32_reference(T, attn, lse_given):
    tensors, idx, scale = _setup(T, attn, seed=T + len(attn) + int(lse_given))
    lse = _reference_lse(tensors[3], tensors[4], idx, scale) if lse_given else None
    ref_kl, ref_loss, ref_grads = _reference(tensors, idx, lse, scale)
    kl, loss, grads = _triton(tensors, idx, lse, scale)
    assert torch.isfinite(kl).all()
    torch.testing.assert_close(kl, ref_kl, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-6)
    for name, a, b, dtype in zip(("index_q", "index_k", "index_w"), grads, ref_grads,
                                 (torch.bfloat16, torch.bfloat16, torch.float32)):
        assert a.dtype == dtype, name
        # dI * w reaches the tensor cores in bf16 (as dS in flash attention): bf16 rounding
        assert _rel(a, b) < 1e-2, f"d{name}: relative error {_rel(a, b):.2e}"


def test_fp32_inputs_use_exact_products():
    tensors, idx, scale = _setup(2048, "gqa", dtype=torch.float32, seed=7)
    ref_kl, ref_loss, ref_grads = _reference(tensors, idx, None, scale)
    kl, loss, grads = _triton(tensors, idx, None, scale)
    torch.testing.assert_close(kl, ref_kl, rtol=1e-4, atol=1e-4)
    for a, b in zip(grads, ref_grads):
        assert _rel(a, b) < 1e-4


def test_dq_dw_deterministic_dk_close():
    """d index_q and d index_w are written once per query (bitwise repeatable); d index_k sums fp32
    atomics in a run-dependent order, so it agrees to rounding only: a few elements land on the
    neighbouring bf16 value (measured on an H200: 3.5e-5 relative norm between two runs)."""
    tensors, idx, scale = _setup(4096, "mla", seed=11)
    _, _, first = _triton(tensors, idx, None, scale)
    _, _, second = _triton(tensors, idx, None, scale)
    assert torch.equal(first[0], second[0]) and torch.equal(first[2], second[2])
    assert _rel(first[1], second[1]) < 1e-3


@pytest.mark.parametrize("attn", ["mla", "gqa"])
def test_given_target_matches_the_loss_that_computes_it(attn):
    """attention_prob_sum's target (against its fp32 reference) fed to indexer_kl_loss_given_target: the
    loss and gradients of indexer_kl_loss on the same lse, bf16 at T = 4096."""
    from hyscale_hf.kernels.indexer_kl import attention_prob_sum, indexer_kl_loss_given_target
    from hyscale_hf.kernels.indexer_kl.naive import attention_prob_sum_reference

    tensors, idx, scale = _setup(4096, attn, seed=7)
    aq, ak = tensors[3:]
    lse = _reference_lse(aq, ak, idx, scale)
    target = attention_prob_sum(aq, ak, idx, lse, scale, backend="triton")
    want_target = torch.cat([attention_prob_sum_reference(aq[:, c:c + 512].float(), ak.float(), idx[:, c:c + 512],
                                                          lse[:, c:c + 512], scale) for c in range(0, 4096, 512)], 1)
    assert _rel(target, want_target) < 1e-3
    per_query, loss, grads = _triton(tensors, idx, lse, scale)
    leaves = [t.clone().requires_grad_() for t in tensors[:3]]
    got = indexer_kl_loss_given_target(*leaves, idx, target, backend="triton")
    got.backward()
    assert abs(got.item() - loss.item()) <= 1e-4 * abs(loss.item())
    for name, a, b in zip(("index_q", "index_k", "index_w"), [t.grad for t in leaves], grads):
        assert _rel(a, b) < 1e-2, name


@pytest.mark.parametrize("T", [8192, 32768])
def test_tiles_match_the_per_query_kernels_at_smollm2_shape(T, monkeypatch):
    """The given-target KL over the attention's query tiles (42 queries: SmolLM2's 9 / 3 heads in
    128-row tiles) against the per-query kernels, bf16, a 2 x 64 indexer, K = 2048: the same loss and
    gradients up to fp32 summation order and bf16 products."""
    from hyscale_hf.kernels.indexer_kl import indexer_kl_loss_given_target, tiled
    from hyscale_hf.kernels.sparse_attn import SparseAttentionConfig
    from hyscale_hf.kernels.sparse_attn.host import union_tiles

    monkeypatch.setattr(tiled, "TILES_AT_ANY_UNION", True)  # the tiles whatever this selection's union

    g = torch.Generator(device=DEVICE).manual_seed(T)
    iq = torch.randn(1, T, 2, 64, device=DEVICE, generator=g).to(torch.bfloat16)
    ik = torch.randn(1, T, 64, device=DEVICE, generator=g).to(torch.bfloat16)
    iw = torch.rand(1, T, 2, device=DEVICE, generator=g) + 0.2
    idx = causal_indices(1, T, T, K, generator=g, device=DEVICE, local=512, sinks=16)
    target = torch.where(idx >= 0, torch.rand(idx.shape, device=DEVICE, generator=g) + 0.05, 0.0)
    tiles = union_tiles(idx, SparseAttentionConfig().tile_rows // 3, T, unique=True)
    results = []
    for given in (tiles, None):
        leaves = [t.clone().requires_grad_() for t in (iq, ik, iw)]
        kl = indexer_kl_loss_given_target(*leaves, idx, target, reduction="none", backend="triton", tiles=given)
        (kl * (torch.arange(T, device=DEVICE) % 7 + 1)).sum().backward()
        results.append([kl.detach()] + [t.grad for t in leaves])
    for name, a, b in zip(("kl", "index_q", "index_k", "index_w"), *results):
        assert torch.isfinite(a).all(), name
        assert _rel(a, b) < 1e-2, f"{name}: relative difference {_rel(a, b):.2e}"


@pytest.mark.parametrize("tiled_path", [True, False], ids=["tiles", "per-query"])
def test_one_pass_matches_two_passes_on_hytopks_selection(tiled_path, monkeypatch):
    """The one pass (the selection's lse from hytopk, loss and gradients from the backward kernels)
    against the forward + backward, at T = 16384 on hytopk's own top-2048 of a 4 x 64 indexer (bf16):
    the lse and the logits are sums in different orders, so the two agree to fp32 rounding."""
    from hyscale_hf.kernels import hytopk
    from hyscale_hf.kernels.indexer_kl import indexer_kl_loss_given_target, tiled
    from hyscale_hf.kernels.sparse_attn.host import union_tiles

    monkeypatch.setattr(tiled, "TILES_AT_ANY_UNION", True)
    T = 16384
    g = torch.Generator(device=DEVICE).manual_seed(5)
    iq = torch.randn(1, T, 4, 64, device=DEVICE, generator=g).to(torch.bfloat16)
    ik = torch.randn(1, T, 64, device=DEVICE, generator=g).to(torch.bfloat16)
    iw = torch.rand(1, T, 4, device=DEVICE, generator=g) * 0.1
    idx, lse = hytopk(iq, ik, iw, K, return_lse=True, backend="triton")
    target = torch.where(idx >= 0, torch.rand(idx.shape, device=DEVICE, generator=g) + 0.05, 0.0)
    tiles = union_tiles(idx, 42, T, unique=True) if tiled_path else None
    results = []
    for given in (lse, None):
        leaves = [t.clone().requires_grad_() for t in (iq, ik, iw)]
        loss = indexer_kl_loss_given_target(*leaves, idx, target, backend="triton", tiles=tiles, index_lse=given)
        loss.backward()
        results.append([loss.detach()] + [t.grad for t in leaves])
    for name, a, b in zip(("loss", "index_q", "index_k", "index_w"), *results):
        assert torch.isfinite(a).all(), name
        tol = 1e-4 if name == "loss" else 1e-2  # the gradients' last rounding is bf16
        assert _rel(a, b) < tol, f"{name}: relative difference {_rel(a, b):.2e}"
