"""Every registered model family has an apply function and is covered by a test.

Coverage convention: each test module under tests/model_patches declares the model types it tests
in a module-level ``COVERED_MODEL_TYPES`` list; this test collects them.
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import tests.model_patches as family_tests
from hyscale_hf import supported_model_types
from hyscale_hf.patching import family_of

DENSE_FAMILIES = {"llama", "qwen2", "qwen3", "mistral", "glm4"}


def _covered() -> set[str]:
    covered = set()
    for info in pkgutil.iter_modules(family_tests.__path__):
        if info.name.startswith("test_") and info.name != __name__.rsplit(".", 1)[-1]:
            module = importlib.import_module(f"{family_tests.__name__}.{info.name}")
            covered.update(getattr(module, "COVERED_MODEL_TYPES", ()))
    return covered


def test_dense_families_are_registered():
    assert DENSE_FAMILIES <= set(supported_model_types())
    assert all(family_of(t).kind == "dense" for t in DENSE_FAMILIES)


@pytest.mark.parametrize("model_type", supported_model_types())
def test_registered_family_has_apply_and_a_test(model_type):
    family = family_of(model_type)
    assert family.model_type == model_type
    assert callable(family.apply)
    assert family.kind in ("dsa", "dense")
    assert model_type in _covered(), (
        f"no test module under tests/model_patches lists {model_type!r} in COVERED_MODEL_TYPES"
    )
