"""position_ids in the visibility builder: plain positions keep the fast path, resets pack sequences."""

import torch

from hyscale_hf.model_patches import _visibility
from hyscale_hf.model_patches._visibility import visibility


def test_plain_positions_take_the_plain_path_and_are_read_once(monkeypatch):
    reads = []
    real = _visibility._holds_resets

    def counting(position_ids, seg):
        reads.append(hasattr(position_ids, _visibility._RESETS_ATTR))
        return real(position_ids, seg)

    monkeypatch.setattr(_visibility, "_holds_resets", counting)
    pos = torch.arange(6)[None].expand(2, 6)
    for _ in range(3):  # three layers of one forward
        vis = visibility(None, pos, {}, 2, 6, 6)
        assert vis.window_start is None and vis.cu_seqlens is None and vis.plain
    assert reads == [False, True, True]  # the host read of the first layer serves the others


def test_positions_with_resets_give_each_query_its_sequence_start():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0]])
    vis = visibility(None, pos, {}, 1, 6, 6)
    assert vis.window_start.tolist() == [[0, 0, 0, 3, 3, 5]]


def test_positions_edited_in_place_are_read_again():
    pos = torch.arange(4)[None].clone()
    assert visibility(None, pos, {}, 1, 4, 4).window_start is None
    pos[0, 2:] = torch.tensor([0, 1])  # a reset written into the same tensor
    assert visibility(None, pos, {}, 1, 4, 4).window_start.tolist() == [[0, 0, 2, 2]]


def test_meta_positions_take_the_general_path():
    pos = torch.empty(1, 4, dtype=torch.long, device="meta")
    vis = visibility(None, pos, {}, 1, 4, 4, device="meta")
    assert vis.window_start is not None and vis.window_start.device.type == "meta"
