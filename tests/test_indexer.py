"""LightningIndexer: shapes, folded scales, RoPE (the family's function, frequency subset), init prior."""

from __future__ import annotations

import pytest
import torch
from transformers.models.glm4.modeling_glm4 import apply_rotary_pos_emb as glm4_rope
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rope

from hyscale_hf.indexer import LightningIndexer, rope_frequency_subset
from hyscale_hf.kernels.topk.naive import indexer_scores


def _tables(positions: torch.Tensor, rotary_dim: int, base: float = 10000.0):
    """Transformers-style rotary tables: cos/sin of [1, T, R] holding two copies of R/2 frequencies."""
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2).double() / rotary_dim)
    freqs = positions.double()[:, None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)[None]
    return emb.cos(), emb.sin()


def _indexer(hidden=32, heads=3, dim=8, rope=4, rotary=llama_rope, seed=0):
    torch.manual_seed(seed)
    return LightningIndexer(hidden, heads, dim, rope, apply_rotary=rotary).double()


def test_shapes_dtypes_and_folded_scales():
    ind = _indexer()
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    cos, sin = _tables(torch.arange(5), 8)
    q, k, w = ind(x, cos, sin)
    assert q.shape == (2, 5, 3, 8) and k.shape == (2, 5, 8) and w.shape == (2, 5, 3)
    assert w.dtype == torch.float32
    torch.testing.assert_close(w, (ind.weights_proj(x) * (3**-0.5 * 8**-0.5)).float())
    # Dims past rope_dim are the plain projections (k through its LayerNorm).
    torch.testing.assert_close(q[..., 4:], ind.wq(x).view(2, 5, 3, 8)[..., 4:])
    torch.testing.assert_close(k[..., 4:], ind.k_norm(ind.wk(x))[..., 4:])


@pytest.mark.parametrize("rotary", [llama_rope, glm4_rope], ids=["half_split", "interleaved"])
def test_scores_depend_on_relative_position_only(rotary):
    ind = _indexer(rotary=rotary)
    x = torch.randn(1, 6, 32, dtype=torch.float64)
    q0, k0, w0 = ind(x, *_tables(torch.arange(6), 8))
    q1, k1, w1 = ind(x, *_tables(torch.arange(6) + 37, 8))
    s0 = torch.einsum("bthd,bsd->bths", q0, k0)
    s1 = torch.einsum("bthd,bsd->bths", q1, k1)
    torch.testing.assert_close(s0, s1)
    assert not torch.allclose(q0, q1)  # the positions did rotate q


def test_rope_subset_equals_a_smaller_rope_with_the_same_base():
    # A model rotating 16 dims; the indexer keeps rope_dim 4 = every 4th of its 8 frequencies
    # base^(-2 (4j) / 16) = base^(-2j / 4): exactly a 4-dim RoPE with the same base.
    ind = _indexer(rope=4)
    x = torch.randn(1, 5, 32, dtype=torch.float64)
    pos = torch.arange(5)
    q, k, _ = ind(x, *_tables(pos, 16))
    q_ref, k_ref = llama_rope(ind.wq(x).view(1, 5, 3, 8)[..., :4], ind.k_norm(ind.wk(x))[:, :, None, :4],
                              *_tables(pos, 4), unsqueeze_dim=2)
    torch.testing.assert_close(q[..., :4], q_ref)
    torch.testing.assert_close(k[..., :4], k_ref[:, :, 0])
    assert rope_frequency_subset(8, 2).tolist() == [0, 4]


def test_init_prior_selects_recent_keys():
    torch.manual_seed(0)
    T, R = 512, 64
    ind = LightningIndexer(256, 8, 64, 32, apply_rotary=llama_rope)
    cos, sin = (t.float() for t in _tables(torch.arange(T), R))
    # Without content every query's best key is itself, and its top-16 are its neighbours.
    q, k, w = ind(torch.zeros(1, T, 256), cos, sin)
    scores = indexer_scores(q, k, w)[0]
    assert torch.equal(scores.argmax(-1), torch.arange(T))
    dist = torch.arange(T)[:, None] - scores.topk(16, dim=-1).indices
    assert dist[T // 2 :].float().median() <= 16
    # With random content the prior still dominates: selections stay far closer than uniform (~190).
    q, k, w = ind(torch.randn(1, T, 256), cos, sin)
    dist = torch.arange(T)[:, None] - indexer_scores(q, k, w)[0].topk(16, dim=-1).indices
    assert dist[T // 2 :].float().median() < 64


def test_no_rope_and_bad_arguments():
    ind = LightningIndexer(16, 2, 4, 0)
    q, k, w = ind(torch.randn(1, 3, 16))
    assert q.shape == (1, 3, 2, 4)
    with pytest.raises(ValueError, match="head_dim must be even"):
        LightningIndexer(16, 2, 5, 0)
    with pytest.raises(ValueError, match="rope_dim"):
        LightningIndexer(16, 2, 4, 6, apply_rotary=llama_rope)
    with pytest.raises(TypeError, match="apply_rotary"):
        LightningIndexer(16, 2, 4, 2)
    with pytest.raises(ValueError, match="n_heads"):
        LightningIndexer(16, 0, 4, 2, apply_rotary=llama_rope)
    with pytest.raises(ValueError, match="rotary tables"):
        LightningIndexer(16, 2, 4, 2, apply_rotary=llama_rope)(torch.randn(1, 3, 16))
    with pytest.raises(ValueError, match="rope_dim=4"):
        LightningIndexer(16, 2, 4, 4, apply_rotary=llama_rope)(torch.randn(1, 3, 16), *_tables(torch.arange(3), 2))
