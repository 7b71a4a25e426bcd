"""A dense model's saved indexers: a checkpoint folder moved before patch_model is named in the error."""

from __future__ import annotations

import shutil

import pytest

from hyscale_hf import patch_model
from tests.model_patches._dense_tiny import INDEXER, tiny_model


def test_moved_checkpoint_folder_is_named(tmp_path):
    saved, moved = tmp_path / "saved", tmp_path / "moved"
    patch_model(tiny_model("llama"), topk=3, **INDEXER).save_pretrained(saved)
    loaded = type(tiny_model("llama")).from_pretrained(saved)
    shutil.move(saved, moved)
    # Before: the hub lookup's "Repo id must be in the form 'repo_name' or 'namespace/repo_name'".
    with pytest.raises(ValueError, match=f"the folder '{saved}' does not exist") as info:
        patch_model(loaded)
    assert "Load the model from the folder that now holds the checkpoint" in str(info.value)
    loaded.name_or_path = str(moved)  # what the message suggests
    patch_model(loaded)
