"""Realistic inputs of the kernel benchmarks and tests: selections and indexer-loss tensors.

- ``realistic_selection``: what a trained DSA indexer tends to pick: a few attention-sink tokens, a
  local window and far tokens spread over the rest of the past (stratified random: one key drawn in
  each of ``far`` equal strata of the far range, so they are distinct and sorted). ``far_share=1``
  draws the far tokens independently for every query (worst case: no reuse between neighbouring
  queries); ``far_share=N`` gives each block of N consecutive queries the same far tokens (the
  vertical-line pattern of real attention maps: keys that many neighbouring queries attend to).
  Queries t < K select all of keys 0..t and pad with -1.
- ``causal_indices``: random selections in hytopk's form, biased to a local window and sinks.
- ``loss_inputs``: indexer and attention tensors with realistic magnitudes.
"""

from __future__ import annotations

import math

import torch


def realistic_selection(T, K, *, sinks=4, window=1024, far_share=1, seed=0, device="cuda", chunk=4096):
    """int32 [1, T, K] sorted indices: sinks + stratified far tokens + local window (module docstring)."""
    far = K - sinks - window
    if far <= 0:
        raise ValueError(f"K = {K} leaves no far tokens after {sinks} sinks and a window of {window}")
    gen = torch.Generator(device=device).manual_seed(seed)
    out = torch.empty(T, K, dtype=torch.int32, device=device)
    j = torch.arange(K, device=device)
    i = torch.arange(far, device=device)
    n_blocks = math.ceil(T / far_share)
    u_all = None
    for c0 in range(0, T, chunk):
        c1 = min(T, c0 + chunk)
        t = torch.arange(c0, c1, device=device)[:, None]
        short = torch.where(j <= t, j, -1)  # t < K: every visible key
        # far range [sinks, t0 - window + 1) with t0 the first query of t's block of far_share
        # queries: the whole block sees the same strata, so with the same random numbers it picks
        # the same far keys (all before every block query's window).
        t0 = (t // far_share) * far_share
        span = (t0 - window + 1 - sinks).clamp_min(far)
        lo = sinks + (i * span) // far
        hi = sinks + ((i + 1) * span) // far
        if far_share == 1:
            u = torch.rand(c1 - c0, far, generator=gen, device=device)
        else:
            if u_all is None:
                u_all = torch.rand(n_blocks, far, generator=gen, device=device)
            u = u_all[torch.arange(c0, c1, device=device) // far_share]
        far_keys = lo + (u * (hi - lo)).long()
        win = t - window + 1 + torch.arange(window, device=device)
        sink = torch.arange(sinks, device=device).expand(c1 - c0, sinks)
        sel = torch.cat([sink, far_keys, win], dim=1)
        out[c0:c1] = torch.where(t < K, short, sel).to(torch.int32)
    return out[None]




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
