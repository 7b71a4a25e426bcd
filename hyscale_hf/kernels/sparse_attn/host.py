"""Host code of the Triton sparse attention: launch configs, key lists, forward and backward launches.

Kernels: ``triton_kernels.py`` (the design is described there) and, for MLA on sm_90, the Gluon
forward (``mla_forward_gluon.py``) and the Gluon dS + dK/dV part of the backward
(``mla_backward_gluon.py``). The autograd wrappers (``op.py``, ``mla.py``) run the forward through
``forward_op.sparse_attention_forward`` (``forward_plan``, then ``forward_launch`` inside a custom op)
and call ``sparse_attention_bwd``; ``SparseAttentionConfig`` chooses tile shapes and kernel variants.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import weakref
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

try:  # Triton is a Linux x86-64 dependency; elsewhere only the torch reference exists.
    import triton

    from . import triton_kernels as kernels
    from .key_passes import key_pass_width, key_passes
    from .tile_head_probs import tile_head_probs
    from .tile_unions import tile_unions
except ImportError:  # pragma: no cover
    triton = None
try:  # Gluon (Triton's explicit-layout dialect) with its Hopper ops: the MLA kernels on sm_90
    from . import mla_backward_gluon, mla_forward_gluon
except (ImportError, AttributeError):  # pragma: no cover  (a Triton without them, or other names)
    mla_forward_gluon = mla_backward_gluon = None

# Whether this build has the Triton kernels (the ops' "triton" backend).
HAS_TRITON = triton is not None

_LOG2E = 1.4426950408889634

# Bytes of the dS buffer [B, chunk, Hq, K] of the split (wide-row) backward.
DS_BYTES = 1 << 30

# Per-token rows are walked up to their last key rounded up to this many slots (>= every BLOCK_N).
EXTENT_GRAIN = 128

# The tiled forward runs only where the tile unions hold on average at most this many times K keys:
# each tile walks its own union, so their total is the forward's work. (The widest union once stood
# for it; a trained SmolLM2 indexer's layer with unions of 3.0 K on average but one of 4.8 K then ran its
# whole forward per token, 43 ms at 128K on an H100 where its neighbours' tiled forwards took 17-20 ms.
# The average is read in the same host sync as the widest union, which sizes the lists.)
TILED_FWD_MAX_UNION = 4

# Widest query (heads x key dims) ``tile_head_probs`` takes: it unrolls every head and keeps their
# query tiles in registers (sm_90 ptxas, 64-query tiles, 8 warps: 9 x 64 and 8 x 64 without spills,
# 16 x 64 spilled). Wider models add the head sums inside the tiled backward kernel instead.
TILE_PROBS_MAX_WIDTH = 576



@dataclass(frozen=True)
class SparseAttentionConfig:
    """Launch choices of the Triton sparse attention; ``SparseAttentionConfig()`` is what runs by default.

    The five kernel fields are overrides of the launch parameters that ``launch_config`` picks by
    shape (measured on one H200 with ``scripts/tune_sparse_attention.py``): a key given here
    replaces that default, keys left out keep it.

    - ``fwd``: the per-token forward (``BLOCK_H``, ``BLOCK_N``, ``num_warps``, ``num_stages``);
    - ``bwd``: the per-token backward (the same keys, and ``split``: the two-kernel backward of wide
      MLA rows, dS + dK/dV then dQ);
    - ``bwd_dq``: the dQ kernel of the split backward (``SLAB`` key-dim columns per program,
      ``BLOCK_N``, ``num_warps``, ``num_stages``; ``BLOCK_N`` must divide ``EXTENT_GRAIN``);
    - ``fwd_tiled``, ``bwd_tiled``, ``probs_tiled``: the query-tile kernels (``BLOCK_N`` in
      {32, 64, 128}, ``num_warps``, ``num_stages``); ``probs_tiled`` is ``tile_head_probs.py``'s.

    ``tile_rows``: rows (query, head pairs) of a query tile, the matmul M side of the tiled kernels;
    0 turns query tiles off (every program walks one token's own list). 128 rows (32 queries of a
    GQA group of 4) rather than 64: each tile sums its keys' dK/dV in registers before one atomic
    add per key, so twice the queries per tile halve the atomics while the union grows only by the
    extra window keys. H200, T = 128K, far tokens shared by 64 queries: backward 89 -> 51 ms,
    forward 34.6 -> 31.7 ms.

    ``mla_gluon``: the Hopper MLA forward (``mla_forward_gluon.py``) where it applies; False runs
    the Triton forward there (the same-run baseline of ``scripts/bench_sparse_attention.py``).
    ``mla_gluon_bwd``: the same for the dS + dK/dV kernel of the backward (``mla_backward_gluon.py``;
    in the deterministic backward it stores each pair's contribution to scratch, as the Triton
    kernel does there).
    ``mla_bwd_pass_bytes``: that kernel's fp32 accumulator (B * T rows of 576) is added to in key
    passes of at most this many bytes each, so each pass's atomics stay in L2 (``key_passes.py``);
    0 adds in one pass.
    ``det_scratch_bytes``: the deterministic backward stores each (query, key) pair's fp32
    contribution to scratch and sums each key's rows in a fixed order; its queries go in chunks
    whose scratch is at most this many bytes (at least one query a chunk).

    ``tiled_head_probs``: on query tiles, a ``HeadProbs`` target comes from its own kernel
    (``tile_head_probs.py``: one program per tile and all heads, no atomics, deterministic); False
    adds it inside the tiled backward kernel by one fp32 atomic per (query, head, key) instead (the
    same-run baseline of the benchmarks).
    """

    fwd: dict = field(default_factory=dict)
    bwd: dict = field(default_factory=dict)
    bwd_dq: dict = field(default_factory=dict)
    fwd_tiled: dict = field(default_factory=dict)
    bwd_tiled: dict = field(default_factory=dict)
    probs_tiled: dict = field(default_factory=dict)
    tile_rows: int = 128
    mla_gluon: bool = True
    mla_gluon_bwd: bool = True
    mla_bwd_pass_bytes: int = 32 << 20
    det_scratch_bytes: int = 4 << 30
    tiled_head_probs: bool = True

    def __post_init__(self):
        for name in ("mla_bwd_pass_bytes", "det_scratch_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"SparseAttentionConfig.{name} must be an int >= 0 (bytes), got {value!r}")

    def overrides(self, kind: str) -> dict:
        """The launch overrides of kernel ``kind`` ("fwd", "bwd", "bwd_dq", "fwd_tiled", "bwd_tiled",
        "probs_tiled")."""
        return getattr(self, kind)


# What ``config=None`` means: read at call time (tests swap it for small blocks).
DEFAULT_CONFIG = SparseAttentionConfig()


def key_pass_count(acc: torch.Tensor, config: SparseAttentionConfig) -> int:
    """Key passes of the Gluon dK/dV kernel for the fp32 accumulator ``acc`` [B, T, 1, C]."""
    if config.mla_bwd_pass_bytes <= 0:
        return 1
    return max(1, triton.cdiv(acc.numel() * acc.element_size(), config.mla_bwd_pass_bytes))


def row_delta(o: torch.Tensor, do: torch.Tensor, dlse: torch.Tensor | None, t0: int, count: int) -> torch.Tensor:
    """fp32 [B, count, H]: rowsum(dO * O) - dlse of tokens [t0, t0 + count) (o, do [B, S, H, Dv] with
    unit inner stride, Dv a power of two)."""
    B, _, H, dv = o.shape
    if dv & (dv - 1) or o.stride(3) != 1 or do.stride(3) != 1:
        raise ValueError(f"row_delta takes rows of a power-of-two width with unit stride, got o {tuple(o.shape)}")
    delta = torch.empty(B, count, H, dtype=torch.float32, device=o.device)
    dl = dlse if dlse is not None else delta  # unread without HAS_DLSE
    block_h = max(1, min(triton.next_power_of_2(H), 8192 // dv))
    kernels.row_delta_kernel[(count, B, triton.cdiv(H, block_h))](
        do, o, dl, delta, do.stride(0), do.stride(1), do.stride(2), o.stride(0), o.stride(1), o.stride(2),
        dl.stride(0), dl.stride(1), dl.stride(2), delta.stride(0), delta.stride(1), delta.stride(2), t0, H,
        DV=dv, BLOCK_H=block_h, HAS_DLSE=dlse is not None,
    )  # fmt: skip
    return delta


def resolve_config(config: SparseAttentionConfig | None) -> SparseAttentionConfig:
    if config is None:
        return DEFAULT_CONFIG
    if not isinstance(config, SparseAttentionConfig):
        raise TypeError(f"config must be a SparseAttentionConfig or None, got {type(config).__name__}")
    return config


def _split_key_dim(d: int) -> tuple[int, int]:
    """d = D1 + D2 with D1 the largest power of two <= d; (0, 0) if D2 is not a power of two >= 16."""
    d1 = 1 << (d.bit_length() - 1)
    d2 = d - d1
    if d1 < 16 or (d2 and (d2 < 16 or d2 & (d2 - 1))):
        return 0, 0
    return d1, d2


def v_is_k_prefix(k: torch.Tensor, v: torch.Tensor) -> bool:
    """v's elements are k's first Dv dims (same storage, offset and strides): ``v = k[..., :Dv]``."""
    return (
        v.data_ptr() == k.data_ptr()
        and v.shape[:3] == k.shape[:3]
        and v.stride() == k.stride()
        and v.shape[3] <= k.shape[3]
        and v.dtype == k.dtype
    )


def v_grad_flows_into_k(k: torch.Tensor, v: torch.Tensor) -> bool:
    """True when autograd routes v's gradient into the storage of k (v is a view of k's base)."""
    if not (k.requires_grad and v.requires_grad and v_is_k_prefix(k, v)):
        return False
    base = k if k._base is None else k._base
    return v._base is not None and v._base is base


def _gluon_mla_forward_applies(
    q: torch.Tensor, k: torch.Tensor, v_from_k: bool, run: KeyLists, config: SparseAttentionConfig
) -> bool:
    """The Hopper MLA forward (``mla_forward_gluon``) takes per-token lists of MLA-absorbed rows:
    one KV head of 576 dims whose first 512 are v, query heads in blocks of 64, bf16/fp16, unit
    inner strides and 16-byte aligned rows (its copies move 16-byte pieces), on an sm_90 GPU.
    ``SparseAttentionConfig(mla_gluon=False)`` turns it off (the Triton forward then runs)."""
    if mla_forward_gluon is None or not q.is_cuda or run.tile_q or not config.mla_gluon:
        return False
    return (
        torch.cuda.get_device_capability(q.device) == (9, 0)
        and q.dtype in (torch.bfloat16, torch.float16)
        and k.dtype == q.dtype
        and v_from_k
        and k.shape[2] == 1
        and q.shape[2] % 64 == 0
        and q.shape[3] == 576
        and run.idx.stride(2) == 1
        and _rows_aligned(q)
        and _rows_aligned(k)
    )


def _gluon_mla_backward_applies(q, k, v_from_k: bool, merge_dv: bool, lists: KeyLists, o, do,
                                config: SparseAttentionConfig) -> bool:
    """The Hopper dS + dK/dV kernel (``mla_backward_gluon``) takes what the Gluon forward takes, with
    o and dO in q's dtype (the kernel reads them as such) and the same row form (unit inner stride,
    16-byte aligned rows), where v's gradient is merged into k's (it adds P^T dO into k's first 512
    columns: with v = k[..., :512].detach() that would be wrong); ``SparseAttentionConfig(
    mla_gluon_bwd=False)`` turns it off."""
    if mla_backward_gluon is None or not merge_dv or not config.mla_gluon_bwd:
        return False
    if not _gluon_mla_forward_applies(q, k, v_from_k, lists, dataclasses.replace(config, mla_gluon=True)):
        return False
    return all(t.dtype == q.dtype and _rows_aligned(t) for t in (o, do))


def _rows_aligned(t: torch.Tensor) -> bool:
    """Rows the Gluon kernels' 16-byte copies can move: a 16-byte aligned start, unit inner stride,
    and every other stride a multiple of 8 elements, except where the dim has size 1. That exception
    matters: the model's output gradient arrives as a permuted view whose size-1 batch dim has stride 1.
    Pass such tensors through ``_unit_dims_zeroed`` so the kernel never sees that stride."""
    if t.stride(-1) != 1 or t.data_ptr() % 16:
        return False
    return all(st % 8 == 0 for st, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1)


def _unit_dims_zeroed(t: torch.Tensor) -> torch.Tensor:
    """The same elements with stride 0 on dims of size 1 (only index 0 is ever read there): the
    Gluon kernels then see strides that keep every row address 16-byte aligned."""
    if all(n > 1 for n in t.shape):
        return t
    return t.as_strided(t.shape, tuple(0 if n == 1 else st for st, n in zip(t.stride(), t.shape)))


def triton_dtype_reason(q, k, v) -> str | None:
    """Why the Triton kernel cannot take these dtypes (None if it can)."""
    if not (q.dtype == k.dtype == v.dtype):
        return f"q, k, v must share one dtype for the Triton kernel, got {q.dtype}, {k.dtype}, {v.dtype}"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"the Triton kernel takes float16/bfloat16/float32, got {q.dtype}"
    return None


def padded_head_dims(dqk: int, dv: int) -> tuple[int, int]:
    """The smallest head dims >= (dqk, dv) the kernels tile: a key width that is a power of two
    >= 16, or one plus a power-of-two tail >= 16 (80 = 64 + 16, 576 = 512 + 64; 112 -> 128,
    24 -> 32), and a value width that is a power of two >= 16 (80, 96, 112 -> 128).

    ``sparse_attention`` zero-pads q, k (and v) to these widths for the Triton path: zero columns
    add nothing to a dot product, and the padded output columns are sliced off.
    """
    if dqk <= 16:
        dqk_p = 16
    else:
        d1 = 1 << (dqk.bit_length() - 1)
        rest = dqk - d1
        dqk_p = d1 + (max(16, _next_pow2(rest)) if rest else 0)  # a tail of d1 makes 2 * d1: a power of two
    return dqk_p, max(16, _next_pow2(dv))


def triton_unsupported_reason(q, k, v) -> str | None:
    """Why the Triton kernel cannot take these inputs as they are (None if it can)."""
    reason = triton_dtype_reason(q, k, v)
    if reason is not None:
        return reason
    dqk, dv = q.shape[-1], v.shape[-1]
    d1, _ = _split_key_dim(dqk)
    if d1 == 0:
        return f"Dqk = {dqk} must be a power of two >= 16 plus an optional power-of-two tail >= 16 (e.g. 576 = 512 + 64)"
    if dv < 16 or dv & (dv - 1):
        return f"Dv = {dv} must be a power of two >= 16 for the Triton kernel"
    return None


def _is_wide(dqk: int, dv: int) -> bool:
    """MLA-absorbed-like rows (576 + 512): big tiles, one program per token, split backward."""
    return dqk + dv > 512


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def launch_config(kind: str, group: int, dqk: int, dv: int, num_idx: int, config: SparseAttentionConfig) -> dict:
    """Block sizes and launch options of one kernel (``kind``), with ``config``'s overrides."""
    block_h = min(64, max(16, _next_pow2(group)))
    wide = _is_wide(dqk, dv)
    # Measured on one H200 (scripts/tune_sparse_attention.py, T = 16K, K = 2048, bf16).
    if kind == "fwd":
        cfg = dict(BLOCK_H=block_h, BLOCK_N=64, num_warps=8 if block_h >= 64 else 4, num_stages=2)
    elif kind == "bwd":
        # Wide rows split the backward in two kernels (dS + dK/dV, then dQ): the fused kernel's
        # [64, 576] fp32 dQ accumulator does not fit beside the rest. BLOCK_N 16 keeps the split
        # dK/dV kernel under sm_90's 227 KB of shared memory; 4 warps beat 8 there (78 vs 108 ms), and
        # 3 stages beat 2 (H200: 35.3 vs 36.8 ms at 8K, 590 vs 636 ms at 128K).
        cfg = dict(BLOCK_H=block_h, BLOCK_N=16 if wide else 32, num_warps=4 if wide or block_h < 64 else 8,
                   num_stages=3 if wide else 2)
        cfg["split"] = wide
    elif kind == "bwd_dq":  # dQ of the split backward, SLAB columns of the key dims per program
        cfg = dict(SLAB=128, BLOCK_N=64, num_warps=4, num_stages=3)
    elif kind == "fwd_tiled":  # BLOCK_H rows = (query, head) pairs of a query tile
        cfg = dict(BLOCK_N=32, num_warps=4, num_stages=3)
    elif kind == "probs_tiled":  # rows = a tile's queries, all heads unrolled (tile_head_probs.py)
        cfg = dict(BLOCK_N=64, num_warps=8, num_stages=2)
    else:  # "bwd_tiled"; head dims <= 64 (converted small models): 4 warps (H100, 9 / 3 heads of 64,
        # T = 32K / 128K: 2.75 / 9.86 ms against 3.45 / 12.80 ms with 8; tune_sparse_attention.py)
        cfg = dict(BLOCK_N=64, num_warps=8 if dqk > 64 else 4, num_stages=2)
    cfg.update(config.overrides(kind))
    if kind.endswith("tiled"):
        cfg["BLOCK_H"] = config.tile_rows
    # Tiled kernels read membership bits a 32-bit word at a time: BLOCK_N in {32, 64, 128}.
    cfg["BLOCK_N"] = min(cfg["BLOCK_N"], max(32 if kind.endswith("tiled") else 16, _next_pow2(num_idx)))
    return cfg


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get full fp32 products (not tf32): the fp32 path is the accuracy path.
    return "ieee" if dtype == torch.float32 else "tf32"


