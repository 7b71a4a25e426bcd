"""Patched models behave like Transformers models (issue 29), for one native DSA family (glm_moe_dsa)
and one dense family given an indexer (llama): what Transformers' own model tests exercise, tiny and
fast. The oracle, as elsewhere: with topk >= T a patched model is the unpatched one.

- generate() with right-padded prompts (the mask gets ones appended after its zeros) and with holes;
- static caches (dense families too), also from inputs_embeds;
- output_attentions=True returns the probabilities in the [B, H, S, T] layout eager attention gives;
- two models built from one config stay independent;
- set_attn_implementation on a patched model changes what it reports and its dense kernel, never a silent unpatch;
- from_pretrained(None, state_dict=...) and _init_weights handle the added indexer.
"""

from __future__ import annotations

import copy

import pytest
import torch

import hyscale_hf
from hyscale_hf.indexer import LightningIndexer

from . import dsa_checks
from ._dense_tiny import INDEXER, tiny_model
from .tiny_models import build, has_family

FAMILIES = [
    pytest.param("glm_moe_dsa", marks=pytest.mark.skipif(not has_family("glm_moe_dsa"), reason="no glm_moe_dsa")),
    "llama",
]


def _reference(family: str, topk: int):
    """(unpatched eager model, patch options) of a tiny ``family`` model."""
    if family == "llama":
        return tiny_model("llama", attn_implementation="eager").eval(), {"topk": topk, **INDEXER}
    return build(family, index_topk=topk)[0], {}


def _pair(family: str, topk: int):
    ref, options = _reference(family, topk)
    pat = copy.deepcopy(ref)
    hyscale_hf.patch_model(pat, backend="torch", **options)
    return ref, pat


def _ids(batch: int, length: int, seed: int = 3) -> torch.Tensor:
    return dsa_checks.tokens(batch, length, seed=seed)


GENERATE = dict(max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)


# ----------------------------------------------------------------------------- masks in generate()


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_with_right_padding_and_holes_matches_unpatched(family):
    """generate() appends ones after a right-padded prompt's zeros: a mask with a hole in every later
    step. With topk covering every key the tokens are the unpatched model's."""
    ref, pat = _pair(family, topk=64)
    x = _ids(3, 9)
    mask = torch.ones_like(x)
    mask[0, 6:] = 0  # right padding
    mask[1, 2:4] = 0  # a hole
    with torch.no_grad():
        expected = ref.generate(x, attention_mask=mask, **GENERATE)
        assert torch.equal(pat.generate(x, attention_mask=mask, **GENERATE), expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_with_holes_and_a_small_topk_selects_as_the_row_alone(family):
    """With topk < T a row with holes generates what its real tokens generate alone."""
    _, pat = _pair(family, topk=3)
    x = _ids(2, 10, seed=4)
    mask = torch.ones_like(x)
    mask[0, 3:6] = 0
    with torch.no_grad():
        both = pat.generate(x, attention_mask=mask, **GENERATE)
        alone = pat.generate(x[:1, mask[0].bool()], **GENERATE)
    assert torch.equal(both[:1, 10:], alone[:, 7:])


# ----------------------------------------------------------------------------- static cache


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_with_a_static_cache(family):
    """A static cache gives what a dynamic one gives (topk < T), also from inputs_embeds, and the
    unpatched model's tokens when topk covers every key."""
    x = _ids(2, 7)
    mask = torch.ones_like(x)
    mask[0, :2] = 0
    static = dict(GENERATE, attention_mask=mask, cache_implementation="static")
    ref, full = _pair(family, topk=64)
    _, small = _pair(family, topk=3)
    with torch.no_grad():
        assert torch.equal(full.generate(x, **static), ref.generate(x, **static))
        dynamic = small.generate(x, attention_mask=mask, **GENERATE)
        assert torch.equal(small.generate(x, **static), dynamic)
        embeds = small.get_input_embeddings()(x)
        assert torch.equal(small.generate(inputs_embeds=embeds, **static), dynamic[:, 7:])


# ----------------------------------------------------------------------------- output_attentions


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("warmup", [False, True], ids=["sparse", "dense_warmup"])
def test_output_attentions_returns_the_probabilities(family, warmup):
    ref, pat = _pair(family, topk=64)
    hyscale_hf.patched_config(pat).dense_warmup = warmup
    x = _ids(2, 8)
    mask = torch.ones_like(x)
    mask[1, 5:] = 0
    with torch.no_grad():
        expected = ref(x, attention_mask=mask, output_attentions=True).attentions
        got = pat(x, attention_mask=mask, output_attentions=True).attentions
        assert pat(x, attention_mask=mask).attentions is None
    assert len(got) == len(expected) == pat.config.num_hidden_layers
    for a, b in zip(got, expected):
        assert a.shape == b.shape == (2, pat.config.num_attention_heads, 8, 8)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_output_attentions_of_a_sparse_selection_sum_to_one_over_it():
    _, pat = _pair("llama", topk=3)
    with torch.no_grad():
        weights = pat(_ids(1, 9), output_attentions=True).attentions[0]
    assert ((weights > 0).sum(-1) <= 3).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(1, weights.shape[1], 9))


