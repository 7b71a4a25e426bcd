"""The key-row gather that both Hopper MLA kernels (``mla_forward_gluon.py``, ``mla_backward_gluon.py``)
run: a block's key ids, and its selected 576-wide latent rows copied into shared memory with ``cp.async``.

Both kernels load a block's key ids one block ahead, before the products that precede its gather: a
gather that loaded its own ids would wait an L2 round trip before it could issue a single copy, on the
softmax warpgroup's path (Nsight Compute on the forward, H100, 32K: half of its warps' stall cycles were
waits on global loads).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import async_copy

from ..gluon_hopper import cp_async as _cp_async

BLOCK = gl.constexpr(64)  # keys per block
D_V = gl.constexpr(512)  # key dims that are also the value (MLA absorbed: v = k[..., :512])
D_ROPE = gl.constexpr(64)  # the remaining key dims (576 = 512 + 64)


@gluon.jit
def copy_rows(dst, dst_rope, row_ptrs, cols, WITH_ROPE: gl.constexpr):
    """``cp.async`` [64, 512] (and the [64, 64] rope tail) of 64 rows into shared memory."""
    for c in gl.static_range(D_V // 64):
        _cp_async(dst.slice(c * 64, 64, dim=1), row_ptrs + (c * 64 + cols)[None, :])
    if WITH_ROPE:
        _cp_async(dst_rope, row_ptrs + (D_V + cols)[None, :])


@gluon.jit
def block_keys(idx_base, count, j, offs):
    """Key ids of block j's slots (-1 past the row's extent), in offs's layout."""
    slot = j * BLOCK + offs
    return gl.load(idx_base + slot, mask=slot < count, other=-1)


@gluon.jit
def gather_block(k_base, s_kt, kid, kv_smem, rope_smem, cols):
    """The K rows ``kid`` (one block) into a key slot (one commit group). Index -1 loads row 0: the
    kernels mask its score, so P (and dS) are 0 there and its contribution is dropped."""
    k_rows = k_base + gl.where(kid >= 0, kid, 0).to(gl.int64)[:, None] * s_kt
    copy_rows(kv_smem, rope_smem, k_rows, cols, True)
    async_copy.commit_group()
