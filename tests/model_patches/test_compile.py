"""``torch.compile(model, fullgraph=True)`` traces a patched model's training step, forward and
backward, without a graph break (issue 28): a tiny GLM-5 (native DSA, IndexShare, MoE) and a tiny Llama
(indexer added), with a right-padded row. ``aot_eager`` traces both graphs through AOTAutograd with
fake tensors, as inductor does, without generating code (inductor takes ~90 s a model on 2 cores)."""

from __future__ import annotations

import pytest
import torch

import hyscale_hf

from ._dense_tiny import INDEXER, tiny_model, tokens
from .tiny_models import build, has_family


def _llama():
    return hyscale_hf.patch_model(tiny_model("llama"), topk=3, backend="torch", **INDEXER)


def _glm():
    if not has_family("glm_moe_dsa"):
        pytest.skip("the installed Transformers has no glm_moe_dsa")
    return hyscale_hf.patch_model(build("glm_moe_dsa", index_topk=4)[0], backend="torch")


def _step(model, ids, mask):
    model.zero_grad()
    loss = model(ids, labels=ids, attention_mask=mask, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


@pytest.mark.parametrize("make", [_glm, _llama], ids=["glm_moe_dsa", "llama"])
def test_a_training_step_compiles_with_fullgraph(make):
    torch._dynamo.reset()
    model = make().train()
    ids = tokens(2, 10)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    eager_loss, eager_grads = _step(model, ids, mask)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    loss, grads = _step(compiled, ids, mask)
    torch.testing.assert_close(loss, eager_loss)
    assert grads.keys() == eager_grads.keys() and any(".indexer." in n for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], msg=name)
