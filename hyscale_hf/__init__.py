"""hyscale_hf: exact, memory-light DSA sparse attention training for Hugging Face Transformers."""

from . import model_patches  # noqa: F401  (registers the model families)
from .callbacks import HyScaleCallback
from .config import HyScaleConfig
from .kernels import hytopk, indexer_kl_loss, sparse_attention
from .patching import is_patched, patch_model, supported_model_types, unpatch_model
from .replay import (
    SelectionReplayMismatch,
    enable_selection_replay,
    replay_context_fn,
    reset_selection_stats,
    selection_stats,
    wrap_layers_for_replay,
)
from .training import (
    indexer_modules_to_save,
    indexer_parameter_names,
    measure_topk_recall,
    patched_config,
    sample_topk_recall,
)

__version__ = "0.1.0"

__all__ = [
    "HyScaleConfig",
    "hytopk",
    "sparse_attention",
    "indexer_kl_loss",
    "patch_model",
    "unpatch_model",
    "is_patched",
    "supported_model_types",
    "enable_selection_replay",
    "wrap_layers_for_replay",
    "replay_context_fn",
    "selection_stats",
    "reset_selection_stats",
    "SelectionReplayMismatch",
    "HyScaleCallback",
    "indexer_parameter_names",
    "indexer_modules_to_save",
    "measure_topk_recall",
    "sample_topk_recall",
    "patched_config",
    "__version__",
]
