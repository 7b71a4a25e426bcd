"""Shared patch for dense families (llama, qwen2, qwen3, mistral, glm4): add a lightning indexer to every
attention layer and run attention over its top-k selection (sparse GQA/MHA).

How a patched model runs (one model instance; nothing is changed at class level):

- Each attention module gets ``module.indexer`` (a ``hyscale_hf.indexer.LightningIndexer``) and an
  instance-level ``forward`` that calls the module's own forward, adding one keyword argument (the
  layer's hidden states, rotary tables and cache). The family's own code still projects, normalises
  (Qwen3's q/k norms), applies RoPE and updates the KV cache; it then calls the attention function
  registered as ``"hyscale_dense"`` in ``AttentionInterface``, which this patch sets as the model
  config's ``_attn_implementation``. That function runs the indexer on the detached hidden states,
  selects with ``hytopk`` and attends with ``sparse_attention`` (or densely in the warm-up stage),
  and joins the indexer KL loss to the output during training.
- ``"hyscale_dense"`` is registered in ``AttentionMaskInterface`` too: its "mask" is the 2-D padding
  mask (or None), never a ``[B, 1, S, T]`` tensor. Each layer turns it, the packing kwargs /
  position_ids and its sliding window into hytopk's visibility (``_visibility``): left and
  right padding, packed sequences, sliding windows. Masks with holes inside a row are refused.
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

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from ..indexer import LightningIndexer, attach_indexer_loss
from ..kernels import hytopk, indexer_kl_loss, sparse_attention
from ..kernels.windows import query_windows
from ..records import LiveRecord, saved_record, set_record
from ..state import PatchState
from ..training import observe_selection
from ._chunked_lm_loss import apply_chunked_lm_loss
from ._dense_cache import indexer_cache_layer
from ._dense_weights import RECORD_ATTR, load_saved_indexers
from ._lean_layers import apply_lean_layers
from ._visibility import Visibility, padding_mask_only, visibility

ATTN_IMPL = "hyscale_dense"
DEFAULT_TOPK = 2048
# Floors of the indexer shape: the Triton HyTopK kernels take at least 2 heads of at least 16 dims.
_MIN_INDEXER_HEADS, _MIN_INDEXER_DIM, _MAX_INDEXER_DIM = 2, 16, 128


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
_CALL_KWARG = "_hyscale_call"


@dataclass
class _LayerCall:
    """What one attention call hands to the attention function (lives only as long as the call)."""

    hidden_states: torch.Tensor
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None
    cache: Any
    state: PatchState


# ----------------------------------------------------------------------------- attention


def _dense_attention(q, k, v, vis: Visibility, scaling: float) -> torch.Tensor:
    """Dense warm-up attention over every visible key: q [B, S, Hq, D], k/v [B, T, Hkv, D] -> [B, S, Hq, Dv]."""
    B, S, _, _ = q.shape
    T = k.shape[1]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    plain = vis.cu_seqlens is None and vis.window_start is None and vis.key_end is None
    if plain and (S == T or S == 1):
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=S > 1, scale=scaling, enable_gqa=True)
        return o.transpose(1, 2)
    start, end = vis.windows(B, S, T, q.device)
    s = torch.arange(T, device=q.device)
    visible = (s >= start[..., None]) & (s <= end[..., None])  # [B, S, T]
    no_key = ~visible.any(-1)
    # A query with no visible key (left padding) attends to key 0 so softmax stays finite; zeroed below.
    visible = visible | (no_key[..., None] & (s == 0))
    o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=visible[:, None], scale=scaling, enable_gqa=True)
    return o.transpose(1, 2).masked_fill(no_key[..., None, None], 0.0)


def dense_sparse_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                           **kwargs):
    """The ``"hyscale_dense"`` attention function: query [B, Hq, S, D], key/value [B, Hkv, T, D] (after
    RoPE and the cache update) -> ``([B, S, Hq, Dv], None)``."""
    call = kwargs.pop(_CALL_KWARG, None)
    if call is None:
        raise RuntimeError(
            f"attention implementation {ATTN_IMPL!r} only serves attention modules patched by hyscale_hf.patch_model"
        )
    state, cfg = call.state, call.state.config
    if dropout:
        raise ValueError(
            f"hyscale_hf sparse attention has no attention dropout; set the model config's attention_dropout to 0 "
            f"(got {dropout})"
        )
    if not getattr(module.config, "is_causal", True):
        raise ValueError("hyscale_hf dense patches support causal attention only (config.is_causal is False)")
    B, _, S, _ = query.shape
    T = key.shape[2]
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    cos_sin = call.position_embeddings if call.position_embeddings is not None else (None, None)
    iq, ik, iw = module.indexer(call.hidden_states.detach(), *cos_sin)
    if call.cache is not None:
        ik = indexer_cache_layer(call.cache, module.layer_idx).hyscale_update_index_keys(ik, T)
    elif T != S:
        raise RuntimeError(f"attention sees {T} keys for {S} queries but no cache was passed to the layer")
    vis = visibility(attention_mask, kwargs.get("position_ids"), kwargs, B, S, T, sliding_window=sliding_window,
                     device=query.device)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    relu = bool(cfg.relu)
    observe_selection(state, iq, ik, iw, q, k, scale=scaling, relu=relu, cu_seqlens=vis.cu_seqlens,
                      window_start=vis.window_start)  # top-k recall sampling (no-op otherwise)
    want_loss = module.training and torch.is_grad_enabled() and cfg.indexer_loss_coef > 0
    if cfg.dense_warmup:
        out = _dense_attention(q, k, v, vis, scaling)
        if want_loss:
            kl = indexer_kl_loss(iq, ik, iw, q, k, None, scale=scaling, relu=relu, cu_seqlens=vis.cu_seqlens,
                                 window_start=vis.window_start, reduction="none", backend=cfg.backend)
            start, end = query_windows(B, S, T, cu_seqlens=vis.cu_seqlens, window_start=vis.window_start,
                                       device=q.device)
            counted = end >= start
            if vis.query_real is not None:
                counted = counted & vis.query_real
            loss = (kl * counted).sum() / counted.sum().clamp_min(1)
    else:
        idx = hytopk(iq, ik, iw, min(int(cfg.topk), T), cu_seqlens=vis.cu_seqlens, window_start=vis.window_start,
                     relu=relu, backend=cfg.backend)
        if vis.key_end is not None:  # right padding: only padding queries could have picked padding keys
            idx = idx.masked_fill(idx > vis.key_end[:, None, None].to(idx.dtype), -1)
        out, lse = sparse_attention(q, k, v, idx, scale=scaling, return_lse=True, backend=cfg.backend)
        if want_loss:
            idx_loss = idx if vis.query_real is None else idx.masked_fill(~vis.query_real[..., None], -1)
            loss = indexer_kl_loss(iq, ik, iw, q, k, idx_loss, attn_lse=lse, scale=scaling, relu=relu,
                                   backend=cfg.backend)
    if want_loss:
        out = attach_indexer_loss(out, loss, state)
    return out, None


AttentionInterface.register(ATTN_IMPL, dense_sparse_attention)
AttentionMaskInterface.register(ATTN_IMPL, padding_mask_only)


# ----------------------------------------------------------------------------- patch / undo


# Attributes a patched attention module carries. They are plain attributes (no closures), so
# copy.deepcopy of a patched model (e.g. a reference model for RL fine-tuning) gives an independent
# patched copy whose forwards, state and undo all point at the copy.
_STATE = "_hyscale_dense_state"
_PREV_FORWARD = "_hyscale_dense_prev_forward"


def _patched_forward(self, *args, **kwargs):
    """Instance forward: the module's own forward plus the hidden states, rotary tables and cache.

    The attention signature is ``(hidden_states, position_embeddings, attention_mask, cache, **kwargs)``
    in every dense family; the cache argument is ``past_key_values`` before Transformers 5.18.
    """
    hidden = args[0] if args else kwargs["hidden_states"]
    pos_emb = args[1] if len(args) > 1 else kwargs.get("position_embeddings")
    cache = args[3] if len(args) > 3 else kwargs.get("cache", kwargs.get("past_key_values"))
    call = _LayerCall(hidden, pos_emb, cache, getattr(self, _STATE))
    prev = getattr(self, _PREV_FORWARD)  # an instance forward that was there before (e.g. an accelerate hook)
    if prev is not None:
        return prev(*args, **{_CALL_KWARG: call}, **kwargs)
    return type(self).forward(self, *args, **{_CALL_KWARG: call}, **kwargs)


def _rotary_dim(model: nn.Module) -> int:
    for mod in model.modules():
        if type(mod).__name__.endswith("RotaryEmbedding") and isinstance(getattr(mod, "inv_freq", None), torch.Tensor):
            return 2 * mod.inv_freq.numel()
    raise ValueError(f"no rotary embedding module (with inv_freq) found in {type(model).__name__}")


def _attention_shape(model_config) -> tuple[int, int]:
    heads = int(model_config.num_attention_heads)
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    return heads, int(head_dim)


def _resolve_settings(model_config, state: PatchState, rotary_dim: int) -> dict:
    """Indexer settings: explicit HyScaleConfig > saved record > model config index_* > the defaults
    (``DEFAULT_TOPK``, ``default_indexer_shape``)."""
    cfg = state.config
    record = saved_record(model_config, RECORD_ATTR)
    if record is not None and not isinstance(record, dict):
        raise ValueError(f"model.config.{RECORD_ATTR} must be a dict written by hyscale_hf, got {type(record).__name__}")
    record = record or {}
    heads, dim = default_indexer_shape(*_attention_shape(model_config))
    defaults = {"topk": DEFAULT_TOPK, "index_n_heads": heads, "index_head_dim": dim}
    out = {}
    model_keys = {"topk": "index_topk", "index_n_heads": "index_n_heads", "index_head_dim": "index_head_dim"}
    for name, default in defaults.items():
        explicit = getattr(cfg, name)
        if explicit is not None and name != "topk" and name in record and record[name] != explicit:
            raise ValueError(
                f"HyScaleConfig.{name}={explicit} differs from the saved indexer's {name}={record[name]} "
                f"(model.config.{RECORD_ATTR}); the saved weights need the saved shape"
            )
        value = explicit or record.get(name) or getattr(model_config, model_keys[name], None) or default
        out[name] = int(value)
    out["relu"] = bool(cfg.relu if cfg.relu is not None else record.get("relu", True))
    D = out["index_head_dim"]
    if D % 2:
        raise ValueError(f"index_head_dim must be even (RoPE rotates pairs), got {D}")
    # DeepSeek-V3.2 rotates half of the indexer head (64 of 128); never more than the model rotates.
    out["rope_dim"] = int(record.get("rope_dim", 2 * min(rotary_dim // 2, D // 4)))
    for name in ("topk", "index_n_heads", "index_head_dim", "relu"):
        setattr(cfg, name, out[name])
    return out


class _DenseUndo:
    """Restores a patched model exactly. A callable object rather than a closure, so that it is
    deep-copied along with the model and then restores the copy."""

    def __init__(self, config, attns: list[nn.Module]) -> None:
        self.config = config
        self.attns = attns
        self.forwards: list[tuple[nn.Module, Any]] = []  # (module, previous instance forward or None)
        self.impls: list[tuple[Any, Any]] = []  # (config, previous _attn_implementation)
        self.record: Callable[[], None] | None = None  # undo of the indexer record in the config
        self.lean: Callable[[], None] | None = None  # undo of the lean norm / MLP forwards
        self.lm_loss: Callable[[], None] | None = None  # undo of the chunked LM loss forward

    def __call__(self) -> None:
        for name in ("lean", "lm_loss"):
            step = getattr(self, name)
            if step is not None:
                step()
                setattr(self, name, None)
        if self.record is not None:
            self.record()
            self.record = None
        for config, old in reversed(self.impls):
            config._attn_implementation = old
        self.impls.clear()
        for m, prev in reversed(self.forwards):
            del m.forward
            if prev is not None:
                m.forward = prev
            for name in (_STATE, _PREV_FORWARD):
                m.__dict__.pop(name, None)
        self.forwards.clear()
        for m in self.attns:
            if "indexer" in m._modules:
                del m.indexer


def make_dense_apply(attention_cls: type, apply_rotary):
    """The ``apply(model, state) -> undo`` of a dense family whose attention class is ``attention_cls``
    and whose RoPE function is ``apply_rotary`` (the family's ``apply_rotary_pos_emb``)."""

    def apply(model: nn.Module, state: PatchState):
        config = model.config
        attns = [(name, m) for name, m in model.named_modules() if isinstance(m, attention_cls)]
        if not attns:
            raise ValueError(f"no {attention_cls.__name__} module found in {type(model).__name__}")
        for name, m in attns:
            if hasattr(m, "indexer"):
                raise ValueError(f"{name} already has an attribute 'indexer'; cannot add the hyscale_hf indexer")
        loaded_record = saved_record(config, RECORD_ATTR)
        settings = _resolve_settings(config, state, _rotary_dim(model))
        configs = {id(c): c for c in [config] + [m.config for _, m in attns]}.values()
        undo = _DenseUndo(config, [m for _, m in attns])
        try:
            for _, m in attns:
                ref = getattr(m.q_proj, "base_layer", m.q_proj).weight  # (PEFT wraps q_proj)
                m.indexer = LightningIndexer(
                    config.hidden_size, settings["index_n_heads"], settings["index_head_dim"], settings["rope_dim"],
                    apply_rotary=apply_rotary, init_std=float(getattr(config, "initializer_range", 0.02)),
                    dtype=ref.dtype, device=ref.device,
                )
                prev = m.__dict__.get("forward")
                setattr(m, _STATE, state)
                setattr(m, _PREV_FORWARD, prev)
                m.forward = types.MethodType(_patched_forward, m)
                undo.forwards.append((m, prev))
            for c in configs:
                undo.impls.append((c, c._attn_implementation))
                c._attn_implementation = ATTN_IMPL
            undo.record = set_record(config, RECORD_ATTR, LiveRecord({"kind": "dense", **settings}))
            if loaded_record is not None:
                load_saved_indexers(model, {name: m.indexer for name, m in attns})
            undo.lean = apply_lean_layers(model, state)
            undo.lm_loss = apply_chunked_lm_loss(model, state)
        except BaseException:
            undo()
            raise
        return undo

    return apply