class KeyLists(NamedTuple):
    """What one program iterates: a token's own index row, or a query tile's union of keys.

    ``idx`` [B, P, L] int32 (-1 = skip) holds one key list per program (P = S tokens or S / tile_q
    tiles) and ``num`` [B, P] int32 how many of its slots a program walks: the union's length, or
    a token row's extent (up to its last key, ``row_extent_kernel``). Tiled lists also carry
    ``bits`` [B * P * tile_q, W] (bit u of a query's row: the query selected union key u);
    per-token lists pass ``idx`` there. ``mean_union``: keys in a tile's union on average, read in the
    build's one host sync (the forward and the indexer KL choose their kernels by it without another);
    -1 where not known (per-token lists, lists rebuilt from saved tensors without it).
    """

    idx: torch.Tensor
    num: torch.Tensor
    bits: torch.Tensor
    tile_q: int  # queries per tile; 0 = one program per token
    mean_union: float = -1.0


def union_tiles(indices: torch.Tensor, tile_q: int, num_keys: int, unique: bool = False):
    """Query tiles of ``tile_q`` consecutive queries: sorted union of their keys + membership bits.

    Neighbouring queries share most of their selection (local window, sinks, popular far keys), so
    a tile reads each shared key row once and runs one tensor-core product for all its queries'
    heads, and its dK/dV contribution per key is summed in registers before the one atomic add.
    Built by Triton kernels without a sort (``tile_unions.py``; torch reference:
    ``naive.tile_unions_reference``). Returns None when a query lists one key twice (a bit
    cannot count it; the per-token path can).
    """
    lists = tile_unions(indices, tile_q, num_keys, unique=unique, with_mean=True)
    return None if lists is None else KeyLists(*lists[:3], tile_q, lists[3])


