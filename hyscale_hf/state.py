"""What a patched model carries, and how any module finds it: a leaf of the core.

``patch_model`` leaves one ``PatchState`` on the patched model (under ``STATE_ATTR``); patched
modules, selection replay, the indexer wiring, the training helpers and the Trainer callback all
read it through ``patch_state``. This module imports nothing of hyscale_hf, so each of them can
import it without importing the others (docs/design.md section 3).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .config import HyScaleConfig

if TYPE_CHECKING:
    from .families import ModelFamily

STATE_ATTR = "_hyscale_state"


@dataclass
class PatchState:
    """What ``patch_model`` leaves on a model, shared with its patched modules.

    ``config`` is live: the Trainer callback flips ``config.dense_warmup`` and patched modules
    read it on every forward. ``indexer_losses`` collects each full indexer layer's detached loss
    since the last ``pop_indexer_loss`` (for logging); ``pending_losses`` holds the losses of the
current forward that wait to be joined to its output (``indexer.attach_indexer_loss``).
``base_frozen`` is set while only the indexer trains (the callback's dense warm-up): forwards then
build no autograd graph outside the indexer (``indexer.before_forward``). ``selection_probe`` is set only while
    ``hyscale_hf.training`` samples top-k recall; patched modules report to it through
    ``hyscale_hf.training.observe_selection`` (a no-op while it is None).
    """

    config: HyScaleConfig
    family: ModelFamily
    undo: list[Callable[[], None]] = field(default_factory=list)
    indexer_losses: list[torch.Tensor] = field(default_factory=list)
    pending_losses: list[torch.Tensor] = field(default_factory=list)
    base_frozen: bool = False
    selection_probe: Callable[..., None] | None = None
    warned: set[str] = field(default_factory=set)  # keys of the warnings this model gave (each once)
    load_from: dict | None = None  # patch_model(state_dict=...): set only while the family applies the patch
    offloader: object | None = None  # the model's hyscale_hf.offload.HostOffload, made at first use
    attn_switch: object | None = None  # model_patches._attn_switch.AttnSwitch: the user's implementation
    context_parallel: object | None = None  # hyscale_hf.context_parallel.ContextParallel while enabled
    cp_undo: Callable[[], None] | None = None  # disables it
    # IndexShare in a dense conversion (HyScaleConfig.index_share): each source layer's selection of the
    # current forward call (and its indexer output while recall is sampled), by layer position, until no
    # shared layer can read it again (model_patches._dense_common)
    shared_selections: dict[int, tuple] = field(default_factory=dict)

    def record_indexer_loss(self, loss: torch.Tensor) -> None:
        self.indexer_losses.append(loss.detach())

    def pop_indexer_loss(self) -> float | None:
        """Mean of the recorded per-layer indexer losses since the last call (None if none)."""
        if not self.indexer_losses:
            return None
        value = torch.stack([x.float().cpu() for x in self.indexer_losses]).mean().item()
        self.indexer_losses.clear()
        return value


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The Transformers model under a PEFT wrapper (or ``model`` itself)."""
    seen = set()
    while hasattr(model, "get_base_model") and id(model) not in seen:
        seen.add(id(model))
        inner = model.get_base_model()
        if inner is model:
            break
        model = inner
    return model


def patch_state(model: torch.nn.Module) -> PatchState | None:
    """The ``PatchState`` of a patched model (PEFT wrappers looked through), else None."""
    return getattr(base_model(model), STATE_ATTR, None)


def add_undo(model: torch.nn.Module, undo: Callable[[], None]) -> None:
    """Run ``undo`` when ``model`` is unpatched (after the family's own undo; last added runs first)."""
    state = patch_state(model)
    if state is None:
        raise ValueError("model is not patched by hyscale_hf")
    state.undo.append(undo)


def in_backward() -> bool:
    """True while autograd runs a backward pass: checkpoint recomputation happens there.

    False while ``torch.compile`` traces: the traced code is the forward (a compiled graph recomputes
    checkpointed regions itself, without running this Python again), and dynamo cannot trace the query.
    """
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1
