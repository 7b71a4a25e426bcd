"""One DSA attention step, run by every patched attention layer (docs/design.md section 2).

A patched layer projects its queries and keys its own way, runs its indexer on detached inputs,
builds its keys' visibility (``_visibility``), and hands all of it to ``dsa_attention``, which

1. selects: ``hytopk`` on the indexer scores (an IndexShare "shared" layer takes its source layer's
   indices of the same forward call through ``share_selection``; a sliding-window layer without an
   indexer selects its window),
2. attends over the selection (sparse), or over every visible key (the dense warm-up stage, and
   layers without DSA),
3. samples top-k recall when asked (``observe_selection``), and during training joins the indexer
   KL loss to the layer's output, computed once per step: in the sparse stage in backward, from the
   target the sparse attention's backward leaves (``_deferred_target``), else in forward
   (``indexer_loss_once``).

The attention comes in two forms, both with the same four methods: ``MLAAttention`` (native DSA
families, ``_mla_dsa``: absorbed MLA queries against one latent row per token) and ``GQAAttention``
(dense families given an indexer, ``_dense_common``: the family's own q/k/v after RoPE and the cache
update).

The model-level mask goes through one registered attention implementation (``ATTN_IMPLEMENTATION``)
whose mask function returns only the 2-D padding mask, so no ``[B, 1, S, T]`` tensor is ever built.
Its attention function serves the dense families, whose own forward calls it (a patched module
hands its layer call in through ``CALL_KWARG``); it refuses any module that hyscale_hf did not patch.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from ..indexer import TiledIndexerLoss, attach_indexer_loss, deferred_indexer_loss, indexer_loss_once
from ..kernels import hytopk, indexer_kl_loss, mla_sparse_attention, sparse_attention
from ..kernels.indexer_kl import indexer_kl_loss_given_target
from ..kernels.sparse_attn import HeadProbs, reuse_query_tiles
from ..kernels.sparse_attn.mla_query import absorbed_query
from ..kernels.windows import chunk_budget_bytes
from ..replay import in_replay_checkpoint, replaying, share_selection
from ..state import PatchState, in_backward
from ..tiling import TileOutput, run_tile, tile_bounds
from ..training import observe_selection
from ._attention_weights import attend_through, layer_weights
from ._compaction import Compaction
from ._visibility import Visibility, padding_mask_only, query_part, window_indices

ATTN_IMPLEMENTATION = "hyscale_dsa"
CALL_KWARG = "_hyscale_call"  # the keyword a patched dense forward adds for the attention function


# ----------------------------------------------------------------------------- attention implementation


def attention_function(module, *args, **kwargs):
    """The ``AttentionInterface`` entry of ``ATTN_IMPLEMENTATION``: runs the layer call a patched
    module's forward passed as ``CALL_KWARG`` (``call(module, query, key, value, attention_mask, ...)``)."""
    call = kwargs.pop(CALL_KWARG, None)
    if call is None:
        raise RuntimeError(
            f"{type(module).__name__} runs with attn_implementation={ATTN_IMPLEMENTATION!r}, which only serves "
            "attention modules patched by hyscale_hf.patch_model; call hyscale_hf.unpatch_model(model) before "
            "changing the model's modules"
        )
    return call(module, *args, **kwargs)


def register_attention_implementation() -> None:
    """Register ``ATTN_IMPLEMENTATION`` in both AttentionInterface and AttentionMaskInterface
    (idempotent; with the first alone ``create_causal_mask`` returns None, docs/design.md section 8)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_function)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, padding_mask_only)


register_attention_implementation()


def wants_weights(module, kwargs: dict) -> bool:
    """Whether this call should return its attention probabilities: ``output_attentions`` as the model's
    forward received it (it reaches the layers in their keyword arguments), else the config's."""
    flag = kwargs.get("output_attentions")
    return bool(getattr(module.config, "output_attentions", False) if flag is None else flag)


