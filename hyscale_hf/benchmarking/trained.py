"""A model the main job saved, and real text to run it on, for the benchmarks that measure a trained
indexer (``bench_trained_selections.py``, ``bench_e2e.py --model``).

- ``load_saved(folder, device, dtype, patch=True)``: ``(model, tokenizer)`` from a folder written by
  ``finetune_long.py --output_dir`` (weights, tokenizer, ``hyscale_config.json``). Patched, it is
  the sparse model with its trained indexer: ``patch_model`` restores the saved options and the
  indexer weights. Unpatched, it is the dense model the indexer was added to (Transformers skips the
  indexer tensors, which its class does not have).
- ``saved_dims(folder, keys)``: the saved model's dims (the stack's ``keys`` its config has), layer
  count and tokenizer, for the scripts that build it as a stack arm.
- ``text_ids(tokenizer, T, seed)``: the first T tokens of the Python standard library's source
  files, in the order ``stdlib_documents(seed=seed)`` gives (the main job holds out the first of
  them), joined with EOS.
"""

from __future__ import annotations

from pathlib import Path

import torch

CONFIG_FILE = "hyscale_config.json"  # what finetune_long.py saves beside the weights


def check_saved(folder: str) -> str | None:
    """Why ``folder`` is not a saved patched model, or None."""
    if not (Path(folder) / CONFIG_FILE).is_file():
        return f"no {CONFIG_FILE} in {folder} (pass the --output_dir of finetune_long.py)"
    return None


def load_saved(folder: str, device, dtype, *, patch: bool = True, **patch_options):
    """``(model, tokenizer)`` of a saved patched model; ``patch_options`` replace saved options."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hyscale_hf

    reason = check_saved(folder)
    if reason:
        raise FileNotFoundError(reason)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device)
    if patch:
        hyscale_hf.patch_model(model, **patch_options)
    return model, AutoTokenizer.from_pretrained(folder)


def saved_dims(folder: str, keys) -> tuple[dict, int, object]:
    """``(dims, layers, tokenizer)`` of a saved model: ``dims`` holds the ``keys`` its config has."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(folder)
    dims = {key: getattr(config, key) for key in keys if hasattr(config, key)}
    return dims, config.num_hidden_layers, AutoTokenizer.from_pretrained(folder)


def text_ids(tokenizer, T: int, seed: int = 0) -> torch.Tensor:
    """``[1, T]`` int64: the first T tokens of the standard library's documents joined with EOS."""
    from ..recipes.data import stdlib_documents

    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id to join documents with")
    ids: list[int] = []
    for doc in stdlib_documents(T * 6, seed=seed):  # > 4 characters per token in source code
        ids += tokenizer(doc, add_special_tokens=False)["input_ids"] + [eos]
        if len(ids) >= T:
            return torch.tensor(ids[:T])[None]
    raise ValueError(f"the standard library holds fewer than {T} tokens")
