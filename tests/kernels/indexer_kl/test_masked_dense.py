"""The masked-dense CPU path of the indexer KL loss against the reference (its oracle)."""

from __future__ import annotations

import pytest
import torch

from hyscale_hf.benchmarking.inputs import causal_indices, loss_inputs
from hyscale_hf.kernels import indexer_kl_loss
from hyscale_hf.kernels.indexer_kl import masked_dense
from hyscale_hf.kernels.indexer_kl.masked_dense import fits, indexer_kl_masked_dense
from hyscale_hf.kernels.indexer_kl.naive import indexer_kl_loss_reference


def _inputs(B=2, S=6, T=9, H=3, D=4, Hq=4, Hkv=2, Dqk=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    iq, ik, iw, aq, ak = loss_inputs(B, S, T, H, D, Hq, Hkv, Dqk, dtype=torch.float64, generator=g,
                                     attn_sharpness=2.0)
    return [t.requires_grad_() for t in (iq, ik, iw.to(torch.float64))] + [aq, ak]


def _loss_and_grads(fn, inputs, indices, **kw):
    """Per-query KL and the gradients of a weighted sum of it in index_q, index_k, index_w."""
    if fn is indexer_kl_masked_dense:
        kl = fn(*inputs, indices, **kw)[0]
    else:
        kl = fn(*inputs, indices, reduction="none", **kw)
    weights = torch.linspace(0.5, 1.5, kl.numel(), dtype=kl.dtype).view_as(kl)
    return (kl, *torch.autograd.grad((kl * weights).sum(), inputs[:3]))


@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("with_lse", [False, True])
@pytest.mark.parametrize("duplicates", [False, True])
def test_sparse_stage_matches_reference(relu, with_lse, duplicates):
    inputs = _inputs()
    idx = causal_indices(2, 6, 9, 4, generator=torch.Generator().manual_seed(1), empty_rows=(2,))
    if duplicates:  # a key listed twice counts twice, under both distributions
        idx[:, 4:, -1] = idx[:, 4:, 0]
    scale = 6**-0.5
    lse = None
    if with_lse:  # the attention's own lse over the same multiset, as sparse_attention returns it
        from hyscale_hf.kernels.sparse_attn.naive import sparse_attention_reference

        aq, ak = inputs[3], inputs[4]
        _, lse = sparse_attention_reference(aq, ak, ak, idx, scale)
    want = _loss_and_grads(indexer_kl_loss_reference, inputs, idx, attn_lse=lse, scale=scale, relu=relu)
    got = _loss_and_grads(indexer_kl_masked_dense, inputs, idx, attn_lse=lse, scale=scale, relu=relu)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert torch.equal(got[0][:, 2], torch.zeros(2, dtype=torch.float64))  # the query with no key


@pytest.mark.parametrize("packing", ["causal", "cu_seqlens", "window_start"])
def test_dense_warmup_matches_reference(packing):
    B = 1 if packing == "cu_seqlens" else 2
    inputs = _inputs(B=B, S=9, T=9)
    kw = {"cu_seqlens": torch.tensor([0, 4, 9], dtype=torch.int32)} if packing == "cu_seqlens" else {}
    if packing == "window_start":
        kw["window_start"] = torch.tensor([3, 0])
    want = _loss_and_grads(indexer_kl_loss_reference, inputs, None, scale=0.4, **kw)
    got = _loss_and_grads(indexer_kl_masked_dense, inputs, None, scale=0.4, **kw)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_attention_chunks_do_not_change_the_loss(monkeypatch):
    inputs = _inputs()
    idx = causal_indices(2, 6, 9, 4, generator=torch.Generator().manual_seed(2))
    whole = indexer_kl_masked_dense(*inputs, idx, scale=0.5)[0]
    monkeypatch.setattr(masked_dense, "CHUNK_BYTES", 4 * 2 * 4 * 9 * 2)  # two queries per chunk
    torch.testing.assert_close(indexer_kl_masked_dense(*inputs, idx, scale=0.5)[0], whole, rtol=0, atol=1e-12)


def test_fits_takes_short_finite_key_ranges_on_a_cpu_only(monkeypatch):
    g = torch.Generator().manual_seed(0)
    iq, ik, iw, aq, ak = loss_inputs(1, 64, 64, 2, 8, 4, 2, 8, generator=g)
    idx = torch.zeros(1, 64, 8, dtype=torch.int32)
    assert fits(iq, ik, iw, aq, ak, idx) and fits(iq, ik, iw, aq, ak, None)
    assert not fits(iq, ik, iw, aq, ak, idx[..., :1])  # 64 keys for 1 selected: the gathers are cheaper
    bad = ak.clone()
    bad[0, 7, 1, 2] = float("inf")  # would reach queries that never select key 7
    assert not fits(iq, ik, iw, aq, bad, idx)
    meta = [t.to("meta") for t in (iq, ik, iw, aq, ak)]
    assert not fits(*meta, idx.to("meta"))
    monkeypatch.setattr(masked_dense, "MAX_SAVED_BYTES", 4 * 64 * 64 * (2 + 3) - 1)  # one byte short
    assert not fits(iq, ik, iw, aq, ak, idx)


def test_public_function_takes_this_path_on_cpu_and_matches_reference(monkeypatch):
    inputs = _inputs()
    idx = causal_indices(2, 6, 9, 4, generator=torch.Generator().manual_seed(3), empty_rows=(0,))
    calls = []
    real = masked_dense.indexer_kl_masked_dense

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    from hyscale_hf.kernels.indexer_kl import op

    monkeypatch.setattr(op, "indexer_kl_masked_dense", spy)
    for indices in (idx, None):
        for reduction in ("mean", "sum", "none"):
            got = indexer_kl_loss(*inputs, indices, scale=0.3, reduction=reduction, backend="torch")
            want = indexer_kl_loss_reference(*inputs, indices, scale=0.3, reduction=reduction)
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert len(calls) == 6
