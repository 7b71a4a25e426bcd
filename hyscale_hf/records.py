"""Records a patch writes into a model's config, and how a patch tells them from a checkpoint's.

A record in ``model.config`` reaches config.json on ``save_pretrained`` and comes back with
``from_pretrained``: that is how a saved patched model tells ``patch_model`` what it was patched
with. This module imports nothing of hyscale_hf (a leaf of the core, like ``state``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable


class LiveRecord(dict):
    """A record that a live patch wrote into a model config, as opposed to one read from config.json.

    Configs are shared objects (several models built from one config, a config kept by a test,
    ``copy.deepcopy(config)`` inside ``from_config``): a patch must tell its own records, and other
    live patches' or their in-memory copies', from a saved checkpoint's, which load back from JSON
    as plain dicts. With ``snapshot``, the record shows ``snapshot()``'s values whenever it is
    deep-copied (what ``PretrainedConfig.to_dict`` and so ``save_pretrained`` do), so a save writes the
    options as they are when saved, not as they were when patched.
    """

    def __init__(self, values: dict, snapshot: Callable[[], dict] | None = None) -> None:
        super().__init__(values)
        self._snapshot = snapshot

    def __deepcopy__(self, memo) -> LiveRecord:
        return LiveRecord(copy.deepcopy(self._snapshot() if self._snapshot is not None else dict(self), memo))


def saved_record(model_config, name: str) -> dict | None:
    """The record ``name`` of ``model_config`` if it was loaded with the config, else None (absent,
    or written by a live patch of this or another model)."""
    record = model_config.__dict__.get(name)
    return None if record is None or isinstance(record, LiveRecord) else record


class _Absent:
    """Marks a config attribute that did not exist (a class: deepcopy keeps its identity)."""


class RestoreRecord:
    """Undo of ``set_record``. A callable object rather than a closure, so that a deep copy of a
    patched model gets an undo that restores the copy's config."""

    def __init__(self, model_config, name: str) -> None:
        self.model_config, self.name = model_config, name
        self.previous = model_config.__dict__.get(name, _Absent)

    def __call__(self) -> None:
        if self.previous is _Absent:
            self.model_config.__dict__.pop(self.name, None)
        else:
            setattr(self.model_config, self.name, self.previous)


def set_record(model_config, name: str, record: LiveRecord) -> RestoreRecord:
    """Write ``record`` into ``model_config``; returns the undo that restores what was there."""
    undo = RestoreRecord(model_config, name)
    setattr(model_config, name, record)
    return undo
