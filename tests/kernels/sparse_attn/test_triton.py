"""Triton sparse attention kernels against the reference at tiny shapes, fp32.

Without CUDA these run under Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1),
so the kernel logic is tested in CI; with CUDA they run on the GPU. fp32 only: the interpreter's
bf16 ``tl.dot`` is not faithful (Triton 3.9), and bf16 accuracy is the GPU tests' job.
BLOCK_N is forced to 16 so that every case runs several key blocks per query.
"""

import collections
import dataclasses
import gc

import pytest
import torch
import torch.nn.functional as F

from hyscale_hf import sparse_attention
from hyscale_hf.kernels.sparse_attn import SparseAttentionConfig, host
from hyscale_hf.kernels.sparse_attn.naive import sparse_attention_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not host.HAS_TRITON, reason="needs triton")


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(host, "DEFAULT_CONFIG", SparseAttentionConfig(fwd={"BLOCK_N": 16}, bwd={"BLOCK_N": 16}))


def make(B, S, T, Hq, Hkv, Dqk, Dv, K, v_mode="separate", seed=0):
    """v_mode: "separate" tensor, "view" (v = k[..., :Dv], autograd view) or "alias" (same storage, detached)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, Hq, Dqk, generator=g).to(DEVICE).requires_grad_()
    k = torch.randn(B, T, Hkv, Dqk, generator=g).to(DEVICE).requires_grad_()
    if v_mode == "view":
        v = k[..., :Dv]
    elif v_mode == "alias":
        v = k.detach()[..., :Dv].requires_grad_()
    else:
        v = torch.randn(B, T, Hkv, Dv, generator=g).to(DEVICE).requires_grad_()
    idx = torch.randint(-1, T, (B, S, K), generator=g, dtype=torch.int32)
    idx[0, 1, 3] = idx[0, 1, 4]  # a repeated key counts twice, as in the reference
    idx[-1, 2] = -1  # a query with no key
    return q, k, v, idx.to(DEVICE)


def leaves(q, k, v):
    out = [q, k]
    if v.is_leaf:
        out.append(v)
    return out


def forward_backward(fn, q, k, v, idx, seed=1):
    o, lse = fn(q, k, v, idx)
    g = torch.Generator().manual_seed(seed)
    wo = torch.randn(o.shape, generator=g).to(DEVICE)
    wl = torch.randn(lse.shape, generator=g).to(DEVICE)
    loss = (o * wo).sum() + (torch.where(torch.isinf(lse), 0.0, lse) * wl).sum()
    return o, lse, torch.autograd.grad(loss, leaves(q, k, v))


def triton_fn(deterministic):
    return lambda q, k, v, idx: sparse_attention(
        q, k, v, idx, return_lse=True, backend="triton", deterministic=deterministic
    )


def reference_fn(q, k, v, idx):
    return sparse_attention_reference(q, k, v, idx, q.shape[-1] ** -0.5)


def assert_matches_reference(q, k, v, idx, deterministic):
    o, lse, grads = forward_backward(triton_fn(deterministic), q, k, v, idx)
    o_ref, lse_ref, grads_ref = forward_backward(reference_fn, q, k, v, idx)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, lse_ref, atol=1e-5, rtol=1e-5)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-5)
    return o, lse, grads


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_gqa_forward_and_grads(deterministic):
    q, k, v, idx = make(B=2, S=12, T=20, Hq=8, Hkv=2, Dqk=32, Dv=16, K=24)
    o, lse, grads = assert_matches_reference(q, k, v, idx, deterministic)
    assert o[-1, 2].abs().max() == 0 and torch.isinf(lse[-1, 2]).all() and grads[0][-1, 2].abs().max() == 0


def use_split_backward(monkeypatch):
    """Force the two-kernel backward (dS + dK/dV, then dQ by column slabs) used for wide rows (MLA)."""
    over = SparseAttentionConfig(fwd={"BLOCK_N": 16}, bwd={"BLOCK_N": 16, "split": True}, bwd_dq={"BLOCK_N": 16, "SLAB": 16})
    monkeypatch.setattr(host, "DEFAULT_CONFIG", over)


@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_mla_absorbed_v_view_of_k(deterministic, split, monkeypatch):
    # Dqk = 48 = 32 + 16 (the 576 = 512 + 64 split in miniature); v = k[..., :32] shares k's buffer.
    if split:
        use_split_backward(monkeypatch)
    q, k, v, idx = make(B=2, S=10, T=16, Hq=16, Hkv=1, Dqk=48, Dv=32, K=20, v_mode="view")
    assert host.v_grad_flows_into_k(k, v)
    assert_matches_reference(q, k, v, idx, deterministic)


def test_split_backward_with_separate_v_and_query_chunks(monkeypatch):
    use_split_backward(monkeypatch)
    monkeypatch.setattr(host, "DS_BYTES", 4 * 8 * 24 * 3)  # dS buffer of 3 queries: several chunks
    q, k, v, idx = make(B=1, S=8, T=20, Hq=8, Hkv=2, Dqk=32, Dv=16, K=24)
    assert_matches_reference(q, k, v, idx, deterministic=False)


def test_v_aliasing_k_without_autograd_link_gets_its_own_gradient():
    q, k, v, idx = make(B=1, S=8, T=16, Hq=16, Hkv=1, Dqk=48, Dv=32, K=16, v_mode="alias")
    assert host.v_is_k_prefix(k, v) and not host.v_grad_flows_into_k(k, v)
    assert_matches_reference(q, k, v, idx, deterministic=False)


def test_group_not_a_power_of_two_and_fewer_queries_than_keys():
    # G = 3 heads per KV head (padded to 16 rows); S < T: the queries are the last positions.
    q, k, v, idx = make(B=1, S=6, T=24, Hq=6, Hkv=2, Dqk=16, Dv=32, K=18)
    assert_matches_reference(q, k, v, idx, deterministic=False)


def test_deterministic_is_bitwise_reproducible_across_scratch_chunks(monkeypatch):
    # 3 queries per chunk
    monkeypatch.setattr(host, "DEFAULT_CONFIG", host.SparseAttentionConfig(det_scratch_bytes=4 * 20 * 48 * 3))
    q, k, v, idx = make(B=1, S=10, T=16, Hq=16, Hkv=1, Dqk=48, Dv=32, K=20, v_mode="view")
    _, _, g1 = assert_matches_reference(q, k, v, idx, deterministic=True)
    _, _, g2 = forward_backward(triton_fn(True), q, k, v, idx)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


def test_all_keys_selected_equals_dense_causal_attention():
    B, T, Hq, Hkv, D = 1, 20, 4, 2, 32
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, T, h, D, generator=g).to(DEVICE) for h in (Hq, Hkv, Hkv))
    t = torch.arange(T)[:, None]
    j = torch.arange(T + 4)  # K = T + 4 >= T
    idx = torch.where(j <= t, j, -1).to(torch.int32)[None].to(DEVICE)
    o = sparse_attention(q, k, v, idx, backend="triton")
    rep = Hq // Hkv
    dense = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.repeat_interleave(rep, 2).transpose(1, 2),
        v.repeat_interleave(rep, 2).transpose(1, 2),
        is_causal=True,
    ).transpose(1, 2)
    torch.testing.assert_close(o, dense, atol=1e-5, rtol=1e-5)


def causal_padded_indices(B, S, T, K, seed=0):
    """Causal rows laid out as HyTopK returns them: query i (key position T - S + i) lists up to K
    of its visible keys, then -1 padding; so rows of the first queries end in a long -1 tail."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.full((B, S, K), -1, dtype=torch.int32)
    for b in range(B):
        for i in range(S):
            visible = T - S + i + 1
            keys = torch.randperm(visible, generator=g)[:K].sort().values
            idx[b, i, : keys.numel()] = keys.to(torch.int32)
    return idx


