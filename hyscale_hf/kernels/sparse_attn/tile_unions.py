"""Query-tile key unions for the tiled GQA sparse attention kernels, built without a sort.

A tile holds ``tile_q`` consecutive queries. Its key list is the sorted union of their selected keys
(``union``, -1 padded to the widest tile), with ``num`` keys, and each query's membership bitmask over
the union slots (``bits``). The pure-torch reference (and the exact output contract) is
``naive.tile_unions_reference``; this module returns exactly the same tensors.

The torch reference sorts every tile's ``tile_q * K`` entries: about 55 ms at T = 128K, K = 2048
on an H200 (``scripts/tune_sparse_attention.py`` times both builds), a third of the GQA
forward+backward then. Keys are integers below T, so a per-tile presence bitmap replaces the sort:

1. ``_tile_bitmap_kernel``: every valid entry ORs its bit into the tile's bitmap (atomics) and the
   tile's [min, max] key is kept, so later passes walk only that word range.
2. ``_tile_rank_kernel``: one program per tile; popcount of each word and an exclusive prefix sum
   over the words: ``rank[w]`` = union slot of word w's lowest key; ``num`` = the total.
3. The host reads the widest union (and the mean: one sync) and allocates ``union`` and ``bits``, their
   width rounded up to whole grains (``union_layout``).
4. ``_tile_expand_kernel``: one program per tile writes key ``32 w + b`` to slot
   ``rank[w] + popc(word & below(b))``: ascending order, as the sort gave.
5. ``_tile_bits_kernel``: each entry finds its slot the same way and ORs its bit into its query's
   row of ``bits``. The atomic returns the old word: if the bit was already set, the query listed
   the key twice (a bit cannot count it twice), and the host returns None (a second sync, skipped
   when the caller vouches that the selections are unique: ``unique=True``).

Scratch (bitmap + ranks) is ``tiles * T / 4`` bytes, 8 GiB for all tiles at 1M tokens, so tiles go
in chunks of at most ``SCRATCH_BYTES``. ``max_u`` is known only after every tile is counted; with
more than one chunk, steps 1-2 run again per chunk before 4-5 (one extra pass over the indices,
only beyond ~128K tokens per sequence at tile_q = 16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..bitmap import bit_slot, word_ranks
from .union_layout import union_width

# Bytes of bitmap + rank scratch one chunk of tiles may use (8 * cdiv(T, 32) bytes per tile):
# 256 MiB holds all 8192 tiles of T = 128K at tile_q = 16 (B = 1) in one chunk.
SCRATCH_BYTES = 256 << 20

_BLOCK_E = 1024  # entries per program of the bitmap and bits kernels
_BLOCK_W_RANK = 1024  # words per step of the prefix sum
_BLOCK_W_EXPAND = 64  # words (x 32 bits) per step of the expansion


@triton.jit
def _tile_entries(IDX, p, eb, n_tiles, num_queries, num_idx, tile_q, num_keys, BLOCK_E: tl.constexpr):
    """Entry block ``eb`` of tile p (flat over B * n_tiles): offsets in the tile, keys, validity.

    A tile's entries are contiguous in the [B, S, K] indices; the last tile of a sequence may hold
    fewer than tile_q queries (no padding copy: its missing queries read as -1).
    """
    b = p // n_tiles
    q0 = (p % n_tiles) * tile_q
    n_entries = tl.minimum(tile_q, num_queries - q0) * num_idx
    offs = eb * BLOCK_E + tl.arange(0, BLOCK_E)
    base = (b.to(tl.int64) * num_queries + q0) * num_idx
    key = tl.load(IDX + base + offs, mask=offs < n_entries, other=-1)
    valid = (key >= 0) & (key < num_keys)  # keys outside [0, T) are skipped, as in the reference
    return offs, key, valid


@triton.jit
def _tile_bitmap_kernel(
    IDX, BITMAP, LO, HI, p0, n_eblocks, n_tiles, num_queries, num_idx, tile_q, num_keys, n_words,
    BLOCK_E: tl.constexpr,
):  # fmt: skip
    """Step 1: BITMAP[t, key >> 5] |= 1 << (key & 31); LO/HI[t] = min/max key. Grid: tiles * blocks."""
    pid = tl.program_id(0)
    t = pid // n_eblocks  # tile within the chunk (scratch row)
    eb = pid % n_eblocks
    _, key, valid = _tile_entries(IDX, p0 + t, eb, n_tiles, num_queries, num_idx, tile_q, num_keys, BLOCK_E)
    row = BITMAP + t.to(tl.int64) * n_words
    tl.atomic_or(row + (key >> 5), 1 << (key & 31), mask=valid, sem="relaxed")
    tl.atomic_min(LO + t, tl.min(tl.where(valid, key, num_keys), 0), sem="relaxed")
    tl.atomic_max(HI + t, tl.max(tl.where(valid, key, -1), 0), sem="relaxed")


@triton.jit
def _tile_rank_kernel(BITMAP, RANK, LO, HI, NUM, p0, n_words, BLOCK_W: tl.constexpr):
    """Step 2: RANK[t, w] = set bits of the tile's words before w; NUM[p0 + t] = all set bits.

    Only words in the tile's [LO, HI] key range are read or written (no valid entry: none).
    """
    t = tl.program_id(0)
    w_lo = tl.load(LO + t) >> 5
    w_hi = (tl.load(HI + t) >> 5) + 1  # HI = -1 (empty tile): w_hi = 0
    row = t.to(tl.int64) * n_words
    total = tl.full([], 0, tl.int32)
    for w0 in range(w_lo, w_hi, BLOCK_W):
        offs = w0 + tl.arange(0, BLOCK_W)
        m = offs < w_hi
        rank, total = word_ranks(tl.load(BITMAP + row + offs, mask=m, other=0), total)
        tl.store(RANK + row + offs, rank, mask=m)
    tl.store(NUM + p0 + t, total)


@triton.jit
def _tile_expand_kernel(BITMAP, RANK, LO, HI, UNION, p0, n_words, max_u, BLOCK_W: tl.constexpr):
    """Step 4: UNION[p0 + t, slot] = key for every set bit (slot = rank + set bits below it)."""
    t = tl.program_id(0)
    w_lo = tl.load(LO + t) >> 5
    w_hi = (tl.load(HI + t) >> 5) + 1
    row = t.to(tl.int64) * n_words
    out = UNION + (p0 + t).to(tl.int64) * max_u
    b = tl.arange(0, 32)
    for w0 in range(w_lo, w_hi, BLOCK_W):
        offs = w0 + tl.arange(0, BLOCK_W)
        m = offs < w_hi
        word = tl.load(BITMAP + row + offs, mask=m, other=0)
        rank = tl.load(RANK + row + offs, mask=m, other=0)
        is_set = ((word[:, None] >> b[None, :]) & 1) != 0  # [BLOCK_W, 32]
        slot = bit_slot(rank[:, None], word[:, None], b[None, :])
        tl.store(out + slot, offs[:, None] * 32 + b[None, :], mask=is_set & m[:, None])


@triton.jit
def _tile_bits_kernel(
    IDX, BITMAP, RANK, BITS, DUP, p0, n_eblocks, n_tiles, num_queries, num_idx, tile_q, num_keys, n_words,
    words, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """Step 5: BITS[(p0 + t) * tile_q + query, slot >> 5] |= 1 << (slot & 31) for every valid entry.

    An old word that already holds the bit means the query listed that key twice: DUP = 1.
    """
    pid = tl.program_id(0)
    t = pid // n_eblocks
    p = p0 + t
    eb = pid % n_eblocks
    offs, key, valid = _tile_entries(IDX, p, eb, n_tiles, num_queries, num_idx, tile_q, num_keys, BLOCK_E)
    row = t.to(tl.int64) * n_words + (key >> 5)
    word = tl.load(BITMAP + row, mask=valid, other=0)
    slot = bit_slot(tl.load(RANK + row, mask=valid, other=0), word, key & 31)
    bits_row = (p.to(tl.int64) * tile_q + offs // num_idx) * words
    bit = slot & 31
    old = tl.atomic_or(BITS + bits_row + (slot >> 5), 1 << bit, mask=valid, sem="relaxed")
    dup = valid & (((old >> bit) & 1) != 0)
    tl.atomic_or(DUP + tl.zeros_like(bit), 1, mask=dup, sem="relaxed")  # no atomic without a repeat


def tile_unions(indices: torch.Tensor, tile_q: int, num_keys: int, unique: bool = False, with_mean: bool = False):
    """Triton build of the query tiles' key lists: ``(union, num, bits)`` or None on a repeated key.
    ``with_mean``: ``(union, num, bits, mean)`` with ``mean`` the keys in a tile's union on average (a
    float, read in the same host sync as the widest union, which sizes the lists).

    ``unique=True``: the caller guarantees that no query lists a key twice (HyTopK's selections), so
    the repeat check and its host read (one GPU sync per call) are skipped; a repeat would then be
    counted once.

    indices int32 [B, S, K] (-1 = empty); tiles of ``tile_q`` consecutive queries, n = cdiv(S, tile_q).
    Returns union int32 [B, n, max_u] (ascending keys, -1 padded; max_u: the widest union rounded up to
    whole ``union_layout.UNION_GRAIN`` slots), num int32 [B, n] and bits int32 [B * n * tile_q, max_u / 32];
    the same tensors as ``naive.tile_unions_reference``.
    """
    idx = indices.contiguous()
    B, S, K = idx.shape
    dev = idx.device
    n_tiles = triton.cdiv(S, tile_q)
    P = B * n_tiles
    n_words = max(1, triton.cdiv(num_keys, 32))
    per_chunk = max(1, min(P, SCRATCH_BYTES // (8 * n_words)))
    chunks = [(p0, min(P, p0 + per_chunk)) for p0 in range(0, P, per_chunk)]
    bitmap = torch.empty(per_chunk, n_words, dtype=torch.int32, device=dev)
    rank = torch.empty(per_chunk, n_words, dtype=torch.int32, device=dev)
    lo = torch.empty(per_chunk, dtype=torch.int32, device=dev)
    hi = torch.empty(per_chunk, dtype=torch.int32, device=dev)
    num = torch.zeros(P, dtype=torch.int32, device=dev)
    # Blocks no larger than a tile's entries / a bitmap row (small shapes: tests, the interpreter).
    block_e = min(_BLOCK_E, triton.next_power_of_2(max(16, tile_q * K)))
    block_r = min(_BLOCK_W_RANK, triton.next_power_of_2(max(16, n_words)))
    block_x = min(_BLOCK_W_EXPAND, triton.next_power_of_2(max(16, n_words)))
    n_eblocks = triton.cdiv(tile_q * K, block_e)
    shape = (n_eblocks, n_tiles, S, K, tile_q, num_keys, n_words)

    def count(p0: int, p1: int) -> None:  # steps 1-2 for tiles [p0, p1)
        bitmap[: p1 - p0].zero_()
        lo.fill_(num_keys)
        hi.fill_(-1)
        if n_eblocks:
            _tile_bitmap_kernel[((p1 - p0) * n_eblocks,)](idx, bitmap, lo, hi, p0, *shape, BLOCK_E=block_e)
        _tile_rank_kernel[(p1 - p0,)](bitmap, rank, lo, hi, num, p0, n_words, BLOCK_W=block_r)

    for p0, p1 in chunks:
        count(p0, p1)
    widest, total = torch.stack([num.max(), num.sum()]).tolist() if P else (0, 0)  # one host sync, not two
    max_u, words = union_width(widest)  # whole grains: the kernels' arguments keep one pattern (union_layout)
    union = torch.full((P, max_u), -1, dtype=torch.int32, device=dev)
    bits = torch.zeros(P * tile_q, words, dtype=torch.int32, device=dev)
    dup = torch.zeros(1, dtype=torch.int32, device=dev)  # written by the bits kernel; read only without ``unique``
    for p0, p1 in chunks:
        if len(chunks) > 1:  # the scratch holds the last chunk only: count this one again
            count(p0, p1)
        _tile_expand_kernel[(p1 - p0,)](bitmap, rank, lo, hi, union, p0, n_words, max_u, BLOCK_W=block_x)
        if n_eblocks:
            _tile_bits_kernel[((p1 - p0) * n_eblocks,)](
                idx, bitmap, rank, bits, dup, p0, *shape, words, BLOCK_E=block_e
            )  # fmt: skip
    if P and not unique and int(dup.item()):
        return None
    lists = union.view(B, n_tiles, max_u), num.view(B, n_tiles), bits
    return (*lists, total / P if P else 0.0) if with_mean else lists
