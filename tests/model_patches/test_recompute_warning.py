"""A checkpoint that reruns the selection in backward instead of replaying it is reported, once.

Transformers' own checkpointing replays selections (``enable_selection_replay``); checkpointing
around it (a reentrant ``torch.utils.checkpoint`` of one's own, or a checkpoint function set on a
layer by hand) cannot, and used to rerun the indexer and its top-k silently."""

from __future__ import annotations

import functools
import warnings

import pytest
from torch.utils.checkpoint import checkpoint

import hyscale_hf
from hyscale_hf.benchmarking.stacks import enable_checkpointing  # Transformers 5.17 and 5.23+ entry points

from . import dsa_checks
from ._dense_tiny import INDEXER, tiny_model, tokens
from .tiny_models import build, has_family


def _llama(**options):
    model = tiny_model("llama")
    hyscale_hf.patch_model(model, topk=3, backend="torch", **INDEXER, **options)
    return model.train()


def _backward_warnings(step) -> list[str]:
    hyscale_hf.reset_selection_stats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step()
    return [str(w.message) for w in caught if "ran again in a checkpoint recompute" in str(w.message)]


def test_a_hand_set_reentrant_checkpoint_function_warns_once():
    model = _llama()
    enable_checkpointing(model)  # replayed: silent
    ids = tokens(2, 10)
    assert _backward_warnings(lambda: model(ids, labels=ids).loss.backward()) == []
    assert hyscale_hf.selection_stats()["indexer_recompute"] == 0
    for layer in model.model.layers:
        layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=True)
    assert len(_backward_warnings(lambda: model(ids, labels=ids).loss.backward())) == 1
    assert hyscale_hf.selection_stats()["indexer_recompute"] == 2
    assert _backward_warnings(lambda: model(ids, labels=ids).loss.backward()) == []  # once per model


def test_a_users_own_reentrant_checkpoint_warns():
    model = _llama()
    embeds = model.get_input_embeddings()(tokens(1, 8)).detach().requires_grad_()

    def step():
        logits = checkpoint(lambda e: model(inputs_embeds=e).logits, embeds, use_reentrant=True)
        logits.sum().backward()

    assert len(_backward_warnings(step)) == 1


def test_recomputing_on_purpose_is_silent():
    model = _llama(selection_replay=False)
    enable_checkpointing(model)
    ids = tokens(2, 10)
    assert _backward_warnings(lambda: model(ids, labels=ids).loss.backward()) == []
    assert hyscale_hf.selection_stats()["indexer_recompute"] == 2


@pytest.mark.skipif(not has_family("glm_moe_dsa"), reason="the installed Transformers has no glm_moe_dsa")
def test_a_dsa_model_under_a_reentrant_checkpoint_warns():
    model, _ = build("glm_moe_dsa", index_topk=4)
    hyscale_hf.patch_model(model, backend="torch")
    model.train()
    enable_checkpointing(model)
    for layer in model.model.layers:
        layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=True)
    x = dsa_checks.tokens(1, 9)
    model.model.embed_tokens.weight.requires_grad_(True)
    assert len(_backward_warnings(lambda: model(x, labels=x).loss.backward())) == 1
