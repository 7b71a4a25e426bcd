"""``hyscale::sparse_attention_forward``: the forward kernels behind a custom op (what replay may keep).

The replay side (the recompute skips the kernels) is ``tests/test_replay.py``.
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from hyscale_hf.kernels.sparse_attn import SparseAttentionConfig, forward_op, host
from hyscale_hf.kernels.sparse_attn.naive import sparse_attention_reference

needs_triton = pytest.mark.skipif(not host.HAS_TRITON, reason="needs triton")


def test_output_is_small_compares_a_tokens_output_with_its_index_row():
    idx = torch.zeros(1, 4, 2048, dtype=torch.int32)
    smollm2_q, smollm2_v = torch.empty(1, 4, 9, 64, dtype=torch.bfloat16), torch.empty(1, 8, 3, 64, dtype=torch.bfloat16)
    assert forward_op.output_is_small(smollm2_q, smollm2_v, idx)  # 9 x (128 + 4) = 1188 <= 8192 bytes
    mla_q, mla_v = torch.empty(1, 4, 64, 576, dtype=torch.bfloat16), torch.empty(1, 8, 1, 512, dtype=torch.bfloat16)
    assert not forward_op.output_is_small(mla_q, mla_v, idx)  # 64 x (1024 + 4) bytes
    edge_q, edge_v = torch.empty(1, 4, 32, 127), torch.empty(1, 8, 8, 63)  # 32 x (63 x 4 + 4) = 8192: fits
    assert forward_op.output_is_small(edge_q, edge_v, idx)


def test_kept_by_replay_reads_the_keep_argument():
    args = (None,) * 9
    assert forward_op.kept_by_replay(args + (True,), {}) and not forward_op.kept_by_replay(args + (False,), {})
    assert forward_op.kept_by_replay(args, {"keep": True})


def test_the_fake_kernel_gives_the_output_shapes():
    with FakeTensorMode():
        q, k, v = torch.empty(2, 5, 6, 32), torch.empty(2, 7, 2, 32), torch.empty(2, 7, 2, 16)
        idx, num = torch.empty(2, 5, 4, dtype=torch.int32), torch.empty(2, 5, dtype=torch.int32)
        o, lse = forward_op.sparse_attention_forward_op(q, k, v, idx, num, idx, 0, 0.5, [0, 16, 16, 4, 2], True)
        assert o.shape == (2, 5, 6, 16) and o.dtype == q.dtype
        assert lse.shape == (2, 5, 6) and lse.dtype == torch.float32


@needs_triton
@pytest.mark.parametrize("tile_rows", [0, 16], ids=["per_token", "tiles"])
def test_the_op_runs_the_planned_kernel(tile_rows):
    config = SparseAttentionConfig(fwd={"BLOCK_N": 16}, fwd_tiled={"BLOCK_N": 32}, tile_rows=tile_rows)
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 9, 4, 16, generator=g), torch.randn(1, 9, 2, 16, generator=g), torch.randn(1, 9, 2, 16, generator=g)
    idx = torch.stack([torch.randperm(9, generator=g)[:5] for _ in range(9)])[None].to(torch.int32)
    o, lse, lists = forward_op.sparse_attention_forward(q, k, v, idx, 0.25, config, unique=True)
    assert bool(lists.tile_q) == bool(tile_rows)
    o_ref, lse_ref = sparse_attention_reference(q, k, v, idx, 0.25)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, lse_ref, atol=1e-5, rtol=1e-5)
