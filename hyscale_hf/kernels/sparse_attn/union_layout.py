"""Widths of the query tiles' key lists, the one rule the Triton build (``tile_unions``) and its torch
reference (``naive.tile_unions_reference``) share.

The union rows are padded to a multiple of ``UNION_GRAIN`` slots rather than to the widest tile. The
width is data: it differs between layers and steps, and it reaches the kernels as an argument and as
the strides of ``union`` and ``bits``. Triton specialises a kernel on whether each integer argument is
divisible by 16 and compiles it again for each new pattern, so with exact widths the tiled attention
and indexer KL kernels could compile anew whenever a step drew a new pattern, long after the first
steps. (On an H100 a converted SmolLM2's 32K step took 686 ms, then 2286 ms in the next step of the
same run; such compiles fit that. With the grains three steps took 626-658 ms; the cause was not
isolated.) With the grain the width and the bit
words are always multiples of 16. The padding costs at most 2 KB of ``union`` per tile and 60 bytes
of ``bits`` per query; kernels walk ``num`` keys, never the padding.
"""

from __future__ import annotations

# Union slots per row are a multiple of this (then bits rows hold UNION_GRAIN / 32 = 16 words each).
UNION_GRAIN = 512


def union_width(widest: int) -> tuple[int, int]:
    """``(max_u, words)`` for tiles whose widest union holds ``widest`` keys: union slots per row (>= 1
    whole grain) and int32 words per query's row of membership bits (``max_u / 32``)."""
    max_u = UNION_GRAIN * max(1, -(-widest // UNION_GRAIN))
    return max_u, max_u // 32
