"""scripts/probe_selection_sharing.py: its sharing statistics count what they claim (CPU, tiny selections)."""

import pytest
import torch

from tests.support.scripts import load_script


def test_union_and_shared_pairs_of_tiles():
    probe = load_script("probe_selection_sharing")
    # tile 1 (rows 0-1): keys {0}, {0, 1}: 3 pairs, union 2, key 0 in both rows (2 shared pairs);
    # tile 2 (rows 2-3): {0, 1}, {1, 2}: 4 pairs, union 3, key 1 in both rows
    idx = torch.tensor([[0, -1], [0, 1], [0, 1], [1, 2]], dtype=torch.int32)
    s = probe.sharing(idx, tiles=(2,))
    assert s["pairs"] == 7
    assert s["G=2"]["union_over_pairs"] == pytest.approx(5 / 7)
    assert s["G=2"]["shared"] == pytest.approx(4 / 7)
    assert s["in_last_1024"] == 1.0


def test_disjoint_rows_share_nothing():
    probe = load_script("probe_selection_sharing")
    idx = (torch.arange(8 * 4, dtype=torch.int32).view(8, 4) * 10)  # every key once
    s = probe.sharing(idx, tiles=(2, 4))
    for g in ("G=2", "G=4"):
        assert s[g]["union_over_pairs"] == 1.0 and s[g]["shared"] == 0.0
