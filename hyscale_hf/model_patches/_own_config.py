"""A patched model gets a config object of its own.

Transformers models share config objects freely: several models built from one config (tests do it
all the time), a config the caller keeps, ``from_pretrained(None, config=config, ...)``. A patch writes
into the config (the ``hyscale_config`` / ``hyscale_indexer`` records, and ``_attn_implementation =
"hyscale_dsa"`` while a patched call runs, ``_attn_switch``), so patching one model in place would
change every other model built from the same object: an unpatched model sharing it could run with an
attention implementation that refuses unpatched modules, and a later model would read the patch's
records. Before any change, the patch therefore
deep-copies the model's config (its sub-configs with it) and points every module of the model that
held the original (or one of its sub-configs) at the copy.

The copy also lets ``output_attentions`` be set on it: Transformers' config refuses that flag unless
the attention implementation is "eager", and a patched model returns its attention probabilities
too (``_attention_weights``). Its class becomes a subclass of the original class, of the same name, that
accepts the flag under ``ATTN_IMPLEMENTATION`` as well.

Unpatching points the modules back at the original objects. Edits made through the patched model
(``model.config.use_cache = False`` while training, say) are carried over to the original then, as if
they had been made on it: after the patch's own changes are undone, every attribute of a copy that
differs from what it was when copied is written to its original.
"""

from __future__ import annotations

import copy

from torch import nn
from transformers import PretrainedConfig

from ._dsa_step import ATTN_IMPLEMENTATION

_PERMISSIVE: dict[type, type] = {}


def _accepting_output_attentions(cls: type) -> type:
    """``cls`` with ``output_attentions`` allowed under ``ATTN_IMPLEMENTATION`` too (same name, so that
    Transformers' auto mappings, which look classes up by name, still find it)."""
    if cls in _PERMISSIVE.values() or not isinstance(getattr(cls, "output_attentions", None), property):
        return cls
    if cls not in _PERMISSIVE:
        base_property = cls.output_attentions

        def set_output_attentions(self, value):
            if value and self._attn_implementation == ATTN_IMPLEMENTATION:
                self._output_attentions = value
            else:
                base_property.fset(self, value)

        def validate_output_attentions(self):
            if self._attn_implementation != ATTN_IMPLEMENTATION:
                cls.validate_output_attentions(self)

        namespace = {"output_attentions": property(base_property.fget, set_output_attentions),
                     "__module__": cls.__module__, "__qualname__": cls.__qualname__}
        if hasattr(cls, "validate_output_attentions"):
            namespace["validate_output_attentions"] = validate_output_attentions
        _PERMISSIVE[cls] = type(cls.__name__, (cls,), namespace)
    return _PERMISSIVE[cls]


def _equal(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values without a plain == (tensors): compare identity
        return a is b


class RestoreConfigs:
    """Undo of ``give_own_config`` (a callable object holding data, so ``copy.deepcopy`` of a patched
    model restores the copy's configs)."""

    def __init__(self, swaps: list[tuple[nn.Module, str, PretrainedConfig]], pairs: list[tuple]) -> None:
        self.swaps = swaps  # (module, attribute, original config)
        self.pairs = pairs  # (original, its copy, the copy's attributes as copied, deep-copied)

    def __call__(self) -> None:
        copies = {id(own): original for original, own, _ in self.pairs}
        for original, own, as_copied in self.pairs:
            for key, value in own.__dict__.items():
                if isinstance(value, PretrainedConfig) and id(value) in copies:
                    continue  # a sub-config: carried over on its own
                if key not in as_copied or not _equal(as_copied[key], value):
                    original.__dict__[key] = value
            for key in as_copied.keys() - own.__dict__.keys():
                original.__dict__.pop(key, None)
        for module, name, original in reversed(self.swaps):
            module.__dict__[name] = original
        self.swaps, self.pairs = [], []


def give_own_config(root: nn.Module, config: PretrainedConfig) -> RestoreConfigs:
    """Replace ``config`` (and each of its sub-configs) by a deep copy on every module of ``root``
    (the model as the caller passed it, PEFT wrappers included); returns the undo."""
    memo: dict = {}
    copy.deepcopy(config, memo)
    # memo maps id(original object) -> its copy, for everything reached from config (its sub-configs too).
    originals = {id(o): o for o in _configs_in(config)}
    copies = {key: memo[key] for key in originals}
    pairs = [(originals[key], own, copy.deepcopy(own.__dict__)) for key, own in copies.items()]
    for own in copies.values():
        own.__class__ = _accepting_output_attentions(type(own))
    swaps = []
    for module in root.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, PretrainedConfig) and id(value) in copies:
                swaps.append((module, name, value))
                module.__dict__[name] = copies[id(value)]
    return RestoreConfigs(swaps, pairs)


def _configs_in(config: PretrainedConfig) -> list[PretrainedConfig]:
    """``config`` and the configs nested in its attributes (text / vision sub-configs), each once."""
    found, todo = {}, [config]
    while todo:
        c = todo.pop()
        if id(c) in found:
            continue
        found[id(c)] = c
        todo.extend(v for v in vars(c).values() if isinstance(v, PretrainedConfig))
    return list(found.values())
