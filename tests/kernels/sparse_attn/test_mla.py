"""mla_sparse_attention: the Triton path (interpreter on CPU, fp32) against the plain composition.

The Triton path keeps q_nope/q_rot/W_UK instead of the absorbed query and rebuilds it in backward;
outputs, lse and every gradient (q_nope, q_rot, W_UK through a view of kv_b's weight, and kv, which
also receives the values' gradient) must match the composition of einsum, cat and sparse attention.
"""

import pytest
import torch

from hyscale_hf.kernels import mla_sparse_attention
from hyscale_hf.kernels.sparse_attn import SparseAttentionConfig, host
from hyscale_hf.kernels.sparse_attn.naive import mla_sparse_attention_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not host.HAS_TRITON, reason="needs triton")

# GLM-5's 64 heads x (192 nope -> 512 latent) + 64 rope, in miniature: C = 32 latent, R = 16 rope.
B, S, T, H, N, C, R, K = 2, 6, 9, 4, 8, 32, 16, 5


def make(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    kv_b = torch.randn(H * (N + 12), C, generator=g).to(DEVICE, dtype).requires_grad_()  # kv_b_proj.weight
    w_uk = kv_b.view(H, N + 12, C)[:, :N]  # a strided view, as the model patch passes it
    q_nope = torch.randn(B, S, H, N, generator=g).to(DEVICE, dtype).requires_grad_()
    q_rot = torch.randn(B, S, H, R, generator=g).to(DEVICE, dtype).requires_grad_()
    latent = torch.randn(B, T, C + R, generator=g).to(DEVICE, dtype).requires_grad_()
    kv = latent[:, :, None] * 1.0  # non-leaf, like the patch's cat([latent, k_rot])
    idx = torch.randint(-1, T, (B, S, K), generator=g, dtype=torch.int32)
    idx[1, 2] = -1  # a query with no key
    return q_nope, q_rot, kv_b, w_uk, latent, kv, idx.to(DEVICE)


def run(fn, seed=0, **kw):
    q_nope, q_rot, kv_b, w_uk, latent, kv, idx = make(seed)
    o, lse, attn_q = fn(q_nope, q_rot, w_uk, kv, idx, **kw)
    g = torch.Generator().manual_seed(seed + 1)
    wo, wl = torch.randn(o.shape, generator=g).to(DEVICE), torch.randn(lse.shape, generator=g).to(DEVICE)
    loss = (o * wo).sum() + (torch.where(torch.isinf(lse), 0.0, lse) * wl).sum()
    return o, lse, attn_q, torch.autograd.grad(loss, (q_nope, q_rot, kv_b, latent))


@needs_triton
@pytest.mark.parametrize("deterministic", [False, True])
def test_triton_path_matches_the_composition(deterministic, monkeypatch):
    monkeypatch.setattr(host, "DEFAULT_CONFIG", SparseAttentionConfig(fwd={"BLOCK_N": 16}, bwd={"BLOCK_N": 16}))
    ref = run(lambda *a: mla_sparse_attention_reference(*a, value_dim=C, scale=0.3))
    got = run(mla_sparse_attention, value_dim=C, scale=0.3, backend="triton", deterministic=deterministic)
    torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], ref[1], atol=1e-5, rtol=1e-5)
    assert torch.equal(got[2], ref[2].detach()) and not got[2].requires_grad
    for name, a, b in zip(("q_nope", "q_rot", "kv_b", "latent"), got[3], ref[3]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m, name=name: f"d{name}: {m}")


def test_torch_path_is_the_composition_and_returns_attn_q_without_grad():
    ref = run(lambda *a: mla_sparse_attention_reference(*a, value_dim=C, scale=0.3))
    got = run(mla_sparse_attention, value_dim=C, scale=0.3, backend="torch")
    for a, b in zip(got[:2], ref[:2]):
        assert torch.equal(a, b)
    assert not got[2].requires_grad
    for a, b in zip(got[3], ref[3]):
        assert torch.equal(a, b)


