"""GPU: mla_sparse_attention at GLM-5's shape (64 heads, nope 192 -> latent 512, rope 64), bf16,
against the plain Triton composition (einsum + cat + sparse_attention under autograd), which keeps
the absorbed query for backward. The same kernels run on the same absorbed query, so the outputs are
bit-identical and the gradients agree to bf16 rounding of the extra einsum backward; the wrapper
keeps less memory for backward."""

import pytest
import torch

from hyscale_hf import sparse_attention
from hyscale_hf.kernels import mla_sparse_attention

from .test_gpu import selection

pytestmark = pytest.mark.gpu
H, N, C, R, V = 64, 192, 512, 64, 256


def inputs(T, seed=0):
    torch.manual_seed(seed)
    kv_b = (torch.randn(H * (N + V), C, device="cuda") * C**-0.5).to(torch.bfloat16).requires_grad_()
    q_nope = torch.randn(1, T, H, N, device="cuda", dtype=torch.bfloat16).requires_grad_()
    q_rot = torch.randn(1, T, H, R, device="cuda", dtype=torch.bfloat16).requires_grad_()
    latent = torch.randn(1, T, C + R, device="cuda", dtype=torch.bfloat16).requires_grad_()
    return q_nope, q_rot, kv_b, latent, selection(T)


def plain(q_nope, q_rot, w_uk, kv, idx, scale):
    attn_q = torch.cat([torch.einsum("bshn,hnc->bshc", q_nope, w_uk), q_rot], dim=-1)
    o, lse = sparse_attention(attn_q, kv, kv[..., :C], idx, scale=scale, return_lse=True, backend="triton",
                              deterministic=True)
    return o, lse, attn_q


def lean(q_nope, q_rot, w_uk, kv, idx, scale):
    return mla_sparse_attention(q_nope, q_rot, w_uk, kv, idx, value_dim=C, scale=scale, backend="triton",
                                deterministic=True)


def run(fn, T):
    q_nope, q_rot, kv_b, latent, idx = inputs(T)
    w_uk = kv_b.view(H, N + V, C)[:, :N]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    o, lse, attn_q = fn(q_nope, q_rot, w_uk, latent[:, :, None] * 1, idx, (N + R) ** -0.5)
    attn_q_cpu = attn_q.detach().cpu()
    del attn_q  # the caller's reference: what stays allocated now is what autograd keeps
    held = torch.cuda.memory_allocated() - base - o.numel() * 2 - lse.numel() * 4
    g = torch.Generator(device="cuda").manual_seed(1)
    wo = torch.randn(o.shape, device="cuda", generator=g, dtype=o.dtype)
    loss = (o * wo).float().sum() + torch.where(torch.isinf(lse), 0, lse).sum()
    grads = torch.autograd.grad(loss, (q_nope, q_rot, kv_b, latent))
    return o, lse, attn_q_cpu, grads, held


@pytest.mark.parametrize("T", [4096])
def test_glm5_shape_matches_the_plain_composition_and_keeps_less(T):
    o1, lse1, q1, g1, held1 = run(plain, T)
    o2, lse2, q2, g2, held2 = run(lean, T)
    assert torch.equal(o2, o1) and torch.equal(lse2, lse1) and torch.equal(q2, q1)
    for name, a, b in zip(("q_nope", "q_rot", "kv_b", "latent"), g2, g1):
        err = (a.float() - b.float()).abs().max().item()
        scale = b.float().abs().max().item()
        assert err <= 2e-2 * scale, f"d{name}: max err {err} vs max {scale}"
    absorbed_query = T * H * (C + R) * 2
    assert held1 - held2 >= 0.9 * absorbed_query, (held1, held2)


@pytest.mark.parametrize("heads", [64, 128])
@pytest.mark.parametrize(
    "pass_bytes,deterministic", [(None, False), (1 << 20, False), (None, True)],
    ids=["one_pass", "key_passes", "deterministic"],
)
def test_head_probs_fused_in_the_gluon_backward_match_their_own_pass(heads, pass_bytes, deterministic, monkeypatch):
    """The indexer KL's target, summed over heads inside the Gluon dK/dV kernel (stored with one head
    block, added atomically with two), against ``attention_prob_sum``'s separate fp32 pass; with key
    passes (9 at 1 MiB) each pass writes its regrouped slots' sums back to their original slots. The
    deterministic backward (contributions to scratch) takes them too: two head blocks' sums added
    onto zero are the same in either order."""
    from hyscale_hf.kernels.indexer_kl import attention_prob_sum
    from hyscale_hf.kernels.sparse_attn import HeadProbs, host

    if host.mla_backward_gluon is None or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon MLA backward is sm_90 only")
    if pass_bytes is not None:
        monkeypatch.setattr(host, "DEFAULT_CONFIG", host.SparseAttentionConfig(mla_bwd_pass_bytes=pass_bytes))
    T = 4096
    torch.manual_seed(0)
    q_nope = torch.randn(1, T, heads, N, device="cuda", dtype=torch.bfloat16).requires_grad_()
    q_rot = torch.randn(1, T, heads, R, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w_uk = (torch.randn(heads, N, C, device="cuda") * C**-0.5).to(torch.bfloat16).requires_grad_()
    kv = torch.randn(1, T, 1, C + R, device="cuda", dtype=torch.bfloat16).requires_grad_()
    idx = selection(T)
    calls = []
    real = host.mla_backward_gluon.mla_backward_dkv
    monkeypatch.setattr(host.mla_backward_gluon, "mla_backward_dkv",
                        lambda *a, **k: calls.append(k.get("psum") is not None) or real(*a, **k))
    slot = HeadProbs()
    scale = (N + R) ** -0.5
    o, lse, attn_q = mla_sparse_attention(q_nope, q_rot, w_uk, kv, idx, value_dim=C, scale=scale, backend="triton",
                                          head_probs=slot, deterministic=deterministic)
    o.float().sum().backward()
    assert calls and all(calls), "the Gluon dK/dV kernel did not take the head sums"
    got = slot.take()
    want = attention_prob_sum(attn_q, kv.detach(), idx, lse.detach(), scale, backend="triton")
    assert torch.equal(got[0, 5], torch.zeros_like(got[0, 5]))  # the query without a key
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 4e-3, f"head sums: relative error {err:.2e}"  # the kernel sums P rounded to bf16 (2^-9)
    # each query's probabilities sum to 1 per head: the head sum over its slots is the head count
    rows = (idx[0] >= 0).any(-1)
    torch.testing.assert_close(got[0, rows].sum(-1), torch.full((int(rows.sum()),), float(heads), device="cuda"),
                               rtol=1e-3, atol=1e-3)
