"""Indexer training helpers: which parameters are the indexer's, and how well its top-k selection
covers the main attention.

- ``indexer_parameter_names`` / ``indexer_modules_to_save``: the indexer is every submodule named
  ``indexer`` (the name the DSA models in Transformers use and the dense-model patches add). The
  Trainer callback trains only these in the dense warm-up; PEFT users list them in
  ``modules_to_save`` so they train (and are saved) alongside LoRA adapters.
- Top-k recall of the dense attention mass: for a query, the share of the main attention's
  probability (summed over heads, normalised over the visible keys) that falls on the indexer's
  top-k keys. 1.0 means the sparse attention loses nothing. Patched attention modules report their
  inputs through ``observe_selection``; it does nothing unless a recall sample is being taken, and
  a sample scores only a few queries per layer with the torch reference ops.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch

from .config import HyScaleConfig
from .kernels.indexer_kl.naive import attention_target
from .kernels.topk.naive import indexer_logits_block, select_topk
from .kernels.windows import chunk_budget_bytes, query_windows, visible_mask
from .state import PatchState, base_model, in_backward, patch_state

INDEXER_MODULE_NAME = "indexer"


# ----------------------------------------------------------------------------- indexer parameters


def _is_indexer_name(name: str) -> bool:
    return INDEXER_MODULE_NAME in name.split(".")


def indexer_parameter_names(model: torch.nn.Module) -> list[str]:
    """Names (as in ``model.named_parameters()``) of the parameters inside indexer submodules.

    Works on a Transformers model or a PEFT wrapper of one; with PEFT ``modules_to_save`` the list
    holds both the trainable copy and the frozen original (filter by ``requires_grad``).
    """
    return [name for name, _ in model.named_parameters() if _is_indexer_name(name)]


def indexer_modules_to_save(model: torch.nn.Module) -> list[str]:
    """Module names to pass as PEFT ``modules_to_save`` so the indexer trains next to LoRA adapters.

    Full names of the indexer submodules of the Transformers model (looked up under any PEFT
    wrapper), e.g. ``model.layers.0.self_attn.indexer``. PEFT matches them by suffix, so they hit
    exactly these modules. Do not also put indexer projections (``wq_b``, ``wk``, ``weights_proj``)
    in LoRA ``target_modules``. Raises ``ValueError`` if the model has no indexer (patch it first).
    """
    names = [
        name for name, _ in base_model(model).named_modules() if name.rsplit(".", 1)[-1] == INDEXER_MODULE_NAME
    ]
    if not names:
        raise ValueError(
            f"model has no submodule named {INDEXER_MODULE_NAME!r}; patch it with hyscale_hf.patch_model first"
        )
    return names


# ----------------------------------------------------------------------------- top-k recall


@torch.no_grad()
def topk_recall(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    index_w: torch.Tensor,
    attn_q: torch.Tensor,
    attn_k: torch.Tensor,
    *,
    topk: int,
    scale: float,
    relu: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    window_start: torch.Tensor | None = None,
    max_queries: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-query share of the dense attention mass kept by the indexer's exact top-k.

    Inputs as in ``hyscale_hf.indexer_kl_loss`` (index_q ``[B, S, H, D]``, index_k ``[B, T, D]``,
    index_w ``[B, S, H]``, attn_q ``[B, S, Hq, Dqk]``, attn_k ``[B, T, Hkv, Dqk]``). Only queries
    that see more than ``topk`` keys count (for the others the selection keeps everything); up to
    ``max_queries`` of them, evenly spaced over the batch, are scored.

    Returns ``(recall, best)``, fp32 ``[n]`` each (empty when no query sees more than ``topk``
    keys): the mass on the indexer's top-k, and the most any k keys could hold (the attention's
    own top-k), the ceiling a perfect indexer reaches. Cost: O(n * T * (H * D + Hq * Dqk)).
    """
    if not isinstance(topk, int) or topk <= 0:
        raise ValueError(f"topk must be a positive int, got {topk!r}")
    if not isinstance(max_queries, int) or max_queries <= 0:
        raise ValueError(f"max_queries must be a positive int, got {max_queries!r}")
    B, S, H, _ = index_q.shape
    T = index_k.shape[1]
    device = index_q.device
    start, end = query_windows(B, S, T, cu_seqlens=cu_seqlens, window_start=window_start, device=device)
    eligible = ((end - start + 1) > topk).flatten().nonzero().squeeze(1)
    if eligible.numel() == 0:
        empty = torch.empty(0, dtype=torch.float32, device=device)
        return empty, empty
    pick = eligible[torch.linspace(0, eligible.numel() - 1, min(max_queries, eligible.numel()), device=device).round().long()]
    pick = pick.unique()
    rows, cols = pick // S, pick % S
    heads = max(H, attn_q.shape[2])
    recall, best = [], []
    for b in rows.unique().tolist():
        queries = cols[rows == b]
        chunk = max(1, chunk_budget_bytes(device) // (4 * heads * T))  # [c, H, window] fp32 scores
        for c0 in range(0, queries.numel(), chunk):
            qs = queries[c0 : c0 + chunk]
            st, en = start[b : b + 1, qs], end[b : b + 1, qs]
            lo, hi = int(st.min()), int(en.max()) + 1
            visible = visible_mask(st, en, lo, hi)
            scores = indexer_logits_block(index_q[b : b + 1, qs], index_k[b : b + 1, lo:hi], index_w[b : b + 1, qs], relu)
            idx, _ = select_topk(scores, visible, topk, key_offset=lo)
            p = attention_target(attn_q[b : b + 1, qs], attn_k[b : b + 1, lo:hi], visible, scale, None)
            valid = idx >= 0
            kept = p.gather(-1, (idx.long() - lo).clamp_min(0)).masked_fill(~valid, 0.0).sum(-1)
            recall.append(kept.reshape(-1).float())
            best.append(p.topk(min(topk, p.shape[-1]), dim=-1).values.sum(-1).reshape(-1).float())
    return torch.cat(recall), torch.cat(best)


class RecallProbe:
    """Collects ``topk_recall`` of every full indexer layer while it is installed on a patched model."""

    def __init__(self, max_queries: int = 64) -> None:
        if not isinstance(max_queries, int) or max_queries <= 0:
            raise ValueError(f"max_queries must be a positive int, got {max_queries!r}")
        self.max_queries = max_queries
        self.per_layer: list[tuple[torch.Tensor, torch.Tensor]] = []  # (recall, best) per layer forward
        self.calls = 0  # layer forwards observed (including ones with no eligible query)

    def __call__(self, state: PatchState, **inputs) -> None:
        self.calls += 1
        topk = state.config.topk
        if topk is None:
            raise ValueError("state.config.topk is None: the model family did not resolve it when patching")
        recall, best = topk_recall(**inputs, topk=topk, max_queries=self.max_queries)
        if recall.numel():
            self.per_layer.append((recall.cpu(), best.cpu()))

    def totals(self) -> tuple[float, float, int]:
        """(sum of per-query recalls, sum of their ceilings, number of queries) over all observed layers."""
        if not self.per_layer:
            return 0.0, 0.0, 0
        recall = torch.cat([r for r, _ in self.per_layer])
        best = torch.cat([b for _, b in self.per_layer])
        return float(recall.sum()), float(best.sum()), int(recall.numel())

    def mean(self) -> float | None:
        """Mean recall over the sampled queries of all observed layers (None if none)."""
        total, _, count = self.totals()
        return total / count if count else None

    def mean_best(self) -> float | None:
        """Mean ceiling (the attention's own top-k mass) over the same queries (None if none)."""
        _, best, count = self.totals()
        return best / count if count else None


def observe_selection(
    state: PatchState,
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    index_w: torch.Tensor,
    attn_q: torch.Tensor,
    attn_k: torch.Tensor,
    *,
    scale: float,
    relu: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    window_start: torch.Tensor | None = None,
) -> None:
    """Called by a patched attention module on every forward of a full indexer layer (both stages,
    training or not) with the tensors it gives ``indexer_kl_loss``. A no-op unless a recall sample is
    being taken; skipped during checkpoint recompute so a layer is counted once."""
    probe = state.selection_probe
    if probe is None or in_backward():
        return
    probe(
        state,
        index_q=index_q.detach(),
        index_k=index_k.detach(),
        index_w=index_w.detach(),
        attn_q=attn_q.detach(),
        attn_k=attn_k.detach(),
        scale=scale,
        relu=relu,
        cu_seqlens=cu_seqlens,
        window_start=window_start,
    )


def _require_state(model: torch.nn.Module) -> PatchState:
    state = patch_state(model)
    if state is None:
        raise ValueError("model is not patched by hyscale_hf; call hyscale_hf.patch_model(model) first")
    return state


def patched_config(model: torch.nn.Module) -> HyScaleConfig:
    """The live ``HyScaleConfig`` of a patched model (None fields resolved from the model): edits
    take effect on the next forward; save it with ``dataclasses.asdict`` to patch a reload alike."""
    return _require_state(model).config


@contextmanager
def sample_topk_recall(model: torch.nn.Module, max_queries: int = 64) -> Iterator[RecallProbe]:
    """Within the block, forwards of the patched ``model`` record top-k recall into the yielded probe."""
    state = _require_state(model)
    if state.selection_probe is not None:
        raise RuntimeError("a top-k recall sample is already being taken on this model")
    probe = RecallProbe(max_queries)
    state.selection_probe = probe
    try:
        yield probe
    finally:
        state.selection_probe = None


def measure_topk_recall(
    model: torch.nn.Module, batch: Mapping[str, torch.Tensor], max_queries: int = 64, return_best: bool = False
):
    """Mean top-k recall of the dense attention mass over the full indexer layers for one forward of
    ``model(**batch)`` (no gradients; the model's train/eval mode is left as it is).

    With ``return_best``, returns ``(recall, best)``: ``best`` is the mean mass of the attention's
    own top-k on the same queries, the ceiling of ``recall``. None (or ``(None, None)``) when no
    query of the batch sees more than ``topk`` keys. Raises ``RuntimeError`` when no patched layer
    reported its selection (a family that does not call ``observe_selection``).
    """
    with sample_topk_recall(model, max_queries) as probe, torch.no_grad():
        model(**batch)
    if probe.calls == 0:
        raise RuntimeError(
            f"no layer of this {_require_state(model).family.model_type} model reported its selection "
            "(its patch does not call hyscale_hf.training.observe_selection)"
        )
    return (probe.mean(), probe.mean_best()) if return_best else probe.mean()