# ----------------------------------------------------------------------------- the two attention forms


class GQAAttention:
    """Attention of a dense layer: ``q [B, S, Hq, D]``, ``k [B, T, Hkv, D]``, ``v [B, T, Hkv, Dv]``.

    Every ``attend_*`` returns ``(o [B, S, Hq, Dv], lse [B, S, Hq] fp32 or None)``.
    """

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> None:
        self.q, self.k, self.v, self.scale = q, k, v, scale
        self.shape, self.device = (q.shape[0], q.shape[1], k.shape[1]), q.device  # shape: (B, S, T)
        self.head_probs = None  # a HeadProbs the next attend_selected fills (defer_target)

    def attend_selected(self, indices: torch.Tensor, backend: str):
        # the step's own selections (dsa_attention): in range, unique, rows ascending. An IndexShare group's
        # layers and a replaying recompute attend over the very same tensor: its query tiles are built once.
        with reuse_query_tiles():
            return sparse_attention(self.q, self.k, self.v, indices, scale=self.scale, return_lse=True,
                                    backend=backend, check_range=False, unique_indices=True,
                                    head_probs=self.head_probs)

    def attend_window(self, indices: torch.Tensor, backend: str):
        return sparse_attention(self.q, self.k, self.v, indices, scale=self.scale, return_lse=True, backend=backend,
                                check_range=False, unique_indices=True)

    def defer_target(self, apply):
        """As ``MLAAttention.defer_target``: the KL target from the sparse attention's backward."""
        return _route_target(self, ("k", "q", "v"), apply)

    def attend_all(self, vis: Visibility, backend: str):
        """Every visible key, through SDPA; no lse. Plain causal inputs use ``is_causal``; anything else a
        boolean mask a query chunk at a time (each chunk checkpointed when there are several, so memory
        stays O(chunk * T))."""
        B, S, T = self.shape
        qt, kt, vt = self.q.transpose(1, 2), self.k.transpose(1, 2), self.v.transpose(1, 2)
        if vis.plain and (S == T or S == 1):
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=S > 1, scale=self.scale, enable_gqa=True)
            return o.transpose(1, 2), None
        start, end = vis.windows(B, S, T, self.device)
        chunk = max(1, chunk_budget_bytes(self.device) // max(1, 4 * B * qt.shape[1] * T))  # [B, H, c, T] fp32

        def block(qc, kc, vc, st, en):
            visible = vis.visible(st, en, 0, kc.shape[2])
            no_key = ~visible.any(-1)
            # A query with no visible key (leading padding) attends to key 0 so softmax stays finite; zeroed below.
            visible = visible | (no_key[..., None] & (torch.arange(kc.shape[2], device=kc.device) == 0))
            o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=visible[:, None], scale=self.scale,
                                               enable_gqa=True)
            return o.masked_fill(no_key[:, None, :, None], 0.0)

        outs = []
        for c0 in range(0, S, chunk):
            c1 = min(S, c0 + chunk)
            hi = vis.last_key(T, S, c1)  # no query of the chunk sees a key past its last one
            args = (qt[:, :, c0:c1], kt[:, :, :hi], vt[:, :, :hi], start[:, c0:c1], end[:, c0:c1])
            several = chunk < S and torch.is_grad_enabled()
            outs.append(checkpoint(block, *args, use_reentrant=False) if several else block(*args))
        return torch.cat(outs, dim=2).transpose(1, 2), None

    def target(self):
        """The attention's (queries, keys) as the indexer's KL target reads them."""
        return self.q, self.k

    def values(self):
        return self.v

    def differentiable_query(self):
        return self.q


