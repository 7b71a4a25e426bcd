"""The indexer KL loss in pure torch: the test oracle of the Triton kernels, the CPU backend and the
dense warm-up loss (chunked and checkpointed, so memory stays O(chunk * T))."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ..sparse_attn.naive import gather_keys
from ..topk.naive import indexer_logits_block
from ..windows import compute_dtype, query_chunk, query_windows, visible_mask


def head_prob_sum(attn_q, attn_k_sel, valid, scale, attn_lse):
    """Head-summed attention probabilities [B, c, K] over a key set, not normalised: each head's
    probabilities from ``attn_lse`` (a non-finite lse counts as 0), or their softmax without it.

    attn_q [B, c, Hq, Dqk]; attn_k_sel [B, c, K, Hkv, Dqk] (per-query sets) or [B, K, Hkv, Dqk]
    (one key window shared by the chunk); valid [B, c, K]; attn_lse [B, c, Hq] (optional: the lse
    the attention itself computed over the same set).
    """
    B, c, Hq, _ = attn_q.shape
    Hkv = attn_k_sel.shape[-2]
    dt = compute_dtype(attn_q, attn_k_sel)
    qg = attn_q.to(dt).view(B, c, Hkv, Hq // Hkv, -1)
    pattern = "bchgd,bckhd->bchgk" if attn_k_sel.dim() == 5 else "bchgd,bkhd->bchgk"
    logits = torch.einsum(pattern, qg, attn_k_sel.to(dt)).flatten(2, 3) * scale
    logits = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
    if attn_lse is None:
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    else:
        lse = attn_lse.to(dt)
        probs = torch.exp(logits - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
        probs = probs.masked_fill(~valid[:, :, None, :], 0.0)
    return probs.sum(dim=2)


def attention_target(attn_q, attn_k_sel, valid, scale, attn_lse):
    """``head_prob_sum`` L1-normalised over the keys (the KL's p, detached by the callers)."""
    p = head_prob_sum(attn_q, attn_k_sel, valid, scale, attn_lse)
    return normalised(p)


def normalised(p: torch.Tensor) -> torch.Tensor:
    return p / p.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)


def attention_prob_sum_reference(attn_q, attn_k, indices, lse, scale):
    """The sparse-stage target P [B, S, K] fp32: ``head_prob_sum`` on each query's selected keys."""
    with torch.no_grad():
        valid = indices >= 0
        return head_prob_sum(attn_q, gather_keys(attn_k, indices), valid, scale, lse).float()


def selected_index_logits(index_q, index_k, index_w, indices, relu):
    """Indexer logits I [B, S, K] on each query's selected keys (0 on slots with index -1)."""
    k_sel = gather_keys(index_k, indices)  # [B, S, K, D]
    dt = compute_dtype(index_q, index_k, index_w)
    logits = torch.einsum("bshd,bskd->bshk", index_q.to(dt), k_sel.to(dt))
    if relu:
        logits = logits.clamp_min(0)
    return (logits * index_w.to(dt)[..., None]).sum(2)


def indexer_kl_given_target_reference(index_q, index_k, index_w, indices, target, *, relu=True, reduction="mean",
                                      index_lse=None):
    """``indexer_kl_loss_reference``'s sparse stage with the target P [B, S, K] given (unnormalised,
    detached; slots with index -1 count as 0), and optionally the logits' lse over the selection
    (``index_lse`` [B, S]: see ``kl_rows``)."""
    valid = indices >= 0
    index_logits = selected_index_logits(index_q, index_k, index_w, indices, relu)
    p = normalised(torch.where(valid, target.detach().to(index_logits.dtype), 0.0))
    return reduce_kl(kl_rows(p, index_logits, valid, index_lse), valid.any(-1), reduction)


