"""A patched forward never reads tensor values on the host (issue 28): what it does with padding,
packing and windows follows from which inputs were given, never from their contents. So a forward and
backward run on the meta device, where any such read raises (on a GPU it would be a host sync per layer)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import hyscale_hf

from ._dense_tiny import _COMMON, INDEXER, VARIANTS, tokens
from .tiny_models import has_family, tiny_config


def _meta_llama():
    config_cls, model_cls, extra = VARIANTS["llama"]
    with torch.device("meta"):
        model = model_cls(config_cls(**_COMMON, **extra))
    return hyscale_hf.patch_model(model, topk=3, backend="torch", **INDEXER)


def _meta_glm():
    if not has_family("glm_moe_dsa"):
        pytest.skip("the installed Transformers has no glm_moe_dsa")
    # Dense MLPs only: Transformers' MoE routing itself cannot run on meta tensors (nonzero).
    config = tiny_config("glm_moe_dsa", index_topk=4, first_k_dense_replace=3)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return hyscale_hf.patch_model(model, backend="torch")


@pytest.mark.parametrize("build", [_meta_llama, _meta_glm], ids=["llama", "glm_moe_dsa"])
@pytest.mark.parametrize("inputs", ["plain", "padded", "packed"])
@pytest.mark.parametrize("warmup", [False, True], ids=["sparse", "dense_warmup"])
def test_forward_and_backward_run_on_the_meta_device(build, inputs, warmup):
    model = build().train()
    hyscale_hf.patched_config(model).dense_warmup = warmup
    ids = tokens(2, 10).to("meta")
    kwargs = {}
    if inputs == "padded":
        kwargs["attention_mask"] = torch.ones(2, 10, dtype=torch.long, device="meta")
    elif inputs == "packed":
        kwargs["position_ids"] = torch.zeros(2, 10, dtype=torch.long, device="meta")
    # use_cache: with neither a mask nor a cache, Transformers itself reads position_ids on the host
    # (find_packed_sequence_indices), which a meta tensor cannot serve.
    out = model(ids, labels=ids, use_cache=True, **kwargs)
    out.loss.backward()
    assert out.logits.device.type == "meta" and out.logits.shape == (2, 10, model.config.vocab_size)