class MLAAttention:
    """Attention of a native DSA layer in MLA absorbed form.

    ``q_nope [B, S, H, N]`` and ``q_rot [B, S, H, R]`` (after RoPE), ``w_uk [H, N, C]``, ``kv [B, T, 1, C + R]``
    one latent row per token (key, and its first ``value_dim`` dims the value), ``sinks [H]`` per-head
    attention-sink logits (an extra softmax term with no value) or None. Every ``attend_*`` returns
    ``(o [B, S, H, value_dim], lse [B, S, H] fp32 or None)``, the sink included.
    """

    def __init__(self, q_nope, q_rot, w_uk, kv, *, value_dim: int, scale: float, sinks=None, name: str = "") -> None:
        self.q_nope, self.q_rot, self.w_uk, self.kv = q_nope, q_rot, w_uk, kv
        self.value_dim, self.scale, self.sinks, self.name = value_dim, scale, sinks, name
        self.shape, self.device = (q_nope.shape[0], q_nope.shape[1], kv.shape[1]), kv.device
        self.attn_q = None  # [B, S, H, C + R] absorbed query, set by the attend_* that ran
        self.head_probs = None  # a HeadProbs the next attend_selected fills (defer_target)

    def attend_selected(self, indices: torch.Tensor, backend: str):
        # attn_q comes back without gradient (the KL target and the recall probe only read it); the
        # attention rebuilds it from q_nope in backward instead of keeping it (see kernels/sparse_attn/mla.py).
        o, lse, self.attn_q = mla_sparse_attention(self.q_nope, self.q_rot, self.w_uk, self.kv, indices,
                                                   value_dim=self.value_dim, scale=self.scale, backend=backend,
                                                   check_range=False, head_probs=self.head_probs)
        return self._with_sinks(o, lse, backend)

    def defer_target(self, apply):
        """Route an input of the next ``attend_selected`` through ``apply(anchor, head_probs)`` (which
        returns ``(anchor', carrier)``) so that the attention leaves the indexer KL's target in
        ``head_probs`` in its backward, and the node ``apply`` builds runs after it; returns the
        carrier, or None where that cannot be (sinks change the target's normaliser; no input needs grad)."""
        if self.sinks is not None:
            return None
        return _route_target(self, ("kv", "q_nope", "q_rot"), apply)

    def attend_window(self, indices: torch.Tensor, backend: str):
        self.attn_q = absorbed_query(self.q_nope, self.q_rot, self.w_uk)  # through plain autograd
        o, lse = sparse_attention(self.attn_q, self.kv, self.kv[..., : self.value_dim], indices, scale=self.scale,
                                  return_lse=True, backend=backend, check_range=False, unique_indices=True)
        return self._with_sinks(o, lse, backend)

    def attend_all(self, vis: Visibility, backend: str):
        self.attn_q = absorbed_query(self.q_nope, self.q_rot, self.w_uk)
        o, lse = _dense_mla(self.attn_q, self.kv, self.value_dim, self.scale, vis, want_lse=self.sinks is not None)
        return self._with_sinks(o, lse, backend)

    def target(self):
        return self.attn_q, self.kv

    def values(self):
        return self.kv[..., : self.value_dim]

    def differentiable_query(self):
        """The absorbed query through autograd (the sparse kernel's ``attn_q`` carries no gradient)."""
        return absorbed_query(self.q_nope, self.q_rot, self.w_uk)

    def _with_sinks(self, o, lse, backend: str):
        if self.sinks is None:
            return o, lse
        if torch.is_grad_enabled() and o.requires_grad and lse.grad_fn is None:
            raise RuntimeError(
                f"attention sinks need gradients through the sparse attention's lse, which backend "
                f"{backend!r} does not provide; use backend='torch' for {self.name}"
            )
        sink = self.sinks.float()
        o = o * torch.sigmoid(lse - sink).to(o.dtype)[..., None]
        return o, torch.logaddexp(lse, sink)  # the softmax normaliser including the sink, for the KL target