def mean_union(lists: KeyLists) -> float:
    """Keys in a tile's union on average: the build's own figure, or (lists without it) one host read."""
    return lists.mean_union if lists.mean_union >= 0 else float(lists.num.float().mean())


def token_lists(indices: torch.Tensor) -> KeyLists:
    """One program per token over its own (contiguous) index row, walked up to the row's extent."""
    B, S, L = indices.shape
    extent = torch.empty(B, S, dtype=torch.int32, device=indices.device)
    if B * S:
        block_r = 16
        kernels.row_extent_kernel[(triton.cdiv(B * S, block_r),)](
            indices, extent, B * S, L, GRAIN=EXTENT_GRAIN, BLOCK_R=block_r, BLOCK_K=min(256, _next_pow2(L))
        )  # fmt: skip
    return KeyLists(indices, extent, indices, 0)


# Bytes of query-tile builds ``reuse_query_tiles`` keeps for later calls over the same indices. A
# replaying checkpoint's recompute attends over the forward's own selection, so a build kept from the
# forward spares the recompute its build and its host sync (a converted SmolLM2's step on an H100 spent
# 48 / 161 ms at 32K / 128K on the tile bitmaps of its 19 builds: BENCHMARKS.md). A build holds
# 4 bytes x (S / tile_q + S / 32) x the union width: about 0.18 GB for 128K queries in 42-query tiles
# with 6K-key unions. The newest builds stay, which are the first recomputed.
KEEP_TILES_BYTES = 1 << 30


