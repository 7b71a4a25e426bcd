"""The registry of model families: the one place ``hyscale_hf/model_patches`` hands its code to the core.

Each family module calls ``register_family`` when it is imported. The registry imports nothing of
hyscale_hf, so the families depend on the core and never the other way round; ``hyscale_hf.patching``
fills it by importing ``hyscale_hf.model_patches`` on first use (docs/design.md section 3).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

ApplyFn = Callable[[torch.nn.Module, "PatchState"], Callable[[], None]]  # noqa: F821 (hyscale_hf.state)


@dataclass(frozen=True)
class ModelFamily:
    """A registered family: ``kind`` is "dsa" (native sparse attention) or "dense" (indexer added)."""

    model_type: str
    apply: ApplyFn
    kind: str


_FAMILIES: dict[str, ModelFamily] = {}


def register_family(model_type: str, apply: ApplyFn, kind: str) -> None:
    """Register ``apply`` for models whose ``config.model_type`` is ``model_type``.

    ``apply(model, state)`` patches one model instance in place (``state.config`` holds the options;
    keep ``state`` on the patched modules if they need the live config or loss log) and returns an
    undo function that restores the instance exactly.
    """
    if kind not in ("dsa", "dense"):
        raise ValueError(f"kind must be 'dsa' or 'dense', got {kind!r}")
    if model_type in _FAMILIES:
        raise ValueError(f"model type {model_type!r} is already registered")
    _FAMILIES[model_type] = ModelFamily(model_type, apply, kind)
