"""Each row's selected keys grouped by key range: the walk order of the MLA backward's key passes.

The Gluon dK/dV kernel adds every (query, key) pair's 576-wide fp32 contribution into the key's row
of a [T, 576] accumulator with atomics, which bound it. At 128K the accumulator is 302 MB, six times
the H200's L2, and a selection that spreads its keys over the whole past misses L2 on most adds.
Split into P passes, pass p adding only the pairs whose key lies in ``[p * span, (p + 1) * span)``,
each launch's adds hit one slice of the accumulator, which stays in L2 (H200, 128K, the benchmark
step's own selection, the whole sparse backward: 561 ms in one pass, 467 ms in 32 MiB passes,
``scripts/probe_dkv_passes.py``; BENCHMARKS.md has the other sizes).

For that every row's slots are regrouped by pass, in slot order within a pass: ``key_passes``
returns the regrouped keys (``idx_p``), each regrouped slot's original slot (``perm``) and each
pass's first regrouped slot (``off[..., p]``). Every other slot holds -1 (perm -1). Each pass's group
starts at a multiple of ``align`` slots: the Gluon kernel writes each 64-slot dS tile of a pass with
one TMA store, whose column must be 16-byte aligned (8 bf16 slots; an unaligned TMA address is an
illegal instruction). A pass's last tile runs over its group's end, so it also writes the -1 gap
before the next group (dS = 0 there, p being 0), and the next pass's launch writes its own slots
afterwards. ``off[..., P]`` is the walk's end: the last group's end rounded up to ``grain`` slots
(the dQ kernel's block), so the last pass writes dS zeros up to where the dQ kernel reads, as the
one-pass walk does up to the row's extent. Rows get ``key_pass_width`` slots. The torch reference is
``naive.key_passes_reference``; this kernel returns exactly the same tensors. One program per row, P
passes over the row's slots (from L1 after the first): each pass's kept slots get their positions by
a prefix sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024  # slots per step


def key_pass_width(num_idx: int, passes: int, align: int = 1, grain: int = 1) -> int:
    """Slots of a regrouped row (``key_passes``) for rows of ``num_idx`` slots: room for every key, a
    gap of less than ``align`` before each group but the first, and the end rounded up to ``grain``."""
    return triton.cdiv(num_idx + (align - 1) * (passes - 1), grain) * grain


@triton.jit
def _key_passes_kernel(
    IDX, IDX_P, PERM, OFF, s_ib, s_is, s_pb, s_ps, s_ob, s_os, t_offset, num_idx, width, span,
    NUM_PASSES: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr, GRAIN: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)  # row of the chunk
    b = tl.program_id(1).to(tl.int64)
    src = IDX + b * s_ib + (t_offset + r) * s_is
    dst = IDX_P + b * s_pb + r * s_ps
    perm = PERM + b * s_pb + r * s_ps
    off = OFF + b * s_ob + r * s_os
    base = tl.zeros([], tl.int32)
    for p in range(NUM_PASSES):
        if ALIGN > 1:  # the group starts at a multiple of ALIGN: -1 in the gap
            first = (base + ALIGN - 1) // ALIGN * ALIGN
            gap = base + tl.arange(0, ALIGN)
            tl.store(dst + gap, tl.full([ALIGN], -1, tl.int32), mask=gap < first)
            tl.store(perm + gap, tl.full([ALIGN], -1, tl.int32), mask=gap < first)
            base = first
        tl.store(off + p, base)
        for start in range(0, num_idx, BLOCK):
            slot = start + tl.arange(0, BLOCK)
            kid = tl.load(src + slot, mask=slot < num_idx, other=-1)
            keep = (kid >= 0) & (kid // span == p)
            pos = base + tl.cumsum(keep.to(tl.int32), 0) - 1
            tl.store(dst + pos, kid, mask=keep)
            tl.store(perm + pos, slot, mask=keep)
            base += tl.sum(keep.to(tl.int32), 0)
    tl.store(off + NUM_PASSES, (base + GRAIN - 1) // GRAIN * GRAIN)
    for start in range(0, width, BLOCK):  # then -1 to the row's end
        slot = start + tl.arange(0, BLOCK)
        tail = (slot >= base) & (slot < width)
        tl.store(dst + slot, tl.full([BLOCK], -1, tl.int32), mask=tail)
        tl.store(perm + slot, tl.full([BLOCK], -1, tl.int32), mask=tail)


def key_passes(idx: torch.Tensor, t_offset: int, count: int, num_keys: int, passes: int, align: int = 1,
               grain: int = 1):  # fmt: skip
    """Rows ``[t_offset, t_offset + count)`` of idx [B, S, L] int32 (-1 = no key; keys below
    ``num_keys``) regrouped into ``passes`` key ranges of ``span = cdiv(num_keys, passes)`` keys, each
    range's group starting at a multiple of ``align`` slots (a power of two), the walk's end
    (``off[..., passes]``) a multiple of ``grain`` (a multiple of ``align``).

    Returns ``(idx_p, perm, off)``: int32 [B, count, W], [B, count, W] (W = ``key_pass_width(L,
    passes, align, grain)``) and [B, count, passes + 1]; contiguous, on idx's device.
    """
    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes}")
    if align < 1 or align & (align - 1):
        raise ValueError(f"align must be a power of two, got {align}")
    if grain < 1 or grain % align:
        raise ValueError(f"grain must be a positive multiple of align = {align}, got {grain}")
    if idx.dtype != torch.int32 or idx.stride(2) != 1:
        raise ValueError(f"idx must be int32 with unit slot stride, got {idx.dtype}, strides {idx.stride()}")
    B, _, L = idx.shape
    width = key_pass_width(L, passes, align, grain)
    idx_p = torch.empty(B, count, width, dtype=torch.int32, device=idx.device)
    perm = torch.empty_like(idx_p)
    off = torch.empty(B, count, passes + 1, dtype=torch.int32, device=idx.device)
    if B * count == 0:
        return idx_p, perm, off
    span = triton.cdiv(max(num_keys, 1), passes)
    _key_passes_kernel[(count, B)](
        idx, idx_p, perm, off, idx.stride(0), idx.stride(1), idx_p.stride(0), idx_p.stride(1),
        off.stride(0), off.stride(1), t_offset, L, width, span, NUM_PASSES=passes,
        BLOCK=min(_BLOCK, triton.next_power_of_2(width)), ALIGN=align, GRAIN=grain,
    )  # fmt: skip
    return idx_p, perm, off
