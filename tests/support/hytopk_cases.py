"""Inputs and checks shared by the HyTopK tests (interpreter and GPU).

Integer-valued inputs: q and k hold small integers and w multiples of 1/8, so every product and
every partial sum is an exactly representable fp32 number; any summation order then gives the same
bits, and the kernel must match the reference bit for bit. Continuous inputs use
``assert_valid_topk`` instead (the kernel's summation order differs from the reference's).
"""

from __future__ import annotations

import torch

from hyscale_hf.kernels.topk.naive import indexer_logits_block
from hyscale_hf.kernels.windows import query_windows


def int_inputs(B, S, T, H, D, *, dtype=torch.bfloat16, device="cpu", seed=0, qk_range=3, w_range=4):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-qk_range, qk_range + 1, (B, S, H, D), generator=g).to(dtype)
    k = torch.randint(-qk_range, qk_range + 1, (B, T, D), generator=g).to(dtype)
    w = torch.randint(-w_range, w_range + 1, (B, S, H), generator=g).float() / 8
    return q.to(device), k.to(device), w.to(device)


def binary_position_keys(T, D, *, descending=False, offset_dim=None):
    """k[s] encodes s in binary over the first log2(T) dims (q = powers of two reads it back):
    exact in bf16 at any T < 2**24, so q . k = s (or T - 1 - s) exactly: monotone rows."""
    bits = max(1, (T - 1).bit_length())
    assert bits <= D, "need one dim per bit of the position"
    s = torch.arange(T)
    pos = (T - 1 - s) if descending else s
    k = torch.zeros(T, D)
    for j in range(bits):
        k[:, j] = ((pos >> j) & 1).float()
    q_read = torch.zeros(D)
    q_read[:bits] = 2.0 ** torch.arange(bits)
    return k, q_read


def adversarial_inputs(S, T, H, D, *, dtype=torch.bfloat16, device="cpu", seed=0, n_strong=3):
    """One batch per adversarial pattern (docs/design.md section 9), all integer-valued (exact):

    0: ReLU zero plateau: all keys but ``n_strong`` score exactly 0 (more zero ties than K);
       some queries have w = 0 or w = -0.0 (all-zero rows, -0.0 scores).
    1: monotone increasing rows (every key beats all earlier ones: worst case for a rising tau).
    2: monotone decreasing rows.
    3: one huge bucket: scores a large constant plus a tiny spread, many exact ties.
    4: many queries sharing a few strong keys on top of random small scores.
    """
    g = torch.Generator().manual_seed(seed)
    B = 5
    q = torch.zeros(B, S, H, D)
    k = torch.zeros(B, T, D)
    w = torch.randint(1, 5, (B, S, H), generator=g).float() / 8
    # 0: plateau. Queries point along +dim0; keys mostly along -dim0.
    q[0, :, :, 0] = torch.randint(1, 3, (S, H), generator=g).float()
    k[0, :, 0] = -torch.randint(1, 3, (T,), generator=g).float()
    strong = torch.randperm(T, generator=g)[:n_strong]
    k[0, strong, 0] = torch.randint(1, 4, (n_strong,), generator=g).float()
    w[0, 1::5] = 0.0
    w[0, 2::5] = -0.0
    # 1, 2: monotone rows through a binary position code.
    for b, desc in ((1, False), (2, True)):
        kb, q_read = binary_position_keys(T, D, descending=desc)
        k[b] = kb
        q[b] = q_read
    # 3: huge bucket: q . k = 100 + (s % 3) for every query.
    q[3, :, :, 0] = 1.0
    q[3, :, :, 1] = 1.0
    k[3, :, 0] = 100.0
    k[3, :, 1] = (torch.arange(T) % 3).float()
    # 4: shared strong keys: random small scores, a few keys far above for every query.
    q[4] = torch.randint(-2, 3, (S, H, D), generator=g).float()
    q[4, :, :, 0] = 2.0
    k[4] = torch.randint(-2, 3, (T, D), generator=g).float()
    k[4, :, 0] = 0.0
    k[4, strong, 0] = 8.0
    return q.to(dtype).to(device), k.to(dtype).to(device), w.to(device)


