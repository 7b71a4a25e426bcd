"""A tiny converted dense model saved the way the main job saves one (for the benchmarks that load a
trained indexer)."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import LlamaConfig, LlamaForCausalLM

import hyscale_hf
from hyscale_hf.recipes.checkpoints import CONFIG_FILE, sparse_config_record
from hyscale_hf.recipes.data import byte_tokenizer
from tests.model_patches._dense_tiny import _COMMON, INDEXER


def save_tiny_converted(folder: Path, topk: int = 8):
    """A 2-layer Llama on the byte tokenizer's vocabulary, patched (top-``topk``), saved with its
    tokenizer and ``hyscale_config.json`` into ``folder``; returns the patched model."""
    tokenizer = byte_tokenizer()
    model = LlamaForCausalLM(LlamaConfig(**(_COMMON | {"vocab_size": len(tokenizer)})))
    hyscale_hf.patch_model(model, topk=topk, **INDEXER)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / CONFIG_FILE).write_text(json.dumps(sparse_config_record(model)))
    return model
