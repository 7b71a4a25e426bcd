"""Shared patch for dense families (llama, qwen2, qwen3, mistral, glm4): add a lightning indexer to every
attention layer and run attention over its top-k selection (sparse GQA/MHA).

How a patched model runs (one model instance; nothing is changed at class level):

- Each attention module gets ``module.indexer`` (a ``hyscale_hf.indexer.LightningIndexer``) and an
  instance-level ``forward`` that calls the module's own forward, adding one keyword argument (the
  layer call: hidden states, rotary tables and cache). The family's own code still projects,
  normalises (Qwen3's q/k norms), applies RoPE and updates the KV cache; it then calls the attention
  function registered for ``_dsa_step.ATTN_IMPLEMENTATION``, which is the model config's
  ``_attn_implementation`` while a patched call runs (``_attn_switch``), and which runs the layer
  call: the indexer on the detached
  hidden states, then the DSA attention step every patched layer runs (``_dsa_step``: selection with
  ``hytopk``, sparse GQA attention or the dense warm-up, the indexer KL loss during training) over
  the visibility of ``_visibility`` (left and right padding, packed sequences, sliding windows).
- IndexShare (``HyScaleConfig.index_share = n``): only layers 0, n, 2n, ... (positions in model
  order) get an indexer; each of the n - 1 layers after such a source attends over the source's
  selection of the same forward call, which the source leaves in ``PatchState.shared_selections``.
  A shared layer takes it through ``share_selection``, so a replaying checkpoint keeps it (the tensor
  itself, no copy) for the layer's recompute;
  the entry is dropped once no shared layer can read it again (``_IndexShare.take``). Top-k recall
  samples a shared layer as its source's selection against its own attention (not under context
  parallelism, where only the indexer layers are sampled).
- The dense warm-up stage attends over all visible keys with SDPA (a boolean ``[B, 1, S, T]``
  mask only when padding, packing or a window needs one, as the family's own sdpa path does).
- generate(): the indexer's keys are cached on the KV cache's layer objects (``_dense_cache``).
- Save / load (``_dense_weights``): patching records the indexer settings in
  ``model.config.hyscale_indexer``, so ``save_pretrained`` writes them to config.json next to the
  indexer weights (``*.self_attn.indexer.*`` in the safetensors files). Loading that checkpoint with
  the unpatched class drops the indexer tensors as unexpected keys (Transformers lists them in its
  load report); ``patch_model`` then sees the record and reloads them from ``model.name_or_path``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..context_parallel import BATCH_KWARG, gather_tokens
from ..indexer import LightningIndexer
from ..records import LiveRecord, set_record
from ..replay import in_replay_checkpoint, placeholder_indices, replaying
from ..state import PatchState, in_backward
from ._cp_attention import cp_attention
from ._dense_cache import indexer_cache_layer, is_static_layer, static_index_keys, static_query_offset
from ._dense_weights import RECORD_ATTR, InitWithIndexers, copy_indexer_tensors, load_saved_indexers
from ._dsa_patch import ATTN_SWITCH, LAYER_STATE, PatchUndo, patch_attention, resolve_indexer_options
from ._dsa_step import CALL_KWARG, GQAAttention, dsa_attention, wants_weights
from ._visibility import visibility

# Floors of the indexer shape: the Triton HyTopK kernels take at least 2 heads of at least 16 dims.
_MIN_INDEXER_HEADS, _MIN_INDEXER_DIM, _MAX_INDEXER_DIM = 2, 16, 128
_PREV_FORWARD = "_hyscale_prev_forward"  # an instance forward that was there before (e.g. an accelerate hook)
_SHARE = "_hyscale_index_share"  # each patched attention module's _IndexShare


@dataclass(frozen=True)
class _IndexShare:
    """A layer's place in its IndexShare group (``HyScaleConfig.index_share``): positions in model order.

    ``source`` is the group's first layer (the one with an indexer), ``last`` the group's last layer.
    """

    position: int
    source: int
    last: int

    @property
    def is_source(self) -> bool:
        return self.position == self.source

    def hand_on(self, state: PatchState, indices: torch.Tensor | None, index: tuple) -> None:
        """A source layer leaves its selection for the layers after it (not in a recompute: the forward's
        entry is still there, and a recompute's would outlive the step), with its indexer output ``index``
        while top-k recall is being sampled (the shared layers' recall is the source's selection against
        their own attention)."""
        if self.is_source and self.last > self.position and indices is not None and not in_backward():
            recall = tuple(t.detach() for t in index) if state.selection_probe is not None else None
            state.shared_selections[self.source] = (indices, recall)

    def take(self, state: PatchState, sparse: bool, query) -> tuple[torch.Tensor | None, tuple | None]:
        """A shared layer's copy source and recall input: the source's selection of this forward call and,
        while recall is sampled, its indexer output (``query`` [B, Hq, S, D]: the layer's queries). The
        entry is dropped where no one will read it again: by the group's last layer outside a replaying
        checkpoint, and in a replaying one by the first shared layer's recompute (backward recomputes the
        layers last to first)."""
        if not sparse:  # the dense warm-up: no selection was made
            return None, None
        if in_replay_checkpoint():
            done = replaying() and self.position == self.source + 1
        else:
            done = self.position == self.last
        entry = state.shared_selections.pop(self.source, None) if done else state.shared_selections.get(self.source)
        if entry is None and replaying():
            # Another forward call ran (and was backpropagated) in between: the replay hands this recompute
            # its own forward's selection whatever share_selection is given. Verify mode's rerun then
            # reports the changed holder, as it should: a recompute without the replay would not see it.
            return placeholder_indices(query.shape[0], query.shape[2], query.device), None
        if entry is None:
            raise RuntimeError(
                f"hyscale_hf IndexShare: attention layer {self.position} found no selection of its source layer "
                f"{self.source} (index_share={state.config.index_share}). The layers of one forward call must run in "
                "order, and a checkpoint recompute needs the replaying non-reentrant checkpoint of "
                "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})"
            )
        return entry


def default_indexer_shape(num_heads: int, head_dim: int) -> tuple[int, int]:
    """``(index_n_heads, index_head_dim)`` of the indexer added to a dense model, from its attention.

    Per query-key pair the indexer costs ``2 * H_I * D_I`` FLOPs and the dense attention it replaces
    about ``4 * H * Dh`` forward and 2.5x that in backward, so an indexer with
    ``H_I * D_I <= H * Dh / 4`` costs at most an eighth of the attention's forward. The head dim is the largest
    power of two <= min(128, budget / 2) (at least 16), the heads fill the rest of the budget (at
    least 2). SmolLM2-135M (9 x 64 -> 144) gets 2 x 64; Llama-3-8B (32 x 128 -> 1024) 8 x 128.
    On very small models the floors can exceed the budget.
    """
    budget = max(1, num_heads * head_dim // 4)
    dim = _MIN_INDEXER_DIM
    while dim * 2 <= min(_MAX_INDEXER_DIM, budget // 2):
        dim *= 2
    return max(_MIN_INDEXER_HEADS, budget // dim), dim


@dataclass
class _LayerCall:
    """What one attention call hands to the attention function (lives only as long as the call)."""

    hidden_states: torch.Tensor
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None
    cache: Any
    state: PatchState

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                 **kwargs):
        """query [B, Hq, S, D], key/value [B, Hkv, T, D] (after RoPE and the cache update) ->
        ``([B, S, Hq, Dv], None)``, as Transformers' attention functions return."""
        if dropout:
            raise ValueError(
                f"hyscale_hf sparse attention has no attention dropout; set the model config's attention_dropout "
                f"to 0 (got {dropout})"
            )
        if not getattr(module.config, "is_causal", True):
            raise ValueError("hyscale_hf dense patches support causal attention only (config.is_causal is False)")
        B, _, S, _ = query.shape
        T = key.shape[2]
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        if self.cache is None and T != S:
            raise RuntimeError(f"attention sees {T} keys for {S} queries but no cache was passed to the layer")
        static = self.cache is not None and is_static_layer(self.cache, module.layer_idx)
        query_offset = static_query_offset(self.cache, module.layer_idx, S) if static else None
        share = getattr(module, _SHARE)
        index = prev = recall = None
        if share.is_source:
            cos_sin = self.position_embeddings if self.position_embeddings is not None else (None, None)
            iq, ik, iw = module.indexer(self.hidden_states.detach(), *cos_sin)
            if static:
                ik = static_index_keys(self.cache, module.layer_idx, ik)
            elif self.cache is not None:
                ik = indexer_cache_layer(self.cache, module.layer_idx).hyscale_update_index_keys(ik, T)
            index = (iq, ik, iw)
        else:  # an IndexShare shared layer: no indexer, its source layer's selection
            prev, recall = share.take(self.state, not self.state.config.dense_warmup, query)
        batch = kwargs.get(BATCH_KWARG)
        if batch is not None:  # context parallelism: this rank's queries over the gathered keys (_cp_attention)
            q, k, v = (t.transpose(1, 2) for t in (query, key, value))
            k, v = (gather_tokens(t, batch.cp) for t in (k, v))
            if index is not None:
                index = (index[0], gather_tokens(index[1], batch.cp), index[2])
            out, indices = cp_attention(lambda a, b, end: GQAAttention(q[:, a:b], k[:, :end], v[:, :end], scaling),
                                        self.state, batch, batch_size=B, index=index, shared=not share.is_source,
                                        prev_indices=prev, window=sliding_window, training=module.training,
                                        device=query.device)
            share.hand_on(self.state, indices, index)
            return out, None
        vis = visibility(attention_mask, kwargs.get("position_ids"), kwargs, B, S, T, sliding_window=sliding_window,
                         query_offset=query_offset, device=query.device)
        attention = GQAAttention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), scaling)
        out, indices, weights = dsa_attention(attention, self.state, vis, index=index, shared=not share.is_source,
                                              prev_indices=prev, training=module.training,
                                              weights=wants_weights(module, kwargs), recall_index=recall)
        share.hand_on(self.state, indices, index)
        return out, weights


