"""Each row's selected keys grouped by key range: the walk order of the MLA backward's key passes.

The Gluon dK/dV kernel adds every (query, key) pair's 576-wide fp32 contribution into the key's row
of a [T, 576] accumulator with atomics, which bound it. At 128K the accumulator is 302 MB, six times
the H200's L2, and a selection that spreads its keys over the whole past misses L2 on most adds.
Split into P passes, pass p adding only the pairs whose key lies in ``[p * span, (p + 1) * span)``,
each launch's adds hit one slice of the accumulator, which stays in L2 (H200, 128K, the benchmark
step's own selection, the whole sparse backward: 561 ms in one pass, 467 ms in 32 MiB passes,
``scripts/probe_dkv_passes.py``; BENCHMARKS.md has the other sizes).

For that every row's slots are regrouped by pass, in slot order within a pass, and the slots
without a key after them: ``key_passes`` returns the regrouped keys (``idx_p``, -1 after the row's
valid keys), each regrouped slot's original slot (``perm``, a permutation of the row's slots) and
each pass's first regrouped slot (``off[..., p]``; ``off[..., P]`` is the row's number of valid
keys). The last pass walks on to the row's extent over the -1 slots, so it writes dS zeros there as
the one-pass walk does and the dQ kernel reads both layouts the same way. The torch reference is ``naive.key_passes_reference``; this
kernel returns exactly the same tensors. One program per row, P passes over the row's slots (from
L1 after the first): each pass's kept slots get their positions by a prefix sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024  # slots per step


@triton.jit
def _key_passes_kernel(
    IDX, IDX_P, PERM, OFF, s_ib, s_is, s_pb, s_ps, s_ob, s_os, t_offset, num_idx, span,
    NUM_PASSES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)  # row of the chunk
    b = tl.program_id(1).to(tl.int64)
    src = IDX + b * s_ib + (t_offset + r) * s_is
    dst = IDX_P + b * s_pb + r * s_ps
    perm = PERM + b * s_pb + r * s_ps
    off = OFF + b * s_ob + r * s_os
    base = tl.zeros([], tl.int32)
    for p in range(NUM_PASSES):
        tl.store(off + p, base)
        for start in range(0, num_idx, BLOCK):
            slot = start + tl.arange(0, BLOCK)
            kid = tl.load(src + slot, mask=slot < num_idx, other=-1)
            keep = (kid >= 0) & (kid // span == p)
            pos = base + tl.cumsum(keep.to(tl.int32), 0) - 1
            tl.store(dst + pos, kid, mask=keep)
            tl.store(perm + pos, slot, mask=keep)
            base += tl.sum(keep.to(tl.int32), 0)
    tl.store(off + NUM_PASSES, base)
    for start in range(0, num_idx, BLOCK):  # then the slots without a key, as -1, in slot order
        slot = start + tl.arange(0, BLOCK)
        kid = tl.load(src + slot, mask=slot < num_idx, other=-1)
        keep = (slot < num_idx) & ((kid < 0) | (kid // span >= NUM_PASSES))
        pos = base + tl.cumsum(keep.to(tl.int32), 0) - 1
        tl.store(dst + pos, tl.full([BLOCK], -1, tl.int32), mask=keep)
        tl.store(perm + pos, slot, mask=keep)
        base += tl.sum(keep.to(tl.int32), 0)


def key_passes(idx: torch.Tensor, t_offset: int, count: int, num_keys: int, passes: int):
    """Rows ``[t_offset, t_offset + count)`` of idx [B, S, L] int32 (-1 = no key; keys below
    ``num_keys``) regrouped into ``passes`` key ranges of ``span = cdiv(num_keys, passes)`` keys.

    Returns ``(idx_p, perm, off)``: int32 [B, count, L], [B, count, L] and [B, count, passes + 1];
    contiguous, on idx's device.
    """
    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes}")
    if idx.dtype != torch.int32 or idx.stride(2) != 1:
        raise ValueError(f"idx must be int32 with unit slot stride, got {idx.dtype}, strides {idx.stride()}")
    B, _, L = idx.shape
    idx_p = torch.empty(B, count, L, dtype=torch.int32, device=idx.device)
    perm = torch.empty_like(idx_p)
    off = torch.empty(B, count, passes + 1, dtype=torch.int32, device=idx.device)
    if B * count == 0:
        return idx_p, perm, off
    span = triton.cdiv(max(num_keys, 1), passes)
    _key_passes_kernel[(count, B)](
        idx, idx_p, perm, off, idx.stride(0), idx.stride(1), idx_p.stride(0), idx_p.stride(1),
        off.stride(0), off.stride(1), t_offset, L, span, NUM_PASSES=passes, BLOCK=min(_BLOCK, triton.next_power_of_2(L)),
    )  # fmt: skip
    return idx_p, perm, off
