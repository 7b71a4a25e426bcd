"""``sparse_attention(..., head_probs=HeadProbs())`` (GQA/MHA): the indexer KL's target from the attention.

The oracle is ``indexer_kl.naive.attention_prob_sum_reference`` on the reference attention's lse. Under
the CPU interpreter (tests/conftest.py) the Triton cases run the kernels themselves; BLOCK_N 16/32 makes
every row span several key blocks, so the tiles' running rank crosses blocks.
"""

import dataclasses

import pytest
import torch

from hyscale_hf import sparse_attention
from hyscale_hf.kernels.checks import check_sorted_rows
from hyscale_hf.kernels.indexer_kl.naive import attention_prob_sum_reference
from hyscale_hf.kernels.sparse_attn import HeadProbs, SparseAttentionConfig, host, op
from hyscale_hf.kernels.sparse_attn.naive import sparse_attention_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not host.HAS_TRITON, reason="needs triton")


def make(B=2, S=29, T=40, Hq=6, Hkv=2, D=32, Dv=16, K=12, seed=0):
    """q, k, v and rows of K distinct keys sorted ascending with -1 after them (hytopk's form)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, Hq, D, generator=g).to(DEVICE).requires_grad_()
    k = torch.randn(B, T, Hkv, D, generator=g).to(DEVICE).requires_grad_()
    v = torch.randn(B, T, Hkv, Dv, generator=g).to(DEVICE).requires_grad_()
    rows = []
    for _ in range(B * S):
        keys = torch.randperm(T, generator=g)[: int(torch.randint(1, K + 1, (), generator=g))]
        rows.append(torch.cat([keys.sort().values, torch.full((K - keys.numel(),), -1)]))
    idx = torch.stack(rows).view(B, S, K).to(torch.int32)
    idx[-1, 2] = -1  # a query with no key
    return q, k, v, idx.to(DEVICE)


def expected(q, k, v, idx, scale):
    _, lse = sparse_attention_reference(q.detach(), k.detach(), v.detach(), idx, scale)
    return attention_prob_sum_reference(q.detach(), k.detach(), idx, lse, scale)


def run(q, k, v, idx, backend, **kwargs):
    slot = HeadProbs()
    o, lse = sparse_attention(q, k, v, idx, scale=0.3, return_lse=True, backend=backend, head_probs=slot, **kwargs)
    filled_in_forward = slot.value is not None
    (o.float().square().sum() + torch.where(torch.isinf(lse), 0.0, lse).sum()).backward()
    return slot.take(), filled_in_forward


CASES = {  # config, (Hq, Hkv): whether the target comes on query tiles or per-token rows
    "tiles-G3": (SparseAttentionConfig(bwd_tiled={"BLOCK_N": 32}, fwd_tiled={"BLOCK_N": 32}, probs_tiled={"BLOCK_N": 32},
                                       tile_rows=16), (6, 2)),
    "tiles-G4": (SparseAttentionConfig(bwd_tiled={"BLOCK_N": 32}, fwd_tiled={"BLOCK_N": 32}, probs_tiled={"BLOCK_N": 32},
                                       tile_rows=64), (8, 2)),
    "per-token": (SparseAttentionConfig(fwd={"BLOCK_N": 16}, bwd={"BLOCK_N": 16}, tile_rows=0), (6, 2)),
}


def no_pass(*args):
    raise AssertionError("a kernel of the backward should have filled the head sums")


@needs_triton
@pytest.mark.parametrize("tiled_kernel", [True, False], ids=["own-kernel", "fused-atomics"])
@pytest.mark.parametrize("case", list(CASES))
def test_backward_fills_the_head_sums(case, tiled_kernel, monkeypatch):
    """The atomic backward fills the target without a pass of its own: on tiles by rank, from
    ``tile_head_probs`` (default) or inside the backward kernel (``tiled_head_probs=False``)."""
    config, (Hq, Hkv) = CASES[case]
    config = dataclasses.replace(config, tiled_head_probs=tiled_kernel)
    monkeypatch.setattr(host, "DEFAULT_CONFIG", config)
    monkeypatch.setattr(op, "prob_sum_pass", no_pass)
    launched = []
    real = host.tile_head_probs
    monkeypatch.setattr(host, "tile_head_probs", lambda *a, **kw: launched.append(1) or real(*a, **kw))
    q, k, v, idx = make(Hq=Hq, Hkv=Hkv)
    lists = host.key_lists(idx, k.shape[1], Hq // Hkv, wide=False, config=config)
    assert bool(lists.tile_q) == case.startswith("tiles")
    got, in_forward = run(q, k, v, idx, "triton", deterministic=False)
    assert not in_forward
    assert bool(launched) == (case.startswith("tiles") and tiled_kernel)
    want = expected(q, k, v, idx, 0.3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[-1, 2], torch.zeros_like(got[-1, 2]))  # the query without a key
    assert torch.equal(got[idx < 0], torch.zeros_like(got[idx < 0]))  # -1 slots stay 0


@needs_triton
def test_models_wider_than_the_kernel_keep_the_atomics(monkeypatch):
    """Past ``TILE_PROBS_MAX_WIDTH`` (heads x dims) the tiled backward adds the sums itself."""
    monkeypatch.setattr(host, "DEFAULT_CONFIG", CASES["tiles-G3"][0])
    monkeypatch.setattr(host, "TILE_PROBS_MAX_WIDTH", 6 * 32 - 1)  # make()'s 6 heads x 32 dims: one too many
    monkeypatch.setattr(op, "prob_sum_pass", no_pass)
    monkeypatch.setattr(host, "tile_head_probs", no_pass)
    q, k, v, idx = make()
    got, _ = run(q, k, v, idx, "triton", deterministic=False)
    torch.testing.assert_close(got, expected(q, k, v, idx, 0.3), atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("D", [80, 24], ids=["split-dims", "padded-dims"])
def test_tile_kernel_serves_the_deterministic_backward_bit_for_bit(D, monkeypatch):
    """``tile_head_probs`` uses no atomics: the deterministic backward takes it too, and two runs give
    the same bits. Dqk 80 = 64 + 16 exercises the kernel's second product (the key dims' tail); 24 is
    zero-padded to 32 by the op."""
    monkeypatch.setattr(host, "DEFAULT_CONFIG", CASES["tiles-G3"][0])
    monkeypatch.setattr(op, "prob_sum_pass", no_pass)
    q, k, v, idx = make(D=D)
    first, _ = run(q, k, v, idx, "triton", deterministic=True)
    second, _ = run(q, k, v, idx, "triton", deterministic=True)
    assert torch.equal(first, second)
    torch.testing.assert_close(first, expected(q, k, v, idx, 0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend,deterministic", [pytest.param("triton", True, marks=needs_triton),
                                                   ("torch", None)], ids=["deterministic", "torch"])
def test_other_paths_take_a_pass_of_their_own(backend, deterministic, monkeypatch):
    """The deterministic backward over per-token rows (its kernels add no sums) and the torch path (in
    forward) compute the target by ``prob_sum_pass``; padded head dims (D = 24 -> 32) do not change it."""
    monkeypatch.setattr(host, "DEFAULT_CONFIG", CASES["per-token"][0])
    q, k, v, idx = make(D=24)
    got, in_forward = run(q, k, v, idx, backend, deterministic=deterministic)
    assert in_forward == (backend == "torch")
    torch.testing.assert_close(got, expected(q, k, v, idx, 0.3), atol=1e-5, rtol=1e-5)


def test_rows_must_be_sorted_unless_the_range_check_is_skipped():
    q, k, v, idx = make()
    shuffled = idx.clone()
    shuffled[0, 5, :2] = idx[0, 5, :2].flip(0)  # two keys out of order
    gap = idx.clone()
    gap[0, 6, :3] = torch.tensor([-1, 3, 5], dtype=torch.int32)  # a -1 before keys
    for bad in (shuffled, gap):
        with pytest.raises(ValueError, match="indices: with head_probs"):
            sparse_attention(q, k, v, bad, head_probs=HeadProbs())
    sparse_attention(q, k, v, shuffled, head_probs=HeadProbs(), check_range=False)  # the caller's word
    sparse_attention(q, k, v, shuffled)  # without head_probs, any order
    check_sorted_rows(idx)


def test_head_probs_must_be_a_head_probs():
    q, k, v, idx = make()
    with pytest.raises(TypeError, match="head_probs must be a HeadProbs"):
        sparse_attention(q, k, v, idx, head_probs=object())