def _patched_forward(self, *args, **kwargs):
    """Instance forward: the module's own forward plus the hidden states, rotary tables and cache.

    The attention signature is ``(hidden_states, position_embeddings, attention_mask, cache, **kwargs)``
    in every dense family; the cache argument is ``past_key_values`` before Transformers 5.18.
    """
    hidden = args[0] if args else kwargs["hidden_states"]
    pos_emb = args[1] if len(args) > 1 else kwargs.get("position_embeddings")
    cache = args[3] if len(args) > 3 else kwargs.get("cache", kwargs.get("past_key_values"))
    call = _LayerCall(hidden, pos_emb, cache, getattr(self, LAYER_STATE))
    prev = getattr(self, _PREV_FORWARD)
    # The family's forward picks its attention function by config._attn_implementation; this call can run
    # alone (a checkpoint's recompute), so it puts ATTN_IMPLEMENTATION there itself (_attn_switch).
    with getattr(self, ATTN_SWITCH).active():
        if prev is not None:
            return prev(*args, **{CALL_KWARG: call}, **kwargs)
        return type(self).forward(self, *args, **{CALL_KWARG: call}, **kwargs)


def _rotary_dim(model: nn.Module) -> int:
    for mod in model.modules():
        if type(mod).__name__.endswith("RotaryEmbedding") and isinstance(getattr(mod, "inv_freq", None), torch.Tensor):
            return 2 * mod.inv_freq.numel()
    raise ValueError(f"no rotary embedding module (with inv_freq) found in {type(model).__name__}")


