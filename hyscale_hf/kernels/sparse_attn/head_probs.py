"""``HeadProbs``: where a sparse attention leaves its head-summed probabilities for the indexer's KL.

The indexer KL's target on each query's selected keys is ``P[b, s, j] = sum_h exp(scale * q[b, s, h] .
k[idx[b, s, j]] - lse[b, s, h])`` (0 where ``idx = -1``). The attention's backward forms exactly these
``exp`` terms when it recomputes its probabilities, so there the target costs a row sum instead of a
second pass over the selected keys at every head (``indexer_kl_fwd_kernel``'s attention part, the
larger part of the KL's time). A caller hands ``mla_sparse_attention(..., head_probs=HeadProbs())``
and reads the value once that backward ran (``take``).
"""

from __future__ import annotations

import torch


class HeadProbs:
    """Receives ``P [B, S, K]`` fp32 of one attention call: in its backward on the Triton path (fused
    into the Gluon dK/dV kernel on sm_90, else ``indexer_kl.attention_prob_sum``), in its forward on
    the torch path."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None

    def take(self) -> torch.Tensor:
        """The probabilities, handed over once (the slot is emptied so they are freed with their reader)."""
        if self.value is None:
            raise RuntimeError("HeadProbs.take(): the attention that fills it has not run its backward yet")
        value, self.value = self.value, None
        return value
