"""The indexer KL loss over all keys under a mask: the fast CPU path for short key ranges.

The reference (``naive.py``) gathers each query's selected indexer and attention keys into
``[B, S, K, ...]`` copies in the sparse stage, and runs the dense warm-up loss in checkpointed query
chunks (so at long contexts its memory stays ``O(chunk * T)``, at the price of a second forward in
backward). For a short key range both are cheaper as matmuls over every key with an additive bias
per (query, key): the log of how often the query lists the key in the sparse stage (``-inf`` when
never, as in sparse attention's masked-dense path), ``0`` / ``-inf`` for visible / hidden keys in the
warm-up. Both distributions are then softmaxes over all keys with that bias, which equal the
reference's over the selected multiset: a key listed ``m`` times carries ``m`` times one listing's
probability under both, so each term of the KL is the reference's ``m`` terms added.

Memory: autograd keeps the indexer's per-head logits ``[B, S, H, T]`` and the log-probabilities
``[B, S, T]``; the attention's per-head logits ``[B, chunk, Hq, T]`` live one query chunk at a time.
Measured on 2 cores at SmolLM2's shape (1024 tokens, a 2 x 64 indexer, 9 / 3 attention heads of 64):
the sparse-stage loss with its backward went from 0.16 s to 0.05 s a layer, the warm-up loss from
0.09 s to 0.05 s.
"""

from __future__ import annotations

import torch

from ..checks import has_values
from ..sparse_attn.masked_dense import MAX_KEYS_PER_SELECTED, selection_bias
from ..topk.naive import indexer_logits_block
from ..windows import compute_dtype, query_windows, visible_mask

# Bound on the [B, S, H + 3, T] fp32 bytes alive at once: the indexer's per-head logits and its
# log-probabilities (kept for backward), the key bias and the target.
MAX_SAVED_BYTES = 256 * 2**20
# The attention's [B, chunk, Hq, T] logits of one query chunk (no grad).
CHUNK_BYTES = 64 * 2**20


def fits(index_q, index_k, index_w, attn_q, attn_k, indices) -> bool:
    """Whether this path is the cheaper torch path for these inputs (and its memory is small).

    Only for finite inputs on a CPU, outside ``torch.compile``: every key enters the matmuls here
    (an unselected or hidden one with weight 0), so a NaN or inf in its row would reach queries the
    reference keeps it from. In the sparse stage (``indices`` given) the key range must be at most
    ``MAX_KEYS_PER_SELECTED`` times the selection, as for sparse attention's masked-dense path.
    """
    B, S, H = index_q.shape[:3]
    T = index_k.shape[1]
    if index_q.device.type != "cpu" or 4 * B * S * T * (H + 3) > MAX_SAVED_BYTES:
        return False
    if indices is not None and T > MAX_KEYS_PER_SELECTED * max(1, indices.shape[-1]):
        return False
    tensors = (index_q, index_k, index_w, attn_q, attn_k)
    if any(t.numel() == 0 for t in tensors):
        return False  # empty inputs: the reference
    if torch.compiler.is_compiling() or not all(has_values(t) for t in tensors):
        return False  # shape propagation (meta, fake tensors) or tracing: no values to check
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def key_bias(indices, start, end, num_keys: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, S, T]`` logit offsets: the selection's log-multiplicities (``indices`` ``[B, S, K]``), or
    ``0`` / ``-inf`` for the keys visible / hidden in the windows ``start``, ``end``."""
    if indices is not None:
        return selection_bias(indices, num_keys, dtype)
    visible = visible_mask(start, end, 0, num_keys)
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, float("-inf"))


def indexer_kl_masked_dense(index_q, index_k, index_w, attn_q, attn_k, indices=None, *, attn_lse=None, scale,
                            relu=True, cu_seqlens=None, window_start=None):
    """Per-query KL ``[B, S]`` and whether each query has a key ``[B, S]``: the contract of
    ``naive.indexer_kl_loss_reference`` with ``reduction="none"`` (gradients reach index_q, index_k,
    index_w only). ``indices`` None is the dense warm-up loss over the windows of ``cu_seqlens`` and
    ``window_start``."""
    B, S, _, _ = index_q.shape
    T, Hkv = attn_k.shape[1], attn_k.shape[2]
    Hq = attn_q.shape[2]
    dt = compute_dtype(index_q, index_k, index_w, attn_q, attn_k)
    start, end = query_windows(B, S, T, cu_seqlens=cu_seqlens, window_start=window_start, device=index_q.device)
    bias = key_bias(indices, start, end, T, dt)  # [B, S, T], within MAX_SAVED_BYTES (fits)
    has_key = torch.isfinite(bias).any(-1)  # [B, S]
    bias = bias.masked_fill(~has_key[..., None], 0.0)  # a query with no key: finite softmaxes, KL set to 0 below
    with torch.no_grad():
        target = torch.empty(B, S, T, dtype=dt, device=index_q.device)
        kt = attn_k.detach().to(dt).permute(0, 2, 3, 1)[:, :, None]  # [B, Hkv, 1, D, T]
        for c0, c1 in _chunks(S, CHUNK_BYTES // (4 * B * Hq * T)):
            qc = attn_q[:, c0:c1].detach().to(dt).view(B, c1 - c0, Hkv, Hq // Hkv, -1).permute(0, 2, 3, 1, 4)
            logits = (torch.matmul(qc, kt) * scale).flatten(1, 2) + bias[:, None, c0:c1]  # [B, Hq, c, T]
            if attn_lse is None:
                probs = torch.softmax(logits, dim=-1)
            else:  # the attention's own lse over the same set; a query without keys has -inf there
                lse = attn_lse[:, c0:c1].detach().to(dt).transpose(1, 2)
                probs = torch.exp(logits - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
            p = probs.sum(dim=1)  # [B, c, T], head-summed
            target[:, c0:c1] = p / p.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(dt).tiny)
        target.masked_fill_(~has_key[..., None], 0.0)
        plogp = torch.where(target > 0, target * torch.log(target.clamp_min(torch.finfo(dt).tiny)), 0.0).sum(-1)
    logq = torch.log_softmax(indexer_logits_block(index_q, index_k, index_w, relu).to(dt) + bias, dim=-1)
    cross = torch.where(target > 0, target * logq, 0.0).sum(-1)
    return plogp - cross, has_key


def _chunks(n: int, size: int):
    size = max(1, size)
    return [(c0, min(n, c0 + size)) for c0 in range(0, n, size)]
