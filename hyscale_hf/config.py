"""HyScaleConfig: the one place where hyscale_hf's options live."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

BACKENDS = ("auto", "torch", "triton")


@dataclass
class HyScaleConfig:
    """Options for patching a model and training its indexer.

    Fields left as ``None`` are filled when ``patch_model`` runs, by one precedence: the record of a
    saved patched model (``model.config.hyscale_indexer``), then the model config's ``index_topk``,
    ``index_n_heads`` and ``index_head_dim`` (DSA families carry them), then the defaults documented
    on each field (docs/design.md section 3).

    Attributes:
        topk: keys kept per query (K). DSA models: ``config.index_topk``; dense models: 2048.
        index_n_heads: indexer heads H. DSA models: ``config.index_n_heads`` (fixed by the weights);
            dense models: sized from the attention (``default_indexer_shape``).
        index_head_dim: indexer head dim D. DSA models: ``config.index_head_dim`` (fixed by the
            weights); dense models: sized from the attention.
        index_share: dense models: an indexer on every ``index_share``-th attention layer (layers 0, n,
            2n, ...); each of the ``n - 1`` layers after one attends over its selection (IndexShare, as in
            GLM-5.2's "shared" layers): the selection, the indexer loss and the replayed indices are paid
            once per group. ``None``: the saved record's value, else 1 (an indexer on every layer). DSA
            models share as their own config says; anything but None or 1 is refused there. Quality
            depends on the context: BENCHMARKS.md, real model.
        relu: apply ReLU to per-head indexer logits before the head-weighted sum. ``None`` follows
            the model family's own code.
        selection_replay: under gradient checkpointing, recompute reuses the forward's indices
            instead of running the indexer and top-k again.
        verify_replay: recompute the selection anyway and raise if it differs from the saved one
            (debugging aid; costs the indexer's recompute).
        indexer_loss_coef: weight of the indexer KL loss added during training.
        dense_warmup: start in the dense warm-up stage (dense attention, only the indexer trains on
            the dense KL loss) instead of the sparse stage.
        backend: ``"auto"`` (Triton on CUDA tensors, torch reference otherwise), ``"torch"`` or
            ``"triton"``.
        lean_activations: give the model's RMSNorms and SwiGLU MLPs forwards that compute the same
            bits but save fewer activations for backward (``kernels.rms_norm`` / ``kernels.swiglu_mlp``;
            about a third of a GLM-5 layer's checkpoint-recompute memory). Modules whose own forward
            the ops' torch path does not reproduce bit for bit keep it. On CUDA the ops run fused
            Triton kernels, which may differ from the torch path in the last bits of fp32 statistics.
        lm_loss_chunk: when set (tokens, e.g. 16384), a forward with ``labels`` computes the causal-LM
            loss that many tokens at a time (``kernels.chunked_cross_entropy``) instead of building the
            ``[B, T, vocab]`` logits, and returns ``logits=None``. ``None``: the model's own loss.
        tile_tokens: when set (tokens, e.g. 65536), the token-wise work of a patched layer runs that many
            tokens at a time, each tile checkpointed, so its activations are O(tile) instead of O(T):
            every decoder layer's MLP, every norm, and in the sparse stage a native DSA layer's query
            side (query projections, sparse attention, output projection) and its indexer KL loss. The selection
            and the keys (one latent row and one indexer key per token) are computed whole. Costs one
            more forward of the tiled work per step; results equal the untiled ones within rounding
            (docs/design.md section 11). ``None``: untiled.
        offload_activations: keep what checkpointed layers hold from forward to backward (their saved
            inputs, their replayed selections, the indexer-loss gradients) in pinned host memory; copies
            run on a side stream and the previous layer's are fetched during the current layer's
            backward (``hyscale_hf.offload``).
            Needs ``selection_replay`` (it rides on the same checkpoint wiring). No effect on CPU tensors.
    """

    topk: int | None = None
    index_n_heads: int | None = None
    index_head_dim: int | None = None
    index_share: int | None = None
    relu: bool | None = None
    selection_replay: bool = True
    verify_replay: bool = False
    indexer_loss_coef: float = 1e-3
    dense_warmup: bool = False
    backend: str = "auto"
    lean_activations: bool = True
    lm_loss_chunk: int | None = None
    tile_tokens: int | None = None
    offload_activations: bool = False

    def __post_init__(self) -> None:
        for name in ("topk", "index_n_heads", "index_head_dim", "index_share", "lm_loss_chunk", "tile_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"HyScaleConfig.{name} must be a positive int or None, got {value!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"HyScaleConfig.backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.verify_replay and not self.selection_replay:
            raise ValueError("HyScaleConfig.verify_replay=True needs selection_replay=True (it checks the replayed selection)")
        if self.index_share not in (None, 1) and not self.selection_replay:
            raise ValueError("HyScaleConfig.index_share > 1 needs selection_replay=True (a shared layer's checkpoint "
                             "recompute takes its copy of the source layer's selection from the replay)")
        if not isinstance(self.offload_activations, bool):
            raise ValueError(f"HyScaleConfig.offload_activations must be a bool, got {self.offload_activations!r}")
        if self.offload_activations and not self.selection_replay:
            raise ValueError("HyScaleConfig.offload_activations=True needs selection_replay=True (the offload "
                             "rides on the replaying checkpoint of each layer)")
        if not isinstance(self.indexer_loss_coef, (int, float)) or self.indexer_loss_coef < 0:
            raise ValueError(
                f"HyScaleConfig.indexer_loss_coef must be a non-negative number, got {self.indexer_loss_coef!r}"
            )

    def replace(self, **overrides: Any) -> HyScaleConfig:
        """A copy with ``overrides`` applied; unknown names raise ``TypeError`` naming them."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"unknown HyScaleConfig option(s) {unknown}; known: {sorted(known)}")
        return dataclasses.replace(self, **overrides)