class _TileReuse:
    """State of ``reuse_query_tiles``: how many blocks are open, and the builds made inside one, newest
    last: key -> (weak reference to the indices' storage, the build, its bytes). An entry counts only
    while that very storage lives (so a new tensor at the old address never takes it); entries of freed
    selections are dropped at the next build, and the oldest go past ``KEEP_TILES_BYTES`` (the newest
    always stays)."""

    depth = 0
    builds: collections.OrderedDict = collections.OrderedDict()


@contextlib.contextmanager
def reuse_query_tiles():
    """Within the block, a query-tile build over the very same indices (storage, view and version) as an
    earlier build made inside such a block takes that build's result instead of building again.

    For callers that attend over one tensor several times: the layers of an IndexShare group, and a
    replaying checkpoint's recompute, which hands a layer the forward's own tensor (a group then builds
    its tiles once a step while its build is kept: ``KEEP_TILES_BYTES``). Outside such a block every
    call builds its own (kernel benchmarks time the build). A kept build lives as long as its indices
    do, or until newer builds push it out.
    """
    _TileReuse.depth += 1
    try:
        yield
    finally:
        _TileReuse.depth -= 1


def _lists_bytes(lists: KeyLists) -> int:
    return sum(t.numel() * t.element_size() for t in (lists.idx, lists.num, lists.bits))


