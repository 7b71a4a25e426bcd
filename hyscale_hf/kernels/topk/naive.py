"""HyTopK in pure torch: the test oracle of the Triton and Gluon kernels, and the CPU backend.

Exact under the selection rule of ``hytopk`` and O(query_chunk * T) in memory: no function builds
a whole ``[S, H, T]`` or ``[S, T]`` table except ``indexer_scores``, which exists for tests and
says so.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..windows import compute_dtype, query_chunk, query_windows, visible_mask

_INT32_MIN = -(2**31)
MASKED_KEY = _INT32_MIN  # never selected
NAN_KEY = _INT32_MIN + 1  # ranks below -inf (whose key is larger), above masked
NAN_MESSAGE = (
    "hytopk: non-finite (NaN) indexer score found (check_nan=True); inputs q, k or w hold NaN/inf, "
    "or a dot product overflows fp32"
)


def indexer_logits_block(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, relu: bool = True, workspace: torch.Tensor | None = None
) -> torch.Tensor:
    """``sum_h w[.., h] * ReLU(q[.., h, :] . k[s, :])`` for a block: q [B, c, H, D], k [B, T, D],
    w [B, c, H] -> [B, c, T] in fp32 (fp64 if any input is fp64).

    ``workspace`` (no-grad callers): a flat buffer of at least B*c*H*T elements of the compute dtype
    that holds the per-head logits, so a loop over chunks reuses one block instead of allocating
    (and fragmenting) a fresh one per chunk.
    """
    dt = compute_dtype(q, k, w)
    B, c, H, D = q.shape
    T = k.shape[1]
    if workspace is None:
        logits = torch.einsum("bchd,btd->bcht", q.to(dt), k.to(dt))
        if relu:
            logits = logits.clamp_min(0)  # keeps NaN; -inf becomes 0, the exact ReLU of it
        return (logits * w.to(dt)[..., None]).sum(dim=2)
    logits = workspace[: B * c * H * T].view(B, c * H, T)
    torch.bmm(q.reshape(B, c * H, D).to(dt), k.to(dt).transpose(1, 2), out=logits)
    logits = logits.view(B, c, H, T)
    if relu:
        logits.clamp_min_(0)
    logits.mul_(w.to(dt)[..., None])
    return logits.sum(dim=2)


def hytopk_scores_block(q, k, w, relu: bool = True, workspace: torch.Tensor | None = None) -> torch.Tensor:
    """HyTopK's fp32 scores of a block ([B, c, T]) under its rule for non-finite values (``hytopk``):
    NaN wherever the weighted head sum (after the cast to fp32) is not finite.

    A head logit of ``+inf`` or NaN (an fp32 overflow, or a non-finite input) makes the sum non-finite;
    ``-inf`` passes ReLU as its exact value, 0. Whether a non-finite sum shows as ``inf`` or NaN depends
    on the summation order, which differs between the backends; as NaN it ranks the same on both. The
    kernels apply the rule to the [BN, BQ] sums only, not to the H-times larger per-head logits.
    """
    scores = indexer_logits_block(q, k, w, relu, workspace).float()
    return scores.masked_fill(~torch.isfinite(scores), float("nan"))


def indexer_scores(q, k, w, *, relu=True, cu_seqlens=None, window_start=None) -> torch.Tensor:
    """Full ``[B, S, T]`` fp32 score table with invisible keys at ``-inf``.

    For tests and small inputs only: this is the O(S*T) table HyTopK exists to avoid.
    """
    B, S = q.shape[:2]
    T = k.shape[1]
    start, end = query_windows(B, S, T, cu_seqlens=cu_seqlens, window_start=window_start, device=q.device)
    scores = hytopk_scores_block(q, k, w, relu)
    return scores.masked_fill(~visible_mask(start, end, 0, T), float("-inf"))


def score_sort_keys(scores: torch.Tensor, visible: torch.Tensor, key_offset: int = 0) -> torch.Tensor:
    """int64 keys whose descending order is the tie rule: score descending, then key index ascending.

    ``-0.0`` ranks as ``+0.0``; NaN ranks below ``-inf``; invisible keys get the lowest key of all.
    The low 32 bits hold ``~index``, so keys are unique and any top-k over them is one exact set.
    """
    s = scores.float() + 0.0  # -0.0 + 0.0 == +0.0: one bit pattern for zero
    bits = s.view(torch.int32)
    mono = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(torch.int64)  # order-preserving
    mono = torch.where(torch.isnan(s), torch.full_like(mono, NAN_KEY), mono)
    mono = torch.where(visible, mono, torch.full_like(mono, MASKED_KEY))
    idx = torch.arange(key_offset, key_offset + scores.shape[-1], device=scores.device, dtype=torch.int64)
    return mono * 2**32 + (2**32 - 1 - idx)


def select_topk(scores: torch.Tensor, visible: torch.Tensor, topk: int, key_offset: int = 0):
    """Exact top-k of each row of ``scores`` [..., W] under the tie rule, among ``visible`` keys.

    Returns int32 indices [..., topk] (``key_offset`` added) sorted ascending and padded with -1,
    and the fp32 scores of those keys (``-inf`` in padded slots).
    """
    W = scores.shape[-1]
    keys = score_sort_keys(scores, visible, key_offset)
    take = min(topk, W)
    top = keys.topk(take, dim=-1, sorted=False).values
    valid = (top >> 32) != MASKED_KEY
    idx = (2**32 - 1) - (top & 0xFFFFFFFF)  # back to absolute key index
    big = key_offset + W
    idx = torch.where(valid, idx, torch.full_like(idx, big)).sort(dim=-1).values
    valid = idx < big
    local = torch.where(valid, idx - key_offset, torch.zeros_like(idx))
    sel_scores = scores.float().gather(-1, local).masked_fill(~valid, float("-inf"))
    idx = torch.where(valid, idx, torch.full_like(idx, -1)).to(torch.int32)
    if take < topk:
        pad = topk - take
        idx = F.pad(idx, (0, pad), value=-1)
        sel_scores = F.pad(sel_scores, (0, pad), value=float("-inf"))
    return idx, sel_scores


@torch.no_grad()
def hytopk_reference(
    q, k, w, topk, *, cu_seqlens=None, window_start=None, relu=True, check_nan=False, chunk_size=None
):
    """Reference HyTopK: exact top-k indices [B, S, topk] int32 and their fp32 scores.

    Scores a chunk of queries at a time over the keys the chunk can see, so extra memory is
    O(chunk * H * window + B * S * topk). See ``hyscale_hf.kernels.hytopk`` for the contract.
    """
    B, S, H, _ = q.shape
    T = k.shape[1]
    idx_out = torch.full((B, S, topk), -1, dtype=torch.int32, device=q.device)
    score_out = torch.full((B, S, topk), float("-inf"), dtype=torch.float32, device=q.device)
    if B * S == 0:  # nothing to score (T = 0 implies S = 0)
        return idx_out, score_out
    start, end = query_windows(B, S, T, cu_seqlens=cu_seqlens, window_start=window_start, device=q.device)
    chunk = query_chunk(B, H, T, chunk_size, q.device)
    dt = compute_dtype(q, k, w)
    k = k.to(dt)  # once, not per chunk
    workspace = torch.empty(B * min(chunk, S) * H * T, dtype=dt, device=q.device)
    for c0 in range(0, S, chunk):
        c1 = min(S, c0 + chunk)
        # Score only the keys some query of the chunk can see (early causal chunks see few).
        lo = int(start[:, c0:c1].min())
        hi = int(end[:, c0:c1].max()) + 1
        if lo >= hi:  # every window of the chunk starts past its query (window_start > position)
            continue  # rows stay -1 / -inf
        scores = hytopk_scores_block(q[:, c0:c1], k[:, lo:hi], w[:, c0:c1], relu, workspace)
        visible = visible_mask(start[:, c0:c1], end[:, c0:c1], lo, hi)
        if check_nan and bool(torch.isnan(scores[visible]).any()):
            raise ValueError(NAN_MESSAGE)
        idx_out[:, c0:c1], score_out[:, c0:c1] = select_topk(scores, visible, topk, key_offset=lo)
    return idx_out, score_out


def selected_lse(scores: torch.Tensor, wanted: bool = True) -> torch.Tensor:
    """Log-sum-exp of each row's selected scores: ``[B, S, K]`` fp32 (``-inf`` padded) -> ``[B, S]`` fp32,
    ``-inf`` for a row without a key and NaN where a selected score is NaN; ``[B, 0]`` when not ``wanted``."""
    if not wanted:
        return scores.new_empty(scores.shape[0], 0)
    return torch.logsumexp(scores.float(), dim=-1)
