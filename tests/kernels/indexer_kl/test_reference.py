"""The indexer KL loss reference (the oracle of the Triton kernel) and the public function's checks."""

from __future__ import annotations

import pytest
import torch

from hyscale_hf.benchmarking.inputs import causal_indices, loss_inputs
from hyscale_hf.kernels import indexer_kl_loss
from hyscale_hf.kernels.indexer_kl.naive import indexer_kl_loss_reference
from hyscale_hf.kernels.windows import query_windows


def _inputs(B=2, S=5, T=7, H=3, D=4, Hq=4, Hkv=2, Dqk=6, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    iq, ik, iw, aq, ak = loss_inputs(B, S, T, H, D, Hq, Hkv, Dqk, dtype=dtype, generator=g, attn_sharpness=2.0)
    return iq, ik, iw.to(torch.float64 if dtype == torch.float64 else torch.float32), aq, ak


def _all_visible_indices(B, S, T, cu_seqlens=None, window_start=None):
    """Each query's whole visible window as a selection (K = T, ascending, -1 padded)."""
    start, end = query_windows(B, S, T, cu_seqlens=cu_seqlens, window_start=window_start)
    keys = torch.arange(T)
    visible = (keys >= start[..., None]) & (keys <= end[..., None])
    idx = torch.where(visible, keys, torch.full_like(keys, T)).sort(dim=-1).values
    return torch.where(idx < T, idx, torch.full_like(idx, -1)).to(torch.int32)


def _explicit_kl(index_q, index_k, index_w, attn_q, attn_k, indices, scale, relu):
    """Per-query KL written out key by key in float64: an oracle independent of the reference."""
    B, S, H, _ = index_q.shape
    Hq, Hkv = attn_q.shape[2], attn_k.shape[2]
    out = torch.zeros(B, S, dtype=torch.float64)
    for b in range(B):
        for i in range(S):
            keys = [int(s) for s in indices[b, i] if s >= 0]
            if not keys:
                continue
            p = torch.zeros(len(keys), dtype=torch.float64)
            for h in range(Hq):
                kv = h // (Hq // Hkv)
                logits = torch.stack([attn_q[b, i, h] @ attn_k[b, s, kv] for s in keys]) * scale
                p += torch.softmax(logits, 0)
            p /= p.sum()
            dots = torch.stack([index_q[b, i] @ index_k[b, s] for s in keys], dim=1)  # [H, n]
            logit = ((dots.clamp_min(0) if relu else dots) * index_w[b, i][:, None]).sum(0)
            out[b, i] = (p * (p.log() - torch.log_softmax(logit, 0))).sum()
    return out


@pytest.mark.parametrize("relu", [True, False])
def test_reference_matches_explicit_kl(relu):
    iq, ik, iw, aq, ak = _inputs()
    idx = causal_indices(2, 5, 7, 4, generator=torch.Generator().manual_seed(1), empty_rows=(1,))
    scale = 6**-0.5
    want = _explicit_kl(iq, ik, iw, aq, ak, idx, scale, relu)
    got = indexer_kl_loss_reference(iq, ik, iw, aq, ak, idx, scale=scale, relu=relu, reduction="none")
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    dense = indexer_kl_loss_reference(iq, ik, iw, aq, ak, None, scale=scale, relu=relu, reduction="none")
    torch.testing.assert_close(dense, _explicit_kl(iq, ik, iw, aq, ak, _all_visible_indices(2, 5, 7), scale, relu))


@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("with_lse", [False, True])
def test_sparse_reference_gradcheck(relu, with_lse):
    iq, ik, iw, aq, ak = _inputs(S=4, T=6, H=2, D=3)
    idx = causal_indices(2, 4, 6, 4, generator=torch.Generator().manual_seed(2), empty_rows=(0,))
    lse = None
    if with_lse:  # the attention's own lse over the set, as sparse_attention returns it
        from hyscale_hf.kernels.sparse_attn.naive import sparse_attention_reference

        lse = sparse_attention_reference(aq, ak, ak, idx, 6**-0.5)[1]
    fn = lambda q, k, w: indexer_kl_loss_reference(q, k, w, aq, ak, idx, attn_lse=lse, scale=6**-0.5,
                                                   relu=relu, reduction="none")
    args = tuple(t.clone().requires_grad_() for t in (iq, ik, iw))
    assert torch.autograd.gradcheck(fn, args)


@pytest.mark.parametrize("relu", [True, False])
def test_dense_reference_gradcheck(relu):
    iq, ik, iw, aq, ak = _inputs(S=3, T=5, H=2, D=3)
    fn = lambda q, k, w: indexer_kl_loss_reference(q, k, w, aq, ak, None, scale=6**-0.5, relu=relu,
                                                   window_start=torch.tensor([0, 2]), chunk_size=2,
                                                   reduction="none")
    args = tuple(t.clone().requires_grad_() for t in (iq, ik, iw))
    assert torch.autograd.gradcheck(fn, args)


def _loss_and_grads(fn, iq, ik, iw):
    args = [t.clone().requires_grad_() for t in (iq, ik, iw)]
    out = fn(*args)
    weights = torch.linspace(0.5, 1.5, out.numel(), dtype=out.dtype).view_as(out)
    (out * weights).sum().backward()
    return out.detach(), [a.grad for a in args]


@pytest.mark.parametrize("packing", ["window_start", "cu_seqlens"])
def test_dense_equals_sparse_over_every_visible_key(packing):
    if packing == "window_start":
        B, S, T, kw = 2, 5, 8, {"window_start": torch.tensor([0, 3])}
    else:
        B, S, T, kw = 1, 9, 9, {"cu_seqlens": torch.tensor([0, 4, 5, 9], dtype=torch.int32)}
    iq, ik, iw, aq, ak = _inputs(B=B, S=S, T=T)
    idx = _all_visible_indices(B, S, T, **kw)
    common = {"scale": 0.4, "reduction": "none"}
    dense, dense_g = _loss_and_grads(
        lambda q, k, w: indexer_kl_loss_reference(q, k, w, aq, ak, None, chunk_size=2, **kw, **common), iq, ik, iw)
    sparse, sparse_g = _loss_and_grads(
        lambda q, k, w: indexer_kl_loss_reference(q, k, w, aq, ak, idx, **common), iq, ik, iw)
    torch.testing.assert_close(dense, sparse)
    for a, b in zip(dense_g, sparse_g):
        torch.testing.assert_close(a, b)


def test_dense_chunked_equals_unchunked():
    iq, ik, iw, aq, ak = _inputs(S=6, T=9)
    runs = [
        _loss_and_grads(lambda q, k, w, c=c: indexer_kl_loss_reference(
            q, k, w, aq, ak, None, scale=0.3, chunk_size=c, reduction="none"), iq, ik, iw)
        for c in (1, 4, None)
    ]
    for loss, grads in runs[:2]:
        torch.testing.assert_close(loss, runs[2][0])
        for a, b in zip(grads, runs[2][1]):
            torch.testing.assert_close(a, b)


def test_dense_cu_seqlens_equals_separate_sequences():
    cu = [0, 3, 7, 10]
    iq, ik, iw, aq, ak = _inputs(B=1, S=10, T=10)
    packed, packed_g = _loss_and_grads(lambda q, k, w: indexer_kl_loss(
        q, k, w, aq, ak, cu_seqlens=torch.tensor(cu), scale=0.5, reduction="sum"), iq, ik, iw)

    def separate(q, k, w):
        return sum(indexer_kl_loss(q[:, a:b], k[:, a:b], w[:, a:b], aq[:, a:b], ak[:, a:b], scale=0.5,
                                   reduction="sum") for a, b in zip(cu, cu[1:]))

    alone, alone_g = _loss_and_grads(separate, iq, ik, iw)
    torch.testing.assert_close(packed, alone)
    for a, b in zip(packed_g, alone_g):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("sparse", [True, False])
def test_target_is_detached(sparse):
    iq, ik, iw, aq, ak = _inputs()
    idx = causal_indices(2, 5, 7, 3, generator=torch.Generator().manual_seed(3)) if sparse else None
    lse = torch.zeros(2, 5, 4, dtype=torch.float64)  # any lse: only its detachment matters here
    leaves = [t.clone().requires_grad_() for t in (iq, ik, iw, aq, ak, lse)]
    loss = indexer_kl_loss(*leaves[:5], idx, attn_lse=leaves[5])
    loss.backward()
    assert all(t.grad is not None for t in leaves[:3])
    assert all(t.grad is None for t in leaves[3:])
    # With only the attention side requiring grad, the loss has no graph at all.
    assert not indexer_kl_loss(iq, ik, iw, *leaves[3:5], idx).requires_grad


def test_reductions_mean_over_queries_with_a_key():
    iq, ik, iw, aq, ak = _inputs()
    idx = causal_indices(2, 5, 7, 3, generator=torch.Generator().manual_seed(4), empty_rows=(0, 2))
    per_query = indexer_kl_loss(iq, ik, iw, aq, ak, idx, reduction="none")
    assert per_query.shape == (2, 5)
    assert torch.all(per_query[:, [0, 2]] == 0)
    assert torch.all(per_query[:, [1, 3, 4]] > 0)
    torch.testing.assert_close(indexer_kl_loss(iq, ik, iw, aq, ak, idx, reduction="sum"), per_query.sum())
    torch.testing.assert_close(indexer_kl_loss(iq, ik, iw, aq, ak, idx), per_query.sum() / 6)


def _bad_call(**overrides):
    iq, ik, iw, aq, ak = _inputs(dtype=torch.float32)
    args = {"index_q": iq, "index_k": ik, "index_w": iw, "attn_q": aq, "attn_k": ak,
            "indices": causal_indices(2, 5, 7, 3)}
    args.update(overrides)
    return lambda: indexer_kl_loss(**args)


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        ({"index_q": torch.randn(2, 5, 3)}, ValueError, "index_q must have rank 4"),
        ({"index_k": torch.randn(2, 7, 5)}, ValueError, "index_k must have shape"),
        ({"index_w": torch.randn(2, 5, 2)}, ValueError, "index_w must have shape"),
        ({"index_w": torch.randn(2, 5, 3).half()}, TypeError, "index_w must have dtype"),
        ({"attn_q": torch.randn(2, 4, 4, 6)}, ValueError, "attn_q must have shape"),
        ({"attn_k": torch.randn(2, 7, 2, 5)}, ValueError, "attn_k must have shape"),
        ({"attn_k": torch.randn(2, 7, 3, 6)}, ValueError, "not a multiple of attn_k"),
        ({"attn_lse": torch.zeros(2, 5, 3)}, ValueError, "attn_lse must have shape"),
        ({"indices": causal_indices(2, 5, 7, 3).long()}, TypeError, "indices must have dtype"),
        ({"indices": torch.full((2, 5, 3), 7, dtype=torch.int32)}, ValueError, r"indices must lie in \[-1, 7\)"),
        ({"indices": torch.full((2, 5, 3), -2, dtype=torch.int32)}, ValueError, "indices must lie in"),
        ({"indices": torch.zeros(2, 5, 0, dtype=torch.int32)}, ValueError, "K > 0"),
        ({"reduction": "max"}, ValueError, "reduction must be"),
        ({"backend": "cuda"}, ValueError, "backend must be"),
        ({"index_q": torch.randn(2, 8, 3, 4), "index_w": torch.randn(2, 8, 3),
          "attn_q": torch.randn(2, 8, 4, 6), "indices": None}, ValueError, "need S <= T"),
        ({"indices": None, "cu_seqlens": torch.tensor([0, 7])}, ValueError, "cu_seqlens"),
        ({"indices": None, "backend": "triton"}, ValueError, "dense warm-up"),
        ({"index_q": torch.randn(2, 5, 3, 4, dtype=torch.float64), "backend": "triton"}, ValueError, "float64"),
        ({"index_k": "keys"}, TypeError, "index_k must be a torch.Tensor"),
    ],
)
def test_public_function_rejects_bad_input(overrides, error, match):
    with pytest.raises(error, match=match):
        _bad_call(**overrides)()