def _query_tiles(indices: torch.Tensor, tile_q: int, num_keys: int, unique: bool):
    """``union_tiles``, or inside ``reuse_query_tiles`` a kept build's result over the same indices."""
    if not _TileReuse.depth or torch.compiler.is_compiling():
        return union_tiles(indices, tile_q, num_keys, unique=unique)
    builds = _TileReuse.builds
    key = (indices.device, indices.data_ptr(), tuple(indices.shape), indices.stride(), indices._version,
           indices.dtype, tile_q, num_keys, unique)
    storage = indices.untyped_storage()
    hit = builds.get(key)
    if hit is not None and hit[0]() is storage:
        builds.move_to_end(key)
        return hit[1]
    for old in [k for k, (ref, _, _) in builds.items() if ref() is None or k == key]:  # freed selections
        del builds[old]
    tiles = union_tiles(indices, tile_q, num_keys, unique=unique)
    if tiles is not None:
        builds[key] = (weakref.ref(storage), tiles, _lists_bytes(tiles))
        while len(builds) > 1 and sum(n for _, _, n in builds.values()) > KEEP_TILES_BYTES:
            builds.popitem(last=False)
    return tiles


def key_lists(
    indices: torch.Tensor, num_keys: int, group: int, wide: bool, config: SparseAttentionConfig | None = None,
    unique: bool = False,
) -> KeyLists:
    """Query tiles (union key lists) where a tile holds >= 2 queries, else per-token index rows."""
    rows = resolve_config(config).tile_rows
    tile_q = rows // group if rows and not wide else 0
    if tile_q >= 2:
        lists = _query_tiles(indices, tile_q, num_keys, unique)
        if lists is not None:
            return lists
    return token_lists(indices)


