"""Shared glue for the DeepSeek-style MLA + lightning-indexer families (GLM-5, DeepSeek-V3.2, ...).

Every DSA family in Transformers builds the indexer's full ``[B, S, H, T]`` score table, a dense
``[B, 1, S, T]`` mask, and runs dense attention under that mask. A patched attention module
instead:

1. projects queries and the compressed KV latents exactly as the family does (family hooks),
2. runs the indexer on detached inputs and selects with ``hytopk`` (IndexShare "shared" layers take
   their source layer's indices of the same forward call through ``reuse_indices``),
3. attends in MLA absorbed form with ``sparse_attention`` (one latent row per token, Hkv = 1),
4. adds the indexer KL loss through ``attach_indexer_loss`` when training.

The model-level mask goes through a registered attention implementation ("hyscale_dsa") whose mask
function returns only the 2-D padding mask, so no ``[B, 1, S, T]`` tensor is ever built.
Family files subclass ``MLADSAFamily`` and override the hooks where their model differs (RoPE
layout, query projection, output gates, attention sinks, names).
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..indexer import attach_indexer_loss
from ..kernels import hytopk, indexer_kl_loss, mla_sparse_attention, sparse_attention
from ..kernels.sparse_attn.mla_query import absorbed_query
from ..kernels.windows import chunk_budget_bytes, query_windows
from ..replay import reuse_indices
from ..state import PatchState
from ..training import observe_selection
from ._chunked_lm_loss import apply_chunked_lm_loss
from ._lean_layers import apply_lean_layers

ATTN_IMPLEMENTATION = "hyscale_dsa"


# ----------------------------------------------------------------------------- attention implementation


def _padding_mask_only(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """Mask function of "hyscale_dsa": return the 2-D padding mask (or None), never a 4-D one.

    Patched attention derives each query's visible window from it (left padding) and from
    ``position_ids`` / ``cu_seq_lens_*`` (packed sequences). A row must be one block of real tokens
    (left and/or right padding); a mask with holes cannot be expressed as a key window.
    """
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise ValueError(
            f"hyscale_hf patched DSA attention takes a 2-D padding mask [batch, keys]; got shape {tuple(attention_mask.shape)}"
        )
    mask = attention_mask.to(torch.bool)
    as_int = mask.to(torch.int8)
    rises = (as_int[:, 1:] > as_int[:, :-1]).sum(-1) + as_int[:, 0]
    if bool((rises > 1).any()):
        raise ValueError(
            "attention_mask rows must hold one contiguous block of real tokens (left and/or right padding); "
            "got a row with holes. Use left padding for batched generate()."
        )
    return mask


def _refuse_unpatched(module, *args, **kwargs):
    raise RuntimeError(
        f"{type(module).__name__} runs with attn_implementation={ATTN_IMPLEMENTATION!r} but was not patched by "
        "hyscale_hf; call hyscale_hf.unpatch_model(model) before changing the model's modules"
    )


def register_attention_implementation() -> None:
    """Register "hyscale_dsa" in both AttentionInterface and AttentionMaskInterface (idempotent)."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _refuse_unpatched)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _padding_mask_only)


# ----------------------------------------------------------------------------- family hooks


