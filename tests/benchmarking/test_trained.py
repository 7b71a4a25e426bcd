"""hyscale_hf.benchmarking.trained and the stacks' saved arms: a saved converted model comes back
with its trained indexer (patched) or without it (dense), and the text is real and whole."""

import pytest
import torch

# the recipe's data module needs datasets, which the GPU host's image lacks: there the GPU suite
# (gpu_check.sh tests) must still collect this file
pytest.importorskip("datasets")

import hyscale_hf  # noqa: E402
from hyscale_hf.benchmarking import stacks  # noqa: E402
from hyscale_hf.benchmarking.trained import check_saved, load_saved, text_ids  # noqa: E402
from hyscale_hf.recipes.data import stdlib_documents  # noqa: E402
from tests.support.saved_model import save_tiny_converted  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("saved")
    return folder, save_tiny_converted(folder)


def _indexer_state(model):
    names = set(hyscale_hf.indexer_parameter_names(model))
    return {n: p.detach() for n, p in model.named_parameters() if n in names}


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_saved_model_reloads_with_its_trained_indexer_or_without_it(saved):
    folder, original = saved
    model, tokenizer = load_saved(str(folder), "cpu", torch.float32)
    want, got = _indexer_state(original), _indexer_state(model)
    assert want and set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
    assert hyscale_hf.patched_config(model).topk == 8
    assert hyscale_hf.patched_config(load_saved(str(folder), "cpu", torch.float32, topk=4)[0]).topk == 4
    dense, _ = load_saved(str(folder), "cpu", torch.float32, patch=False)
    assert not hyscale_hf.is_patched(dense) and not hyscale_hf.indexer_parameter_names(dense)
    assert tokenizer.eos_token_id is not None


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_stack_arms_of_a_saved_model(saved):
    folder, original = saved
    for arm in ("hyscale", "replay_off"):
        model, _ = stacks.make_arm("smollm2", arm, {}, 0, 64, "cpu", torch.float32, saved=str(folder))
        assert hyscale_hf.is_patched(model) and model.training
        assert all(torch.equal(p, _indexer_state(original)[n]) for n, p in _indexer_state(model).items())
    dense, _ = stacks.make_arm("smollm2", "dense", {}, 0, 64, "cpu", torch.float32, saved=str(folder))
    assert not hyscale_hf.is_patched(dense) and dense.config.use_cache is False
    with pytest.raises(ValueError, match="smollm2 stack"):
        stacks.make_arm("glm5", "hyscale", {}, 0, 64, "cpu", torch.float32, saved=str(folder))


def test_text_ids_are_the_standard_library_joined_with_eos(saved):
    folder, _ = saved
    _, tokenizer = load_saved(str(folder), "cpu", torch.float32, patch=False)
    first = tokenizer(stdlib_documents(1)[0], add_special_tokens=False)["input_ids"]
    T = len(first) + 10  # the first document, EOS, and the start of the second
    ids = text_ids(tokenizer, T)
    assert ids.shape == (1, T) and ids.dtype == torch.int64
    assert ids[0, : len(first)].tolist() == first and int(ids[0, len(first)]) == tokenizer.eos_token_id
    assert torch.equal(ids, text_ids(tokenizer, T)) and not torch.equal(ids, text_ids(tokenizer, T, seed=1))


def test_a_folder_without_the_saved_config_is_named(tmp_path):
    assert "hyscale_config.json" in check_saved(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="hyscale_config.json"):
        load_saved(str(tmp_path), "cpu", torch.float32)
