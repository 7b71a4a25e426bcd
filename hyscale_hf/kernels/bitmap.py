"""Bitmaps of integer keys in Triton: popcounts, ranks, slots (``sparse_attn.tile_unions``, HyTopK's final selection).

Distinct keys below T set bits in a bitmap of cdiv(T, 32) int32 words. An exclusive prefix sum of the
words' popcounts (``word_ranks``) gives each word's first slot in ascending key order, and key
``32 w + b`` then sits at slot ``rank[w] + set bits of word w below b`` (``bit_slot``): a sort of
distinct integers without a sort.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _popc(x, HW: tl.constexpr):
    """Set bits of each int32: with ``HW`` one ``popc.b32`` each (sm_90 SASS: a single POPC), else SWAR
    in plain integer ops, which the interpreter runs (it runs no PTX) and which costs about a dozen ALU
    instructions an element on a GPU (LLVM does not turn this form into a popcount).

    ``>>`` is an arithmetic shift on int32; every shifted term is masked so the sign copies never
    count, and from the third step on the fields are small and non-negative.
    """
    if HW:
        return tl.inline_asm_elementwise("popc.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=True, pack=1)
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    x = x + (x >> 8)
    x = x + (x >> 16)
    return x & 0x3F


@triton.jit
def _below(word, bit):
    """The bits of ``word`` below position ``bit`` (0..31): ``~(-1 << bit)``, no (1 << 31) - 1 overflow."""
    return word & ~((tl.zeros_like(bit) - 1) << bit)


@triton.jit
def word_ranks(word, total, HW: tl.constexpr = False):
    """Exclusive prefix sum of the set bits of a block of words, continuing from ``total``:
    (slot of each word's lowest set bit, ``total`` after the block). ``HW``: ``_popc``'s."""
    c = _popc(word, HW)
    return total + tl.cumsum(c, 0) - c, total + tl.sum(c, 0)


@triton.jit
def bit_slot(rank, word, bit, HW: tl.constexpr = False):
    """Slot of bit ``bit`` (0..31) of ``word`` whose lowest set bit has slot ``rank``. ``HW``: ``_popc``'s."""
    return rank + _popc(_below(word, bit), HW)
