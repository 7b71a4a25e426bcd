"""Triton query-tile key unions (``sparse_attn.tile_unions.tile_unions``) against the torch reference, bit for bit.

Without CUDA these run under Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1);
shapes are tiny. ``num_keys`` is never a multiple of 32 and the widest unions pass 128 keys, so the
membership rows hold more than one 128-slot group.
"""

import pytest
import torch

from hyscale_hf.kernels.sparse_attn.naive import tile_unions_reference

triton = pytest.importorskip("triton")
from hyscale_hf.kernels.sparse_attn import tile_unions as tu  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_indices(B, S, T, K, seed=0, sort=False):
    """Distinct keys per query (some -1), one all -1 query, the last key T - 1 somewhere."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(T, generator=g)[:K] for _ in range(B * S)]).view(B, S, K)
    idx = idx.masked_fill(torch.rand(B, S, K, generator=g) < 0.25, -1)
    if sort:  # HyTopK's layout: ascending keys, -1 last
        idx = torch.where(idx < 0, T, idx).sort(-1).values
        idx = torch.where(idx == T, -1, idx)
    idx[-1, 2] = -1
    idx[0, 0] = torch.where(idx[0, 0] == T - 1, -1, idx[0, 0])  # T - 1 once, in the first slot
    idx[0, 0, 0] = T - 1
    return idx.to(torch.int32).to(DEVICE)


def assert_same(idx, tile_q, T):
    want = tile_unions_reference(idx, tile_q, T)
    got = tu.tile_unions(idx, tile_q, T)
    assert want is not None and got is not None
    for name, a, b in zip(("union", "num", "bits"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.shape, b.shape)
        assert torch.equal(a, b), name
    return got


@pytest.mark.parametrize("tile_q", [2, 4, 16])
@pytest.mark.parametrize("sort", [False, True], ids=["unsorted", "sorted"])
def test_matches_reference(tile_q, sort):
    S = 2 * tile_q + 3  # not a multiple of tile_q: the last tile is partial
    union, num, bits = assert_same(random_indices(2, S, 203, 24, seed=tile_q, sort=sort), tile_q, 203)
    n = -(-S // tile_q)
    assert union.shape[:2] == (2, n) and bits.shape[0] == 2 * n * tile_q
    if tile_q == 16:
        assert int(num.max()) > 128  # bits rows span several 128-slot groups


def test_local_windows_and_partial_last_tile():
    """Overlapping windows (most keys shared by the tile), S < tile_q, keys up to T - 1 = 64."""
    T, S, K = 65, 11, 9
    t = torch.arange(T - S, T)[:, None]
    idx = (t - torch.arange(K)).clamp_min(-1).to(torch.int32)[None]
    idx[0, 3, 2] = 0
    assert_same(idx.to(DEVICE), 16, T)
    assert_same(idx.to(DEVICE), 4, T)


def test_empty_rows_and_tiles():
    idx = torch.full((2, 9, 5), -1, dtype=torch.int32, device=DEVICE)
    union, num, bits = assert_same(idx, 4, 40)
    assert union.shape == (2, 3, 512) and int(num.max()) == 0 and not bits.any()  # one grain (union_layout)
    idx[1, 8, 4] = 39  # one key in the last (one-query) tile of the second sequence
    union, num, _ = assert_same(idx, 4, 40)
    assert union.shape == (2, 3, 512) and num.tolist() == [[0, 0, 0], [0, 0, 1]]
    union, _, bits = assert_same(idx[:, :0], 4, 40)  # no queries at all
    assert union.shape == (2, 0, 512) and bits.shape == (0, 16)


def test_non_contiguous_indices():
    idx = random_indices(2, 10, 77, 10, seed=3).transpose(0, 1).contiguous().transpose(0, 1)
    assert not idx.is_contiguous()
    assert_same(idx, 4, 77)


@pytest.mark.parametrize("tiles_per_chunk", [1, 3])
def test_chunked_scratch(tiles_per_chunk, monkeypatch):
    T = 203
    monkeypatch.setattr(tu, "SCRATCH_BYTES", tiles_per_chunk * 8 * -(-T // 32))
    assert_same(random_indices(2, 13, T, 24, seed=5), 4, T)


@pytest.mark.parametrize("chunked", [False, True])
def test_repeated_key_returns_none(chunked, monkeypatch):
    if chunked:
        monkeypatch.setattr(tu, "SCRATCH_BYTES", 1)  # one tile per chunk
    idx = random_indices(2, 11, 90, 12, seed=7)
    idx[1, 8:10] = torch.where(idx[1, 8:10] == 42, -1, idx[1, 8:10])
    idx[1, 9, 5] = idx[1, 9, 9] = 42  # the same query twice, in the last tile
    assert tile_unions_reference(idx, 4, 90) is None
    assert tu.tile_unions(idx, 4, 90) is None
    idx[1, 9, 9] = -1
    idx[1, 8, 3] = 42  # the same key in two queries of one tile is fine
    assert_same(idx, 4, 90)


def test_the_mean_union_comes_with_the_lists():
    idx = random_indices(2, 13, 203, 24, seed=12)
    *lists, mean = tu.tile_unions(idx, 4, 203, with_mean=True)
    for a, b in zip(lists, tu.tile_unions(idx, 4, 203)):
        assert torch.equal(a, b)
    assert mean == pytest.approx(float(lists[1].float().mean()))


def test_unique_selections_skip_the_repeat_check_with_the_same_lists(monkeypatch):
    """``unique=True`` (the caller vouches for no repeats): the same tensors, and the repeat flag is never
    read on the host."""
    idx = random_indices(2, 13, 203, 24, seed=11)
    want = tu.tile_unions(idx, 4, 203)
    reads = []
    original = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda t: reads.append(t.shape) or original(t))
    got = tu.tile_unions(idx, 4, 203, unique=True)
    assert reads == []  # num.max() goes through int(), the repeat flag through .item()
    for a, b in zip(got, want):
        assert torch.equal(a, b)
