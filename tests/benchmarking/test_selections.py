"""hyscale_hf.benchmarking.selections: the sharing statistics count what they claim, and the capture
keeps what HyTopK returned and the arguments that reproduce it (CPU, tiny selections)."""

import pytest
import torch

import hyscale_hf
from hyscale_hf.benchmarking.selections import SelectionCapture, sharing
from tests.model_patches._dense_tiny import INDEXER, tiny_model, tokens


def test_union_and_shared_pairs_of_tiles():
    # tile 1 (rows 0-1): keys {0}, {0, 1}: 3 pairs, union 2, key 0 in both rows (2 shared pairs);
    # tile 2 (rows 2-3): {0, 1}, {1, 2}: 4 pairs, union 3, key 1 in both rows
    idx = torch.tensor([[0, -1], [0, 1], [0, 1], [1, 2]], dtype=torch.int32)
    s = sharing(idx, tiles=(2,))
    assert s["pairs"] == 7
    assert s["G=2"]["union_over_pairs"] == pytest.approx(5 / 7)
    assert s["G=2"]["shared"] == pytest.approx(4 / 7)
    assert s["G=2"]["max_union"] == 3 and s["G=2"]["mean_union"] == pytest.approx(2.5)
    assert s["in_last_1024"] == 1.0


def test_disjoint_rows_share_nothing_and_a_short_last_tile_counts():
    idx = torch.arange(7 * 4, dtype=torch.int32).view(7, 4) * 10  # every key once; 7 rows: last tile of 4 is short
    s = sharing(idx, tiles=(2, 4))
    for g in ("G=2", "G=4"):
        assert s[g]["union_over_pairs"] == 1.0 and s[g]["shared"] == 0.0
    assert s["G=4"]["max_union"] == 16 and s["G=4"]["mean_union"] == pytest.approx(14)
    far = torch.full((2048, 1), 0, dtype=torch.int32)  # row i selects key 0: recent only for i < 1024
    assert sharing(far, tiles=(1,))["in_last_1024"] == pytest.approx(0.5)


def test_sharing_rejects_bad_input():
    with pytest.raises(ValueError, match="idx must be"):
        sharing(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="no selected key"):
        sharing(torch.full((4, 2), -1, dtype=torch.int32))
    with pytest.raises(ValueError, match="tiles"):
        sharing(torch.zeros(4, 2, dtype=torch.int32), tiles=(0,))


def test_capture_keeps_every_layer_and_the_arguments_that_reproduce_it():
    model = hyscale_hf.patch_model(tiny_model("llama"), topk=3, backend="torch", **INDEXER).eval()
    cap = SelectionCapture(inputs_of=(1,))
    with torch.no_grad(), cap:
        model(tokens(1, 12))
    assert len(cap.indices) == model.config.num_hidden_layers and set(cap.inputs) == {1}
    assert all(idx.shape == (1, 12, 3) for idx in cap.indices)
    args, kwargs = cap.inputs[1]
    again = torch.ops.hyscale.hytopk(*args, **kwargs)[0]
    assert torch.equal(again, cap.indices[1])
