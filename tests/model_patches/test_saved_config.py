"""A saved patched model reloads into the same sparse model with no arguments, and a patch's records
in a shared config object never pass for a checkpoint's."""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM

from hyscale_hf import patch_model, patched_config, unpatch_model
from hyscale_hf.records import LiveRecord, saved_record

from ._dense_tiny import INDEXER, tiny_model, tokens


def test_reload_patches_with_the_saved_options(tmp_path):
    model = tiny_model("llama")
    patch_model(model, topk=5, indexer_loss_coef=0.25, lm_loss_chunk=7, **INDEXER)
    patched_config(model).indexer_loss_coef = 0.5  # a live edit after patching is what gets saved
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    patch_model(reloaded)  # no arguments
    assert patched_config(reloaded) == patched_config(model)
    assert patched_config(reloaded).indexer_loss_coef == 0.5
    ids = tokens(1, 9)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, atol=0, rtol=0)
    patch_model(unpatch_model(reloaded), topk=3)  # explicit options still win over the saved ones
    assert patched_config(reloaded).topk == 3


def test_a_second_model_from_the_same_config_patches_and_unpatches_independently():
    first = tiny_model("qwen3")
    second = type(first)(first.config)  # the same config object
    patch_model(first, topk=3, **INDEXER)
    assert isinstance(first.config.hyscale_indexer, LiveRecord)
    assert saved_record(first.config, "hyscale_indexer") is None  # a live record, not a checkpoint's
    patch_model(second, topk=4, **INDEXER)  # used to raise: "saved with trained hyscale_hf indexers"
    assert patched_config(second).topk == 4
    copied = copy.deepcopy(first.config)  # what from_config does: still not a checkpoint's record
    assert saved_record(copied, "hyscale_config") is None and saved_record(copied, "hyscale_indexer") is None
    unpatch_model(second)
    unpatch_model(first)
    assert "hyscale_config" not in first.config.__dict__ and "hyscale_indexer" not in first.config.__dict__
