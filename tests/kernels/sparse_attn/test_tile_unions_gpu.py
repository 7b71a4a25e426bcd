"""GPU: Triton query-tile key unions against the torch reference, bit for bit, at T = 16K, K = 2048.

Selections mimic a DSA indexer (4 sinks, a 1024-token local window, far tokens one per stratum of the
rest); ``share`` queries in a row draw the same far tokens: share 1 gives the widest unions (~16.5K
keys per 16-query tile), share 16 the realistic ones (~2K).
"""

import pytest
import torch

from hyscale_hf.kernels.sparse_attn import tile_unions as tu
from hyscale_hf.kernels.sparse_attn.naive import tile_unions_reference

pytestmark = pytest.mark.gpu

K_SEL = 2048


def selection(T, K=K_SEL, share=1, sinks=4, window=1024, seed=0):
    """int32 [1, T, K]: distinct ascending keys per query; queries t < K take keys 0..t, -1 padded."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    t = torch.arange(T, device="cuda")[:, None]
    j = torch.arange(K, device="cuda")
    far_n = K - sinks - window
    i = torch.arange(far_n, device="cuda")
    t0 = (t // share) * share  # the block's first query: the block shares its far strata
    span = (t0 - window + 1 - sinks).clamp_min(far_n)
    lo, hi = sinks + i * span // far_n, sinks + (i + 1) * span // far_n
    u = torch.rand(T // share + 1, far_n, generator=gen, device="cuda")[t[:, 0] // share]
    far = lo + (u * (hi - lo)).long()
    sel = torch.cat([j[:sinks].expand(T, sinks), far, t - window + 1 + j[:window]], dim=1)
    idx = torch.where(t < K, torch.where(j <= t, j, -1), sel).to(torch.int32)
    idx[5] = -1  # a query with no key
    return idx[None].contiguous()


def assert_same(idx, tile_q, T):
    want = tile_unions_reference(idx, tile_q, T)
    got = tu.tile_unions(idx, tile_q, T)
    for name, a, b in zip(("union", "num", "bits"), got, want):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        assert torch.equal(a, b), name
    return got


@pytest.mark.parametrize("share", [1, 16])
def test_matches_reference_at_16k(share):
    T = 16384
    union, num, _ = assert_same(selection(T, share=share), 16, T)
    assert union.shape[2] > (8000 if share == 1 else 2048)  # share 1: ~11.3K keys at 16K


def test_batch_of_two_in_chunks_and_a_repeated_key(monkeypatch):
    T = 4096 + 5  # neither S nor T a multiple of the tile / word
    idx = torch.cat([selection(T, seed=0), selection(T, share=16, seed=1)])
    monkeypatch.setattr(tu, "SCRATCH_BYTES", 100 * 8 * -(-T // 32))  # 100 tiles per chunk
    assert_same(idx, 16, T)
    assert_same(idx, 4, T)
    idx[1, 3000, 100] = idx[1, 3000, 101]
    assert tile_unions_reference(idx, 16, T) is None
    assert tu.tile_unions(idx, 16, T) is None
