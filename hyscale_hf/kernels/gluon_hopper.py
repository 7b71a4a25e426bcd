"""Gluon names for Hopper that changed across Triton releases, in one place for the Gluon kernels
(``sparse_attn/mla_gather_gluon.py`` and the MLA kernels, ``topk/scan_gluon.py``): the device runs Triton 3.6, CI a newer Triton."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import async_copy, tma

# cp.async global -> shared: ``async_load`` in newer Triton, ``async_copy_global_to_shared`` before
cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
# TMA global -> shared: ``async_load`` in newer Triton, ``async_copy_global_to_shared`` before
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# TMA shared -> global: ``async_store`` in newer Triton, ``async_copy_shared_to_global`` before
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
# a partition's own barrier: ``barrier`` in newer Triton, ``thread_barrier`` before
_HAS_THREAD_BARRIER = gl.constexpr(hasattr(gl, "thread_barrier"))


@gluon.jit
def sync_partition():
    """Barrier over the calling partition's warps (its shared-memory writes are done before it
    signals another partition)."""
    if _HAS_THREAD_BARRIER:
        gl.thread_barrier()
    else:
        gl.barrier()
