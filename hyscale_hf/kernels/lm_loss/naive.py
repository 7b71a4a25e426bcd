"""The whole-logits cross-entropy that ``chunked_cross_entropy`` must equal (the test oracle)."""

from __future__ import annotations

import torch.nn.functional as F


def cross_entropy_reference(hidden, head, labels, *, ignore_index: int = -100, num_items_in_batch=None):
    """What ``chunked_cross_entropy`` computes, with the whole logits at once (Transformers'
    ``ForCausalLMLoss`` after the label shift: fp32 logits, sum / num_items_in_batch or the mean)."""
    logits = head(hidden.reshape(-1, hidden.shape[-1])).float()
    y = labels.reshape(-1)
    if num_items_in_batch is None:
        return F.cross_entropy(logits, y, ignore_index=ignore_index)
    return F.cross_entropy(logits, y, ignore_index=ignore_index, reduction="sum") / num_items_in_batch
