"""The masked-dense torch path of sparse attention against the gather reference (its oracle)."""

import pytest
import torch

from hyscale_hf import sparse_attention
from hyscale_hf.kernels.sparse_attn import masked_dense
from hyscale_hf.kernels.sparse_attn.masked_dense import fits, sparse_attention_masked_dense
from hyscale_hf.kernels.sparse_attn.naive import sparse_attention_reference


def random_selection(B, S, T, K, *, seed=0, duplicates=False, empty_rows=()):
    """Causal selections of K keys per query (-1 where fewer are visible); optional repeats and empty rows."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.full((B, S, K), -1, dtype=torch.int32)
    for b in range(B):
        for i in range(S):
            pos = T - S + i
            keys = torch.randperm(pos + 1, generator=g)[:K]
            idx[b, i, : keys.numel()] = keys.to(torch.int32)
            if duplicates and keys.numel() >= 2:
                idx[b, i, -1] = keys[0]  # key listed twice: counts twice, as in the reference
    for b, i in empty_rows:
        idx[b, i] = -1
    return idx


@pytest.mark.parametrize("Hq,Hkv,Dqk,Dv", [(4, 2, 16, 16), (6, 1, 24, 8), (3, 3, 8, 12)])
@pytest.mark.parametrize("duplicates", [False, True])
def test_masked_dense_matches_reference_forward_lse_and_gradients(Hq, Hkv, Dqk, Dv, duplicates):
    torch.manual_seed(0)
    B, S, T, K = 2, 7, 11, 4
    q = torch.randn(B, S, Hq, Dqk, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, T, Hkv, Dqk, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, T, Hkv, Dv, dtype=torch.float64, requires_grad=True)
    idx = random_selection(B, S, T, K, duplicates=duplicates, empty_rows=[(1, 2)])
    do, dlse = torch.randn(B, S, Hq, Dv, dtype=torch.float64), torch.randn(B, S, Hq, dtype=torch.float64)
    results = []
    for fn in (sparse_attention_reference, sparse_attention_masked_dense):
        o, lse = fn(q, k, v, idx, 0.3)
        finite = torch.isfinite(lse)
        loss = (o * do).sum() + (lse.masked_fill(~finite, 0) * dlse).sum()
        results.append((o, lse, *torch.autograd.grad(loss, (q, k, v))))
    for ref, got in zip(*results):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    o, lse = results[1][:2]
    assert torch.equal(o[1, 2], torch.zeros_like(o[1, 2])) and bool(torch.isneginf(lse[1, 2]).all())


def test_lse_gradient_chunks_queries_without_changing_results(monkeypatch):
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 9, 2, 16, requires_grad=True), torch.randn(1, 9, 1, 16, requires_grad=True),
               torch.randn(1, 9, 1, 16, requires_grad=True))
    idx = random_selection(1, 9, 9, 3)
    dlse = torch.randn(1, 9, 2)

    def grads():
        o, lse = sparse_attention_masked_dense(q, k, v, idx, 0.25)
        return torch.autograd.grad((o.sum() + (lse * dlse).sum()), (q, k, v))

    whole = grads()
    monkeypatch.setattr(masked_dense, "CHUNK_BYTES", 4 * 2 * 9 * 2)  # two queries per chunk
    parts = grads()
    for a, b in zip(whole, parts):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_gradients_of_o_alone_and_of_lse_alone_match_reference():
    """The kernel's backward covers o; the lse's gradient is added by hand: check each on its own."""
    torch.manual_seed(3)
    q = torch.randn(1, 6, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 6, 2, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 6, 2, 8, dtype=torch.float64, requires_grad=True)
    idx = random_selection(1, 6, 6, 3)
    for pick in (0, 1):
        got, ref = (torch.autograd.grad(fn(q, k, v, idx, 0.5)[pick].sum(), (q, k, v), materialize_grads=True)
                    for fn in (sparse_attention_masked_dense, sparse_attention_reference))
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_fits_takes_short_key_ranges_of_finite_inputs_only():
    q, kv = torch.zeros(1, 1024, 9, 64), torch.zeros(1, 1024, 3, 64)
    assert fits(q, kv, kv, torch.empty(1, 1024, 128, dtype=torch.int32))
    # 32x more keys than selected: the gathers are cheaper
    long_kv = torch.zeros(1, 8192, 3, 64)
    assert not fits(q[:, :1], long_kv, long_kv, torch.empty(1, 1, 128, dtype=torch.int32))
    # the [B, S, T] selection bias would exceed MAX_BIAS_BYTES
    big = torch.empty(1, 16384, 9, 64, device="meta")
    assert not fits(big, big[:, :, :3], big[:, :, :3], torch.empty(1, 16384, 2048, dtype=torch.int32, device="meta"))
    # a NaN in any row would reach queries that never selected it: the reference's gathers keep it out
    bad = kv.clone()
    bad[0, 5, 1, 3] = float("nan")
    assert not fits(q, kv, bad, torch.empty(1, 1024, 128, dtype=torch.int32))
    assert not fits(q.to("meta"), kv.to("meta"), kv.to("meta"), torch.empty(1, 1024, 128, dtype=torch.int32))
    bf16 = torch.zeros(1, 1024, 9, 64, dtype=torch.bfloat16)  # other dtypes are computed in fp32 here
    assert fits(bf16, bf16[:, :, :3], bf16[:, :, :3], torch.empty(1, 1024, 128, dtype=torch.int32))
    assert not fits(q[:, :0], kv, kv, torch.empty(1, 0, 128, dtype=torch.int32))  # empty: the reference


def test_public_torch_backend_takes_masked_dense_and_matches_reference():
    torch.manual_seed(2)
    q, k, v = torch.randn(1, 8, 4, 16), torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16)
    idx = random_selection(1, 8, 8, 3)
    assert fits(q, k, v, idx)
    o, lse = sparse_attention(q, k, v, idx, scale=0.25, return_lse=True, backend="torch")
    o_ref, lse_ref = sparse_attention_reference(q, k, v, idx, 0.25)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-5, atol=1e-6)
