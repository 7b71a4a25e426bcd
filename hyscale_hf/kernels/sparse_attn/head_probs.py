"""``HeadProbs``: where a sparse attention leaves its head-summed probabilities for the indexer's KL.

The indexer KL's target on each query's selected keys is ``P[b, s, j] = sum_h exp(scale * q[b, s, h] .
k[idx[b, s, j]] - lse[b, s, h])`` (0 where ``idx = -1``). The attention's backward forms exactly these
``exp`` terms when it recomputes its probabilities, so there the target costs a row sum instead of a
second pass over the selected keys at every head (``indexer_kl_fwd_kernel``'s attention part, the
larger part of the KL's time). A caller hands ``sparse_attention(..., head_probs=HeadProbs())`` or
``mla_sparse_attention(..., head_probs=HeadProbs())`` and reads the value once that backward ran (``take``).
"""

from __future__ import annotations

import torch


class HeadProbs:
    """Receives ``P [B, S, K]`` fp32 of one attention call: in its backward on the Triton path (on GQA
    query tiles ``tile_head_probs``, per token the GQA backward kernel itself, the Gluon MLA dK/dV
    kernel on sm_90; else ``prob_sum_pass``), in its forward on the torch path. Where that backward
    walked query tiles (GQA), it also leaves their key lists (``tiles``, a ``host.KeyLists``), which
    the indexer KL can walk instead of every query's keys (``indexer_kl_loss_given_target(...,
    tiles=...)``)."""

    __slots__ = ("value", "tiles")

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None
        self.tiles = None

    def take(self) -> torch.Tensor:
        """The probabilities, handed over once (the slot is emptied so they are freed with their reader)."""
        if self.value is None:
            raise RuntimeError("HeadProbs.take(): the attention that fills it has not run its backward yet")
        value, self.value = self.value, None
        return value

    def take_tiles(self):
        """The query tiles' key lists the attention walked (None: it walked each query's keys), handed
        over once like ``take``."""
        tiles, self.tiles = self.tiles, None
        return tiles


def prob_sum_pass(q, k, indices, lse, scale: float, backend: str) -> torch.Tensor:
    """``P`` by a pass of its own over the selected keys (``indexer_kl.attention_prob_sum``), where no
    attention kernel that ran could add it: the torch path, the deterministic backward, the MLA
    backward's Triton kernels."""
    # imported here: indexer_kl builds on sparse_attn's reference (gather_keys)
    from ..indexer_kl import attention_prob_sum

    return attention_prob_sum(q.detach(), k.detach(), indices, lse.detach(), scale, backend=backend,
                              check_range=False)