class MLADSAFamily:
    """Defaults follow DeepSeek-V3.2; a family file overrides what its model does differently.

    Attributes set by subclasses:
        model_type: ``config.model_type`` the family registers for.
        attention_class: the Transformers attention module class to patch.
        main_rope: the family's RoPE function for the main attention, ``(q, k, cos, sin, unsqueeze_dim=...)``
            (a ``staticmethod``).
        indexer_rope: the family's RoPE function for the indexer (same signature, a ``staticmethod``).
        indexer_rope_first: RoPE on the first ``qk_rope_head_dim`` dims of the indexer head (else the last).
        relu: the family's own choice of ReLU on the per-head indexer logits.
        returns_indices: the attention returns ``(out, weights, topk_indices)`` (IndexShare families).
    """

    model_type: str = ""
    attention_class: type = None
    main_rope: Callable = None
    indexer_rope: Callable = None
    indexer_rope_first: bool = True
    relu: bool = True
    returns_indices: bool = False

    # --- main attention

    def query(self, attn, x: torch.Tensor, position_ids):
        """-> (q_nope [B, S, H, nope], q_rot [B, S, H, rope] before RoPE, indexer query input, gate or None)."""
        q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
        q = attn.q_b_proj(q_resid).view(*x.shape[:-1], attn.num_heads, attn.qk_head_dim)
        q_nope, q_rot = torch.split(q, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
        return q_nope, q_rot, q_resid, None

    def latent_kv(self, attn, x: torch.Tensor):
        """-> (normalised latent [B, S, kv_lora_rank], k_rot [B, S, rope] before RoPE) of this call's tokens."""
        compressed = attn.kv_a_proj_with_mqa(x)
        kv_pass, k_rot = torch.split(compressed, [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
        return attn.kv_a_layernorm(kv_pass), k_rot

    def apply_main_rope(self, attn, q_rot, k_rot, cos, sin):
        """q_rot [B, S, H, r], k_rot [B, S, r] -> both rotated (the family's layout)."""
        q_rot, k_rot = self.main_rope(q_rot, k_rot[:, :, None], cos, sin, unsqueeze_dim=2)
        return q_rot, k_rot[:, :, 0]

    def all_keys(self, attn, latent, k_rot, cache, queries: int, kwargs: dict):
        """-> (latent [B, T, C], k_rot [B, T, R] of every visible token, past = T - S).

        Appends this call's latents to the KV cache (when there is one) and returns the cached ones too.
        """
        if cache is None:
            return latent, k_rot, 0
        past = _past_length(cache, attn.layer_idx)
        latent, k_rot = _update_latent_cache(cache, attn.layer_idx, latent, k_rot, past)
        return latent, k_rot, past

    def scale_query(self, attn, q_nope, q_rot, position_ids):
        """Hook for per-position query scaling after RoPE (Mistral-Large-4); identity by default."""
        return q_nope, q_rot

    def finish_output(self, attn, x: torch.Tensor, o: torch.Tensor, gate) -> torch.Tensor:
        """o [B, S, H, v_head_dim] -> [B, S, H * v_head_dim], the input of o_proj (gates go here)."""
        return o.reshape(*o.shape[:2], -1)

    def sinks(self, attn) -> torch.Tensor | None:
        """Per-head attention-sink logits [H] (an extra softmax term with no value), or None."""
        return None

    # --- indexer

    def indexer(self, attn):
        """The attention's own indexer module, or None on an IndexShare "shared" layer."""
        return getattr(attn, "indexer", None)

    def is_shared_layer(self, attn) -> bool:
        return bool(getattr(attn, "skip_topk", False))

    def sliding_window(self, attn) -> int | None:
        """Window W of a sliding-window layer (keys q - W < s <= q), None for DSA and full layers."""
        return None

    def indexer_key(self, indexer, x: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE indexer key [B, S, D]."""
        return indexer.k_norm(indexer.wk(x))

    def indexer_query(self, indexer, x: torch.Tensor, q_input: torch.Tensor, position_ids) -> torch.Tensor:
        """Pre-RoPE indexer query [B, S, H, D]."""
        return indexer.wq_b(q_input).view(*x.shape[:-1], indexer.n_heads, indexer.head_dim)

    def indexer_uses_rope(self, indexer) -> bool:
        return True

    def indexer_weights(self, indexer, x: torch.Tensor) -> torch.Tensor:
        """w [B, S, H] fp32 with every positive scale folded in: ReLU(c * s) = c * ReLU(s) for c > 0."""
        w = indexer.weights_proj(x.to(indexer.weights_proj.weight.dtype)).float()
        return w * (indexer.n_heads**-0.5 * indexer.softmax_scale)

    def indexer_qkw(self, indexer, x, q_input, cos, sin, position_ids):
        """-> (q [B, S, H, D], k [B, S, D], w [B, S, H] fp32), as the family's indexer computes them."""
        q = self.indexer_query(indexer, x, q_input, position_ids)
        k = self.indexer_key(indexer, x)[:, :, None]
        if self.indexer_uses_rope(indexer):
            r, d = indexer.qk_rope_head_dim, indexer.head_dim
            sizes = [r, d - r] if self.indexer_rope_first else [d - r, r]
            q_parts, k_parts = list(torch.split(q, sizes, dim=-1)), list(torch.split(k, sizes, dim=-1))
            i = 0 if self.indexer_rope_first else 1
            q_parts[i], k_parts[i] = self.indexer_rope(q_parts[i], k_parts[i], cos, sin, unsqueeze_dim=2)
            q, k = torch.cat(q_parts, dim=-1), torch.cat(k_parts, dim=-1)
        return q, k[:, :, 0], self.indexer_weights(indexer, x)

    # --- config

    def model_index_config(self, config) -> tuple[int, int, int]:
        """(index_topk, index_n_heads, index_head_dim) of the model config."""
        return config.index_topk, config.index_n_heads, config.index_head_dim


# ----------------------------------------------------------------------------- visibility


def _first_real_key(mask: torch.Tensor) -> torch.Tensor:
    """[B] index of each row's first True (0 for an all-False row)."""
    return mask.to(torch.int8).argmax(dim=-1)


def _packed_starts(position_ids: torch.Tensor, batch: int) -> torch.Tensor | None:
    """[B, S] first token of each query's packed sequence from position_ids resets (Transformers' rule:
    a new sequence starts wherever the position does not rise by one), or None when there is no reset."""
    pos = position_ids.expand(batch, -1)
    first = torch.ones_like(pos[:, :1], dtype=torch.bool)
    is_start = torch.cat([first, pos[:, 1:] - pos[:, :-1] != 1], dim=1)
    if not bool(is_start[:, 1:].any()):
        return None
    arange = torch.arange(pos.shape[1], device=pos.device).expand_as(pos)
    return torch.where(is_start, arange, torch.zeros_like(arange)).cummax(dim=1).values


def key_windows(attention_mask, position_ids, kwargs: dict, batch: int, queries: int, keys: int):
    """(cu_seqlens, window_start) narrowing each query's visible keys, as hytopk takes them.

    Packed sequences come as ``cu_seq_lens_q/k`` kwargs (DataCollatorWithFlattening) or as
    ``position_ids`` resets; left padding comes from the 2-D padding mask. Resets are looked for
    whenever there is no cached prefix (``queries == keys``): Transformers looks only without a
    cache object and without a padding mask, so an unpatched model run with ``use_cache=True`` on a
    packed batch would attend across sequences; a patched one never selects across a boundary.
    """
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        cu = cu_q if cu_q is not None else cu_k
        if cu_q is not None and cu_k is not None and not torch.equal(cu_q, cu_k):
            raise ValueError("cu_seq_lens_q and cu_seq_lens_k must be equal for causal self-attention over packed sequences")
        if queries != keys:
            raise ValueError("cu_seq_lens_* (packed sequences) cannot be combined with a cached prefix")
        return cu.to(torch.int32), None
    window_start = None
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(
                f"hyscale_hf patched DSA attention takes a 2-D padding mask; got shape {tuple(attention_mask.shape)}"
            )
        if attention_mask.shape[-1] < keys:
            raise ValueError(f"attention_mask covers {attention_mask.shape[-1]} keys but there are {keys}")
        first = _first_real_key(attention_mask[:, :keys])
        window_start = first if bool(first.any()) else None
    if position_ids is not None and position_ids.dim() == 2 and queries == keys:
        starts = _packed_starts(position_ids, batch)
        if starts is not None:
            window_start = starts if window_start is None else torch.maximum(starts, window_start[:, None])
    return None, window_start


# ----------------------------------------------------------------------------- caches


def _past_length(cache, layer_idx: int) -> int:
    if layer_idx >= len(getattr(cache, "layers", ())):
        return 0
    return int(cache.get_seq_length(layer_idx))


def _indexer_keys(cache, layer_idx: int, new_keys: torch.Tensor, past: int, total: int) -> torch.Tensor:
    """All indexer keys [B, T, D] of this layer: the cached ones plus ``new_keys`` (appended to the cache).

    Uses the cache layer's own indexer key cache (Transformers' DynamicIndexedLayer/StaticIndexedLayer,
    so beam reordering and cropping keep it in step); a cache layer without one gets a per-layer
    tensor stored on the Cache object itself, so two caches never share state.
    """
    if cache is None:
        return new_keys
    layer = cache.layers[layer_idx] if layer_idx < len(getattr(cache, "layers", ())) else None
    if layer is not None and hasattr(layer, "update_indexer"):
        full = cache.update_indexer(new_keys.detach(), layer_idx)[:, :total]
    else:
        store = cache.__dict__.setdefault("_hyscale_indexer_keys", {})
        prev = store.get(layer_idx)
        prev_len = 0 if prev is None else prev.shape[1]
        if prev_len != past:
            raise RuntimeError(
                f"indexer key cache of layer {layer_idx} holds {prev_len} tokens but the KV cache holds {past}; "
                "this Cache was modified (cropped/reordered) in a way hyscale_hf cannot follow"
            )
        full = new_keys.detach() if prev is None else torch.cat([prev, new_keys.detach()], dim=1)
        store[layer_idx] = full
    if full.shape[1] != total:
        raise RuntimeError(f"indexer key cache of layer {layer_idx} has {full.shape[1]} keys, expected {total}")
    if new_keys.requires_grad:  # keep the graph to this call's keys (the cache holds detached copies)
        full = torch.cat([full[:, :past], new_keys], dim=1)
    return full


def _update_latent_cache(cache, layer_idx: int, latent: torch.Tensor, k_rot: torch.Tensor, past: int):
    """Append this call's latents [B, S, C] / [B, S, R] and return all of them [B, T, C], [B, T, R].

    Stored as [B, 1, S, *] single-head states, the layout Transformers' own MLA cache uses.
    """
    total = past + latent.shape[1]
    c_all, r_all = cache.update(latent[:, None], k_rot[:, None], layer_idx)
    return c_all[:, 0, :total], r_all[:, 0, :total]


# ----------------------------------------------------------------------------- MLA absorbed form


def _kv_b_weight(attn) -> torch.Tensor:
    """kv_b_proj as a matrix [H * (nope + v), kv_lora_rank], whatever wraps it (PEFT LoRA, ...)."""
    proj = attn.kv_b_proj
    if type(proj) is torch.nn.Linear:
        return proj.weight
    if proj.training and any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in proj.modules()):
        raise ValueError(
            "kv_b_proj has active dropout (e.g. LoRA dropout); MLA absorbed form needs it as one linear map: "
            "set lora_dropout=0 for kv_b_proj"
        )
    eye = torch.eye(attn.kv_lora_rank, device=attn.kv_b_proj.weight.device, dtype=attn.kv_b_proj.weight.dtype)
    zero = torch.zeros_like(eye[:1])
    return (proj(eye) - proj(zero)).t()


def _absorb_weights(attn):
    """(W_UK [H, nope, C], W_UV [H, v, C]) of kv_b_proj: q_nope . (W_UK c) == (W_UK^T q_nope) . c."""
    w = _kv_b_weight(attn).view(attn.num_heads, attn.qk_nope_head_dim + attn.v_head_dim, attn.kv_lora_rank)
    return w[:, : attn.qk_nope_head_dim], w[:, attn.qk_nope_head_dim :]


def _window_indices(batch, queries, keys, window, key_offset, cu_seqlens, window_start, device) -> torch.Tensor:
    """int32 [B, S, min(W, T)]: each query's last W visible keys (ascending, -1 padded), as positions in a
    key buffer that starts at absolute position ``key_offset`` (a sliding-window cache drops older keys)."""
    start, end = query_windows(batch, queries, keys, cu_seqlens=cu_seqlens, window_start=window_start, device=device)
    first = torch.maximum(start, end - (window - 1))
    idx = first[..., None] + torch.arange(min(window, keys), device=device)
    return torch.where(idx <= end[..., None], idx - key_offset, -1).to(torch.int32)


def _dense_attention(q, k, value_dim: int, scale: float, cu_seqlens, window_start, want_lse: bool):
    """Attention of every query over all its visible keys (the dense warm-up stage), MLA absorbed form.

    q [B, S, H, D], k [B, T, 1, D], v = k[..., :value_dim]. Plain causal inputs use SDPA (no mask);
    anything else (padding, packing, a cache offset, or when the lse is needed) runs query chunks
    with each chunk checkpointed, so memory stays O(chunk * T). Returns (o [B, S, H, value_dim], lse or None).
    """
    B, S, H, _ = q.shape
    T = k.shape[1]
    if cu_seqlens is None and window_start is None and S == T and not want_lse:
        qt = q.transpose(1, 2)
        kt = k.transpose(1, 2).expand(B, H, T, k.shape[-1])
        o = F.scaled_dot_product_attention(qt, kt, kt[..., :value_dim], is_causal=True, scale=scale)
        return o.transpose(1, 2), None
    start, end = query_windows(B, S, T, cu_seqlens=cu_seqlens, window_start=window_start, device=q.device)
    chunk = max(1, chunk_budget_bytes(q.device) // max(1, 4 * B * H * T))  # [B, c, H, W] fp32 logits
    outs, lses = [], []
    for c0 in range(0, S, chunk):
        c1 = min(S, c0 + chunk)
        lo, hi = int(start[:, c0:c1].min()), int(end[:, c0:c1].max()) + 1
        hi = max(hi, lo + 1)
        keys = torch.arange(lo, hi, device=q.device)
        visible = (keys >= start[:, c0:c1, None]) & (keys <= end[:, c0:c1, None])  # [B, c, W]

        def block(qc, kc, visible=visible):
            logits = torch.einsum("bchd,bkd->bchk", qc.float(), kc.float()) * scale
            logits = logits.masked_fill(~visible[:, :, None], float("-inf"))
            lse = torch.logsumexp(logits, dim=-1)
            safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
            p = torch.exp(logits - safe[..., None])
            o = torch.einsum("bchk,bkd->bchd", p, kc[..., :value_dim].float())
            return o.to(qc.dtype), lse

        args = (q[:, c0:c1], k[:, lo:hi, 0])
        o_c, lse_c = checkpoint(block, *args, use_reentrant=False) if torch.is_grad_enabled() else block(*args)
        outs.append(o_c)
        lses.append(lse_c)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


# ----------------------------------------------------------------------------- patched forward


def mla_dsa_attention_forward(
    self,
    hidden_states: torch.Tensor,
    position_embeddings=None,
    attention_mask=None,
    cache=None,
    past_key_values=None,
    position_ids=None,
    prev_topk_indices=None,
    **kwargs,
):
    """Patched forward of one MLA + indexer attention module (bound to the instance).

    Accepts both cache keyword names (``past_key_values`` on Transformers 5.17, ``cache`` later).
    Returns ``(attn_output, None, topk_indices)`` for IndexShare families, else ``(attn_output, None)``.
    """
    family: MLADSAFamily = self._hyscale_family
    state: PatchState = self._hyscale_state
    cfg = state.config
    if cache is None:
        cache = past_key_values
    if self.training and self.attention_dropout and torch.is_grad_enabled():
        raise ValueError(
            f"attention_dropout={self.attention_dropout} is not supported by hyscale_hf sparse attention; set it to 0"
        )
    x = hidden_states
    B, S, _ = x.shape
    cos, sin = position_embeddings

    q_nope, q_rot, q_index_input, gate = family.query(self, x, position_ids)
    latent, k_rot = family.latent_kv(self, x)
    q_rot, k_rot = family.apply_main_rope(self, q_rot, k_rot, cos, sin)
    q_nope, q_rot = family.scale_query(self, q_nope, q_rot, position_ids)
    latent, k_rot, past = family.all_keys(self, latent, k_rot, cache, S, kwargs)
    T = past + S  # keys visible to this call; a sliding-window cache returns only the last latent.shape[1]
    key_offset = T - latent.shape[1]

    w_uk, w_uv = _absorb_weights(self)
    attn_k = torch.cat([latent, k_rot.to(latent.dtype)], dim=-1)[:, :, None]  # [B, L, 1, C + R]
    value_dim = self.kv_lora_rank
    cu_seqlens, window_start = key_windows(attention_mask, position_ids, kwargs, B, S, T)

    indexer = family.indexer(self)
    shared_layer = family.is_shared_layer(self)
    window = family.sliding_window(self)
    if (indexer is not None or shared_layer or window is None) and key_offset:
        raise RuntimeError(f"layer {self.layer_idx}: the cache returned {latent.shape[1]} of {T} keys; only a "
                           "sliding-window layer may drop old keys")
    index_q = index_k = index_w = None
    if indexer is not None:
        # Detached inputs (RoPE tables too: Mistral Large 4 learns its frequencies): the indexer learns
        # only from its KL loss, and that loss reaches nothing but the indexer.
        index_q, new_keys, index_w = family.indexer_qkw(
            indexer, x.detach(), q_index_input.detach() if q_index_input is not None else None, cos.detach(),
            sin.detach(), position_ids,
        )
        index_k = _indexer_keys(cache, self.layer_idx, new_keys, past, T)

    sinks = family.sinks(self)
    topk_indices = loss_indices = None
    sparse = window is None and not cfg.dense_warmup and (indexer is not None or shared_layer)
    if not sparse:  # the absorbed query [B, S, H, C + R] through plain autograd
        attn_q = absorbed_query(q_nope, q_rot, w_uk)
    if window is not None:  # a sliding-window layer (no indexer): its selection is the window itself
        o_latent, lse = sparse_attention(attn_q, attn_k, attn_k[..., :value_dim],
                                         _window_indices(B, S, T, window, key_offset, cu_seqlens, window_start, x.device),
                                         scale=self.scaling, return_lse=True, backend=cfg.backend)
    elif cfg.dense_warmup or (indexer is None and not shared_layer):  # warm-up, or a layer without DSA
        o_latent, lse = _dense_attention(attn_q, attn_k, value_dim, self.scaling, cu_seqlens, window_start,
                                         want_lse=sinks is not None)
    else:
        if indexer is not None:
            # K >= visible keys returns every visible key, so min(topk, T) selects the same set.
            topk_indices = hytopk(index_q.detach(), index_k.detach(), index_w.detach(), min(cfg.topk, T),
                                  cu_seqlens=cu_seqlens, window_start=window_start, relu=cfg.relu,
                                  backend=cfg.backend)
        else:
            if prev_topk_indices is None:
                raise ValueError("an IndexShare 'shared' layer needs the indices of a previous 'full' indexer layer")
            topk_indices = reuse_indices(prev_topk_indices)
        # attn_q comes back without gradient (the KL target and the recall probe only read it); the
        # attention rebuilds it from q_nope in backward instead of keeping it (see kernels/sparse_attn/mla.py).
        o_latent, lse, attn_q = mla_sparse_attention(q_nope, q_rot, w_uk, attn_k, topk_indices, value_dim=value_dim,
                                                     scale=self.scaling, backend=cfg.backend)
        loss_indices = topk_indices
    if indexer is not None:  # top-k recall sampling (a no-op unless a sample is being taken)
        observe_selection(state, index_q, index_k, index_w, attn_q, attn_k, scale=self.scaling, relu=cfg.relu,
                          cu_seqlens=cu_seqlens, window_start=window_start)

    if sinks is not None:
        if torch.is_grad_enabled() and o_latent.requires_grad and lse.grad_fn is None:
            raise RuntimeError(
                f"attention sinks need gradients through the sparse attention's lse, which backend "
                f"{cfg.backend!r} does not provide; use backend='torch' for {family.model_type}"
            )
        sink = sinks.float()
        o_latent = o_latent * torch.sigmoid(lse - sink).to(o_latent.dtype)[..., None]
        lse = torch.logaddexp(lse, sink)  # the softmax normaliser including the sink, for the KL target

    o = torch.einsum("bshc,hvc->bshv", o_latent, w_uv.to(o_latent.dtype))
    attn_output = self.o_proj(family.finish_output(self, x, o, gate))

    coef = float(cfg.indexer_loss_coef)
    if indexer is not None and self.training and torch.is_grad_enabled() and coef > 0:
        loss = indexer_kl_loss(
            index_q, index_k, index_w, attn_q, attn_k, loss_indices, attn_lse=lse, scale=self.scaling,
            relu=cfg.relu, cu_seqlens=cu_seqlens if loss_indices is None else None,
            window_start=window_start if loss_indices is None else None, backend=cfg.backend,
        )
        attn_output = attach_indexer_loss(attn_output, loss, state)

    if family.returns_indices:
        return attn_output, None, topk_indices
    return attn_output, None


# ----------------------------------------------------------------------------- apply / undo


def _resolve_config(state: PatchState, family: MLADSAFamily, model_config) -> None:
    """Fill the config's None fields from the model and check the rest fits the model's indexer."""
    cfg = state.config
    topk, n_heads, head_dim = family.model_index_config(model_config)
    for name, model_value in (("index_n_heads", n_heads), ("index_head_dim", head_dim)):
        value = getattr(cfg, name)
        if value is not None and value != model_value:
            raise ValueError(
                f"HyScaleConfig.{name}={value} does not match the model's indexer ({name}={model_value}); "
                "a DSA model's indexer shape is fixed by its weights: leave it None"
            )
    cfg.topk = topk if cfg.topk is None else cfg.topk
    cfg.index_n_heads, cfg.index_head_dim = n_heads, head_dim
    cfg.relu = family.relu if cfg.relu is None else cfg.relu


def patch_mla_dsa_model(model: torch.nn.Module, state: PatchState, family: MLADSAFamily) -> Callable[[], None]:
    """Patch every ``family.attention_class`` module of ``model`` in place; returns the undo function."""
    modules = [m for m in model.modules() if isinstance(m, family.attention_class)]
    if not modules:
        raise ValueError(
            f"{type(model).__name__} has no {family.attention_class.__name__} module to patch for {family.model_type!r}"
        )
    text_config = modules[0].config
    _resolve_config(state, family, text_config)
    register_attention_implementation()

    undo_steps: list[Callable[[], None]] = [apply_chunked_lm_loss(model, state)]  # the only step that may refuse
    for module in modules:
        module._hyscale_family = family
        module._hyscale_state = state
        module.forward = types.MethodType(mla_dsa_attention_forward, module)
        indexer = family.indexer(module)
        flags = [(p, p.requires_grad) for p in indexer.parameters()] if indexer is not None else []
        for p, _ in flags:
            p.requires_grad_(True)  # the indexer trains from its KL loss

        def undo_module(module=module, flags=flags):
            del module.forward
            del module._hyscale_family
            del module._hyscale_state
            for p, flag in flags:
                p.requires_grad_(flag)

        undo_steps.append(undo_module)

    undo_steps.append(apply_lean_layers(model, state))
    configs = {id(m.config): m.config for m in modules}
    for config in configs.values():
        previous = config._attn_implementation

        def undo_config(config=config, previous=previous):
            config._attn_implementation = previous

        config._attn_implementation = ATTN_IMPLEMENTATION
        undo_steps.append(undo_config)

    def undo() -> None:
        for step in reversed(undo_steps):
            step()

    return undo


def load_family_module(name: str):
    """``transformers.models.<name>.modeling_<name>``, or None where the installed Transformers lacks it."""
    import importlib

    try:
        return importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    except ImportError:
        return None

