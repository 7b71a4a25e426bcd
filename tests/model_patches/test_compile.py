"""``torch.compile(model, fullgraph=True)`` traces a patched model's training step, forward and
backward, without a graph break (issue 28): a tiny GLM-5 (native DSA, IndexShare, MoE) and a tiny Llama
(indexer added), with a right-padded row. ``aot_eager`` traces both graphs through AOTAutograd with
fake tensors, as inductor does, without generating code (inductor takes ~90 s a model on 2 cores)."""

from __future__ import annotations

import inspect

import pytest
import torch
import transformers

import hyscale_hf

from ._dense_tiny import INDEXER, tiny_model, tokens
from .tiny_models import build, has_family


def _llama():
    return hyscale_hf.patch_model(tiny_model("llama"), topk=3, backend="torch", **INDEXER)


def _glm():
    if not has_family("glm_moe_dsa"):
        pytest.skip("the installed Transformers has no glm_moe_dsa")
    if not hasattr(transformers.PreTrainedModel, "activation_checkpointing_enable"):  # before 5.23
        pytest.skip("Transformers before 5.23 (5.17 checked): its MoE grouped-mm fallback cannot be traced "
                    "fullgraph (a data-dependent guard in its backward; the unpatched model fails the same way)")
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


def _cache_kwarg(model) -> str:
    """The forward's name for the cache: ``past_key_values`` up to Transformers 5.17, ``cache`` later."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def _decode(model, compiled_forward, cache, ids, mask, steps):
    """Greedy tokens: an eager prefill over ``cache``, then ``steps`` decode steps through ``compiled_forward``."""
    name = _cache_kwarg(model)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=True, **{name: cache})
        tokens = [out.logits[:, -1].argmax(-1)]
        for _ in range(steps):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out = compiled_forward(tokens[-1][:, None], attention_mask=mask, use_cache=True, **{name: cache})
            tokens.append(out.logits[:, -1].argmax(-1))
    return torch.stack(tokens, 1)


@pytest.mark.parametrize("family", ["llama", "deepseek_v32"])
def test_decoding_compiles_with_fullgraph(family):
    """Compiled decode steps (as generate() compiles them) equal eager ones: a dense family on a static
    cache, a DSA family on a dynamic one (its cache grows, so each step compiles anew here)."""
    from transformers import DynamicCache, StaticCache

    torch._dynamo.reset()
    if family == "llama":
        model = hyscale_hf.patch_model(tiny_model("llama"), topk=3, **INDEXER).eval()
        new_cache = lambda: StaticCache(config=model.config, max_cache_len=16)  # noqa: E731
    else:
        if not has_family(family):
            pytest.skip(f"the installed Transformers has no {family}")
        model = hyscale_hf.patch_model(build(family, index_topk=3)[0], backend="torch")
        new_cache = lambda: DynamicCache(config=model.config)  # noqa: E731
    ids = tokens(2, 7)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    expected = _decode(model, model.forward, new_cache(), ids, mask, steps=2)
    compiled = torch.compile(model.forward, fullgraph=True, backend="eager", dynamic=False)
    assert torch.equal(_decode(model, compiled, new_cache(), ids, mask, steps=2), expected)