def test_gradcheck_of_the_reference_in_float64():
    q_nope, q_rot, kv_b, w_uk, latent, kv, idx = make()
    to64 = [t.detach().double().requires_grad_() for t in (q_nope, q_rot, latent)]

    def f(qn, qr, lat):
        o, lse, _ = mla_sparse_attention(qn, qr, w_uk.detach().double(), lat[:, :, None], idx, value_dim=C, scale=0.3,
                                         backend="torch")
        return o, torch.where(torch.isinf(lse), 0.0, lse)

    assert torch.autograd.gradcheck(f, to64)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(w_uk=torch.zeros(H, N + 1, C)), "w_uk"),
        (dict(kv=torch.zeros(B, T, 2, C + R)), "kv"),
        (dict(q_rot=torch.zeros(B, S + 1, H, R)), "q_rot"),
        (dict(value_dim=C + R + 1), "value_dim"),
    ],
)
def test_bad_input_names_the_argument(change, match):
    q_nope, q_rot, _, w_uk, _, kv, idx = make()
    args = dict(q_nope=q_nope, q_rot=q_rot, w_uk=w_uk, kv=kv, indices=idx, value_dim=C, scale=0.3)
    args.update({k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in change.items()})
    with pytest.raises(ValueError, match=match):
        mla_sparse_attention(**args)


def _head_probs_reference(q_nope, q_rot, w_uk, kv, idx, scale):
    """sum_h exp(scale q_h . k_j - lse_h) on each index slot (0 where idx = -1), from the composition."""
    o, lse, attn_q = mla_sparse_attention_reference(q_nope, q_rot, w_uk, kv, idx, value_dim=C, scale=scale)
    safe = idx.clamp_min(0).long()
    keys = kv[:, :, 0][torch.arange(B, device=idx.device)[:, None, None], safe]  # [B, S, K, C + R]
    logits = torch.einsum("bshd,bskd->bshk", attn_q, keys) * scale
    p = torch.exp(logits - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return (p * (idx >= 0)[:, :, None]).sum(2).detach()


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_head_probs_receive_the_head_summed_probabilities(backend, monkeypatch):
    """The indexer KL's target: filled in the forward on the torch path, in the backward on the Triton
    path (there by ``attention_prob_sum`` where the fused Gluon kernel does not run, as on a CPU)."""
    from hyscale_hf.kernels.sparse_attn import HeadProbs

    monkeypatch.setattr(host, "DEFAULT_CONFIG", SparseAttentionConfig(fwd={"BLOCK_N": 16}, bwd={"BLOCK_N": 16}))
    q_nope, q_rot, kv_b, w_uk, latent, kv, idx = make()
    want = _head_probs_reference(q_nope, q_rot, w_uk, kv, idx, 0.3)
    slot = HeadProbs()
    o, lse, _ = mla_sparse_attention(q_nope, q_rot, w_uk, kv, idx, value_dim=C, scale=0.3, backend=backend,
                                     head_probs=slot)
    assert (slot.value is None) == (backend == "triton")
    o.sum().backward()
    torch.testing.assert_close(slot.take(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(want[1, 2], torch.zeros(K, device=want.device))  # the query without a key


def test_head_probs_must_be_a_head_probs():
    q_nope, q_rot, kv_b, w_uk, latent, kv, idx = make()
    with pytest.raises(TypeError, match="head_probs"):
        mla_sparse_attention(q_nope, q_rot, w_uk, kv, idx, value_dim=C, scale=0.3, head_probs=[])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_absorbed_query_without_autograd_is_the_einsum_and_cat_bit_for_bit(dtype):
    """The build for the op's forward and backward (no autograd: the product written into the query's
    columns) against the autograd one (einsum + cat), on strided views as the model passes them."""
    from hyscale_hf.kernels.sparse_attn.mla_query import absorbed_query

    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, S, H, N + R, generator=g).to(DEVICE, dtype)
    q_nope, q_rot = q[..., :N], q[..., N:]  # split views of one projection
    w_uk = torch.randn(H, N + 12, C, generator=g).to(DEVICE, dtype)[:, :N]
    with torch.no_grad():
        fast = absorbed_query(q_nope, q_rot, w_uk)
    slow = absorbed_query(q_nope.requires_grad_(), q_rot, w_uk)
    assert slow.requires_grad and fast.is_contiguous() and fast.shape == (B, S, H, C + R)
    assert torch.equal(fast, slow.detach())
