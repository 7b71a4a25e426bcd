"""Selection replay: checkpoint recomputation reuses the forward's indices (DESIGN section 7).

Selections enter the graph only through dispatcher-visible custom ops (``hyscale::hytopk`` for a
full indexer layer, ``hyscale::reuse_indices`` for an IndexShare layer taking its source layer's
indices), so a selective-checkpoint policy can save their outputs and the recompute replays them.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("hyscale::reuse_indices", mutates_args=())
def reuse_indices(indices: torch.Tensor) -> torch.Tensor:
    """An IndexShare layer's copy of its source layer's indices.

    Saved by the replay policy, so a recomputed shared layer uses exactly the indices of *its own*
    forward invocation even if the holder it read them from was overwritten since.
    """
    return indices.clone()


@reuse_indices.register_fake
def _(indices):
    return torch.empty_like(indices)