def forward_plan(q, k, v, indices, config: SparseAttentionConfig, unique: bool = False):
    """``(lists, run, launch)`` of a forward: the key lists saved for the backward, the lists the forward
    kernel walks, and its launch (``[1]``: the Gluon MLA forward; else ``[0, BLOCK_H, BLOCK_N, num_warps,
    num_stages]`` of ``sparse_attn_fwd_kernel``). ``unique``: no query lists a key twice (``tile_unions``)."""
    B, S, Hq, Dqk = q.shape
    T, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    group = Hq // Hkv
    d1, _ = _split_key_dim(Dqk)
    lists = key_lists(indices, T, group, _is_wide(Dqk, Dv), config, unique=unique)
    run = lists
    limit = TILED_FWD_MAX_UNION * indices.shape[2]
    if S and lists.tile_q and mean_union(lists) > limit:
        # Little overlap between neighbouring queries: a tile's product would be mostly masked
        # work, while the per-token forward only moves the selected rows. (The backward still
        # takes the tiles: there a key's contributions sum in registers before one atomic add.)
        run = token_lists(indices)
    v_from_k = v_is_k_prefix(k, v) and Dv == d1
    if _gluon_mla_forward_applies(q, k, v_from_k, run, config):
        return lists, run, [1]
    cfg = launch_config("fwd_tiled" if run.tile_q else "fwd", group, Dqk, Dv, run.idx.shape[2], config)
    return lists, run, [0, cfg["BLOCK_H"], cfg["BLOCK_N"], cfg["num_warps"], cfg["num_stages"]]


