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


def test_patching_changes_no_other_model_built_from_the_same_config():
    """A patch writes into its own copy of the config: a model sharing the original object keeps
    running unpatched, and the caller's config carries no record and no attention implementation."""
    config = tiny_model("llama").config
    before = dict(config.__dict__)
    first, second = type(tiny_model("llama"))(config), type(tiny_model("llama"))(config)
    ids = tokens(1, 9)
    with torch.no_grad():
        expected = second(ids).logits
    patch_model(first, topk=3, **INDEXER)
    assert first.config is not config and first.model.layers[0].self_attn.config is first.config
    assert config.__dict__ == before  # no record, no "hyscale_dsa"
    with torch.no_grad():  # used to raise: "only serves attention modules patched by hyscale_hf"
        torch.testing.assert_close(second(ids).logits, expected, atol=0, rtol=0)
    unpatch_model(first)
    assert first.config is config and first.model.layers[0].self_attn.config is config


def test_a_serialised_copy_of_a_patched_config_builds_a_model_that_patches():
    """Round trips through dicts and JSON (what Transformers' own tests do with configs) keep the
    patch's records marked as live, or drop them; never as a checkpoint's."""
    model = tiny_model("llama")
    patch_model(model, topk=3, **INDEXER)
    for config in (type(model.config).from_dict(model.config.to_dict()), copy.deepcopy(model.config)):
        other = type(model)(config)
        patch_model(other, **INDEXER)
        assert patched_config(other).topk == 2048  # the first model's topk=3 did not leak
