"""Indexer training wiring: add each indexer layer's KL loss to training without touching the loop.

A patched attention module computes its indexer KL loss and passes its output through
``attach_indexer_loss``: the forward value is unchanged (the Trainer's loss stays the LM loss), and
backward injects ``coef * d(indexer_loss)`` into the graph. Because the indexer's inputs are
detached and the KL target is detached, that gradient reaches only the indexer's parameters, and the
LM loss never reaches the indexer (top-k indices carry no gradient).
"""

from __future__ import annotations

import torch

from .patching import PatchState


def in_backward() -> bool:
    """True while autograd runs a backward pass: checkpoint recomputation happens there."""
    return torch._C._current_graph_task_id() != -1


class _AttachLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, loss: torch.Tensor, coef: float) -> torch.Tensor:
        ctx.coef = coef
        ctx.loss_meta = (loss.shape, loss.dtype, loss.device)
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad_hidden: torch.Tensor):
        shape, dtype, device = ctx.loss_meta
        return grad_hidden, torch.full(shape, ctx.coef, dtype=dtype, device=device), None


def attach_indexer_loss(hidden: torch.Tensor, loss: torch.Tensor, state: PatchState) -> torch.Tensor:
    """Return ``hidden`` unchanged, with ``state.config.indexer_loss_coef * loss`` joined to its graph.

    Records the detached loss in ``state`` for logging (not during checkpoint recompute, which
    would count it twice). A loss that needs no gradient is only recorded.
    """
    if not in_backward():
        state.record_indexer_loss(loss)
    coef = float(state.config.indexer_loss_coef)
    if coef == 0.0 or not loss.requires_grad or not torch.is_grad_enabled():
        return hidden
    return _AttachLoss.apply(hidden, loss, coef)
