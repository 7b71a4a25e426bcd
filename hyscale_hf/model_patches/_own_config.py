"""A patched model gets a config object of its own.

Transformers models share config objects freely: several models built from one config (tests do it
all the time), a config the caller keeps, ``from_pretrained(None, config=config, ...)``. A patch writes
into the config (``_attn_implementation = "hyscale_dsa"``, the ``hyscale_config`` / ``hyscale_indexer``
records), so patching one model in place would change every other model built from the same object:
an unpatched model sharing it would run with an attention implementation that refuses unpatched
modules, and a later model would read the patch's records. Before any change, the patch therefore
deep-copies the model's config (its sub-configs with it) and points every module of the model that
held the original (or one of its sub-configs) at the copy. Unpatching points them back at the
original object, which the patch never touched; edits made to ``model.config`` while patched stay
with the copy.
"""

from __future__ import annotations

import copy

from torch import nn
from transformers import PretrainedConfig


class RestoreConfigs:
    """Undo of ``give_own_config``: puts the original config objects back on the modules that held them
    (a callable object holding data, so ``copy.deepcopy`` of a patched model restores the copy)."""

    def __init__(self, swaps: list[tuple[nn.Module, str, PretrainedConfig]]) -> None:
        self.swaps = swaps

    def __call__(self) -> None:
        for module, name, original in reversed(self.swaps):
            module.__dict__[name] = original
        self.swaps = []


def give_own_config(root: nn.Module, config: PretrainedConfig) -> RestoreConfigs:
    """Replace ``config`` (and each of its sub-configs) by a deep copy on every module of ``root``
    (the model as the caller passed it, PEFT wrappers included); returns the undo."""
    memo: dict = {}
    copy.deepcopy(config, memo)
    # memo maps id(original object) -> its copy, for everything reached from config (its sub-configs too).
    copies = {key: value for key, value in memo.items() if isinstance(value, PretrainedConfig)}
    swaps = []
    for module in root.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, PretrainedConfig) and id(value) in copies and value is not copies[id(value)]:
                swaps.append((module, name, value))
                module.__dict__[name] = copies[id(value)]
    return RestoreConfigs(swaps)
