"""hyscale_hf: exact, memory-light DSA sparse attention training for Hugging Face Transformers.

The public names load on first access (PEP 562 ``__getattr__``), so ``import hyscale_hf`` and
``import hyscale_hf.kernels`` import neither Transformers nor the model families: the ops need only
torch and triton. The families register when ``hyscale_hf.model_patches`` is first imported, which
``patch_model`` and ``supported_model_types`` do on first use (docs/design.md section 3).
"""

import importlib

__version__ = "0.1.0"

# Public name -> the module that defines it (relative to this package).
_PUBLIC = {
    "HyScaleConfig": "config",
    "hytopk": "kernels",
    "sparse_attention": "kernels",
    "indexer_kl_loss": "kernels",
    "patch_model": "patching",
    "unpatch_model": "patching",
    "is_patched": "patching",
    "supported_model_types": "patching",
    "enable_selection_replay": "model_patches._checkpointing",
    "wrap_layers_for_replay": "model_patches._checkpointing",
    "replay_context_fn": "replay",
    "selection_stats": "replay",
    "reset_selection_stats": "replay",
    "SelectionReplayMismatch": "replay",
    "HyScaleCallback": "callbacks",
    "indexer_parameter_names": "training",
    "indexer_modules_to_save": "training",
    "measure_topk_recall": "training",
    "sample_topk_recall": "training",
    "patched_config": "training",
    "enable_context_parallel": "context_parallel",
    "disable_context_parallel": "context_parallel",
}

__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