@pytest.mark.parametrize("grain", [1, 16])
def test_row_extent_is_one_past_the_last_listed_key(grain, monkeypatch):
    monkeypatch.setattr(host, "EXTENT_GRAIN", grain)
    idx = causal_padded_indices(2, 9, 12, 40)
    idx[0, 3, 5] = -1  # a hole before the last key does not shorten the row
    idx[1, 4] = -1  # no key at all
    idx[1, 5, -1] = 7  # a key in the last slot
    extent = host.token_lists(idx.to(DEVICE)).num.cpu()
    valid = idx >= 0
    last = torch.where(valid.any(-1), idx.shape[-1] - valid.flip(-1).int().argmax(-1), 0)
    expected = ((last + grain - 1) // grain * grain).clamp(max=40)
    assert torch.equal(extent, expected.to(torch.int32))
    assert extent[1, 4] == 0 and extent[1, 5] == 40
    assert extent[0, 3] == (7 if grain == 1 else 16)


@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_per_token_rows_with_padded_tails(deterministic, split, monkeypatch):
    # K = 40 slots (3 key blocks of 16) but the first queries see only a few keys: their programs
    # stop at the row's extent, and every gradient still matches the reference.
    if split:
        use_split_backward(monkeypatch)
    monkeypatch.setattr(host, "DEFAULT_CONFIG", dataclasses.replace(host.DEFAULT_CONFIG, tile_rows=0))  # per token
    monkeypatch.setattr(host, "EXTENT_GRAIN", 16)  # = BLOCK_N here: rows stop after 1, 2 or 3 blocks
    q, k, v, _ = make(B=2, S=36, T=36, Hq=16, Hkv=1, Dqk=48, Dv=32, K=40, v_mode="view")
    idx = causal_padded_indices(2, 36, 36, 40).to(DEVICE)
    idx[0, 5, 1] = -1  # a hole inside a row
    lists = host.key_lists(idx, 36, 16, wide=False)
    assert lists.tile_q == 0 and lists.num.min() == 16 and lists.num.max() == 40
    assert_matches_reference(q, k, v, idx, deterministic)


def test_triton_backend_rejects_fp64_and_mixed_dtypes():
    # head dims never are a reason any more (odd ones are zero-padded: test_edge_cases.py); dtypes are
    q, k, v, idx = make(B=1, S=4, T=8, Hq=2, Hkv=1, Dqk=40, Dv=16, K=8)
    with pytest.raises(ValueError, match="float16/bfloat16/float32, got torch.float64"):
        sparse_attention(q.double(), k.double(), v.double(), idx, backend="triton")
    with pytest.raises(ValueError, match="must share one dtype"):
        sparse_attention(q, k.double(), v, idx, backend="triton")
    o = sparse_attention(q.double(), k.double(), v.double(), idx, backend="auto")  # auto: the reference
    torch.testing.assert_close(o, reference_fn(q.double(), k.double(), v.double(), idx)[0])


def distinct_indices(B, S, T, K, seed=0):
    """Rows of K distinct keys (a few replaced by -1), as HyTopK returns them (here unsorted)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(T, generator=g)[:K] for _ in range(B * S)]).view(B, S, K)
    idx = idx.masked_fill(torch.rand(B, S, K, generator=g) < 0.2, -1).to(torch.int32)
    idx[-1, 2] = -1  # a query with no key
    return idx.to(DEVICE)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("Hq,Hkv,rows", [(8, 2, 64), (6, 2, 64), (8, 2, 16)], ids=["G4", "G3", "G4-small-tiles"])
def test_query_tiles_share_the_union_of_their_keys(Hq, Hkv, rows, deterministic, monkeypatch):
    over = SparseAttentionConfig(fwd_tiled={"BLOCK_N": 32}, bwd_tiled={"BLOCK_N": 32}, tile_rows=rows)
    monkeypatch.setattr(host, "DEFAULT_CONFIG", over)
    q, k, v, _ = make(B=2, S=37, T=48, Hq=Hq, Hkv=Hkv, Dqk=32, Dv=16, K=20)
    idx = distinct_indices(2, 37, 48, 20)
    lists = host.key_lists(idx, 48, Hq // Hkv, wide=False)
    assert lists.tile_q == rows // (Hq // Hkv) and lists.idx.shape[1] == -(-37 // lists.tile_q)
    assert_matches_reference(q, k, v, idx, deterministic)


def test_query_tiles_are_built_once_for_the_same_indices_inside_reuse_blocks(monkeypatch):
    # An IndexShare group's layers (and a replaying recompute) pass the very same tensor: one build.
    builds = []
    original = host.union_tiles
    monkeypatch.setattr(host, "union_tiles", lambda *a, **kw: builds.append(1) or original(*a, **kw))
    monkeypatch.setattr(host._TileReuse, "builds", collections.OrderedDict())
    idx = distinct_indices(1, 8, 32, 10)
    assert host.key_lists(idx, 32, 4, wide=False) is not host.key_lists(idx, 32, 4, wide=False)  # outside: builds
    assert len(builds) == 2
    with host.reuse_query_tiles():
        first = host.key_lists(idx, 32, 4, wide=False)
    with host.reuse_query_tiles():
        assert host.key_lists(idx.detach(), 32, 4, wide=False) is first  # an alias: same storage and version
        assert len(builds) == 3
        assert host.key_lists(idx.clone(), 32, 4, wide=False) is not first  # equal values, other storage
        assert host.key_lists(idx, 32, 8, wide=False).tile_q == 16  # another tile size
        assert host.key_lists(idx, 32, 4, wide=False) is first  # still kept beside the two newer builds
        idx[0, 0, 0] = idx[0, 0, 0]  # written in place: a new version
        host.key_lists(idx, 32, 4, wide=False)
    assert len(builds) == 6


def test_kept_query_tiles_follow_their_indices_and_the_byte_budget(monkeypatch):
    """Builds of several selections stay for later calls (a recompute after the other groups' forwards),
    the least recently used go past ``KEEP_TILES_BYTES``, and a freed selection's build goes with it (a
    new tensor of equal values builds its own)."""
    builds = []
    original = host.union_tiles
    monkeypatch.setattr(host, "union_tiles", lambda *a, **kw: builds.append(1) or original(*a, **kw))
    monkeypatch.setattr(host._TileReuse, "builds", collections.OrderedDict())
    groups = [distinct_indices(1, 8, 32, 10, seed=s) for s in range(3)]
    with host.reuse_query_tiles():
        forward = [host.key_lists(g, 32, 4, wide=False) for g in groups]
        assert [host.key_lists(g, 32, 4, wide=False) for g in reversed(groups)] == forward[::-1]  # the recomputes
        assert len(builds) == 3
        one = host._lists_bytes(forward[0])
        monkeypatch.setattr(host, "KEEP_TILES_BYTES", 2 * one)  # room for two builds
        host.key_lists(distinct_indices(1, 8, 32, 10, seed=9), 32, 4, wide=False)
        assert len(host._TileReuse.builds) == 2  # the two least recently used went (groups 2 and 1)
        assert host.key_lists(groups[0], 32, 4, wide=False) is forward[0] and len(builds) == 4
        assert host.key_lists(groups[2], 32, 4, wide=False) is not forward[2] and len(builds) == 5
        monkeypatch.setattr(host, "KEEP_TILES_BYTES", 1 << 30)
        del groups[2], forward
        gc.collect()
        host.key_lists(distinct_indices(1, 8, 32, 10, seed=1), 32, 4, wide=False)  # equal values, new tensor
        assert len(builds) == 6
        assert all(ref() is not None for ref, _, _ in host._TileReuse.builds.values())  # the freed one dropped


def test_query_tiles_fall_back_to_per_token_lists_on_a_repeated_key():
    idx = distinct_indices(1, 8, 32, 10)
    assert host.key_lists(idx, 32, 4, wide=False).tile_q == 32
    idx[0, 3, 1] = idx[0, 3, 0] = 7
    assert host.key_lists(idx, 32, 4, wide=False).tile_q == 0


def test_wide_unions_run_the_per_token_forward_and_the_tiled_backward(monkeypatch):
    over = SparseAttentionConfig(fwd={"BLOCK_N": 16}, bwd_tiled={"BLOCK_N": 32})
    monkeypatch.setattr(host, "DEFAULT_CONFIG", over)
    monkeypatch.setattr(host, "TILED_FWD_MAX_UNION", 0)  # every union counts as too wide
    q, k, v, _ = make(B=1, S=20, T=40, Hq=8, Hkv=2, Dqk=32, Dv=16, K=12)
    idx = distinct_indices(1, 20, 40, 12)
    assert_matches_reference(q, k, v, idx, deterministic=False)


def test_one_wide_tile_does_not_send_the_forward_per_token(monkeypatch):
    """The forward's rule is the unions' mean: one tile wider than the limit keeps the tiled forward."""
    monkeypatch.setattr(host, "DEFAULT_CONFIG", SparseAttentionConfig(fwd_tiled={"BLOCK_N": 32}, tile_rows=16))
    q, k, v, _ = make(B=1, S=32, T=64, Hq=4, Hkv=2, Dqk=32, Dv=16, K=5)
    idx = torch.tensor([0, 1, 2, 3, -1], dtype=torch.int32).expand(1, 32, 5).clone()  # unions of keys 0-3
    idx[0, 8:16, :4] = torch.arange(32, 64, dtype=torch.int32).view(8, 4)  # but the second tile's: 32 keys
    monkeypatch.setattr(host, "TILED_FWD_MAX_UNION", 3)  # widest 32 > 15 >= mean (4 + 32 + 4 + 4) / 4 = 11
    lists, run, _ = host.forward_plan(q, k, v, idx, host.DEFAULT_CONFIG, unique=True)
    assert lists.tile_q == 8 and int(lists.num.max()) == 32 and run.tile_q == 8
    assert_matches_reference(q, k, v, idx, deterministic=False)
    monkeypatch.setattr(host, "TILED_FWD_MAX_UNION", 2)  # mean 11 > 10: per token
    assert host.forward_plan(q, k, v, idx, host.DEFAULT_CONFIG, unique=True)[1].tile_q == 0


def test_the_forward_plan_reads_the_host_once(monkeypatch):
    """The tile build reads the widest and the mean union in one host sync, and the forward's choice takes
    that mean (``KeyLists.mean_union``) rather than reading the lists again."""
    monkeypatch.setattr(host, "DEFAULT_CONFIG", SparseAttentionConfig(fwd_tiled={"BLOCK_N": 32}, tile_rows=16))
    monkeypatch.setattr(host, "TILED_FWD_MAX_UNION", 2)  # the widest union (32) is past the limit (10)
    q, k, v, _ = make(B=1, S=32, T=64, Hq=4, Hkv=2, Dqk=32, Dv=16, K=5)
    idx = torch.tensor([0, 1, 2, 3, -1], dtype=torch.int32).expand(1, 32, 5).clone()
    idx[0, 8:16, :4] = torch.arange(32, 64, dtype=torch.int32).view(8, 4)
    reads = []
    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, *a, _o=original, _n=name: reads.append(_n) or _o(t, *a))
    lists, run, _ = host.forward_plan(q, k, v, idx, host.DEFAULT_CONFIG, unique=True)
    assert reads == ["tolist"] and lists.mean_union == 11.0 and run.tile_q == 0  # mean 11 > 10: per token
    assert host.mean_union(lists._replace(mean_union=-1.0)) == 11.0  # rebuilt lists without it: read once more


def test_unique_indices_keep_the_query_tiles_and_the_results(monkeypatch):
    """``unique_indices=True`` on selections without repeats: the same query tiles and results, the repeat
    check's host read skipped (``tile_unions``); a non-bool is refused."""
    over = SparseAttentionConfig(fwd_tiled={"BLOCK_N": 32}, bwd_tiled={"BLOCK_N": 32}, tile_rows=16)
    monkeypatch.setattr(host, "DEFAULT_CONFIG", over)
    q, k, v, _ = make(B=1, S=20, T=40, Hq=8, Hkv=2, Dqk=32, Dv=16, K=12)
    idx = distinct_indices(1, 20, 40, 12)
    assert host.key_lists(idx, 40, 4, wide=False, unique=True).tile_q == 4
    want = sparse_attention(q, k, v, idx, return_lse=True, backend="triton")
    got = sparse_attention(q, k, v, idx, return_lse=True, backend="triton", unique_indices=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    with pytest.raises(TypeError, match="unique_indices must be a bool"):
        sparse_attention(q, k, v, idx, unique_indices=1)