# ----------------------------------------------------------------------------- configs and switching


@pytest.mark.parametrize("family", FAMILIES)
def test_two_models_from_one_config_stay_independent(family):
    ref, options = _reference(family, topk=64)  # every key: the two models' fresh indexers cannot differ
    config = ref.config
    attn, keys = config._attn_implementation, set(config.__dict__)
    other = type(ref)(config).eval()
    other.load_state_dict(ref.state_dict())
    x = _ids(1, 6)
    with torch.no_grad():
        unpatched = other(x).logits
    hyscale_hf.patch_model(ref, backend="torch", **options)
    assert set(config.__dict__) == keys and config._attn_implementation == attn  # no record, no "hyscale_dsa"
    with torch.no_grad():
        torch.testing.assert_close(other(x).logits, unpatched, atol=0, rtol=0)  # still runs unpatched
    hyscale_hf.patch_model(other, backend="torch", **options)  # the first patch left no record behind
    with torch.no_grad():
        torch.testing.assert_close(other(x).logits, ref(x).logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_set_attn_implementation_on_a_patched_model_keeps_the_patch(family):
    """The config reports the implementation the user chose and set_attn_implementation changes it as on
    any model; the patched layers keep running hyscale_hf's attention (never a silent unpatch): with
    topk 4 < 12 keys the output stays the patched one, and the switch changes which SDPA backend the
    dense warm-up uses, not its result."""
    ref, pat = _pair(family, topk=4)
    x = _ids(2, 12)
    with torch.no_grad():
        sparse = pat(x).logits
        unpatched = ref(x).logits
    assert not torch.allclose(sparse, unpatched)
    before = pat.config._attn_implementation
    assert before == ref.config._attn_implementation and before != "hyscale_dsa"
    for request in ("eager", "sdpa", {"": "eager"}):
        pat.set_attn_implementation(request)
        expected = request if isinstance(request, str) else request[""]
        assert pat.config._attn_implementation == expected and hyscale_hf.is_patched(pat)
        with torch.no_grad():
            torch.testing.assert_close(pat(x).logits, sparse, atol=1e-6, rtol=1e-5)
        assert pat.config._attn_implementation == expected  # a forward leaves the user's value in place
    with pytest.raises(ValueError, match='attn_implementation="foo"'):
        pat.set_attn_implementation("foo")  # Transformers' own check
    hyscale_hf.patched_config(pat).dense_warmup = True  # the dense parts: the same result either way
    with torch.no_grad():
        pat.set_attn_implementation("eager")
        math = pat(x).logits
        pat.set_attn_implementation("sdpa")
        torch.testing.assert_close(pat(x).logits, math, atol=1e-5, rtol=1e-4)
    hyscale_hf.unpatch_model(pat)
    assert pat.config._attn_implementation == "sdpa"  # the user's last choice, which the model now runs
    with torch.no_grad():
        torch.testing.assert_close(pat(x).logits, ref(x).logits, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_patch_survives_a_recompute_outside_the_model_forward(family):
    """A checkpoint's recompute runs a patched attention module alone, in backward: it still dispatches
    to hyscale_hf's attention (the gradients equal the untiled, uncheckpointed ones)."""
    ref, pat = _pair(family, topk=4)
    x = _ids(2, 12)
    pat.train()
    grads = {}
    for checkpointing in (False, True):
        if checkpointing:
            pat.gradient_checkpointing_enable({"use_reentrant": False})
        pat.zero_grad(set_to_none=True)
        pat(input_ids=x, labels=x).loss.backward()
        grads[checkpointing] = {n: p.grad.clone() for n, p in pat.named_parameters() if p.grad is not None}
    assert set(grads[True]) == set(grads[False])
    for name, g in grads[False].items():
        torch.testing.assert_close(grads[True][name], g, atol=1e-6, rtol=1e-5, msg=name)


# ----------------------------------------------------------------------------- loading and initialisation


def test_from_pretrained_with_a_state_dict_keeps_the_indexers():
    _, pat = _pair("llama", topk=3)
    with torch.no_grad():
        for p in pat.parameters():
            p.add_(0.01 * torch.randn_like(p))
    state_dict = pat.state_dict()
    loaded = type(pat).from_pretrained(None, config=pat.config, state_dict=state_dict)
    hyscale_hf.patch_model(loaded, state_dict=state_dict, **INDEXER)  # from_pretrained dropped the indexer's tensors
    assert loaded.state_dict().keys() == state_dict.keys()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, state_dict[name]), name
    with pytest.raises(TypeError, match="state_dict must be a dict"):
        hyscale_hf.patch_model(tiny_model("llama"), state_dict=[1])


@pytest.mark.skipif(not has_family("glm_moe_dsa"), reason="no glm_moe_dsa")
def test_a_dsa_model_loads_its_own_indexers_from_a_state_dict():
    _, pat = _pair("glm_moe_dsa", topk=4)
    state_dict = pat.state_dict()
    loaded = type(pat).from_pretrained(None, config=pat.config, state_dict=state_dict)
    with pytest.raises(ValueError, match="part of its checkpoint"):
        hyscale_hf.patch_model(loaded, state_dict=state_dict)
    hyscale_hf.patch_model(loaded, backend="torch")
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, state_dict[name]), name


