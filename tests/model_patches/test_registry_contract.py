"""Contract of the family registry (Liger style): every registered family has an apply function and
is covered by a test, and unsupported models fail with a message listing the supported ones.

Coverage convention: each test module under tests/model_patches declares the model types it tests
in a module-level ``COVERED_MODEL_TYPES`` list; this test collects them.
"""

import importlib
import pkgutil

import pytest

import hyscale_hf
import tests.model_patches as family_tests
from hyscale_hf.patching import family_of
from hyscale_hf.state import patch_state

DENSE_FAMILIES = {"llama", "qwen2", "qwen3", "mistral", "glm4"}


def _covered() -> set[str]:
    covered = set()
    for info in pkgutil.iter_modules(family_tests.__path__):
        if info.name.startswith("test_") and info.name != __name__.rsplit(".", 1)[-1]:
            module = importlib.import_module(f"{family_tests.__name__}.{info.name}")
            covered.update(getattr(module, "COVERED_MODEL_TYPES", ()))
    return covered


@pytest.mark.parametrize("model_type", hyscale_hf.supported_model_types())
def test_every_registered_family_has_an_apply_function_and_a_test(model_type):
    family = family_of(model_type)
    assert family.model_type == model_type
    assert callable(family.apply)
    assert family.kind in ("dsa", "dense")
    assert model_type in _covered(), f"no test module under tests/model_patches lists {model_type!r} in COVERED_MODEL_TYPES"


def test_dense_families_are_registered():
    assert DENSE_FAMILIES <= set(hyscale_hf.supported_model_types())
    assert all(family_of(t).kind == "dense" for t in DENSE_FAMILIES)


def test_dsa_families_of_the_installed_transformers_are_registered():
    """A DSA family that Transformers ships (and hyscale_hf has a patch for) must be registered."""
    from .tiny_models import FAMILY_KWARGS, has_family

    for model_type in FAMILY_KWARGS:
        assert has_family(model_type) == (model_type in hyscale_hf.supported_model_types()), model_type


def test_unsupported_model_raises_listing_the_supported_ones():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=16))
    with pytest.raises(ValueError, match="gpt2") as err:
        hyscale_hf.patch_model(model)
    for model_type in hyscale_hf.supported_model_types():
        assert model_type in str(err.value)
    assert not hyscale_hf.is_patched(model)


def test_patching_twice_is_refused_and_options_are_written_back():
    from .tiny_models import build

    model, config = build("deepseek_v32", index_topk=7)
    hyscale_hf.patch_model(model, backend="torch")
    state = patch_state(model)
    assert (state.config.topk, state.config.index_n_heads, state.config.index_head_dim, state.config.relu) == (
        7, config.index_n_heads, config.index_head_dim, True)
    with pytest.raises(ValueError, match="already patched"):
        hyscale_hf.patch_model(model)
    hyscale_hf.unpatch_model(model)
    with pytest.raises(ValueError, match="index_n_heads"):
        hyscale_hf.patch_model(model, index_n_heads=config.index_n_heads + 1)
    assert not hyscale_hf.is_patched(model)
    assert all("forward" not in vars(m) for m in model.modules())  # a refused patch leaves no trace
