"""Sparse attention in pure torch: the test oracle of the Triton and Gluon kernels, and the CPU backend.

Differentiable through torch autograd (gathers, einsums); memory O(B * S * K * Hkv * D) for the
gathered keys, so large inputs go a query chunk at a time.
"""

from __future__ import annotations

import torch

from ..windows import compute_dtype
from .mla_query import absorbed_query
from .union_layout import union_width


def gather_keys(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """x [B, T, ...] gathered at indices [B, S, K] (-1 -> row 0, masked later) -> [B, S, K, ...]."""
    if x.shape[1] == 0:  # no keys (every index is -1): gather from one zero row, still in the graph
        x = torch.cat([x, x.new_zeros(x.shape[0], 1, *x.shape[2:])], dim=1)
    b = torch.arange(x.shape[0], device=x.device)[:, None, None]
    return x[b, indices.clamp_min(0).long()]


def sparse_attention_reference(q, k, v, indices, scale):
    """Attention of each query over its selected keys only.

    q [B, S, Hq, Dqk], k [B, T, Hkv, Dqk], v [B, T, Hkv, Dv], indices [B, S, K] int32 (-1 skipped).
    Returns o [B, S, Hq, Dv] (q's dtype; zeros for a query with no key) and lse [B, S, Hq] fp32
    (``-inf`` there). Differentiable in q, k, v through torch autograd.
    """
    B, S, Hq, Dqk = q.shape
    Hkv, Dv = k.shape[2], v.shape[-1]
    G = Hq // Hkv
    dt = compute_dtype(q, k, v)
    valid = indices >= 0  # [B, S, K]
    kg = gather_keys(k, indices).to(dt)  # [B, S, K, Hkv, D]
    vg = gather_keys(v, indices).to(dt)
    # -1 slots gathered row 0 as a stand-in; its p is 0, but 0 * NaN (or inf) in that row would
    # still reach o, so the stand-in values are zeroed (the kernels never load them)
    vg = torch.where(valid[..., None, None], vg, 0.0)
    qg = q.to(dt).reshape(B, S, Hkv, G, Dqk)  # sizes spelled out: -1 is ambiguous with 0 elements
    logits = torch.einsum("bshgd,bskhd->bshgk", qg, kg) * scale
    logits = logits.masked_fill(~valid[:, :, None, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    # Non-finite logits (docs/design.md section 4): no key, or only -inf logits, is a row without
    # keys (p = 0: o = 0, lse = -inf); a NaN or +inf logit makes o and lse NaN (logsumexp would
    # give +inf for +inf: NaN is what the kernels' online softmax yields).
    no_key = lse == float("-inf")
    p = torch.exp(logits - torch.where(no_key, torch.zeros_like(lse), lse)[..., None])
    o = torch.einsum("bshgk,bskhd->bshgd", p, vg)
    lse = torch.where(lse == float("inf"), float("nan"), lse)
    return o.reshape(B, S, Hq, Dv).to(q.dtype), lse.reshape(B, S, Hq).to(torch.float32 if dt != torch.float64 else dt)


def tile_unions_reference(indices: torch.Tensor, tile_q: int, num_keys: int):
    """Query tiles of ``tile_q`` consecutive queries: sorted union of their keys + membership bits.

    The key lists of the tiled GQA sparse attention kernels (``host.union_tiles``; the Triton build
    is ``tile_unions.tile_unions``). indices int32 [B, S, K] (-1 and keys outside
    [0, num_keys) skipped); n = cdiv(S, tile_q) tiles per sequence, the last one padded with empty
    queries. Returns ``(union, num, bits)``: union int32 [B, n, max_u] (each tile's distinct keys
    ascending, -1 padded; max_u = the widest tile rounded up to whole ``union_layout.UNION_GRAIN``
    slots), num int32 [B, n] (keys per tile) and bits int32 [B * n * tile_q, max_u / 32] (bit u of a
    query's row: the query selected union slot u; whole grains, so a kernel block of <= 128 slots
    never reads past a row).
    Returns None when a query lists one key twice (a bit cannot count it; the per-token path can).
    """
    B, S, K = indices.shape
    n_tiles = -(-S // tile_q)
    idx = indices
    if n_tiles * tile_q != S:
        idx = torch.nn.functional.pad(indices, (0, 0, 0, n_tiles * tile_q - S), value=-1)
    vals = idx.reshape(B * n_tiles, tile_q * K)
    vals = torch.where(vals >= 0, vals, num_keys)  # -1 sorts last (keys >= num_keys are skipped too)
    srt, order = torch.sort(vals, dim=1, stable=True)  # stable: equal keys stay in query order
    valid = srt < num_keys
    new = torch.ones_like(valid)
    new[:, 1:] = srt[:, 1:] != srt[:, :-1]
    same_query = (order[:, 1:] // K) == (order[:, :-1] // K)
    if bool((valid[:, 1:] & ~new[:, 1:] & same_query).any()):
        return None
    first = new & valid
    slot = torch.cumsum(first, dim=1, dtype=torch.int32) - 1  # union slot of each sorted entry
    num = first.sum(dim=1, dtype=torch.int32)
    max_u, words = union_width(int(num.max()) if num.numel() else 0)
    rows = torch.arange(B * n_tiles, device=idx.device)[:, None].expand_as(first)
    union = torch.full((B * n_tiles, max_u), -1, dtype=torch.int32, device=idx.device)
    union[rows[first], slot[first].long()] = srt[first]
    bit_row = rows * tile_q + order // K  # the query (row of bits) each sorted entry belongs to
    flat = (bit_row * words + (slot // 32))[valid]
    bits = torch.zeros(B * n_tiles * tile_q * words, dtype=torch.int32, device=idx.device)
    bits.scatter_add_(0, flat, torch.bitwise_left_shift(torch.ones_like(slot), slot % 32)[valid])  # distinct bits: + is |
    return union.view(B, n_tiles, max_u), num.view(B, n_tiles), bits.view(-1, words)


def mla_sparse_attention_reference(q_nope, q_rot, w_uk, kv, indices, value_dim: int, scale: float):
    """MLA absorbed-form sparse attention as a plain composition (see ``mla.mla_sparse_attention``).

    attn_q = ``absorbed_query(q_nope, q_rot, w_uk)``; attention over the selected rows of ``kv``
    [B, T, 1, C + R] with values its first ``value_dim`` dims. Returns (o, lse, attn_q).
    """
    attn_q = absorbed_query(q_nope, q_rot, w_uk)
    o, lse = sparse_attention_reference(attn_q, kv, kv[..., :value_dim], indices, scale)
    return o, lse, attn_q


def key_passes_reference(idx: torch.Tensor, t_offset: int, count: int, num_keys: int, passes: int,
                         align: int = 1, grain: int = 1):  # fmt: skip
    """``key_passes.key_passes`` in torch, row by row: rows [t_offset, t_offset + count) of idx [B, S,
    L] with their valid keys grouped by key range ``key // cdiv(num_keys, passes)``, in slot order
    within a range, each group from a multiple of ``align``, -1 (perm -1) in every other slot, and
    ``off[..., passes]`` the last group's end rounded up to ``grain``. Returns ``(idx_p, perm, off)``."""
    rows = idx[:, t_offset : t_offset + count].long()
    B, S, L = rows.shape
    width = -(-(L + (align - 1) * (passes - 1)) // grain) * grain
    span = -(-max(num_keys, 1) // passes)
    idx_p = torch.full((B, S, width), -1, dtype=torch.int32, device=idx.device)
    perm = torch.full_like(idx_p, -1)
    off = torch.zeros(B, S, passes + 1, dtype=torch.int32, device=idx.device)
    for b in range(B):
        for r in range(S):
            end = 0
            for p in range(passes):
                first = -(-end // align) * align
                slots = torch.nonzero((rows[b, r] >= 0) & (rows[b, r] // span == p)).flatten()
                idx_p[b, r, first : first + len(slots)] = rows[b, r, slots].to(torch.int32)
                perm[b, r, first : first + len(slots)] = slots.to(torch.int32)
                off[b, r, p] = first
                end = first + len(slots)
            off[b, r, passes] = -(-end // grain) * grain
    return idx_p, perm, off
