"""GPU: sparse attention (bf16; Triton, and on sm_90 the Gluon MLA forward) against the fp32
reference at T = 4K and 16K, MLA and GQA shapes.

Selections mimic a DSA indexer: 4 sink tokens, a 1024-token local window and random far tokens,
K = 2048; queries t < K see all keys 0..t and pad with -1; one query selects nothing.
The fp32 reference runs a query chunk at a time (its gathers are [chunk, K, Hkv, D]) and
accumulates the key gradients across chunks through autograd.
"""

import pytest
import torch

from hyscale_hf import sparse_attention
from hyscale_hf.kernels.sparse_attn import SparseAttentionConfig, host
from hyscale_hf.kernels.sparse_attn.naive import sparse_attention_reference

pytestmark = pytest.mark.gpu

K_SEL = 2048


def selection(T, K=K_SEL, sinks=4, window=1024, seed=0):
    """Distinct keys per query: sinks, one random far key in each of K - sinks - window strata, window."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    t = torch.arange(T, device="cuda")[:, None]
    j = torch.arange(K, device="cuda")
    far_n = K - sinks - window
    i = torch.arange(far_n, device="cuda")
    span = (t - window + 1 - sinks).clamp_min(far_n)
    lo, hi = sinks + i * span // far_n, sinks + (i + 1) * span // far_n
    far = lo + (torch.rand(T, far_n, generator=gen, device="cuda") * (hi - lo)).long()
    sel = torch.cat([j[:sinks].expand(T, sinks), far, t - window + 1 + j[:window]], dim=1)
    idx = torch.where(t < K, torch.where(j <= t, j, -1), sel).to(torch.int32)
    idx[5] = -1  # a query with no key: o = 0, lse = -inf, no gradient
    return idx[None].contiguous()


def make_inputs(T, Hq, Hkv, Dqk, Dv, mla, seed=0):
    torch.manual_seed(seed)
    dt = torch.bfloat16
    q = torch.randn(1, T, Hq, Dqk, device="cuda", dtype=dt, requires_grad=True)
    k = torch.randn(1, T, Hkv, Dqk, device="cuda", dtype=dt, requires_grad=True)
    v = k[..., :Dv] if mla else torch.randn(1, T, Hkv, Dv, device="cuda", dtype=dt, requires_grad=True)
    do = torch.randn(1, T, Hq, Dv, device="cuda", dtype=dt)
    dlse = torch.randn(1, T, Hq, device="cuda")
    return q, k, v, do, dlse


def loss_of(o, lse, do, dlse):
    return (o.float() * do.float()).sum() + (torch.where(torch.isinf(lse), 0.0, lse) * dlse).sum()


def reference_fp32(q, k, v, idx, do, dlse, mla, chunk):
    scale = q.shape[-1] ** -0.5
    k32 = k.detach().float().requires_grad_()
    v32 = k32[..., : v.shape[-1]] if mla else v.detach().float().requires_grad_()
    outs, lses, dqs = [], [], []
    for c0 in range(0, q.shape[1], chunk):
        qc = q.detach()[:, c0 : c0 + chunk].float().requires_grad_()
        oc, lc = sparse_attention_reference(qc, k32, v32, idx[:, c0 : c0 + chunk], scale)
        loss_of(oc, lc, do[:, c0 : c0 + chunk], dlse[:, c0 : c0 + chunk]).backward()
        outs.append(oc.detach())
        lses.append(lc.detach())
        dqs.append(qc.grad)
    grads = [torch.cat(dqs, 1), k32.grad] + ([] if mla else [v32.grad])
    return torch.cat(outs, 1), torch.cat(lses, 1), grads


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def run_triton(q, k, v, idx, do, dlse, mla, deterministic=False):
    o, lse = sparse_attention(q, k, v, idx, return_lse=True, backend="triton", deterministic=deterministic)
    leaves = [q, k] + ([] if mla else [v])
    grads = torch.autograd.grad(loss_of(o, lse, do, dlse), leaves)
    return o, lse, grads


def check_against_reference(T, Hq, Hkv, Dqk, Dv, mla, chunk, deterministic=False):
    q, k, v, do, dlse = make_inputs(T, Hq, Hkv, Dqk, Dv, mla)
    idx = selection(T)
    o, lse, grads = run_triton(q, k, v, idx, do, dlse, mla, deterministic)
    o_ref, lse_ref, grads_ref = reference_fp32(q, k, v, idx, do, dlse, mla, chunk)
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
    finite = torch.isfinite(lse_ref)
    assert (lse[finite] - lse_ref[finite]).abs().max().item() < 2e-2
    assert rel_err(o, o_ref) < 1e-2
    assert o[0, 5].abs().max().item() == 0
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        err = rel_err(g, g_ref)
        assert err < 2e-2, f"{name}: relative error {err:.2e}"
    assert grads[0][0, 5].abs().max().item() == 0
    return o, lse, grads


MLA_CASES = [(4096, 16), (4096, 64), (4096, 128), (16384, 64)]
GQA_CASES = [(4096, 32, 8, 128), (4096, 8, 8, 64), (4096, 16, 2, 128), (4096, 8, 4, 64), (16384, 32, 8, 128)]


@pytest.mark.parametrize("T,H", MLA_CASES)
def test_mla_absorbed_matches_fp32_reference(T, H):
    check_against_reference(T, H, 1, 576, 512, mla=True, chunk=256 if H <= 64 else 128)


@pytest.mark.parametrize("T,Hq,Hkv,D", GQA_CASES)
def test_gqa_matches_fp32_reference(T, Hq, Hkv, D):
    check_against_reference(T, Hq, Hkv, D, D, mla=False, chunk=128)


def test_gqa_per_token_path_matches_fp32_reference(monkeypatch):
    # GQA normally runs query tiles (union key lists); tile rows = 0 forces one program per token.
    monkeypatch.setattr(host, "DEFAULT_CONFIG", SparseAttentionConfig(tile_rows=0))
    check_against_reference(4096, 32, 8, 128, 128, mla=False, chunk=128)


@pytest.mark.parametrize("own_kernel", [True, False], ids=["tile_head_probs", "fused_atomics"])
@pytest.mark.parametrize("tile_rows", [128, 0], ids=["tiles", "per_token"])
@pytest.mark.parametrize("Hq,Hkv,D", [(9, 3, 64), (32, 8, 128)], ids=["smollm2", "gqa32x8"])
def test_gqa_backward_fills_the_head_sums(monkeypatch, tile_rows, Hq, Hkv, D, own_kernel):
    """The head sums of the GQA backward (``HeadProbs``: ``tile_head_probs`` on tiles of narrow
    models, else inside the backward kernel) against the pass of their own (``attention_prob_sum``) on
    the same lse; the fallback pass must not run."""
    from hyscale_hf.kernels.indexer_kl import attention_prob_sum
    from hyscale_hf.kernels.sparse_attn import HeadProbs, op

    config = SparseAttentionConfig(tile_rows=tile_rows, tiled_head_probs=own_kernel)
    monkeypatch.setattr(host, "DEFAULT_CONFIG", config)
    monkeypatch.setattr(op, "prob_sum_pass", None)  # calling it would fail
    launched = []
    real = host.tile_head_probs
    monkeypatch.setattr(host, "tile_head_probs", lambda *a, **kw: launched.append(1) or real(*a, **kw))
    T = 4096
    q, k, v, do, dlse = make_inputs(T, Hq, Hkv, D, D, mla=False)
    idx = selection(T)
    slot = HeadProbs()
    o, lse = sparse_attention(q, k, v, idx, return_lse=True, backend="triton", head_probs=slot, deterministic=False)
    loss_of(o, lse, do, dlse).backward()
    got = slot.take()
    want = attention_prob_sum(q.detach(), k.detach(), idx, lse.detach(), D**-0.5, backend="triton")
    assert rel_err(got, want) < 1e-3
    assert got[0, 5].abs().max().item() == 0 and bool((got[idx < 0] == 0).all())
    sums = got.sum(-1)[0]  # each query's heads each sum to 1 over its keys
    assert (sums[idx[0].ge(0).any(-1)] - Hq).abs().max().item() < 1e-2 * Hq
    assert bool(launched) == (own_kernel and tile_rows > 0 and Hq * D <= host.TILE_PROBS_MAX_WIDTH)


@pytest.mark.parametrize("mla", [True, False], ids=["mla", "gqa"])
def test_deterministic_backward_is_bitwise_reproducible(mla):
    shape = (4096, 64, 1, 576, 512) if mla else (4096, 32, 8, 128, 128)
    q, k, v, do, dlse = make_inputs(*shape, mla=mla)
    idx = selection(shape[0])
    _, _, g1 = run_triton(q, k, v, idx, do, dlse, mla, deterministic=True)
    _, _, g2 = run_triton(q, k, v, idx, do, dlse, mla, deterministic=True)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)
    check_against_reference(*shape, mla=mla, chunk=128, deterministic=True)


def _on_sm90(module) -> bool:
    return module is not None and torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_gluon_forward = pytest.mark.skipif(
    not _on_sm90(host.mla_forward_gluon), reason="the Gluon MLA forward is sm_90 only"
)
needs_gluon_backward = pytest.mark.skipif(
    not _on_sm90(host.mla_backward_gluon), reason="the Gluon MLA backward is sm_90 only"
)


def _gluon_forward_calls(monkeypatch):
    """Counts launches of the Hopper MLA forward (``mla_forward_gluon``)."""
    calls = []
    real = host.mla_forward_gluon.mla_forward
    monkeypatch.setattr(host.mla_forward_gluon, "mla_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _gluon_backward_calls(monkeypatch):
    """Counts launches of the Hopper MLA dS + dK/dV kernel (``mla_backward_gluon``), and whether each
    stored to scratch."""
    calls = []
    real = host.mla_backward_gluon.mla_backward_dkv
    monkeypatch.setattr(host.mla_backward_gluon, "mla_backward_dkv",
                        lambda *a, **k: calls.append(k.get("scratch", False)) or real(*a, **k))
    return calls


@needs_gluon_forward
@pytest.mark.parametrize(
    "T,H,dtype", [(4096, 64, torch.bfloat16), (4096, 128, torch.float16), (300, 64, torch.bfloat16)]
)
def test_mla_gluon_forward_matches_triton_forward(monkeypatch, T, H, dtype):
    # Same blocks of 64 keys in the same order, the same fp32 softmax and 16-bit P: the two
    # forwards agree to rounding (bitwise equal on an H200 when this test was added). T = 300 < K:
    # every row is shorter than K, its last block partly -1; query 5 selects nothing.
    q, k, v, _, _ = make_inputs(T, H, 1, 576, 512, mla=True)
    q, k = q.detach().to(dtype), k.detach().to(dtype)
    v = k[..., :512]
    idx = selection(T)
    calls = _gluon_forward_calls(monkeypatch)
    o, lse = sparse_attention(q, k, v, idx, return_lse=True, backend="triton")
    assert len(calls) == 1
    monkeypatch.setattr(host, "DEFAULT_CONFIG", SparseAttentionConfig(mla_gluon=False))
    o_t, lse_t = sparse_attention(q, k, v, idx, return_lse=True, backend="triton")
    assert len(calls) == 1
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_t))
    finite = torch.isfinite(lse_t)
    assert (lse[finite] - lse_t[finite]).abs().max().item() < 1e-4
    assert rel_err(o, o_t) < 1e-3
    assert o[0, 5].abs().max().item() == 0


@needs_gluon_backward
@pytest.mark.parametrize(
    "T,H,dtype,K",
    [(4096, 64, torch.bfloat16, K_SEL), (4096, 128, torch.float16, K_SEL), (300, 64, torch.bfloat16, K_SEL),
     (12288, 64, torch.bfloat16, K_SEL), (4096, 64, torch.bfloat16, K_SEL - 4)],
)
@pytest.mark.parametrize("pass_bytes", [None, 1 << 20], ids=["one_pass", "key_passes"])
def test_mla_gluon_backward_matches_triton_backward(monkeypatch, T, H, dtype, K, pass_bytes):
    # The same P and dS from the same lse (up to the order of fp32 sums) and the same contributions;
    # fp32 atomics add them in a different order. T = 300 < K: rows shorter than K, query 5 selects
    # nothing (its dq is exactly 0). The dS buffer feeds the same Triton dQ kernel. With 1 MiB key
    # passes the accumulator is added to in 9 (T = 4096), 27 (T = 12288: 3 query chunks) or 1 (T = 300)
    # key ranges. K - 4 slots: rows not a multiple of the 8 slots the kernel's TMA dS stores align to.
    if pass_bytes is not None:
        monkeypatch.setattr(host, "DEFAULT_CONFIG", SparseAttentionConfig(mla_bwd_pass_bytes=pass_bytes))
    q, k, _, do, dlse = make_inputs(T, H, 1, 576, 512, mla=True)
    q, k = q.detach().to(dtype).requires_grad_(), k.detach().to(dtype).requires_grad_()
    do = do.to(dtype)
    idx = selection(T, K)
    calls = _gluon_backward_calls(monkeypatch)
    _, _, grads = run_triton(q, k, k[..., :512], idx, do, dlse, mla=True)
    launches = len(calls)  # one per chunk of queries whose dS fits the buffer, and per key pass
    passes = host.key_pass_count(torch.empty(1, T, 1, 576), host.DEFAULT_CONFIG)
    assert launches >= passes and launches % passes == 0
    assert (passes > 1) == (pass_bytes is not None and T >= 4096)
    monkeypatch.setattr(host, "DEFAULT_CONFIG", SparseAttentionConfig(mla_gluon_bwd=False))
    _, _, grads_t = run_triton(q, k, k[..., :512], idx, do, dlse, mla=True)
    assert len(calls) == launches
    for name, g, g_t in zip(("dq", "dk"), grads, grads_t):
        err = rel_err(g, g_t)
        assert err < 5e-3, f"{name}: relative error {err:.2e}"
    assert grads[0][0, 5].abs().max().item() == 0


@needs_gluon_backward
@pytest.mark.parametrize("H", [64, 128])
def test_mla_gluon_deterministic_backward_is_reproducible_and_matches_the_atomic_one(monkeypatch, H):
    # The Gluon kernel stores each pair's contribution to scratch and the host sums each key's rows
    # in a fixed order: two runs are bitwise equal and agree with the atomic backward to fp32
    # rounding. Scratch for 600 queries a chunk: 7 chunks of T = 4096, the last one shorter.
    T = 4096
    monkeypatch.setattr(host, "DEFAULT_CONFIG", SparseAttentionConfig(det_scratch_bytes=600 * K_SEL * (H // 64) * 576 * 4))
    q, k, _, do, dlse = make_inputs(T, H, 1, 576, 512, mla=True)
    idx = selection(T)
    calls = _gluon_backward_calls(monkeypatch)
    _, _, g1 = run_triton(q, k, k[..., :512], idx, do, dlse, mla=True, deterministic=True)
    assert calls == [True] * 7
    _, _, g2 = run_triton(q, k, k[..., :512], idx, do, dlse, mla=True, deterministic=True)
    _, _, g_atomic = run_triton(q, k, k[..., :512], idx, do, dlse, mla=True)
    assert calls[-1] is False
    for name, a, b, c in zip(("dq", "dk"), g1, g2, g_atomic):
        assert torch.equal(a, b), f"{name} differs between two deterministic runs"
        err = rel_err(a, c)
        assert err < 5e-3, f"{name}: relative error {err:.2e} against the atomic backward"
    assert g1[0][0, 5].abs().max().item() == 0


@needs_gluon_backward
def test_mla_backward_with_v_a_detached_prefix_of_k_gives_k_only_its_own_gradient(monkeypatch):
    # v = k[..., :512].detach() shares k's storage but takes no gradient: P^T dO must not reach dk.
    # The Gluon kernel merges them into k's first 512 columns, so it must not run here.
    T, H = 4096, 64
    q, k, _, do, dlse = make_inputs(T, H, 1, 576, 512, mla=True)
    idx = selection(T)
    calls = _gluon_backward_calls(monkeypatch)
    o, lse = sparse_attention(q, k, k[..., :512].detach(), idx, return_lse=True, backend="triton")
    dq, dk = torch.autograd.grad(loss_of(o, lse, do, dlse), [q, k])
    assert not calls
    k32 = k.detach().float().requires_grad_()
    q32 = q.detach().float().requires_grad_()
    for c0 in range(0, T, 256):
        rows = slice(c0, c0 + 256)
        oc, lc = sparse_attention_reference(q32[:, rows], k32, k32.detach()[..., :512], idx[:, rows], 576**-0.5)
        loss_of(oc, lc, do[:, rows], dlse[:, rows]).backward()
    assert rel_err(dk, k32.grad) < 2e-2 and rel_err(dq, q32.grad) < 2e-2


@needs_gluon_backward
def test_mla_gluon_backward_takes_the_models_permuted_output_gradient(monkeypatch):
    # In the patched model dO reaches the attention as a view of [H, S, D] storage whose size-1
    # batch dim has stride 1; the Gluon dK/dV kernel must still take it, and agree with the Triton
    # backward fed the same gradient in contiguous form.
    T, H = 4096, 64
    q, k, _, do, _ = make_inputs(T, H, 1, 576, 512, mla=True)
    base = do[0].transpose(0, 1).contiguous()
    do_perm = base.as_strided((1, T, H, 512), (1, 512, T * 512, 1))
    assert do_perm.stride(0) == 1 and torch.equal(do_perm, do)
    idx = selection(T)
    calls = _gluon_backward_calls(monkeypatch)
    o = sparse_attention(q, k, k[..., :512], idx, backend="triton")
    grads = torch.autograd.grad(o, [q, k], grad_outputs=do_perm)
    assert calls, "the Gluon dK/dV kernel did not take the permuted output gradient"
    monkeypatch.setattr(host, "DEFAULT_CONFIG", SparseAttentionConfig(mla_gluon_bwd=False))
    o_t = sparse_attention(q, k, k[..., :512], idx, backend="triton")
    grads_t = torch.autograd.grad(o_t, [q, k], grad_outputs=do.contiguous())
    for name, g, g_t in zip(("dq", "dk"), grads, grads_t):
        err = rel_err(g, g_t)
        assert err < 5e-3, f"{name}: relative error {err:.2e}"
