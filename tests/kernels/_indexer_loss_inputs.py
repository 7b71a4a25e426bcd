"""Inputs for the indexer-loss tests: indexer and attention tensors and realistic selections."""

from __future__ import annotations

import torch


def causal_indices(batch, queries, keys, topk, *, generator=None, device="cpu", local=0, sinks=0,
                   chunk=1024, empty_rows=()):
    """int32 [B, S, K] selections in hytopk's form: unique visible keys (query i at position
    T - S + i sees keys 0..T-S+i), sorted ascending, -1 padded at the end.

    Random picks, biased to the ``local`` most recent keys and the first ``sinks`` keys (the
    local-window + sinks + scattered pattern of real selections). ``empty_rows``: query rows given
    no key at all (all -1). Built a query chunk at a time so no [S, T] table exists on the GPU.
    """
    out = torch.empty(batch, queries, topk, dtype=torch.int32, device=device)
    key_pos = torch.arange(keys, device=device)
    for c0 in range(0, queries, chunk):
        c1 = min(queries, c0 + chunk)
        pos = torch.arange(keys - queries + c0, keys - queries + c1, device=device)
        score = torch.rand(batch, c1 - c0, keys, generator=generator, device=device)
        score += 2.0 * ((pos[:, None] - key_pos[None, :]) < local) + 2.0 * (key_pos < sinks)[None, :]
        visible = key_pos[None, :] <= pos[:, None]
        score = score.masked_fill(~visible, -1.0)
        take = min(topk, keys)
        vals, idx = score.topk(take, dim=-1)
        idx = torch.where(vals >= 0, idx, torch.full_like(idx, keys)).sort(dim=-1).values
        idx = torch.where(idx < keys, idx, torch.full_like(idx, -1))
        if take < topk:
            idx = torch.nn.functional.pad(idx, (0, topk - take), value=-1)
        out[:, c0:c1] = idx.to(torch.int32)
    for row in empty_rows:
        out[:, row] = -1
    return out


def loss_inputs(B, S, T, H, D, Hq, Hkv, Dqk, *, dtype=torch.float32, device="cpu", generator=None,
                attn_sharpness=1.0):
    """(index_q, index_k, index_w, attn_q, attn_k) with realistic magnitudes: the indexer logits have
    a spread of a few units (the scale folded into w), the attention logits ``attn_sharpness`` x unit."""
    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=generator, device=device, dtype=torch.float32).to(dt)

    index_q = randn(B, S, H, D)
    index_k = randn(B, T, D)
    index_w = randn(B, S, H, dt=torch.float32) * (H * D) ** -0.5 * 4
    attn_q = (randn(B, S, Hq, Dqk, dt=torch.float32) * attn_sharpness).to(dtype)
    attn_k = randn(B, T, Hkv, Dqk)
    return index_q, index_k, index_w, attn_q, attn_k