def _forget_initialisation(model):
    for t in (*model.parameters(), *model.buffers(), *model.modules()):
        t._is_hf_initialized = False


def test_init_weights_gives_the_added_indexer_its_prior():
    """Transformers' _init_weights knows the indexer's Linear and LayerNorm only by their generic rule;
    a patched model's initialisation gives the indexer its own locality prior, reproducibly, and keeps
    tensors marked as loaded."""
    _, pat = _pair("llama", topk=3)
    indexers = [m for m in pat.modules() if isinstance(m, LightningIndexer)]
    with torch.no_grad():
        for ix in indexers:
            for p in ix.parameters():
                p.fill_(7.0)
    _forget_initialisation(pat)
    loaded = indexers[1].wk.weight
    loaded._is_hf_initialized = True  # as from_pretrained marks a tensor it read
    torch.manual_seed(0)
    pat.initialize_weights()
    first = {n: p.clone() for n, p in pat.named_parameters()}
    ix = indexers[0]
    rope = torch.zeros(ix.head_dim)
    rope[: ix.rope_dim] = 1
    torch.testing.assert_close(ix.wq.bias, rope.repeat(ix.n_heads))
    torch.testing.assert_close(ix.k_norm.bias, rope)
    assert torch.equal(ix.weights_proj.bias, torch.ones(ix.n_heads)) and ix.wk.weight.std() < 1
    assert (loaded == 7.0).all()
    _forget_initialisation(pat)
    loaded._is_hf_initialized = True
    torch.manual_seed(0)
    pat.initialize_weights()
    for n, p in pat.named_parameters():
        assert torch.equal(p, first[n]), n


@pytest.mark.parametrize("family", FAMILIES)
def test_output_attentions_keep_the_gradients_and_can_be_set_on_the_config(family):
    """As with eager attention: the output is computed from the returned probabilities (gradients reach
    them and the inputs alike), and config.output_attentions works on a patched model's config."""
    ref, pat = _pair(family, topk=64)
    pat.train()
    ref.train()
    x = _ids(2, 6)
    out = pat(x, labels=x, output_attentions=True)
    out.attentions[0].retain_grad()
    out.loss.backward()
    assert out.attentions[0].grad is not None
    ref(x, labels=x).loss.backward()
    dsa_checks.assert_grads_close(ref, pat)
    pat.config.output_attentions = True
    with torch.no_grad():
        assert len(pat(x).attentions) == pat.config.num_hidden_layers
