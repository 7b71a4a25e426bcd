"""Causal-LM cross-entropy computed a token chunk at a time, so the ``[N, vocab]`` logits never exist.

At long context the LM head dominates memory once attention is sparse: GLM-5's 154K-token
vocabulary makes the bf16 logits of a 128K-token sequence 40 GB, and the loss's fp32 copy and its
gradient as much again. Here each chunk of hidden states goes through the head and the
cross-entropy under non-reentrant checkpointing: forward keeps only the per-chunk loss sums, and
backward recomputes one chunk's logits at a time (one extra LM-head forward per step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def chunked_cross_entropy(
    hidden: torch.Tensor,
    head,
    labels: torch.Tensor,
    chunk: int,
    *,
    ignore_index: int = -100,
    num_items_in_batch: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(head(hidden).float(), labels, ignore_index=ignore_index)``, ``chunk`` rows at a time.

    Args:
        hidden: ``[N, H]`` (or ``[..., H]``, flattened) inputs of the head.
        head: callable ``[n, H] -> [n, vocab]`` (the LM head module).
        labels: ``[N]`` (or matching leading dims) target ids, already shifted; ``ignore_index`` rows
            count for nothing.
        chunk: rows per chunk (positive).
        num_items_in_batch: when given, the loss is the sum divided by it (Transformers' convention for
            gradient accumulation); else the mean over rows that are not ignored (NaN when all are).

    Returns: fp32 scalar loss, differentiable in ``hidden`` and the head's parameters.
    """
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk <= 0:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1).to(h.device)
    if y.shape[0] != h.shape[0]:
        raise ValueError(f"labels has {y.shape[0]} entries but hidden has {h.shape[0]} rows")

    def piece(hc, yc):
        return F.cross_entropy(head(hc).float(), yc, ignore_index=ignore_index, reduction="sum")

    total = None
    for c0 in range(0, h.shape[0], chunk):
        args = (h[c0 : c0 + chunk], y[c0 : c0 + chunk])
        part = checkpoint(piece, *args, use_reentrant=False) if torch.is_grad_enabled() else piece(*args)
        total = part if total is None else total + part
    if total is None:  # no rows at all
        total = h.new_zeros((), dtype=torch.float32)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch
    return total / (y != ignore_index).sum()
