"""Pure-torch reference ops: the test oracles and the CPU path.

Everything here is exact under the contracts of docs/design.md section 2 and keeps memory at
O(query_chunk * T): no function materialises a whole ``[S, H, T]`` or ``[S, T]`` table except
``indexer_scores``, which exists for tests and says so.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# Bytes one query chunk may use for its [B, chunk, H, T_window] fp32 block. On a GPU the chunked
# loops are bound by launch and Python overhead long before memory (a 32 MiB block is 64 queries of
# an 8-head, 8K-token, batch-2 indexer: 128 chunks per layer call), so chunks are larger there.
SCORE_CHUNK_BYTES = 32 * 2**20
SCORE_CHUNK_BYTES_CUDA = 512 * 2**20


def chunk_budget_bytes(device) -> int:
    """Bytes a query chunk's fp32 score block may take on ``device``."""
    return SCORE_CHUNK_BYTES_CUDA if torch.device(device).type == "cuda" else SCORE_CHUNK_BYTES

_INT32_MIN = -(2**31)
_MASKED_KEY = _INT32_MIN  # never selected
_NAN_KEY = _INT32_MIN + 1  # ranks below -inf (whose key is larger), above masked


# ----------------------------------------------------------------------------- visibility


def query_windows(batch: int, queries: int, num_keys: int, *, cu_seqlens=None, window_start=None, device=None):
    """Visible key window of each query: key s is visible to query i iff start <= s <= end.

    Query i sits at key position ``T - S + i`` (``end``). ``cu_seqlens`` (packed, B = 1, S = T)
    moves ``start`` to the first token of the query's sequence; ``window_start`` ([B, S] or [B]
    integer, e.g. the first non-pad key with left padding) raises it further.
    Returns ``(start, end)`` as int64 ``[B, S]``.
    """
    end = torch.arange(num_keys - queries, num_keys, device=device, dtype=torch.int64).expand(batch, queries)
    start = torch.zeros(batch, queries, dtype=torch.int64, device=device)
    if cu_seqlens is not None:
        cu = cu_seqlens.to(device=device, dtype=torch.int64)
        pos = torch.arange(queries, device=device, dtype=torch.int64)
        seq_id = torch.searchsorted(cu[1:], pos, right=True)
        start = cu[seq_id].expand(batch, queries)
    if window_start is not None:
        ws = window_start.to(device=device, dtype=torch.int64)
        ws = ws[:, None].expand(batch, queries) if ws.dim() == 1 else ws
        start = torch.maximum(start, ws)
    return start.contiguous(), end.contiguous()


