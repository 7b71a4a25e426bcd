"""Shared glue for the DeepSeek-style MLA + lightning-indexer families (GLM-5, DeepSeek-V3.2, ...).

Every DSA family in Transformers builds the indexer's full ``[B, S, H, T]`` score table, a dense
``[B, 1, S, T]`` mask, and runs dense attention under that mask. A patched attention module
instead projects queries and the compressed KV latents exactly as the family does (family hooks),
runs the indexer on detached inputs, and hands the absorbed-MLA inputs (``MLAAttention``: one latent
row per token, Hkv = 1) to the DSA attention step every patched layer runs (``_dsa_step``:
selection, sparse or dense warm-up attention, indexer KL loss).

Family files subclass ``MLADSAFamily`` and override the hooks where their model differs (RoPE
layout, query projection, output gates, attention sinks, names).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from ..context_parallel import BATCH_KWARG, gather_tokens
from ..kernels.rope import rotary_embedding
from ..kernels.sparse_attn.mla_output import absorbed_output
from ..state import PatchState
from ._cp_attention import cp_attention
from ._dsa_patch import patch_attention, resolve_indexer_options
from ._dsa_step import MLAAttention, dsa_attention, dsa_attention_tiled, sparse_step, wants_weights
from ._visibility import visibility

# ----------------------------------------------------------------------------- family hooks


class MLADSAFamily:
    """Defaults follow DeepSeek-V3.2; a family file overrides what its model does differently.

    Attributes set by subclasses:
        model_type: ``config.model_type`` the family registers for.
        attention_class: the Transformers attention module class to patch.
        main_rope: the family's RoPE function for the main attention, ``(q, k, cos, sin, unsqueeze_dim=...)``
            (a ``staticmethod``).
        main_rope_interleaved: where main_rope is one of Transformers' two RoPE forms, which: True for
            ``apply_rotary_pos_emb_interleave``, False for ``apply_rotary_pos_emb``; the fused kernel
            (``kernels.rope``) then runs in its place, once a probe has found the two give the same
            bits (``_fused_rope``). None: main_rope runs.
        indexer_rope: the family's RoPE function for the indexer (same signature, a ``staticmethod``).
        indexer_rope_interleaved: the same for indexer_rope.
        indexer_rope_first: RoPE on the first ``qk_rope_head_dim`` dims of the indexer head (else the last).
        relu: the family's own choice of ReLU on the per-head indexer logits.
        returns_indices: the attention returns ``(out, weights, topk_indices)`` (IndexShare families).
        mlp_ends_layer: the decoder layer ends in ``residual + self.mlp(x)`` (``_lean_layers``: its
            MLP skips its output in the layer's recompute).
    """

    model_type: str = ""
    attention_class: type = None
    main_rope: Callable = None
    main_rope_interleaved: bool | None = None
    indexer_rope: Callable = None
    indexer_rope_interleaved: bool | None = None
    indexer_rope_first: bool = True
    relu: bool = True
    returns_indices: bool = False
    mlp_ends_layer: bool = False

    # --- main attention

    def query(self, attn, x: torch.Tensor, position_ids):
        """-> (q_nope [B, S, H, nope], q_rot [B, S, H, rope] before RoPE, indexer query input, gate or None).

        A family that overrides it computes its queries its own way, so its query side is not tiled
        (``tile_tokens``); one that keeps it gets the two halves below, which tiling calls apart."""
        q_input = self.query_input(attn, x)
        q_nope, q_rot, gate = self.query_heads(attn, x, q_input)
        return q_nope, q_rot, q_input, gate

    def query_input(self, attn, x: torch.Tensor) -> torch.Tensor:
        """The compressed query ``[B, S, q_lora_rank]`` that the query heads and the indexer both read."""
        return attn.q_a_layernorm(attn.q_a_proj(x))

    def query_heads(self, attn, x: torch.Tensor, q_input: torch.Tensor):
        """-> (q_nope, q_rot before RoPE, gate or None) from ``query_input``'s output."""
        q = attn.q_b_proj(q_input).view(*x.shape[:-1], attn.num_heads, attn.qk_head_dim)
        q_nope, q_rot = torch.split(q, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
        return q_nope, q_rot, None

    def tiles_queries(self) -> bool:
        """Whether ``tile_tokens`` can run this family's query side in tiles (it keeps ``query``)."""
        return type(self).query is MLADSAFamily.query

    def latent_kv(self, attn, x: torch.Tensor):
        """-> (normalised latent [B, S, kv_lora_rank], k_rot [B, S, rope] before RoPE) of this call's tokens."""
        compressed = attn.kv_a_proj_with_mqa(x)
        kv_pass, k_rot = torch.split(compressed, [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
        return attn.kv_a_layernorm(kv_pass), k_rot

    def apply_main_rope(self, attn, q_rot, k_rot, cos, sin):
        """q_rot [B, S, H, r], k_rot [B, S, r] -> both rotated (the family's layout)."""
        interleaved = _fused_rope(self.main_rope, self.main_rope_interleaved, cos, sin)
        if interleaved is not None:
            return (rotary_embedding(q_rot, cos, sin, interleaved=interleaved),
                    rotary_embedding(k_rot[:, :, None], cos, sin, interleaved=interleaved)[:, :, 0])
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
            q, k = self._indexer_rope(indexer, q, k, cos, sin)
        return q, k[:, :, 0], self.indexer_weights(indexer, x)

    def indexer_keys(self, indexer, x, cos, sin) -> torch.Tensor:
        """The indexer keys ``[B, S, D]`` of ``indexer_qkw`` alone (the tiled forward takes them whole and
        the queries a tile at a time). RoPE acts on a query and a key alike, so the key goes in as both."""
        k = self.indexer_key(indexer, x)[:, :, None]
        if self.indexer_uses_rope(indexer):
            k = self._indexer_rope(indexer, k, k, cos, sin)[1]
        return k[:, :, 0]

    def _indexer_rope(self, indexer, q, k, cos, sin):
        """``(q, k)`` with the family's indexer RoPE on its rotated dims (the first or last ``qk_rope_head_dim``)."""
        r, d = indexer.qk_rope_head_dim, indexer.head_dim
        interleaved = _fused_rope(self.indexer_rope, self.indexer_rope_interleaved, cos, sin)
        if interleaved is not None:  # the rotated part and the rest in one pass, no split and cat
            kw = dict(interleaved=interleaved, rotary_dims=r, rotary_first=self.indexer_rope_first)
            return rotary_embedding(q, cos, sin, **kw), rotary_embedding(k, cos, sin, **kw)
        sizes = [r, d - r] if self.indexer_rope_first else [d - r, r]
        q_parts, k_parts = list(torch.split(q, sizes, dim=-1)), list(torch.split(k, sizes, dim=-1))
        i = 0 if self.indexer_rope_first else 1
        q_parts[i], k_parts[i] = self.indexer_rope(q_parts[i], k_parts[i], cos, sin, unsqueeze_dim=2)
        return torch.cat(q_parts, dim=-1), torch.cat(k_parts, dim=-1)


# ----------------------------------------------------------------------------- fused RoPE


# (function, interleaved) -> whether it computes the bits of rotary_embedding; filled at patch time
# (``probe_family_ropes``), outside any forward: the probe runs autograd of its own, which a
# checkpointed or compiled forward must not see.
_ROPE_MATCHES: dict[tuple[Callable, bool], bool] = {}


def probe_family_ropes(family: MLADSAFamily) -> None:
    """Probe the family's declared RoPE layouts once (``_rope_matches``), for ``_fused_rope``."""
    for fn, interleaved in ((family.main_rope, family.main_rope_interleaved),
                            (family.indexer_rope, family.indexer_rope_interleaved)):
        if interleaved is not None and (fn, interleaved) not in _ROPE_MATCHES:
            with torch.enable_grad():
                _ROPE_MATCHES[fn, interleaved] = _rope_matches(fn, interleaved)


def _fused_rope(fn: Callable, interleaved: bool | None, cos: torch.Tensor, sin: torch.Tensor) -> bool | None:
    """The layout to run ``kernels.rope`` in instead of the family's RoPE function ``fn``, or None to run
    ``fn``: where the family declares one, the probe found ``fn`` computing its bits, and the tables
    need no gradient (Mistral Large 4 can learn its frequencies; the kernel gives only the input's)."""
    if interleaved is None or cos.dim() != 3 or not _ROPE_MATCHES.get((fn, interleaved), False):
        return None
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        return None
    return interleaved


def _rope_matches(fn: Callable, interleaved: bool) -> bool:
    """Whether Transformers' ``fn`` gives the bits of ``rotary_embedding`` (its torch path, which the
    kernel matches), forward and backward, on a small bfloat16 probe; warns once if not (a Transformers
    version that rewrote its RoPE: the family's own function then runs)."""
    g = torch.Generator().manual_seed(0)
    B, S, H, r = 2, 3, 2, 8
    q = (torch.randn(B, S, H, r, generator=g) * 4).bfloat16()
    k = (torch.randn(B, S, 1, r, generator=g) * 4).bfloat16()
    half = torch.randn(B, S, r // 2, generator=g) * 3
    ang = torch.cat([half, half], -1)  # as Transformers' rotary embeddings build the tables
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    grads = [torch.randn(B, S, n, r, generator=g).bfloat16() for n in (H, 1)]

    def run(f):
        leaves = [t.clone().requires_grad_() for t in (q, k)]
        outs = f(*leaves)
        torch.autograd.backward(outs, grads)
        return [*outs, *(t.grad for t in leaves)]

    try:
        ours = run(lambda a, b: (rotary_embedding(a, cos, sin, interleaved=interleaved, backend="torch"),
                                 rotary_embedding(b, cos, sin, interleaved=interleaved, backend="torch")))
        theirs = run(lambda a, b: tuple(fn(a, b, cos, sin, unsqueeze_dim=2)))
        same = all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(ours, theirs))
    except Exception:  # noqa: BLE001 - any failure means "not the same function"
        same = False
    if not same:
        warnings.warn(
            f"hyscale_hf: {getattr(fn, '__module__', '?')}.{getattr(fn, '__name__', fn)} does not compute "
            f"Transformers' {'interleaved' if interleaved else 'rotate_half'} RoPE bit for bit in this "
            "Transformers version; the fused RoPE kernel is off for it and the function itself runs",
            stacklevel=2,
        )
    return same


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
    if cache is None:
        cache = past_key_values
    if self.training and self.attention_dropout and torch.is_grad_enabled():
        raise ValueError(
            f"attention_dropout={self.attention_dropout} is not supported by hyscale_hf sparse attention; set it to 0"
        )
    x = hidden_states
    B, S, _ = x.shape
    cos, sin = position_embeddings
    if _tiled(self, family, state, S, cache, kwargs):
        return _tiled_forward(self, family, state, x, cos, sin, attention_mask, position_ids, prev_topk_indices,
                              kwargs)

    q_nope, q_rot, q_index_input, gate = family.query(self, x, position_ids)
    latent, k_rot = family.latent_kv(self, x)
    q_rot, k_rot = family.apply_main_rope(self, q_rot, k_rot, cos, sin)
    q_nope, q_rot = family.scale_query(self, q_nope, q_rot, position_ids)
    latent, k_rot, past = family.all_keys(self, latent, k_rot, cache, S, kwargs)
    T = past + S  # keys visible to this call; a sliding-window cache returns only the last latent.shape[1]
    key_offset = T - latent.shape[1]

    w_uk, w_uv = _absorb_weights(self)
    attn_k = torch.cat([latent, k_rot.to(latent.dtype)], dim=-1)[:, :, None]  # [B, L, 1, C + R]

    indexer = family.indexer(self)
    shared_layer = family.is_shared_layer(self)
    window = family.sliding_window(self)
    if (indexer is not None or shared_layer or window is None) and key_offset:
        raise RuntimeError(f"layer {self.layer_idx}: the cache returned {latent.shape[1]} of {T} keys; only a "
                           "sliding-window layer may drop old keys")
    index = None
    if indexer is not None:
        # Detached inputs (RoPE tables too: Mistral Large 4 learns its frequencies): the indexer learns
        # only from its KL loss, and that loss reaches nothing but the indexer.
        index_q, new_keys, index_w = family.indexer_qkw(
            indexer, x.detach(), q_index_input.detach() if q_index_input is not None else None, cos.detach(),
            sin.detach(), position_ids,
        )
        index = (index_q, _indexer_keys(cache, self.layer_idx, new_keys, past, T), index_w)
    if kwargs.get(BATCH_KWARG) is not None:
        return _cp_forward(self, family, state, kwargs[BATCH_KWARG], x, q_nope, q_rot, gate, attn_k, index,
                           prev_topk_indices, window)
    # Counted over the L keys attended over (a sliding-window cache keeps only the last of the T so far).
    vis = visibility(attention_mask, position_ids, kwargs, B, S, latent.shape[1], sliding_window=window,
                     device=x.device)
    attention = MLAAttention(q_nope, q_rot, w_uk, attn_k, value_dim=self.kv_lora_rank, scale=self.scaling,
                             sinks=family.sinks(self), name=family.model_type)

    def finish(o_latent):  # [B, S, H, C] -> the module output
        o = absorbed_output(o_latent, w_uv.to(o_latent.dtype))
        return self.o_proj(family.finish_output(self, x, o, gate))

    attn_output, topk_indices, weights = dsa_attention(
        attention, state, vis, index=index, shared=shared_layer, prev_indices=prev_topk_indices, window=window,
        training=self.training, finish=finish, weights=wants_weights(self, kwargs),
    )
    if family.returns_indices:
        return attn_output, weights, topk_indices
    return attn_output, weights


def _cp_forward(self, family: MLADSAFamily, state: PatchState, batch, x, q_nope, q_rot, gate, attn_k, index,
                prev_topk_indices, window):
    """The patched forward's attention under context parallelism (``_cp_attention``): the latent rows and
    the indexer keys gathered over the group, this rank's queries attending chunk by chunk."""
    attn_k = gather_tokens(attn_k, batch.cp)
    if index is not None:
        index = (index[0], gather_tokens(index[1], batch.cp), index[2])
    w_uk, w_uv = _absorb_weights(self)
    sinks = family.sinks(self)

    def chunk_attention(a: int, b: int, end: int):
        return MLAAttention(q_nope[:, a:b], q_rot[:, a:b], w_uk, attn_k[:, :end], value_dim=self.kv_lora_rank,
                            scale=self.scaling, sinks=sinks, name=family.model_type)

    def finish(a: int, b: int):
        def run(o_latent):
            o = absorbed_output(o_latent, w_uv.to(o_latent.dtype))
            return self.o_proj(family.finish_output(self, x[:, a:b], o, None if gate is None else gate[:, a:b]))

        return run

    attn_output, topk_indices = cp_attention(
        chunk_attention, state, batch, batch_size=x.shape[0], index=index, shared=family.is_shared_layer(self),
        prev_indices=prev_topk_indices, window=window, training=self.training, device=x.device, finish=finish,
    )
    if family.returns_indices:
        return attn_output, None, topk_indices
    return attn_output, None


# ----------------------------------------------------------------------------- query tiles


def _tiled(attn, family: MLADSAFamily, state: PatchState, S: int, cache, kwargs: dict) -> bool:
    """Whether this call runs its query side in tiles: ``tile_tokens`` set and exceeded, a sparse step
    (the dense warm-up attends in query chunks of its own), no cache, no attention weights asked for, no
    context parallelism (whose two local chunks run one after the other; MLPs and norms still tile)."""
    tile = state.config.tile_tokens
    if tile is None or S <= tile or cache is not None or wants_weights(attn, kwargs):
        return False
    if kwargs.get(BATCH_KWARG) is not None:  # context parallelism: its chunks (T / 2N queries each) take the place
        return False
    indexer, shared = family.indexer(attn), family.is_shared_layer(attn)
    if not sparse_step(state.config, indexer, shared, family.sliding_window(attn)):
        return False
    if not family.tiles_queries():
        if "untiled_queries" not in state.warned:
            state.warned.add("untiled_queries")
            warnings.warn(f"hyscale_hf: {family.model_type} computes its queries its own way, so tile_tokens tiles "
                          "its MLPs but not its attention's query side", UserWarning, stacklevel=3)
        return False
    return True


def _tiled_forward(self, family: MLADSAFamily, state: PatchState, x, cos, sin, attention_mask, position_ids,
                   prev_topk_indices, kwargs):
    """The patched forward with the query side in tiles of ``tile_tokens`` (``dsa_attention_tiled``).

    Computed whole: the latent keys and the indexer keys. Per tile: the indexer's queries and weights and
    the tile's selection; then, checkpointed, the compressed query, the query heads, RoPE, attention over
    the keys the tile sees, W_UV and o_proj. The same ops as the untiled forward on each query's rows; no
    query-sized tensor of the whole sequence but the layer's output (at 1M tokens of GLM-5's indexer its
    queries alone are 8 GiB, their KL gradients as much again, the selection 8 GiB).
    """
    B, S, _ = x.shape
    latent, k_rot_raw = family.latent_kv(self, x)
    k_rot = family.apply_main_rope(self, k_rot_raw[:, :, None], k_rot_raw, cos, sin)[1]  # keys only
    w_uk, w_uv = _absorb_weights(self)
    attn_k = torch.cat([latent, k_rot.to(latent.dtype)], dim=-1)[:, :, None]  # [B, T, 1, C + R]
    indexer = family.indexer(self)
    window = family.sliding_window(self)
    vis = visibility(attention_mask, position_ids, kwargs, B, S, S, sliding_window=window, device=x.device)
    sinks = family.sinks(self)
    tile = state.config.tile_tokens
    # The indexer reads detached inputs (RoPE tables too), as in the untiled forward.
    x_in, cos_in, sin_in = x.detach(), cos.detach(), sin.detach()

    def index_part(a: int, b: int):
        """The indexer's (q, k, w) of the tokens a:b (its compressed-query input computed without a graph)."""
        with torch.no_grad():
            q_input = family.query_input(self, x_in[:, a:b])
        pos = None if position_ids is None else position_ids[:, a:b]
        return family.indexer_qkw(indexer, x_in[:, a:b], q_input, cos_in[:, a:b], sin_in[:, a:b], pos)

    index_keys = index_queries = None
    if indexer is not None:
        index_keys = family.indexer_keys(indexer, x_in, cos_in, sin_in)  # [B, T, D]: small, taken whole

        def index_queries(a: int, b: int):
            q, _, w = index_part(a, b)
            return q, w

    # The whole-T tensors a tile reads go in as checkpoint inputs, not through the closure: the closure
    # would keep them alive from the layer's forward to its backward, while inputs are saved like any
    # other tensor, which the layer's own checkpoint drops until its recompute.
    tile_inputs = (x, k_rot_raw, cos, sin, attn_k)

    def query_tile(a: int, b: int, selected: bool):
        def run(attended, x, k_rot_raw, cos, sin, attn_k):
            q_input = family.query_input(self, x[:, a:b])
            q_nope, q_rot, gate = family.query_heads(self, x[:, a:b], q_input)
            q_rot = family.apply_main_rope(self, q_rot, k_rot_raw[:, a:b], cos[:, a:b], sin[:, a:b])[0]
            pos = None if position_ids is None else position_ids[:, a:b]
            q_nope, q_rot = family.scale_query(self, q_nope, q_rot, pos)
            attention = MLAAttention(q_nope, q_rot, w_uk, attn_k[:, :b], value_dim=self.kv_lora_rank,
                                     scale=self.scaling, sinks=sinks, name=family.model_type)
            attend = attention.attend_selected if selected else attention.attend_window
            o_latent, lse = attend(attended, state.config.backend)
            o = absorbed_output(o_latent, w_uv.to(o_latent.dtype))
            out = self.o_proj(family.finish_output(self, x[:, a:b], o, gate))
            return out, attention.attn_q.detach(), lse.detach()

        return run

    attn_output, topk_indices = dsa_attention_tiled(
        query_tile, tile_inputs, attn_k, state, vis, (B, S, S), index_keys=index_keys, index_queries=index_queries,
        shared=family.is_shared_layer(self), prev_indices=prev_topk_indices, window=window, training=self.training,
        scale=self.scaling, tile=tile, keep_indices=family.returns_indices,
    )
    if family.returns_indices:
        return attn_output, None, topk_indices
    return attn_output, None


# ----------------------------------------------------------------------------- apply


def patch_mla_dsa_model(model: torch.nn.Module, state: PatchState, family: MLADSAFamily) -> Callable[[], None]:
    """Patch every ``family.attention_class`` module of ``model`` in place; returns the undo."""
    modules = [m for m in model.modules() if isinstance(m, family.attention_class)]
    if not modules:
        raise ValueError(
            f"{type(model).__name__} has no {family.attention_class.__name__} module to patch for {family.model_type!r}"
        )
    resolve_indexer_options(state.config, modules[0].config, default_relu=family.relu, shape_from_weights=True)
    probe_family_ropes(family)

    def prepare(undo, module):
        undo.set_attr(module, "_hyscale_family", family)
        indexer = family.indexer(module)
        for p in indexer.parameters() if indexer is not None else ():
            undo.set_value(p, "requires_grad", True)  # the indexer trains from its KL loss

    return patch_attention(model, state, modules, mla_dsa_attention_forward, prepare=prepare,
                           mlp_ends_layer=family.mlp_ends_layer)


def load_family_module(name: str):
    """``transformers.models.<name>.modeling_<name>``, or None where the installed Transformers lacks it."""
    import importlib

    try:
        return importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    except ImportError:
        return None