def kl_rows(p: torch.Tensor, index_logits: torch.Tensor, valid: torch.Tensor,
            index_lse: torch.Tensor | None = None) -> torch.Tensor:
    """KL(p || softmax(index_logits)) per row over ``valid`` keys; 0 * log 0 = 0. With ``index_lse``
    (detached, [rows]) the log-probabilities are ``I - index_lse`` and the logits' gradient
    ``exp(I - index_lse) - p`` (the KL's where index_lse is their lse): the value takes the given lse,
    and ``mass - mass.detach()`` (0 in value, gradient ``exp(I - index_lse)``) gives the gradient."""
    if index_lse is None:
        logq = torch.log_softmax(index_logits.masked_fill(~valid, float("-inf")), dim=-1)
    else:
        lse = index_lse.detach().to(index_logits.dtype)
        lse = torch.where(valid.any(-1), lse, torch.zeros_like(lse))[..., None]  # rows without a key: unused
        shifted = torch.where(valid, index_logits - lse, torch.full_like(index_logits, float("-inf")))
        mass = torch.exp(shifted).sum(-1, keepdim=True)
        logq = index_logits - lse - (mass - mass.detach())
    logq = torch.where(valid, logq, torch.zeros_like(logq))
    plogp = torch.where(p > 0, p * torch.log(p.clamp_min(torch.finfo(p.dtype).tiny)), torch.zeros_like(p))
    return (plogp - p * logq).sum(-1)


def indexer_kl_loss_reference(
    index_q,
    index_k,
    index_w,
    attn_q,
    attn_k,
    indices=None,
    *,
    attn_lse=None,
    scale,
    relu=True,
    cu_seqlens=None,
    window_start=None,
    chunk_size=None,
    reduction="mean",
):
    """KL(p || softmax(I)) per query, with p the detached head-summed attention distribution.

    Sparse stage (``indices`` given): over each query's selected set. Dense warm-up
    (``indices=None``): over all visible keys, a query chunk at a time; each chunk is
    checkpointed so forward and backward memory stay O(chunk * T).
    Returns a scalar (``reduction`` "mean" over queries with a visible key, or "sum"), or the
    per-query KL [B, S] with ``reduction="none"``. Gradients reach index_q, index_k, index_w only.
    """
    attn_q, attn_k = attn_q.detach(), attn_k.detach()
    attn_lse = None if attn_lse is None else attn_lse.detach()
    B, S, H, _ = index_q.shape
    T = index_k.shape[1]
    if indices is not None:
        valid = indices >= 0
        index_logits = selected_index_logits(index_q, index_k, index_w, indices, relu)
        with torch.no_grad():
            p = attention_target(attn_q, gather_keys(attn_k, indices), valid, scale, attn_lse)
        kl = kl_rows(p.to(index_logits.dtype), index_logits, valid)
        has_key = valid.any(-1)
    else:
        start, end = query_windows(B, S, T, cu_seqlens=cu_seqlens, window_start=window_start, device=index_q.device)
        chunk = query_chunk(B, max(H, attn_q.shape[2]), T, chunk_size, index_q.device)
        pieces = []
        for c0 in range(0, S, chunk):
            c1 = min(S, c0 + chunk)
            if torch.compiler.is_compiling() or index_q.device.type == "meta":
                lo, hi = 0, T - S + c1  # bounds without reading the windows (which neither can do)
            else:
                lo, hi = int(start[:, c0:c1].min()), int(end[:, c0:c1].max()) + 1
            visible = visible_mask(start[:, c0:c1], end[:, c0:c1], lo, hi)
            lse_c = None if attn_lse is None else attn_lse[:, c0:c1]

            def chunk_kl(iq, ik, iw, aq, ak, lse_c=lse_c, visible=visible):
                index_logits = indexer_logits_block(iq, ik, iw, relu)
                with torch.no_grad():
                    p = attention_target(aq, ak, visible, scale, lse_c)
                return kl_rows(p.to(index_logits.dtype), index_logits, visible)

            args = (index_q[:, c0:c1], index_k[:, lo:hi], index_w[:, c0:c1], attn_q[:, c0:c1], attn_k[:, lo:hi])
            if torch.is_grad_enabled():
                pieces.append(checkpoint(chunk_kl, *args, use_reentrant=False))
            else:
                pieces.append(chunk_kl(*args))
        kl = torch.cat(pieces, dim=1)
        has_key = end >= start
    return reduce_kl(kl, has_key, reduction)


def reduce_kl(kl: torch.Tensor, has_key: torch.Tensor, reduction: str) -> torch.Tensor:
    """The per-query KL ``[B, S]`` reduced as ``reduction`` asks ("mean" over queries with a key)."""
    if reduction == "none":
        return kl
    if reduction == "sum":
        return kl.sum()
    if reduction == "mean":
        return kl.sum() / has_key.sum().clamp_min(1)
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
