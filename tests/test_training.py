"""hyscale_hf.training: the top-k recall metric against a brute-force oracle, and the recall probe."""

from __future__ import annotations

import pytest
import torch

import hyscale_hf
from hyscale_hf.state import patch_state
from hyscale_hf.training import topk_recall
from tests.model_patches.tiny_models import build


def brute_force_recall(iq, ik, iw, aq, ak, topk, scale, relu=True):
    """Full [B, S, T] tables: indexer scores -> stable top-k (lower index wins ties), attention mass."""
    B, S, _, _ = iq.shape
    T = ik.shape[1]
    logits = torch.einsum("bshd,btd->bsht", iq.double(), ik.double())
    if relu:
        logits = logits.clamp_min(0)
    scores = (logits * iw.double()[..., None]).sum(2)
    causal = torch.arange(T)[None, :] <= torch.arange(T - S, T)[:, None]
    scores = scores.masked_fill(~causal, float("-inf"))
    att = torch.einsum("bshd,btd->bsht", aq.double(), ak[:, :, 0].double()) * scale
    p = torch.softmax(att.masked_fill(~causal[:, None], float("-inf")), dim=-1).sum(2)
    p = p / p.sum(-1, keepdim=True)
    recall, best = [], []
    for b in range(B):
        for s in range(S):
            visible = int(causal[s].sum())
            if visible <= topk:
                continue
            order = sorted(range(visible), key=lambda j: (-scores[b, s, j].item(), j))[:topk]
            recall.append(p[b, s, order].sum().item())
            best.append(p[b, s].topk(topk).values.sum().item())
    return torch.tensor(recall, dtype=torch.float64), torch.tensor(best, dtype=torch.float64)


@pytest.mark.parametrize("relu", [True, False])
def test_topk_recall_matches_brute_force(relu):
    g = torch.Generator().manual_seed(0)
    B, T, H, D, Hq, Dqk, K = 2, 40, 3, 8, 4, 12, 6
    iq, ik, iw = torch.randn(B, T, H, D, generator=g), torch.randn(B, T, D, generator=g), torch.randn(B, T, H, generator=g)
    iq[0, 20:, :, :] = 0.0  # exact-zero scores: ties broken by the lower key index
    aq, ak = torch.randn(B, T, Hq, Dqk, generator=g), torch.randn(B, T, 1, Dqk, generator=g)
    recall, best = topk_recall(iq, ik, iw, aq, ak, topk=K, scale=0.5, relu=relu, max_queries=10_000)
    want_recall, want_best = brute_force_recall(iq, ik, iw, aq, ak, K, 0.5, relu)
    assert recall.shape == (B * (T - K),)
    torch.testing.assert_close(recall.double(), want_recall, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(best.double(), want_best, rtol=1e-5, atol=1e-6)
    assert (best >= recall - 1e-6).all()
    sampled, _ = topk_recall(iq, ik, iw, aq, ak, topk=K, scale=0.5, relu=relu, max_queries=5)
    assert sampled.shape == (5,)
    empty, _ = topk_recall(iq, ik, iw, aq, ak, topk=T, scale=0.5)
    assert empty.numel() == 0  # no query sees more than T keys


def test_topk_recall_argument_errors():
    x = torch.zeros(1, 4, 1, 2)
    with pytest.raises(ValueError, match="topk"):
        topk_recall(x, x[:, :, 0], x[..., 0], x, x, topk=0, scale=1.0)
    with pytest.raises(ValueError, match="max_queries"):
        topk_recall(x, x[:, :, 0], x[..., 0], x, x, topk=1, scale=1.0, max_queries=0)


def test_probe_counts_each_full_layer_once_under_checkpoint_recompute():
    model, _ = build("glm_moe_dsa")  # layers: full, shared, full
    hyscale_hf.patch_model(model)
    model.gradient_checkpointing_enable()
    model.train()
    ids = torch.randint(3, 100, (1, 32), generator=torch.Generator().manual_seed(0))
    with hyscale_hf.sample_topk_recall(model) as probe:
        model(input_ids=ids, labels=ids).loss.backward()
    assert probe.calls == 2  # the two full indexer layers, not again in recompute, not the shared layer
    assert 0.0 < probe.mean() <= probe.mean_best() + 1e-6
    assert patch_state(model).selection_probe is None
    with pytest.raises(ValueError, match="not patched"):
        hyscale_hf.measure_topk_recall(build("glm_moe_dsa")[0], {"input_ids": ids})