def _route_target(attention, names: tuple[str, ...], apply):
    """``defer_target`` of both forms: route the first input among ``names`` that needs grad through
    ``apply(anchor, head_probs)`` and keep the routed tensor in its place; the carrier, or None when none
    needs grad."""
    for name in names:
        anchor = getattr(attention, name)
        if anchor.requires_grad:
            attention.head_probs = HeadProbs()
            routed, carrier = apply(anchor, attention.head_probs)
            setattr(attention, name, routed)
            return carrier
    return None


def _dense_mla(q, k, value_dim: int, scale: float, vis: Visibility, want_lse: bool):
    """Attention of every query over all its visible keys, MLA absorbed form.

    q [B, S, H, D], k [B, T, 1, D], v = k[..., :value_dim]. Plain causal inputs use SDPA (no mask);
    anything else (padding, packing, a cache offset, or when the lse is needed) runs query chunks
    with each chunk checkpointed, so memory stays O(chunk * T). Returns (o [B, S, H, value_dim], lse or None).
    """
    B, S, H, _ = q.shape
    T = k.shape[1]
    if vis.plain and S == T and not want_lse:
        qt = q.transpose(1, 2)
        kt = k.transpose(1, 2).expand(B, H, T, k.shape[-1])
        o = F.scaled_dot_product_attention(qt, kt, kt[..., :value_dim], is_causal=True, scale=scale)
        return o.transpose(1, 2), None
    start, end = vis.windows(B, S, T, q.device)
    chunk = max(1, chunk_budget_bytes(q.device) // max(1, 4 * B * H * T))  # [B, c, H, W] fp32 logits
    outs, lses = [], []
    for c0 in range(0, S, chunk):
        c1 = min(S, c0 + chunk)
        lo, hi = 0, vis.last_key(T, S, c1)  # bounds known without reading the windows (no host sync)
        visible = vis.visible(start[:, c0:c1], end[:, c0:c1], lo, hi)  # [B, c, W]

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


# ----------------------------------------------------------------------------- the step


def dsa_attention(
    attention: GQAAttention | MLAAttention,
    state: PatchState,
    vis: Visibility,
    *,
    index: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    shared: bool = False,
    prev_indices: torch.Tensor | None = None,
    window: int | None = None,
    training: bool = False,
    finish: Callable[[torch.Tensor], torch.Tensor] | None = None,
    weights: bool = False,
    loss_sink: Callable | None = None,
    loss_count: torch.Tensor | None = None,
    recall_index: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
):
    """One attention step of a patched layer; reads the live ``state.config`` (stage, topk, backend).

    Args:
        attention: the layer's attention inputs (``MLAAttention`` or ``GQAAttention``), over T keys.
        vis: the visibility of those keys (``_visibility.visibility``).
        index: the layer's indexer output on detached inputs, ``(q [B, S, H, D], k [B, T, D] with
            the cached keys, w [B, S, H] fp32)``; None for a layer without an indexer.
        shared: an IndexShare "shared" layer: it attends over ``prev_indices`` (int32 ``[B, S, K]``, its
            source layer's selection of this forward call).
        window: ``W`` of a sliding-window layer without an indexer: its selection is its window.
        training: the module's training flag (the indexer loss is added only when training with grad).
        finish: maps the attention output ``o [B, S, H, Dv]`` to the layer output the loss rides on
            (MLA: ``W_UV``, gates and ``o_proj``); identity when None.
        weights: also return the attention probabilities (``output_attentions=True``).
        loss_sink: takes the indexer loss function (of this call's ``index``) instead of joining it here,
            for a layer that sums several calls' losses (``_cp_attention``); None: joined to the output.
        loss_count: the indexer loss's divisor (a sum over this call's queries divided by it), for a loss
            taken over more queries than this call's; None: the mean over this call's counted queries.
        recall_index: a shared layer's source indexer output (as ``index``), used only by top-k recall
            sampling: the source's selection against this layer's attention.

    Returns:
        ``(output, indices, probabilities)``: indices int32 ``[B, S, K]`` of the sparse stage (None
        otherwise); probabilities fp32 ``[B, H, S, T]`` when ``weights``, else None.

    The selections the step attends over are its own (``hytopk``'s, a source layer's, a window built
    here), in range and without repeats by construction, so the ops skip their range check
    (``check_range=False``) and the GQA tiles' repeat check (``unique_indices=True``): each reads the
    indices on the host, a GPU sync per op and layer.
    """
    cfg = state.config
    B, S, T = attention.shape
    indices = attended = None  # attended: the keys each query attended to, as indices (None: all visible)
    recall_index = index if index is not None else recall_index
    compaction = None
    if recall_index is not None and vis.key_mask is not None:  # a padding mask: select in compacted order
        compaction = Compaction(vis.key_mask, vis.windows(B, S, T, attention.device)[0], S, vis.query_pos)
    wants_loss = index is not None and training and torch.is_grad_enabled() and float(cfg.indexer_loss_coef) > 0
    carrier = None  # the indexer loss deferred to the attention's backward (_deferred_target)
    if sparse_step(cfg, index, shared, window):
        deferred = wants_loss and loss_sink is None and not weights  # the KL from the attention's backward
        indices, attended, index_lse = _selection(state, vis, compaction, attention.shape, attention.device,
                                                  index=index, shared=shared, prev_indices=prev_indices,
                                                  window=window, with_lse=deferred)
        if deferred and indices is not None:
            carrier = _deferred_target(attention, state, index, indices, index_lse, vis, loss_count)
        attend = attention.attend_selected if indices is not None else attention.attend_window
        o, lse = attend(attended, cfg.backend)
    else:  # warm-up, or a layer without DSA: SDPA, its math backend when the user chose "eager" (_attn_switch)
        with state.attn_switch.dense_kernel() if state.attn_switch is not None else contextlib.nullcontext():
            o, lse = attention.attend_all(vis, cfg.backend)
    probabilities = None
    if weights:  # output_attentions: the output comes from the probabilities returned, as in eager attention
        probabilities = layer_weights(attention, attended, vis)
        o = attend_through(probabilities, attention.values()).to(o.dtype)
    if recall_index is not None:  # top-k recall sampling (a no-op unless a sample is being taken)
        q_and_k, windows = _dense_inputs(attention, recall_index, vis, compaction)
        observe_selection(state, *q_and_k[:5], scale=attention.scale, relu=cfg.relu, **windows)
    out = o if finish is None else finish(o)
    if carrier is not None:
        out = attach_indexer_loss(out, carrier, state, record=False)
    elif wants_loss:
        def loss_fn(*index_outputs):
            return _indexer_loss(attention, index_outputs, indices, lse, vis, compaction, cfg, loss_count)

        if loss_sink is not None:
            loss_sink(loss_fn)
        else:
            out = indexer_loss_once(out, index, loss_fn, state)
    return out, indices, probabilities


def _deferred_target(attention, state: PatchState, index: tuple, indices: torch.Tensor, index_lse: torch.Tensor,
                     vis: Visibility, count: torch.Tensor | None):
    """The sparse stage's indexer KL from the target the attention's backward leaves (``HeadProbs``):
    no second pass over the selected keys at every head, and nothing held from forward to backward but the
    selection's lse (``index_lse`` [B, S], hytopk's: the KL then runs in one pass, no forward of its own).
    Returns the loss carrier to join to the output, or None (the attention cannot; ``torch.compile``,
    which the deferred node's backward-time ``autograd.grad`` would break): the loss is then computed
    in forward (``indexer_loss_once``)."""
    if torch.compiler.is_compiling():
        return None
    cfg = state.config
    query_real = vis.query_real

    def loss_fn(target, indices, iq, ik, iw, tiles=None):
        if query_real is not None:  # padding queries are no training signal
            indices = indices.masked_fill(~query_real[..., None], -1)
        # tiles: the attention's query tiles over these indices (GQA), walked instead of each query's keys
        kl = indexer_kl_loss_given_target(iq, ik, iw, indices, target, relu=cfg.relu, backend=cfg.backend,
                                          check_range=False, reduction="mean" if count is None else "sum",
                                          tiles=tiles, index_lse=index_lse)
        return kl if count is None else kl / count

    return attention.defer_target(
        lambda anchor, head_probs: deferred_indexer_loss(anchor, head_probs, loss_fn, indices, index, state)
    )


def dsa_attention_tiled(
    query_tile: Callable,
    tile_inputs: tuple,
    kv: torch.Tensor,
    state: PatchState,
    vis: Visibility,
    shape: tuple,
    *,
    index_keys: torch.Tensor | None,
    index_queries: Callable | None,
    shared: bool,
    prev_indices: torch.Tensor | None,
    window: int | None,
    training: bool,
    scale: float,
    tile: int,
    keep_indices: bool,
):
    """``dsa_attention`` of a sparse step whose queries run in tiles (``HyScaleConfig.tile_tokens``).

    Each tile of queries ``a:b`` is its own DSA step over the keys ``:b`` it can see (``query_part`` cuts
    the layer's visibility to it), so nothing query-sized exists for the whole sequence but the output:
    ``index_queries(a, b)`` gives the tile's indexer queries and weights (``index_keys``: the layer's
    indexer keys ``[B, T, D]``); the tile selects (one replayed selection op per tile), then
    ``query_tile(a, b, selected)(attended, *tile_inputs)`` runs under its own checkpoint
    (``hyscale_hf.tiling``; ``tile_inputs``: the whole-T tensors the tiles read, passed as inputs; the
    last tile of a replay-checkpointed layer has no checkpoint of its own): the layer's query side from
    its inputs, attention over the keys ``:b``, the output projection; it returns
    ``(output [B, b - a, ...], absorbed query, lse)``, the last two detached (the KL target). The tile's
    indexer KL follows at once (``TiledIndexerLoss``), a sum over its queries divided by the layer's count
    of real queries: the same loss as untiled. ``kv``: the attention's keys ``[B, T, 1, C]``. Returns
    ``(output, indices [B, S, min(topk, T)] or None)``, the indices only with ``keep_indices`` (an
    IndexShare layer hands them on).
    """
    cfg = state.config
    B, S, T = shape
    loss = None
    if index_keys is not None and training and torch.is_grad_enabled() and float(cfg.indexer_loss_coef) > 0:
        loss = TiledIndexerLoss(index_keys, state)
        # Every real query sees at least its own key: the layer's count, known before any tile selects.
        count = (torch.full((), B * S, dtype=torch.float32, device=kv.device) if vis.query_real is None
                 else vis.query_real.sum().float().clamp_min(1))
    bounds = tile_bounds(S, tile)
    outs = TileOutput(S)
    kept = None
    for a, b in bounds:
        part = query_part(vis, a, b, B, kv.device)
        index = None
        if index_keys is not None:
            iq, iw = index_queries(a, b)
            index = (iq, index_keys[:, :b], iw)
        compaction = None
        if index is not None and part.key_mask is not None:
            compaction = Compaction(part.key_mask, part.windows(B, b - a, b, kv.device)[0], b - a, None)
        indices, attended, _ = _selection(state, part, compaction, (B, b - a, b), kv.device, index=index,
                                          shared=shared, window=window,
                                          prev_indices=None if prev_indices is None else prev_indices[:, a:b])
        run = query_tile(a, b, indices is not None)
        if (a, b) == bounds[-1] and in_replay_checkpoint():
            # In a checkpointed layer the last tile runs without its own checkpoint: what it saves in the
            # forward is dropped by the layer's checkpoint, and what it saves in the layer's recompute is
            # read by its backward, the first of the tiles' (so it does not run a third time).
            out, attn_q, lse = run(attended, *tile_inputs)
        else:
            out, attn_q, lse = run_tile(run, attended, *tile_inputs)
        outs.put(a, b, out)
        del out
        if loss is not None:
            counted = indices if part.query_real is None else indices.masked_fill(~part.query_real[..., None], -1)

            def loss_fn(iq, ik, iw, attn_q=attn_q, lse=lse, counted=counted, b=b):
                kl = indexer_kl_loss(iq, ik, iw, attn_q, kv[:, :b], counted, attn_lse=lse, scale=scale,
                                     relu=cfg.relu, reduction="sum", backend=cfg.backend, check_range=False)
                return kl / count

            loss.add(index, loss_fn)
        if keep_indices and indices is not None:
            if kept is None:
                kept = torch.full((B, S, min(int(cfg.topk), T)), -1, dtype=torch.int32, device=kv.device)
            kept[:, a:b, : indices.shape[-1]] = indices
        if index is not None and (a, b) == bounds[-1]:
            _observe_last_tile(state, index, attn_q, kv, part, compaction, (B, b - a, b), scale)
    out = outs.tensor
    return (out if loss is None else loss.join(out)), kept


def _observe_last_tile(state, index, attn_q, kv, vis: Visibility, compaction, shape, scale: float):
    """Top-k recall sampling under tiling: the last tile's queries (they see the most keys) against
    their keys (``index``, ``vis`` and ``shape``: the tile's). Under a padding mask (compacted selection)
    no sample is taken, said once."""
    if state.selection_probe is None:
        return
    if compaction is not None:
        if "tiled_recall" not in state.warned:
            state.warned.add("tiled_recall")
            warnings.warn("hyscale_hf: top-k recall is not sampled in layers whose queries run in tiles "
                          "(tile_tokens) under a padding attention_mask", UserWarning, stacklevel=4)
        return
    B, S, T = shape
    iq, ik, iw = index
    window_start = None if vis.plain else vis.windows(B, S, T, kv.device)[0]
    observe_selection(state, iq, ik, iw, attn_q, kv[:, :T], scale=scale, relu=state.config.relu,
                      window_start=window_start)


def sparse_step(cfg, index, shared: bool, window: int | None) -> bool:
    """Whether a layer attends over a selection (its indexer's, a source layer's, its window) rather than
    over every visible key (the dense warm-up, a layer without DSA)."""
    if index is None and not shared:
        return window is not None
    return not cfg.dense_warmup


def _selection(state: PatchState, vis: Visibility, compaction: Compaction | None, shape: tuple, device, *, index,
               shared: bool, prev_indices, window: int | None, with_lse: bool = False):
    """``(indices, attended, index_lse)`` of a sparse step: the indexer's or the source layer's selection (both
    the same tensor), or a window layer's window (``indices`` None); ``index_lse`` ([B, S], the indexer's
    log-sum-exp over each query's selection) with ``with_lse`` for a layer with an indexer, else None."""
    B, S, T = shape
    cfg = state.config
    if index is None and not shared:
        return None, window_indices(vis, window, B, S, T, device), None
    index_lse = None
    if index is not None:
        # K >= visible keys returns every visible key, so min(topk, T) selects the same set.
        indices, index_lse = _select(index, vis, compaction, min(int(cfg.topk), T), cfg, with_lse)
        if cfg.selection_replay and in_backward() and not replaying():
            _warn_selection_recomputed(state)
    elif prev_indices is None:
        raise ValueError("an IndexShare 'shared' layer needs the indices of a previous 'full' indexer layer")
    else:
        indices = share_selection(prev_indices)
    return indices, indices, index_lse


def _select(index, vis: Visibility, compaction: Compaction | None, topk: int, cfg, with_lse: bool):
    """``(indices, index_lse or None)``: hytopk on the indexer's detached outputs, in compacted order under a
    padding mask (exact top-k among each real query's visible keys; ``_compaction``)."""
    iq, ik, iw = (t.detach() for t in index)
    if compaction is None:
        out = hytopk(iq, ik, iw, topk, cu_seqlens=vis.cu_seqlens, window_start=vis.window_start, relu=cfg.relu,
                     return_lse=with_lse, backend=cfg.backend)
        return out if with_lse else (out, None)
    c = compaction
    out = hytopk(c.queries(iq), c.keys(ik), c.queries(iw), topk, window_start=c.window_start, relu=cfg.relu,
                 return_lse=with_lse, backend=cfg.backend)
    indices, index_lse = out if with_lse else (out, None)
    return c.to_original(indices), None if index_lse is None else c.rows_to_original(index_lse)


def _dense_inputs(attention, index, vis: Visibility, compaction: Compaction | None, lse=None):
    """``((index q, k, w, attention q, k, lse), windows)`` as the ops that score every visible key take
    them (the dense KL and the recall probe): in compacted order under a padding mask."""
    attn_q, attn_k = attention.target()
    tensors = (*index, attn_q, attn_k, lse)
    if compaction is None:
        return tensors, {"cu_seqlens": vis.cu_seqlens, "window_start": vis.window_start}
    c = compaction
    iq, ik, iw = index
    moved = (c.queries(iq), c.keys(ik), c.queries(iw), c.queries(attn_q), c.keys(attn_k),
             None if lse is None else c.queries(lse))
    return moved, {"cu_seqlens": None, "window_start": c.window_start}


_RECOMPUTED = (
    "hyscale_hf: the indexer and its top-k ran again in a checkpoint recompute. This checkpoint does not "
    "replay selections: reentrant checkpointing (use_reentrant=True), a checkpoint function set by hand "
    "on a layer (_gradient_checkpointing_func), or your own torch.utils.checkpoint call without "
    "context_fn=hyscale_hf.replay_context_fn(). Backward then repeats the O(T^2) selection and may see "
    "a different one than the forward used. Use Transformers' gradient_checkpointing_enable() (replay "
    "is wired into it), pass replay_context_fn() to non-reentrant checkpoint calls, or patch with "
    "selection_replay=False to recompute on purpose (which silences this warning)."
)


def _warn_selection_recomputed(state: PatchState) -> None:
    """Warn once per patched model that a checkpoint recompute ran the selection instead of replaying it."""
    if "recomputed_selection" not in state.warned:
        state.warned.add("recomputed_selection")
        warnings.warn(_RECOMPUTED, UserWarning, stacklevel=3)


def _indexer_loss(attention, index, indices, lse, vis: Visibility, compaction: Compaction | None, cfg,
                  count: torch.Tensor | None = None) -> torch.Tensor:
    """The indexer KL (fp32 scalar, mean over the real queries that have a key, or their sum over
    ``count``): on each query's selected set in the sparse stage, over every visible key in the dense warm-up."""
    iq, ik, iw = index
    if indices is not None:
        attn_q, attn_k = attention.target()
        if vis.query_real is not None:  # padding queries are no training signal
            indices = indices.masked_fill(~vis.query_real[..., None], -1)
        kl = indexer_kl_loss(iq, ik, iw, attn_q, attn_k, indices, attn_lse=lse, scale=attention.scale,
                             relu=cfg.relu, backend=cfg.backend, check_range=False,
                             reduction="mean" if count is None else "sum")
        return kl if count is None else kl / count
    (iq, ik, iw, attn_q, attn_k, lse), windows = _dense_inputs(attention, index, vis, compaction, lse)
    kl = indexer_kl_loss(iq, ik, iw, attn_q, attn_k, None, attn_lse=lse, scale=attention.scale, relu=cfg.relu,
                         reduction="none", backend=cfg.backend, **windows)
    if compaction is not None:
        counted = compaction.real_slot  # a real query always sees itself
    else:
        B, S, T = attention.shape
        start, end = vis.windows(B, S, T, iq.device)
        counted = end >= start
    return (kl * counted).sum() / (counted.sum().clamp_min(1) if count is None else count)