def forward_launch(q, k, v, run: KeyLists, scale: float, launch: list[int]):
    """o [B, S, Hq, Dv] in q's dtype and lse [B, S, Hq] fp32 over the lists ``run``, as ``forward_plan``
    launched them."""
    B, S, Hq, Dqk = q.shape
    Hkv, Dv = k.shape[2], v.shape[3]
    group = Hq // Hkv
    d1, d2 = _split_key_dim(Dqk)
    v_from_k = v_is_k_prefix(k, v) and Dv == d1
    o = torch.empty(B, S, Hq, Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, S, Hq, dtype=torch.float32, device=q.device)
    if S == 0:
        return o, lse
    if launch[0]:
        z = _unit_dims_zeroed
        mla_forward_gluon.mla_forward(z(q), z(k), run.idx, run.num, scale * _LOG2E, o, lse)
        return o, lse
    block_h, block_n, num_warps, num_stages = launch[1:]
    L = run.idx.shape[2]
    nhb, programs = (1, run.idx.shape[1]) if run.tile_q else (triton.cdiv(group, block_h), S)
    kernels.sparse_attn_fwd_kernel[(programs, B * Hkv * nhb)](
        q, k, v, run.idx, run.num, run.bits, o, lse,
        *q.stride(), *k.stride(), *v.stride(), *run.idx.stride(), run.bits.stride(0) if run.tile_q else 0,
        *o.stride(), *lse.stride(),
        S, L, Hkv, group, nhb, run.idx.shape[1], max(1, run.tile_q), scale * _LOG2E,
        D1=d1, D2=d2, DV=Dv, V_FROM_K=v_from_k, TILED=bool(run.tile_q), BLOCK_H=block_h,
        BLOCK_N=block_n, DOT_PREC=_dot_precision(q.dtype), num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return o, lse


def sparse_attention_bwd(
    q, k, v, lists, o, lse, do, dlse, scale: float, merge_dv: bool, deterministic: bool, config: SparseAttentionConfig,
    psum: torch.Tensor | None = None,
):
    """Returns (dq, dk, dv, psum_done); dv is None when ``merge_dv`` folded it into dk. ``psum`` (fp32
    zeros [B, S, K] over the caller's index slots): the kernels that can add each slot's head-summed P
    there (the indexer KL's target) do so: on query tiles over rows sorted ascending a kernel of its
    own (``tile_head_probs``, atomic or deterministic backward) or, with ``config.tiled_head_probs``
    off, the fused GQA kernel (atomic backward); on per-token lists the fused GQA kernel (atomic
    backward) and the Gluon MLA dK/dV kernel; ``psum_done`` says whether one did."""
    B, S, Hq, Dqk = q.shape
    T, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    idx = lists.idx
    L = idx.shape[2]
    group = Hq // Hkv
    d1, d2 = _split_key_dim(Dqk)
    v_from_k = v_is_k_prefix(k, v) and Dv == d1
    merge_dv = merge_dv and v_from_k
    tiled = bool(lists.tile_q)
    cfg = launch_config("bwd_tiled" if tiled else "bwd", group, Dqk, Dv, L, config)
    split = cfg.get("split", False)
    nhb = 1 if tiled else triton.cdiv(group, cfg["BLOCK_H"])
    ncol = Dqk if merge_dv else Dqk + Dv
    dq = torch.empty(B, S, Hq, Dqk, dtype=q.dtype, device=q.device)
    acc = torch.zeros(B, T, Hkv, ncol, dtype=torch.float32, device=q.device)
    units = idx.shape[1]  # programs along dim 0: tokens, or query tiles
    if S == 0:
        return dq, acc[..., :Dqk].to(k.dtype), None if merge_dv else acc[..., Dqk:].to(v.dtype), psum is not None
    has_dlse = dlse is not None
    dlse_t = dlse if has_dlse else lse  # any fp32 [B, S, Hq] tensor; unread without HAS_DLSE
    common = dict(
        D1=d1, D2=d2, DV=Dv, V_FROM_K=v_from_k, MERGE_DV=merge_dv, HAS_DLSE=has_dlse,
        BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], DOT_PREC=_dot_precision(q.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    grid_heads = B * Hkv * nhb

    gluon_dkv = split and _gluon_mla_backward_applies(q, k, v_from_k, merge_dv, lists, o, do, config)
    # key passes keep the atomics' targets in L2; the deterministic backward stores to scratch instead
    passes = key_pass_count(acc, config) if gluon_dkv and not deterministic else 1
    # the scratch's head blocks: the Gluon kernel's programs take 64 heads each, the Triton one's BLOCK_H
    scratch_hb = q.shape[2] // mla_backward_gluon.HEADS.value if gluon_dkv else nhb
    if split:
        qcfg = launch_config("bwd_dq", group, Dqk, Dv, L, config)
        if EXTENT_GRAIN % qcfg["BLOCK_N"]:  # it would read dS slots past the row's extent
            raise ValueError(f"bwd_dq BLOCK_N = {qcfg['BLOCK_N']} must divide EXTENT_GRAIN = {EXTENT_GRAIN}")
    # dS slots a row: the Gluon kernel's TMA stores need rows of a multiple of SLOT_ALIGN, and key
    # passes regroup the slots into aligned groups (key_passes.py), their walks ending on a dQ block
    ds_width = L
    if gluon_dkv:
        align = mla_backward_gluon.SLOT_ALIGN
        ds_width = key_pass_width(L, passes, align, qcfg["BLOCK_N"]) if passes > 1 else triton.cdiv(L, align) * align

    # Programs go in chunks when a per-chunk buffer is needed: dS (split kernels) or scratch.
    chunk = units
    if split:
        chunk = min(chunk, DS_BYTES // (B * Hq * ds_width * q.element_size()))
    if deterministic:
        chunk = min(chunk, config.det_scratch_bytes // (B * L * Hkv * scratch_hb * ncol * 4))
    chunk = max(1, chunk)
    ds_buf = torch.empty(B, chunk, Hq, ds_width, dtype=q.dtype, device=q.device) if split else None
    if deterministic:
        target = torch.empty(B * chunk * L, Hkv * scratch_hb, ncol, dtype=torch.float32, device=q.device)
        tstrides = (0, target.stride(0), target.stride(1))
    else:
        target, tstrides = acc, (acc.stride(0), acc.stride(1), acc.stride(2))

    tiled_probs = psum is not None and tiled and config.tiled_head_probs and Hq * (d1 + d2) <= TILE_PROBS_MAX_WIDTH
    fused_psum = psum is not None and not split and not deterministic and not tiled_probs
    if tiled_probs:
        tile_head_probs(q, k, lists, lse, scale, psum, d1, d2, launch_config("probs_tiled", group, Dqk, Dv, L, config),
                        _dot_precision(q.dtype))
    psum_t = psum if fused_psum else lse  # any fp32 tensor of rank 3; unread without HAS_PSUM
    # the Gluon kernel adds several head blocks' sums by atomics: in a fixed result for at most two
    gluon_psum = psum if gluon_dkv and (not deterministic or scratch_hb <= 2) else None
    for t0 in range(0, units, chunk):
        count = min(chunk, units - t0)
        dq_idx, dq_num, dq_idx_t0 = idx, lists.num, 0  # the slots dS was written for, and their extents
        if gluon_dkv:
            z = _unit_dims_zeroed
            walks = [(idx, None)]  # (slots, key pass) of each launch
            if passes > 1:  # the chunk's slots regrouped by key range, one launch per range (key_passes.py)
                idx_p, perm, off = key_passes(idx.contiguous(), t0, count, T, passes, align, qcfg["BLOCK_N"])
                delta = row_delta(z(o), z(do), dlse, t0, count)
                walks = [(idx_p, (p, perm, off, delta)) for p in range(passes)]
                dq_idx, dq_num, dq_idx_t0 = idx_p, off[:, :, passes], t0
            dst = target[: B * count * L].view(B, count * L, scratch_hb, ncol) if deterministic else acc
            for walk_idx, key_pass in walks:
                mla_backward_gluon.mla_backward_dkv(
                    z(q), z(k), walk_idx, lists.num, z(o), z(do), lse, dlse, ds_buf, dst, t0, count, scale,
                    scale * _LOG2E, psum=gluon_psum, key_pass=key_pass, scratch=deterministic,
                )  # fmt: skip
        elif split:
            args = (
                *q.stride(), *k.stride(), *v.stride(), *idx.stride(), *o.stride(), *do.stride(),
                *lse.stride(), *dlse_t.stride(),
            )  # fmt: skip
            kernels.sparse_attn_bwd_dkv_kernel[(count, grid_heads)](
                q, k, v, idx, lists.num, o, do, lse, dlse_t, ds_buf, target, *args,
                ds_buf.stride(0), ds_buf.stride(1), ds_buf.stride(2), *tstrides,
                t0, count, S, L, Hkv, group, nhb, scale, scale * _LOG2E, SCRATCH=deterministic, **common,
            )  # fmt: skip
        if split:
            slab = min(d1, qcfg["SLAB"])
            kernels.sparse_attn_bwd_dq_kernel[(count * (d1 // slab), grid_heads)](
                ds_buf, k, dq_idx, dq_num, dq, ds_buf.stride(0), ds_buf.stride(1), ds_buf.stride(2),
                *k.stride(), *dq_idx.stride(), *dq_num.stride(), *dq.stride(), t0, dq_idx_t0, dq_idx.shape[2],
                Hkv, group, nhb,
                D1=d1, D2=d2, SLAB=slab, BLOCK_H=cfg["BLOCK_H"], BLOCK_N=qcfg["BLOCK_N"],
                DOT_PREC=_dot_precision(q.dtype),
                num_warps=qcfg["num_warps"], num_stages=qcfg["num_stages"],
            )  # fmt: skip
        else:
            kernels.sparse_attn_bwd_kernel[(count, grid_heads)](
                q, k, v, idx, lists.num, lists.bits, o, do, lse, dlse_t, dq, target, psum_t,
                *q.stride(), *k.stride(), *v.stride(), *idx.stride(), lists.bits.stride(0) if tiled else 0,
                *o.stride(), *do.stride(), *lse.stride(), *dlse_t.stride(), *dq.stride(), *tstrides,
                *psum_t.stride(), t0, count, S, L, Hkv, group, nhb, units, max(1, lists.tile_q), scale,
                scale * _LOG2E, SCRATCH=deterministic, TILED=tiled, HAS_PSUM=fused_psum, **common,
            )  # fmt: skip
        if deterministic:
            _reduce_scratch(idx[:, t0 : t0 + count], target, acc, scratch_hb, ncol)
    dk = acc[..., :Dqk].to(k.dtype)
    dv = None if merge_dv else acc[..., Dqk:].to(v.dtype)
    return dq, dk, dv, psum is not None and (gluon_psum is not None or fused_psum or tiled_probs)


def _reduce_scratch(idx, scratch, acc, nhb: int, ncol: int) -> None:
    """acc[b, key] += the chunk's scratch rows of that key, summed in a fixed order (no atomics)."""
    B, T, Hkv = acc.shape[0], acc.shape[1], acc.shape[2]
    batch_key = torch.arange(B, device=acc.device, dtype=torch.int64)[:, None, None] * T
    keys = torch.where(idx >= 0, idx.to(torch.int64) + batch_key, B * T).flatten()
    sorted_keys, perm = torch.sort(keys, stable=True)  # stable: a key's pairs stay in query order
    n_valid = int((idx >= 0).sum())
    if n_valid == 0:
        return
    seg_key, counts = torch.unique_consecutive(sorted_keys[:n_valid], return_counts=True)
    seg_start = torch.zeros(seg_key.numel() + 1, dtype=torch.int64, device=acc.device)
    torch.cumsum(counts, 0, out=seg_start[1:])
    block_c = 64
    kernels.scratch_reduce_kernel[(seg_key.numel(), Hkv, triton.cdiv(ncol, block_c))](
        scratch, perm, seg_start, seg_key, acc,
        scratch.stride(0), scratch.stride(1), acc.stride(0), acc.stride(1), acc.stride(2),
        T, nhb, ncol, BLOCK_R=32, BLOCK_C=block_c,
    )  # fmt: skip
