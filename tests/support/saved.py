"""How many bytes autograd keeps for backward: the distinct non-parameter storages packed while a block runs."""

from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def saved_bytes(model: torch.nn.Module):
    """Yields a dict ``{storage pointer: bytes}`` filled with every storage autograd saves inside the block,
    each counted once, the model's parameters left out; ``sum(d.values())`` is what the block keeps."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in weights:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield storages