def assert_same(got, ref, what=""):
    """Indices equal exactly; scores equal as values (-0.0 == +0.0, NaN == NaN), bit for bit otherwise.
    ``got`` and ``ref`` are ``(indices, scores)`` or ``hytopk_triton``'s ``(indices, scores, lse)``."""
    gi, gs = got[:2]
    ri, rs = ref[:2]
    assert gi.dtype == torch.int32 and gs.dtype == torch.float32
    if not torch.equal(gi, ri):
        bad = (gi != ri).any(-1).nonzero()
        b, i = bad[0].tolist()
        raise AssertionError(
            f"{what}: indices differ in {len(bad)} rows; first (b={b}, i={i}):\n got {gi[b, i].tolist()}\n"
            f" ref {ri[b, i].tolist()}\n got scores {gs[b, i].tolist()}\n ref scores {rs[b, i].tolist()}"
        )
    torch.testing.assert_close(gs, rs, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: scores differ: {m}")


def assert_valid_topk(idx, scores, q, k, w, topk, *, tol, relu=True, chunk=1024, **windows):
    """The kernel's set is an exact top-k of the (fp32) reference scores up to ``tol`` at the boundary.

    For continuous inputs the kernel sums in another order than the reference, so scores can differ
    in the last bits; a key may then swap with one within ``tol`` of the k-th score, nothing more.
    Checks per row: sorted ascending, -1 padded, no duplicates, visible keys only, the right count,
    min(selected) >= max(unselected visible) - tol, and returned scores within tol of the reference.
    Works a query chunk at a time (the reference score table of a chunk is [chunk, T]).
    """
    B, S = q.shape[:2]
    T = k.shape[1]
    start, end = query_windows(B, S, T, device=q.device, **windows)
    keys = torch.arange(T, device=q.device)
    for c0 in range(0, S, chunk):
        c1 = min(S, c0 + chunk)
        ref = indexer_logits_block(q[:, c0:c1], k, w[:, c0:c1], relu).float()
        visible = (keys >= start[:, c0:c1, None]) & (keys <= end[:, c0:c1, None])
        ix, sc = idx[:, c0:c1], scores[:, c0:c1]
        n_vis = visible.sum(-1)
        valid = ix >= 0
        assert torch.equal(valid.sum(-1), n_vis.clamp(max=topk)), "wrong number of selected keys"
        first_pad = valid.sum(-1, keepdim=True)
        assert torch.equal(valid, torch.arange(topk, device=ix.device) < first_pad), "-1 not at the end"
        srt = torch.where(valid, ix, torch.iinfo(torch.int32).max)
        assert bool((srt[..., 1:] > srt[..., :-1]).logical_or(~valid[..., 1:]).all()), "not strictly ascending"
        gidx = ix.clamp_min(0).long()
        assert bool(visible.gather(-1, gidx)[valid].all()), "selected an invisible key"
        sel_ref = ref.gather(-1, gidx)
        chosen = torch.zeros(visible.shape, dtype=torch.int32, device=ix.device)
        chosen = chosen.scatter_add(-1, gidx, valid.to(torch.int32)) > 0
        min_sel = torch.where(valid, sel_ref, torch.inf).amin(-1)
        max_rest = torch.where(visible & ~chosen, ref, -torch.inf).amax(-1)
        gap = (max_rest - min_sel).max()
        assert bool(gap <= tol), f"an unselected key beats a selected one by {float(gap)} > tol {tol}"
        if bool(valid.any()):
            err = (sc - sel_ref).abs()[valid].max()
            assert bool(err <= tol), f"returned scores off by {float(err)} > tol {tol}"
        assert bool((sc[~valid] == -torch.inf).all()), "padding is not -inf"
