"""Contract of the family registry (Liger style): every registered family has an apply function and
its own test file, and unsupported models fail with a message listing the supported ones."""

from pathlib import Path

import pytest

import hyscale_hf
from hyscale_hf.patching import family_of

TEST_DIR = Path(__file__).resolve().parent


@pytest.mark.parametrize("model_type", hyscale_hf.supported_model_types())
def test_every_registered_family_has_an_apply_function_and_a_test(model_type):
    family = family_of(model_type)
    assert family.model_type == model_type
    assert callable(family.apply)
    assert family.kind in ("dsa", "dense")
    test_file = TEST_DIR / f"test_{model_type}.py"
    assert test_file.exists(), f"registered family {model_type!r} has no tests/model_patches/{test_file.name}"
    assert "def test_" in test_file.read_text()


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
    state = hyscale_hf.patching.patch_state(model)
    assert (state.config.topk, state.config.index_n_heads, state.config.index_head_dim, state.config.relu) == (
        7, config.index_n_heads, config.index_head_dim, True)
    with pytest.raises(ValueError, match="already patched"):
        hyscale_hf.patch_model(model)
    hyscale_hf.unpatch_model(model)
    with pytest.raises(ValueError, match="index_n_heads"):
        hyscale_hf.patch_model(model, index_n_heads=config.index_n_heads + 1)
    assert not hyscale_hf.is_patched(model)
    assert all("forward" not in vars(m) for m in model.modules())  # a refused patch leaves no trace