def _chunk_size(batch: int, heads: int, window: int, requested: int | None, device) -> int:
    if requested is not None:
        return max(1, requested)
    return max(1, chunk_budget_bytes(device) // max(1, 4 * batch * heads * window))


def _compute_dtype(*tensors) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


# ----------------------------------------------------------------------------- indexer scores


def indexer_logits_block(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, relu: bool = True, workspace: torch.Tensor | None = None
) -> torch.Tensor:
    """``sum_h w[.., h] * ReLU(q[.., h, :] . k[s, :])`` for a block: q [B, c, H, D], k [B, T, D],
    w [B, c, H] -> [B, c, T] in fp32 (fp64 if any input is fp64).

    ``workspace`` (no-grad callers): a flat buffer of at least B*c*H*T elements of the compute dtype
    that holds the per-head logits, so a loop over chunks reuses one block instead of allocating
    (and fragmenting) a fresh one per chunk.
    """
    dt = _compute_dtype(q, k, w)
    B, c, H, D = q.shape
    T = k.shape[1]
    if workspace is None:
        logits = torch.einsum("bchd,btd->bcht", q.to(dt), k.to(dt))
        if relu:
            logits = logits.clamp_min(0)
        return (logits * w.to(dt)[..., None]).sum(dim=2)
    logits = workspace[: B * c * H * T].view(B, c * H, T)
    torch.bmm(q.reshape(B, c * H, D).to(dt), k.to(dt).transpose(1, 2), out=logits)
    logits = logits.view(B, c, H, T)
    if relu:
        logits.clamp_min_(0)
    logits.mul_(w.to(dt)[..., None])
    return logits.sum(dim=2)


def _visible_mask(start, end, lo: int, hi: int) -> torch.Tensor:
    """[B, c, hi - lo] bool: key lo + j visible to each query of the chunk."""
    s = torch.arange(lo, hi, device=start.device)
    return (s >= start[..., None]) & (s <= end[..., None])


def indexer_scores(q, k, w, *, relu=True, cu_seqlens=None, window_start=None) -> torch.Tensor:
    """Full ``[B, S, T]`` fp32 score table with invisible keys at ``-inf``.

    For tests and small inputs only: this is the O(S*T) table HyTopK exists to avoid.
    """
    B, S = q.shape[:2]
    T = k.shape[1]
    start, end = query_windows(B, S, T, cu_seqlens=cu_seqlens, window_start=window_start, device=q.device)
    scores = indexer_logits_block(q, k, w, relu).float()
    return scores.masked_fill(~_visible_mask(start, end, 0, T), float("-inf"))


# ----------------------------------------------------------------------------- exact top-k


def score_sort_keys(scores: torch.Tensor, visible: torch.Tensor, key_offset: int = 0) -> torch.Tensor:
    """int64 keys whose descending order is the tie rule: score descending, then key index ascending.

    ``-0.0`` ranks as ``+0.0``; NaN ranks below ``-inf``; invisible keys get the lowest key of all.
    The low 32 bits hold ``~index``, so keys are unique and any top-k over them is one exact set.
    """
    s = scores.float() + 0.0  # -0.0 + 0.0 == +0.0: one bit pattern for zero
    bits = s.view(torch.int32)
    mono = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(torch.int64)  # order-preserving
    mono = torch.where(torch.isnan(s), torch.full_like(mono, _NAN_KEY), mono)
    mono = torch.where(visible, mono, torch.full_like(mono, _MASKED_KEY))
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
    valid = (top >> 32) != _MASKED_KEY
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
    start, end = query_windows(B, S, T, cu_seqlens=cu_seqlens, window_start=window_start, device=q.device)
    idx_out = torch.empty(B, S, topk, dtype=torch.int32, device=q.device)
    score_out = torch.empty(B, S, topk, dtype=torch.float32, device=q.device)
    chunk = _chunk_size(B, H, T, chunk_size, q.device)
    dt = _compute_dtype(q, k, w)
    k = k.to(dt)  # once, not per chunk
    workspace = torch.empty(B * min(chunk, S) * H * T, dtype=dt, device=q.device)
    for c0 in range(0, S, chunk):
        c1 = min(S, c0 + chunk)
        # Score only the keys some query of the chunk can see (early causal chunks see few).
        lo = int(start[:, c0:c1].min())
        hi = int(end[:, c0:c1].max()) + 1
        scores = indexer_logits_block(q[:, c0:c1], k[:, lo:hi], w[:, c0:c1], relu, workspace).float()
        visible = _visible_mask(start[:, c0:c1], end[:, c0:c1], lo, hi)
        if check_nan and bool(torch.isnan(scores[visible]).any()):
            raise ValueError("hytopk: NaN indexer score found (check_nan=True); inputs q, k or w hold NaN/inf")
        idx_out[:, c0:c1], score_out[:, c0:c1] = select_topk(scores, visible, topk, key_offset=lo)
    return idx_out, score_out


# ----------------------------------------------------------------------------- sparse attention


def _gather_keys(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """x [B, T, ...] gathered at indices [B, S, K] (-1 -> row 0, masked later) -> [B, S, K, ...]."""
    b = torch.arange(x.shape[0], device=x.device)[:, None, None]
    return x[b, indices.clamp_min(0).long()]


def sparse_attention_reference(q, k, v, indices, scale):
    """Attention of each query over its selected keys only.

    q [B, S, Hq, Dqk], k [B, T, Hkv, Dqk], v [B, T, Hkv, Dv], indices [B, S, K] int32 (-1 skipped).
    Returns o [B, S, Hq, Dv] (q's dtype; zeros for a query with no key) and lse [B, S, Hq] fp32
    (``-inf`` there). Differentiable in q, k, v through torch autograd.
    """
    B, S, Hq, _ = q.shape
    Hkv, Dv = k.shape[2], v.shape[-1]
    G = Hq // Hkv
    dt = _compute_dtype(q, k, v)
    valid = indices >= 0  # [B, S, K]
    kg = _gather_keys(k, indices).to(dt)  # [B, S, K, Hkv, D]
    vg = _gather_keys(v, indices).to(dt)
    qg = q.to(dt).view(B, S, Hkv, G, -1)
    logits = torch.einsum("bshgd,bskhd->bshgk", qg, kg) * scale
    logits = logits.masked_fill(~valid[:, :, None, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    any_valid = valid.any(-1)[:, :, None, None]
    p = torch.exp(logits - torch.where(any_valid, lse, torch.zeros_like(lse))[..., None])
    o = torch.einsum("bshgk,bskhd->bshgd", p, vg)
    lse = lse.masked_fill(~any_valid, float("-inf"))
    return o.reshape(B, S, Hq, Dv).to(q.dtype), lse.reshape(B, S, Hq).to(torch.float32 if dt != torch.float64 else dt)


def tile_unions_reference(indices: torch.Tensor, tile_q: int, num_keys: int):
    """Query tiles of ``tile_q`` consecutive queries: sorted union of their keys + membership bits.

    The key lists of the tiled GQA sparse attention kernels (``sparse_attention._union_tiles``; the
    Triton build is ``_tile_unions.tile_unions``). indices int32 [B, S, K] (-1 and keys outside
    [0, num_keys) skipped); n = cdiv(S, tile_q) tiles per sequence, the last one padded with empty
    queries. Returns ``(union, num, bits)``: union int32 [B, n, max_u] (each tile's distinct keys
    ascending, -1 padded; max_u = max(1, widest tile)), num int32 [B, n] (keys per tile) and bits
    int32 [B * n * tile_q, 4 * cdiv(max_u, 128)] (bit u of a query's row: the query selected union
    slot u; whole 128-slot groups, so a kernel block of <= 128 slots never reads past a row).
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
    max_u = max(1, int(num.max())) if num.numel() else 1
    rows = torch.arange(B * n_tiles, device=idx.device)[:, None].expand_as(first)
    union = torch.full((B * n_tiles, max_u), -1, dtype=torch.int32, device=idx.device)
    union[rows[first], slot[first].long()] = srt[first]
    words = 4 * (-(-max_u // 128))
    bit_row = rows * tile_q + order // K  # the query (row of bits) each sorted entry belongs to
    flat = (bit_row * words + (slot // 32))[valid]
    bits = torch.zeros(B * n_tiles * tile_q * words, dtype=torch.int32, device=idx.device)
    bits.scatter_add_(0, flat, torch.bitwise_left_shift(torch.ones_like(slot), slot % 32)[valid])  # distinct bits: + is |
    return union.view(B, n_tiles, max_u), num.view(B, n_tiles), bits.view(-1, words)


# ----------------------------------------------------------------------------- indexer KL loss


def _attention_target(attn_q, attn_k_sel, valid, scale, attn_lse):
    """Head-summed, L1-normalised attention probabilities [..., K] over a key set (detached).

    attn_q [B, c, Hq, Dqk]; attn_k_sel [B, c, K, Hkv, Dqk] (per-query sets) or [B, K, Hkv, Dqk]
    (one key window shared by the chunk); valid [B, c, K]; attn_lse [B, c, Hq] (optional: the lse
    the attention itself computed over the same set).
    """
    B, c, Hq, _ = attn_q.shape
    Hkv = attn_k_sel.shape[-2]
    dt = _compute_dtype(attn_q, attn_k_sel)
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
    p = probs.sum(dim=2)
    return p / p.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(dt).tiny)


def _kl_rows(p: torch.Tensor, index_logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """KL(p || softmax(index_logits)) per row over ``valid`` keys; 0 * log 0 = 0."""
    logq = torch.log_softmax(index_logits.masked_fill(~valid, float("-inf")), dim=-1)
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
        k_sel = _gather_keys(index_k, indices)  # [B, S, K, D]
        dt = _compute_dtype(index_q, index_k, index_w)
        logits = torch.einsum("bshd,bskd->bshk", index_q.to(dt), k_sel.to(dt))
        if relu:
            logits = logits.clamp_min(0)
        index_logits = (logits * index_w.to(dt)[..., None]).sum(2)
        with torch.no_grad():
            p = _attention_target(attn_q, _gather_keys(attn_k, indices), valid, scale, attn_lse)
        kl = _kl_rows(p.to(index_logits.dtype), index_logits, valid)
        has_key = valid.any(-1)
    else:
        start, end = query_windows(B, S, T, cu_seqlens=cu_seqlens, window_start=window_start, device=index_q.device)
        chunk = _chunk_size(B, max(H, attn_q.shape[2]), T, chunk_size, index_q.device)
        pieces = []
        for c0 in range(0, S, chunk):
            c1 = min(S, c0 + chunk)
            lo, hi = int(start[:, c0:c1].min()), int(end[:, c0:c1].max()) + 1
            visible = _visible_mask(start[:, c0:c1], end[:, c0:c1], lo, hi)
            lse_c = None if attn_lse is None else attn_lse[:, c0:c1]

            def chunk_kl(iq, ik, iw, aq, ak, lse_c=lse_c, visible=visible):
                index_logits = indexer_logits_block(iq, ik, iw, relu)
                with torch.no_grad():
                    p = _attention_target(aq, ak, visible, scale, lse_c)
                return _kl_rows(p.to(index_logits.dtype), index_logits, visible)

            args = (index_q[:, c0:c1], index_k[:, lo:hi], index_w[:, c0:c1], attn_q[:, c0:c1], attn_k[:, lo:hi])
            if torch.is_grad_enabled():
                pieces.append(checkpoint(chunk_kl, *args, use_reentrant=False))
            else:
                pieces.append(chunk_kl(*args))
        kl = torch.cat(pieces, dim=1)
        has_key = end >= start
    if reduction == "none":
        return kl
    if reduction == "sum":
        return kl.sum()
    if reduction == "mean":
        return kl.sum() / has_key.sum().clamp_min(1)
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


# ----------------------------------------------------------------------------- dense layer parts


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Llama/GLM RMSNorm as Transformers writes it (statistics in fp32, scale after the cast)."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def swiglu_mlp_reference(x, w_gate, w_up, w_down) -> torch.Tensor:
    """The bias-free SwiGLU MLP: ``down(silu(gate(x)) * up(x))``."""
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


def absorbed_query(q_nope, q_rot, w_uk):
    """MLA's absorbed query ``[q_nope . W_UK per head, q_rot]`` [B, S, H, C + R], in q_nope's dtype."""
    q_latent = torch.einsum("bshn,hnc->bshc", q_nope, w_uk.to(q_nope.dtype))
    return torch.cat([q_latent, q_rot.to(q_latent.dtype)], dim=-1)


def mla_sparse_attention_reference(q_nope, q_rot, w_uk, kv, indices, value_dim: int, scale: float):
    """MLA absorbed-form sparse attention as a plain composition (see ``mla_attention``).

    attn_q = ``absorbed_query(q_nope, q_rot, w_uk)``; attention over the selected rows of ``kv``
    [B, T, 1, C + R] with values its first ``value_dim`` dims. Returns (o, lse, attn_q).
    """
    attn_q = absorbed_query(q_nope, q_rot, w_uk)
    o, lse = sparse_attention_reference(attn_q, kv, kv[..., :value_dim], indices, scale)
    return o, lse, attn_q


def cross_entropy_reference(hidden, head, labels, *, ignore_index: int = -100, num_items_in_batch=None):
    """What ``lm_loss.chunked_cross_entropy`` computes, with the whole logits at once (Transformers'
    ``ForCausalLMLoss`` after the label shift: fp32 logits, sum / num_items_in_batch or the mean)."""
    logits = head(hidden.reshape(-1, hidden.shape[-1])).float()
    y = labels.reshape(-1)
    if num_items_in_batch is None:
        return F.cross_entropy(logits, y, ignore_index=ignore_index)
    return F.cross_entropy(logits, y, ignore_index=ignore_index, reduction="sum") / num_items_in_batch
