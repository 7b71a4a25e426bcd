"""Sparse attention: the torch reference (oracle and CPU path) and the public function's checks."""

import pytest
import torch
import torch.nn.functional as F

from hyscale_hf import sparse_attention
from hyscale_hf.kernels.sparse_attn.naive import sparse_attention_reference


def causal_all_keys(S, T, K):
    """Every visible key of query i (position T - S + i), ascending, -1 padded; K >= T."""
    pos = torch.arange(T - S, T)[:, None]
    j = torch.arange(K)
    return torch.where(j <= pos, j, -1).to(torch.int32)[None]


def dense_causal(q, k, v, scale):
    """SDPA with the bottom-right causal mask, KV heads repeated for GQA."""
    S, T = q.shape[1], k.shape[1]
    rep = q.shape[2] // k.shape[2]
    mask = torch.arange(T)[None, :] <= torch.arange(T - S, T)[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.repeat_interleave(rep, 2).transpose(1, 2),
        v.repeat_interleave(rep, 2).transpose(1, 2),
        attn_mask=mask,
        scale=scale,
    )
    return out.transpose(1, 2)


@pytest.mark.parametrize(
    "S,T,Hq,Hkv,Dqk,Dv,mla",
    [(9, 9, 4, 2, 16, 16, False), (5, 9, 6, 3, 8, 12, False), (7, 7, 4, 1, 24, 16, True)],
    ids=["gqa", "gqa-suffix-queries", "mla-view"],
)
def test_reference_with_all_keys_selected_equals_dense_causal_sdpa(S, T, Hq, Hkv, Dqk, Dv, mla):
    torch.manual_seed(0)
    q = torch.randn(1, S, Hq, Dqk, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, T, Hkv, Dqk, dtype=torch.float64, requires_grad=True)
    v = k[..., :Dv] if mla else torch.randn(1, T, Hkv, Dv, dtype=torch.float64, requires_grad=True)
    idx = causal_all_keys(S, T, K=T + 3)
    scale = 0.37
    o = sparse_attention(q, k, v, idx, scale=scale, backend="torch")
    o_ref = dense_causal(q, k, v, scale)
    torch.testing.assert_close(o, o_ref)
    w = torch.randn_like(o)
    ins = [q, k] if mla else [q, k, v]
    g = torch.autograd.grad((o * w).sum(), ins)
    g_ref = torch.autograd.grad((o_ref * w).sum(), ins)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b)


def test_reference_skips_minus_one_entries():
    torch.manual_seed(1)
    q = torch.randn(1, 3, 2, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 10, 1, 8, dtype=torch.float64)
    v = torch.randn(1, 10, 1, 4, dtype=torch.float64)
    idx = torch.tensor([[[4, -1, 7, -1], [-1, -1, -1, -1], [0, 1, 2, 3]]], dtype=torch.int32)
    o, lse = sparse_attention(q, k, v, idx, return_lse=True, backend="torch")
    # Row 0 equals attention over keys {4, 7} only.
    o_sub, lse_sub = sparse_attention(q[:, :1], k, v, idx[:, :1, [0, 2]], return_lse=True, backend="torch")
    torch.testing.assert_close(o[:, :1], o_sub)
    torch.testing.assert_close(lse[:, :1], lse_sub)
    # Row 1 selects nothing: zero output, -inf lse, zero gradient, no NaN anywhere.
    assert o[0, 1].abs().max() == 0 and torch.isinf(lse[0, 1]).all() and (lse[0, 1] < 0).all()
    (dq,) = torch.autograd.grad(o.sum(), q)
    assert dq[0, 1].abs().max() == 0 and torch.isfinite(dq).all()


@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla-view"])
def test_reference_gradcheck_float64(mla):
    torch.manual_seed(2)
    q = torch.randn(1, 4, 4, 6, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 5, 2 if not mla else 1, 6, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 5, 2, 3, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([[[0, 2, -1], [1, 1, 4], [-1, -1, -1], [3, 0, 2]]], dtype=torch.int32)

    def fn(q, k, v):
        vv = k[..., :4] if mla else v
        o, lse = sparse_attention_reference(q, k, vv, idx, 0.5)
        return o, torch.where(torch.isinf(lse), 0.0, lse)

    assert torch.autograd.gradcheck(fn, (q, k, v))


def _inputs():
    q = torch.randn(1, 3, 4, 8)
    k = torch.randn(1, 5, 2, 8)
    v = torch.randn(1, 5, 2, 4)
    idx = torch.zeros(1, 3, 2, dtype=torch.int32)
    return q, k, v, idx


@pytest.mark.parametrize(
    "change,error,match",
    [
        (lambda a: dict(a, q=a["q"][0]), ValueError, "q must have rank 4"),
        (lambda a: dict(a, k=a["k"][..., :4]), ValueError, "k must have shape"),
        (lambda a: dict(a, k=torch.randn(1, 5, 3, 8), v=torch.randn(1, 5, 3, 4)), ValueError, "multiple of"),
        (lambda a: dict(a, v=torch.randn(1, 6, 2, 4)), ValueError, "v must have shape"),
        (lambda a: dict(a, indices=a["indices"].long()), TypeError, "indices must have dtype"),
        (lambda a: dict(a, indices=a["indices"] + 5), ValueError, r"indices must lie in \[-1, 5\)"),
        (lambda a: dict(a, indices=a["indices"] - 2), ValueError, "indices must lie"),
        (lambda a: dict(a, indices=a["indices"][:, :, :0]), ValueError, "K > 0"),
        (lambda a: dict(a, indices=a["indices"][:, :2]), ValueError, "indices must have shape"),
        (lambda a: dict(a, q=a["q"].to(torch.int64)), TypeError, "q must have dtype"),
        (lambda a: dict(a, indices=a["indices"].to("meta")), ValueError, "indices is on meta"),
        (lambda a: dict(a, backend="cuda"), ValueError, "backend must be"),
        (lambda a: dict(a, deterministic=1), TypeError, "deterministic must be a bool"),
    ],
)
def test_public_function_rejects_bad_input(change, error, match):
    q, k, v, idx = _inputs()
    args = change(dict(q=q, k=k, v=v, indices=idx))
    with pytest.raises(error, match=match):
        sparse_attention(**args)


def test_triton_backend_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v, idx = _inputs()
    with pytest.raises(ValueError, match="cannot run on cpu"):
        sparse_attention(q, k, v, idx, backend="triton")


def test_check_range_false_skips_only_the_range_read():
    from hyscale_hf.kernels.checks import check_indices

    bad = torch.full((1, 3, 2), 9, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"indices must lie in \[-1, 5\)"):
        check_indices(bad, 1, 3, 5)
    check_indices(bad, 1, 3, 5, check_range=False)  # trusted: not read
    with pytest.raises(TypeError, match="int32"):  # dtype and shape are still checked
        check_indices(bad.long(), 1, 3, 5, check_range=False)
