"""Save / load of the indexers added to dense models.

Saving needs nothing special: the indexers are submodules of the attention layers, so
``save_pretrained`` writes their tensors (``...self_attn.indexer.wq.weight`` etc.), and the patch
records its settings in ``model.config.hyscale_indexer`` (kind, heads, head dim, rope dims, topk,
relu), which ``save_pretrained`` writes to config.json.

Loading: ``from_pretrained`` with the unpatched class drops the indexer tensors as unexpected keys
but keeps the record in the config. When ``patch_model`` finds the record, it builds indexers of the
recorded shape and copies their tensors from the checkpoint the model came from
(``model.name_or_path``: a local directory, or a Hub id resolved through the Hugging Face cache at
the config's commit), single-file or sharded safetensors. A record without a readable checkpoint, or
a checkpoint missing some indexer tensor or holding another shape, is an error: silently starting
from fresh indexers would throw the trained ones away. (To start fresh on purpose, delete
``model.config.hyscale_indexer`` before patching.)
"""

from __future__ import annotations

import json
import logging
import os

import torch
from torch import nn

RECORD_ATTR = "hyscale_indexer"
_log = logging.getLogger(__name__)
_SINGLE = "model.safetensors"
_INDEX = "model.safetensors.index.json"


def _resolve_file(source: str, filename: str, revision: str | None) -> str | None:
    if os.path.isdir(source):
        path = os.path.join(source, filename)
        return path if os.path.isfile(path) else None
    from transformers.utils import cached_file

    return cached_file(
        source, filename, revision=revision, _raise_exceptions_for_missing_entries=False,
        _raise_exceptions_for_connection_errors=False,
    )


def _is_local_path(source: str) -> bool:
    """A name that cannot be a hub repo id ("name" or "owner/name") is a local path."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if os.path.isabs(source) or source.startswith((".", "~")) or source.count("/") > 1 or os.sep != "/" and os.sep in source:
        return True
    try:
        validate_repo_id(source)
    except HFValidationError:
        return True
    return False


def _checkpoint_files(model: nn.Module) -> list[str]:
    source = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", "")
    revision = getattr(model.config, "_commit_hash", None)
    hint = (f"model.config.{RECORD_ATTR} says this model was saved with trained hyscale_hf indexers, but "
            f"their weights cannot be read from the checkpoint it was loaded from ({source!r})")
    if not source:
        raise ValueError(f"{hint}: model.name_or_path is empty. Delete model.config.{RECORD_ATTR} to start fresh indexers.")
    if not os.path.isdir(source) and _is_local_path(source):
        # Without this, the hub lookup below fails with "Repo id must be in the form ...".
        raise ValueError(
            f"{hint}: the folder {source!r} does not exist (any more: moved or deleted after from_pretrained?). "
            "Load the model from the folder that now holds the checkpoint and patch it then, or set "
            f"model.name_or_path to that folder before patch_model; delete model.config.{RECORD_ATTR} to start fresh indexers."
        )
    single = _resolve_file(source, _SINGLE, revision)
    if single is not None:
        return [single]
    index = _resolve_file(source, _INDEX, revision)
    if index is None:
        raise ValueError(f"{hint}: no {_SINGLE} or {_INDEX} found. Delete model.config.{RECORD_ATTR} to start fresh indexers.")
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    shards = sorted({shard for key, shard in weight_map.items() if ".indexer." in key})
    files = [_resolve_file(source, shard, revision) for shard in shards]
    missing = [s for s, f in zip(shards, files) if f is None]
    if missing:
        raise ValueError(f"{hint}: shard(s) {missing} not found")
    return files


def load_saved_indexers(model: nn.Module, indexers: dict[str, nn.Module]) -> None:
    """Copy each indexer's tensors (``{attention module name: indexer}``) from ``model``'s checkpoint."""
    from safetensors import safe_open

    saved: dict[str, torch.Tensor] = {}
    for path in _checkpoint_files(model):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                if ".indexer." in key:
                    saved[key] = f.get_tensor(key)
    copy_indexer_tensors(model, indexers, saved, getattr(model, "name_or_path", "") or "the checkpoint")


def copy_indexer_tensors(model: nn.Module, indexers: dict[str, nn.Module], saved: dict, source: str) -> None:
    """Copy each indexer's tensors from ``saved`` (a state dict, or a checkpoint's indexer tensors);
    every one must be there with its shape."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    missing, wrong = [], []
    with torch.no_grad():
        for attn_name, indexer in indexers.items():
            for pname, tensor in indexer.state_dict(keep_vars=True).items():
                name = f"{attn_name}.indexer.{pname}"
                candidates = [name, f"{prefix}.{name}"]
                if prefix and name.startswith(prefix + "."):
                    candidates.append(name[len(prefix) + 1 :])
                key = next((c for c in candidates if c in saved), None)
                if key is None:
                    missing.append(name)
                elif saved[key].shape != tensor.shape:
                    wrong.append(f"{key}: saved {tuple(saved[key].shape)}, needed {tuple(tensor.shape)}")
                else:
                    tensor.copy_(saved[key].to(device=tensor.device, dtype=tensor.dtype))
    if missing or wrong:
        raise ValueError(
            f"cannot restore the saved hyscale_hf indexers: missing {missing[:4]}{'...' if len(missing) > 4 else ''}, "
            f"shape mismatch {wrong[:4]}. Delete model.config.{RECORD_ATTR} to start fresh indexers."
        )
    # Printed right under Transformers' load report, which lists these tensors as UNEXPECTED: the
    # unpatched class has no indexer, so from_pretrained dropped them and patch_model put them back.
    _log.warning(
        "hyscale_hf: restored the %d trained indexer tensors (%d layers) from %s. Transformers' load report above "
        "lists them as UNEXPECTED because the unpatched model class has no indexer; patch_model added the indexers "
        "and loaded them, so the patched model is complete.", sum(len(i.state_dict()) for i in indexers.values()),
        len(indexers), source)


# ----------------------------------------------------------------------------- initialisation


def init_indexer(indexer: nn.Module) -> None:
    """``LightningIndexer.reset_parameters`` (its locality prior) for the parameters Transformers has not
    marked as loaded (``_is_hf_initialized``): what ``_init_weights`` must do for a module it does not know."""
    params = dict(indexer.named_parameters())
    loaded = {n: p.detach().clone() for n, p in params.items() if getattr(p, "_is_hf_initialized", False)}
    if len(loaded) == len(params):
        return
    indexer.reset_parameters()
    with torch.no_grad():
        for name, value in loaded.items():
            params[name].copy_(value)


class InitWithIndexers:
    """``_init_weights`` of a patched dense model: Transformers initialises the modules it knows (the
    indexer's Linear and LayerNorm among them, with its generic rule) and then calls this on each of
    their parents, so an added ``LightningIndexer`` gets its own prior last (``from_pretrained`` with
    indexer tensors missing, ``model.init_weights()``). An object, so ``copy.deepcopy`` follows the copy."""

    def __init__(self, owner: nn.Module, indexer_type: type, previous=None) -> None:
        self.owner, self.indexer_type, self.previous = owner, indexer_type, previous

    def __call__(self, module: nn.Module) -> None:
        if isinstance(module, self.indexer_type):
            init_indexer(module)
        elif self.previous is not None:
            self.previous(module)
        else:
            type(self.owner)._init_weights(self.owner, module)
