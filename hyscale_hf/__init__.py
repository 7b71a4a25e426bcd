"""hyscale_hf: exact, memory-light DSA sparse attention training for Hugging Face Transformers.

The public names below load on first use (PEP 562): ``import hyscale_hf`` alone imports neither
torch nor transformers, so command-line tools built on the package (``hyscale-finetune-long
--help``) answer in a fraction of a second. The first public name used imports every submodule, in
the order the eager package did, the model families' registration included.
"""

from importlib import import_module

__version__ = "0.1.0"

# public name -> submodule that defines it
_EXPORTS = {
    "HyScaleCallback": "callbacks",
    "HyScaleConfig": "config",
    "hytopk": "kernels",
    "indexer_kl_loss": "kernels",
    "sparse_attention": "kernels",
    "is_patched": "patching",
    "patch_model": "patching",
    "supported_model_types": "patching",
    "unpatch_model": "patching",
    "SelectionReplayMismatch": "replay",
    "enable_selection_replay": "replay",
    "replay_context_fn": "replay",
    "reset_selection_stats": "replay",
    "selection_stats": "replay",
    "wrap_layers_for_replay": "replay",
    "indexer_modules_to_save": "training",
    "indexer_parameter_names": "training",
    "measure_topk_recall": "training",
    "patched_config": "training",
    "sample_topk_recall": "training",
}
# Imported together on first use: model_patches registers the model families patch_model needs.
_SUBMODULES = ("model_patches", "callbacks", "config", "kernels", "patching", "replay", "training")

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


def _load_all() -> None:
    for name in _SUBMODULES:
        import_module(f".{name}", __name__)
    for name, module in _EXPORTS.items():
        globals()[name] = getattr(import_module(f".{module}", __name__), name)


def __getattr__(name: str):
    if name in _EXPORTS or name in _SUBMODULES:
        _load_all()
        return globals()[name] if name in _EXPORTS else import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_SUBMODULES))