def _attention_shape(model_config) -> tuple[int, int]:
    heads = int(model_config.num_attention_heads)
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    return heads, int(head_dim)


def _on_meta(indexers: dict) -> bool:
    return any(p.device.type == "meta" for m in indexers.values() for p in m.parameters())


def _windowed_layers(config, attns: list) -> list[str]:
    """Names of the attention modules that run a sliding window: by ``config.layer_types`` where the family
    has it (Qwen2/3), else every layer under ``config.sliding_window`` (Mistral)."""
    types = getattr(config, "layer_types", None)
    if types is not None:
        return [name for name, m in attns if types[m.layer_idx] == "sliding_attention"]
    if getattr(config, "sliding_window", None):
        return [name for name, _ in attns]
    return [name for name, m in attns if getattr(m, "sliding_window", None)]


def make_dense_apply(attention_cls: type, apply_rotary, *, mlp_ends_layer: bool):
    """The ``apply(model, state) -> undo`` of a dense family whose attention class is ``attention_cls``
    and whose RoPE function is ``apply_rotary`` (the family's ``apply_rotary_pos_emb``);
    ``mlp_ends_layer``: its decoder layers end in ``residual + self.mlp(x)`` (``_lean_layers``)."""

    def apply(model: nn.Module, state: PatchState):
        config = model.config
        attns = [(name, m) for name, m in model.named_modules() if isinstance(m, attention_cls)]
        if not attns:
            raise ValueError(f"no {attention_cls.__name__} module found in {type(model).__name__}")
        for name, m in attns:
            if hasattr(m, "indexer"):
                raise ValueError(f"{name} already has an attribute 'indexer'; cannot add the hyscale_hf indexer")
        cfg = state.config
        saved = resolve_indexer_options(cfg, config, default_shape=default_indexer_shape(*_attention_shape(config)),
                                        share_layers=True)
        n = cfg.index_share
        windowed = _windowed_layers(config, attns)
        if n > 1 and windowed:
            # a sliding-window layer's cache keeps only its window: another layer's key indices do not fit it
            raise ValueError(f"HyScaleConfig.index_share={n}: IndexShare groups full-attention layers only, and "
                             f"{windowed[0]} has a sliding window; use index_share=1 with this model")
        roles = {id(m): _IndexShare(i, i - i % n, min(i - i % n + n, len(attns)) - 1) for i, (_, m) in enumerate(attns)}
        D = cfg.index_head_dim
        # DeepSeek-V3.2 rotates half of the indexer head (64 of 128); never more than the model rotates.
        rope_dim = int((saved or {}).get("rope_dim", 2 * min(_rotary_dim(model) // 2, D // 4)))
        settings = {"topk": cfg.topk, "index_n_heads": cfg.index_n_heads, "index_head_dim": D, "relu": cfg.relu,
                    "rope_dim": rope_dim, "index_share": n}

        def prepare(undo: PatchUndo, m: nn.Module) -> None:
            ref = getattr(m.q_proj, "base_layer", m.q_proj).weight  # (PEFT wraps q_proj)
            undo.set_attr(m, _SHARE, roles[id(m)])
            if roles[id(m)].is_source:
                undo.set_attr(m, "indexer", LightningIndexer(
                    config.hidden_size, cfg.index_n_heads, D, rope_dim, apply_rotary=apply_rotary,
                    init_std=float(getattr(config, "initializer_range", 0.02)), dtype=ref.dtype, device=ref.device,
                ))
            undo.set_attr(m, _PREV_FORWARD, m.__dict__.get("forward"))

        def finish(undo: PatchUndo) -> None:
            undo.add(set_record(config, RECORD_ATTR, LiveRecord({"kind": "dense", **settings})))
            for owner in model.modules():  # the model and the Transformers models inside it
                if callable(getattr(owner, "_init_weights", None)):
                    undo.set_attr(owner, "_init_weights",
                                  InitWithIndexers(owner, LightningIndexer, owner.__dict__.get("_init_weights")))
            indexers = {name: m.indexer for name, m in attns if roles[id(m)].is_source}
            given = state.load_from
            if given is not None and (saved is not None or any(".indexer." in key for key in given)):
                copy_indexer_tensors(model, indexers, given, "the state_dict passed to patch_model")
            elif saved is not None and not _on_meta(indexers):
                # The checkpoint holds trained indexers: load them. (A model patched on the meta device,
                # as inside from_pretrained, gets them from from_pretrained's own loading.)
                load_saved_indexers(model, indexers)

        return patch_attention(model, state, [m for _, m in attns], _patched_forward, prepare=prepare, finish=finish,
                               mlp_ends_layer=mlp_ends_layer)

    return apply
