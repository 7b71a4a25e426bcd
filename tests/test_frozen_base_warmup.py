"""The dense warm-up with the base frozen: the same indexer gradients, without a graph through the base."""

from __future__ import annotations

import torch

from hyscale_hf import indexer_parameter_names, patch_model, patched_config
from hyscale_hf.state import patch_state
from tests.model_patches._dense_tiny import INDEXER, tiny_model, tokens


def _warmup_grads(frozen: bool, checkpointing: bool):
    model = tiny_model("llama")
    patch_model(model, topk=3, **INDEXER)
    names = set(indexer_parameter_names(model))
    for name, p in model.named_parameters():
        p.requires_grad_(name in names)
    patched_config(model).dense_warmup = True
    patch_state(model).base_frozen = frozen
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable()  # marks the input embeddings as requiring grad
    ids = tokens(2, 11)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if n in names}, out


def test_frozen_base_gives_the_same_loss_and_indexer_gradients():
    for checkpointing in (False, True):
        loss_ref, grads_ref, _ = _warmup_grads(frozen=False, checkpointing=checkpointing)
        loss, grads, out = _warmup_grads(frozen=True, checkpointing=checkpointing)
        assert torch.equal(loss, loss_ref)
        for name, g in grads.items():
            torch.testing.assert_close(g, grads_ref[name], atol=1e-7, rtol=1e-5, msg=name)
        # the LM loss carries only the indexer's graph: nothing upstream of the logits needs grad
        assert out.logits.grad_fn is None
