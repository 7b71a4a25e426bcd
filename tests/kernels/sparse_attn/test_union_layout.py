"""The query tiles' list widths (``union_layout``): whole grains, whatever the widest union."""

import pytest
import torch

from hyscale_hf.kernels.sparse_attn.naive import tile_unions_reference
from hyscale_hf.kernels.sparse_attn.union_layout import UNION_GRAIN, union_width


@pytest.mark.parametrize("widest,want", [(0, (512, 16)), (1, (512, 16)), (512, (512, 16)), (513, (1024, 32)),
                                         (3001, (3072, 96))])
def test_widths_are_whole_grains(widest, want):
    assert UNION_GRAIN == 512 and union_width(widest) == want


def test_lists_of_different_selections_share_their_width_pattern():
    """Two selections with different widest unions (7 and 40 keys) give lists of one width: what keeps
    the kernels' integer arguments (the width, its strides, the bit words) divisible by 16."""
    narrow = torch.arange(7, dtype=torch.int32).expand(1, 8, 7).contiguous()
    wide = torch.arange(40, dtype=torch.int32).view(1, 8, 5).contiguous()
    for idx in (narrow, wide):
        union, num, bits = tile_unions_reference(idx, 8, 64)
        assert union.shape == (1, 1, 512) and bits.shape == (8, 16) and int(num.max()) == idx.unique().numel()
        assert (union[0, 0, int(num.max()):] == -1).all()
