"""Triton kernels of HyTopK (host launch: ``host.py``; custom op and public function: ``op.py``).

Exact streaming top-k without a score table. Every candidate is an int64 *key* that orders like the
tie rule (``naive.score_sort_keys``): ``mono(score) << 32 | (2**32 - 1 - index)``, where ``mono``
is an order-preserving int32 image of the fp32 score (-0.0 -> +0.0, every non-finite score to NaN
just above the masked sentinel). Keys are unique, so "the K largest keys" is one exact set.

``hytopk_scan_kernel`` (on sm_90 from 64K keys per sequence, ``scan_gluon`` takes its place
with the same contract): a program owns BQ query rows and all their heads (matmul N = BQ * H, keys
on M as in DeepGEMM's mqa logits, so the head sum runs in each thread's accumulator registers). It
walks a segment of SEG tiles of its rows' key window: dot -> ReLU -> * w -> sum over heads -> causal
mask -> keys, all in registers. Each row keeps a threshold key ``tau`` that only rises and appends
keys >= tau to its own buffer in global scratch.

Buffer layout ("slots"): key offset j of a BN-key tile always appends to slot j of the row, whose
o-th entry lives at ``o * BN + j``, so the append needs only the per-(slot, row) fill counters held
in registers (no prefix sum across threads; on an H200 the earlier prefix-sum append cost as much as
the scoring itself). A tile adds at most one key per slot, so a segment of SEG tiles adds at most
SEG. The host launches the scan once per segment; between two launches ``hytopk_refine_kernel``
refines every row with a slot fuller than SC - SEG (SC = slot capacity): ``_select_threshold`` finds
a new tau with K <= #{keys >= tau} <= K + SLACK by a radix select over the buffer (exact: K keys >=
tau exist, so no key below tau can be in the top K) and ``_compact`` moves the survivors to the
front. n contiguous survivors are exactly a balanced slot layout (slot j holds ceil((n - j) / BN)),
and K + SLACK fits under SC - SEG per slot, so no slot can ever overflow, whatever the scores:
nothing is truncated and no luck is involved. The refine lives in its own kernel because its loops,
histogram and registers slowed the scan even when no row needed it (lower occupancy); the rows'
state (tau, fill counts, and the smallest and largest stored mono, which bound the radix select so
it needs no min/max pass over the buffer) crosses launches through small global arrays.

Threshold pre-pass (``host.presample_plan``): before the first segment, the scan runs once over every
KS-th key into the empty buffers and a refine (``PRESAMPLE``: K = r, no slack) sets each row's tau to
its r-th sample and empties the buffer, so rows start near their K-th key instead of filling and
refining their buffers, and (Triton scan) one scan launch per chunk takes whole windows with no
refines (``STOP_FULL``); rows that fill a slot get a second launch from a higher threshold. After
the scan, ``hytopk_short_rows_kernel`` lists any row that ended with fewer keys than its top K (its
estimate lay above its K-th key, or a full slot emptied it in the second launch) and
``hytopk_rescue_kernel`` rebuilds each listed row exactly.

``hytopk_finalize_kernel``: per row, the exact K-th key (SLACK = 0; after the first radix level over
the buffer, the later levels run over a copy of the one bucket that holds it); the K keys >= it go out
in index order through a bitmap of their indices (no sort): int32 indices (+ fp32 scores), -1 / -inf
padded.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..bitmap import bit_slot, word_ranks
from ..triton_math import lse_value

_I32_MIN = tl.constexpr(-(2**31))
_I32_MAX = tl.constexpr(2**31 - 1)
_I64_MIN = tl.constexpr(-(2**63))
_I64_MAX = tl.constexpr(2**63 - 1)
_NAN_MONO = tl.constexpr(-(2**31) + 1)  # naive.NAN_KEY: below -inf, above masked keys


@triton.jit
def _load_slots(row_ptr, slots, ob, NS: tl.constexpr, OB: tl.constexpr, L1: tl.constexpr = False):
    """Entries ``ob + [0, OB)`` of every slot: keys [OB, NS] and which of them are filled.

    ``L1``: cache them in L1 (``.ca``) for the program's next pass over the same row, for a buffer no
    thread writes during the kernel (the final selection's; L1 is not coherent within a grid, and
    the driver invalidates it between dependent grids). Else ``.cg`` (L2 only), for buffers and
    scratch the same kernel writes."""
    o = ob + tl.arange(0, OB)
    j = tl.arange(0, NS)
    m = o[:, None] < slots[None, :]
    x = tl.load(row_ptr + o[:, None] * NS + j[None, :], mask=m, other=0, cache_modifier=".ca" if L1 else ".cg")
    return x, m


@triton.jit
def _sort_key(mono, index):
    """The tie rule's int64 key of an int32 mono and a key index: ``((mono + 1) << 32) - 1 - index``,
    mono in the high word and 2**32 - 1 - index in the low (``_key_index`` inverts it)."""
    return ((mono.to(tl.int64) + 1) << 32) - 1 - index.to(tl.int64)


@triton.jit
def _key_bounds(th_row):
    """[lo, hi] holding every key of a row's buffer, from its state ``th_row[0:4]`` = (tau mono, tau
    index, smallest stored mono, largest stored mono): all stored keys are >= tau and their monos
    lie in the tracked range (the scan keeps it), so the radix select needs no min/max pass."""
    tau = _sort_key(tl.load(th_row), tl.load(th_row + 1))
    lo = tl.maximum(tau, tl.load(th_row + 2).to(tl.int64) << 32)
    hi = ((tl.load(th_row + 3).to(tl.int64) + 1) << 32) - 1
    return lo, hi


@triton.jit
def _level_digits(lo, hi, LOG_NB: tl.constexpr):
    """Shift s and base of one radix-select level over the keys in [lo, hi]: buckets of width 2**s,
    bucket of key x = (x >> s) - base, fewer than 2**LOG_NB of them.

    s = floor(log2(r)) - (LOG_NB - 3) for r = (hi >> 1) - (lo >> 1) (halved so hi - lo cannot overflow
    int64), read off r's float exponent (a rounding up of r only makes s larger, which still fits)."""
    r = ((hi >> 1) - (lo >> 1)).to(tl.float64)
    e = (r.to(tl.int64, bitcast=True) >> 52) - 1023
    s = tl.maximum(e - (LOG_NB - 3), 0)
    return s, lo >> s


@triton.jit
def _bucket_counts(x, inside, s, base, LOG_NB: tl.constexpr):
    """Histogram of the keys ``x`` (flat) inside the level's range into its buckets (``_level_digits``)."""
    return tl.histogram(((x >> s) - base).to(tl.int32), 1 << LOG_NB, mask=inside)


@triton.jit
def _level_pick(hist, above, K, SLACK, lo, hi, s, base, LOG_NB: tl.constexpr):
    """One level's decision from its histogram: the bucket b holding the K-th largest key (``above``
    keys lie above hi). Returns the next level's state (done, lo, above, hi) with lo = b's lower edge:
    done when that edge is tight enough (K <= keys >= edge <= K + SLACK, or b holds one key), the
    threshold then being lo; else the narrowed range is [lo, hi]."""
    bins = tl.arange(0, 1 << LOG_NB)
    suffix = tl.sum(hist) - tl.cumsum(hist, 0) + hist  # keys inside [lo, hi] in buckets >= j
    b = tl.max(tl.where(suffix >= K - above, bins, -1))
    suffix_b = tl.sum(tl.where(bins == b, suffix, 0))
    count_b = tl.sum(tl.where(bins == b, hist, 0))
    edge = tl.maximum((base + b) << s, lo)
    done = ((above + suffix_b <= K + SLACK) | (count_b <= 1)).to(tl.int32)
    if base + b < (hi >> s):  # else bucket b holds hi: (base + b + 1) << s could overflow
        hi = ((base + b + 1) << s) - 1
    return done, edge, above + suffix_b - count_b, hi


@triton.jit
def _level_hist(
    row_ptr, slots, lo, hi, s, base, NS: tl.constexpr, OB: tl.constexpr, LOG_NB: tl.constexpr, L1: tl.constexpr = False
):  # fmt: skip
    """One radix level's histogram of a row's keys inside [lo, hi] (``_level_digits``' s and base)."""
    hist = tl.zeros([1 << LOG_NB], tl.int32)
    for ob in range(0, tl.max(slots), OB):
        x, m = _load_slots(row_ptr, slots, ob, NS, OB, L1)
        inside = m & (x >= lo) & (x <= hi)
        hist += _bucket_counts(tl.reshape(x, [OB * NS]), tl.reshape(inside, [OB * NS]), s, base, LOG_NB)
    return hist


@triton.jit
def _select_threshold(
    row_ptr, slots, K, SLACK, lo, hi, above, NS: tl.constexpr, OB: tl.constexpr, LOG_NB: tl.constexpr
):  # fmt: skip
    """Key ``tau`` with ``K <= #{x >= tau} <= K + SLACK`` among the ``above`` keys > hi and the keys of
    a row inside [lo, hi] (``_key_bounds``), which together number more than K.

    Radix select that adapts its digit to the live range: each level histograms the keys inside
    [lo, hi] into <= 2**LOG_NB buckets of width 2**s (s the smallest shift that fits the range),
    keeps the bucket holding the K-th largest key and stops as soon as its lower edge is tight
    enough. With SLACK = 0 the result is the exact K-th largest key.
    """
    done = tl.zeros([], tl.int32)
    above += tl.zeros([], tl.int32)  # a loop-carried tensor even when the caller passes a literal 0
    while done == 0:
        s, base = _level_digits(lo, hi, LOG_NB)
        hist = _level_hist(row_ptr, slots, lo, hi, s, base, NS, OB, LOG_NB)
        done, lo, above, hi = _level_pick(hist, above, K, SLACK, lo, hi, s, base, LOG_NB)
    return lo


@triton.jit
def _put_in_layout(ptr, value, mask, OR: tl.constexpr, ASM: tl.constexpr):
    """Masked store of ``value`` (32- or 64-bit), or with ``OR`` a relaxed atomic OR of int32, that
    keeps the registers' layout (``ASM``: one PTX instruction per element; the interpreter, which
    runs no PTX, takes ``tl.store`` / ``tl.atomic_or``).

    Triton gives every ``tl.store`` and atomic a blocked "coalesced" layout of its own. The scan's
    keys live in a slice of the wgmma accumulator layout, and converting them (keys, addresses and
    mask) cost three round trips through shared memory with barriers per key tile (sm_90 TTGIR and
    SASS); the final selection and the refine's compaction paid the same per buffer step. These
    writes go to scattered rows or slots, so the blocked layout coalesced nothing.
    """
    tl.static_assert(not OR or value.dtype.primitive_bitwidth == 32, "_put_in_layout: OR takes 32-bit values")
    if ASM:  # the mask goes in as a predicate ("b"): as an int, ptxas kept a select and a compare per store
        addr = ptr.to(tl.int64)
        if value.dtype.primitive_bitwidth == 64:
            tl.inline_asm_elementwise(
                "{ @$3 st.global.b64 [$1], $2; mov.b32 $0, 0; }",
                "=r,l,l,b", [addr, value.to(tl.int64, bitcast=True), mask], dtype=tl.int32, is_pure=False, pack=1,
            )  # fmt: skip
        elif OR:
            tl.inline_asm_elementwise(
                "{ @$3 red.relaxed.gpu.global.or.b32 [$1], $2; mov.b32 $0, 0; }",
                "=r,l,r,b", [addr, value, mask], dtype=tl.int32, is_pure=False, pack=1,
            )  # fmt: skip
        else:
            tl.inline_asm_elementwise(
                "{ @$3 st.global.b32 [$1], $2; mov.b32 $0, 0; }",
                "=r,l,r,b", [addr, value.to(tl.int32, bitcast=True), mask], dtype=tl.int32, is_pure=False, pack=1,
            )  # fmt: skip
    elif OR:
        tl.atomic_or(ptr, value, mask=mask, sem="relaxed")
    else:
        tl.store(ptr, value, mask=mask)


@triton.jit
def _compact(
    row_ptr, slots, lo, hi, dst_ptr, NS: tl.constexpr, OB: tl.constexpr, ASM: tl.constexpr, L1: tl.constexpr = False
):  # fmt: skip
    """Copy a row's keys inside [lo, hi] to ``dst_ptr[0:n]`` (in place when ``dst_ptr`` is ``row_ptr``);
    returns n.

    Entries are visited in address order and each goes to an address <= its own, so in place a block
    is read by every thread before any thread overwrites part of it (the barrier), and never later.
    """
    depth = tl.max(slots)
    kept = tl.zeros([], tl.int32)
    for ob in range(0, depth, OB):
        x, m = _load_slots(row_ptr, slots, ob, NS, OB, L1)
        keep = tl.reshape((m & (x >= lo) & (x <= hi)).to(tl.int32), [OB * NS])
        pos = kept + tl.cumsum(keep, 0) - keep
        tl.debug_barrier()
        _put_in_layout(dst_ptr + pos, tl.reshape(x, [OB * NS]), keep > 0, False, ASM)
        kept += tl.sum(keep)
    tl.debug_barrier()
    return kept


@triton.jit
def _row_threshold(row_ptr, th_row, slots, K, SLACK, NS: tl.constexpr, OB: tl.constexpr, LOG_NB: tl.constexpr):
    """The threshold a row keeps: ``K <= #{x >= tau} <= K + SLACK`` when its buffer holds more than
    K keys, else the smallest key (all kept)."""
    tau = tl.full([], _I64_MIN, tl.int64)
    if tl.sum(slots) > K:
        lo, hi = _key_bounds(th_row)
        tau = _select_threshold(row_ptr, slots, K, SLACK, lo, hi, 0, NS, OB, LOG_NB)
    return tau


@triton.jit
def _exact_threshold(
    row_ptr, th_row, slots, K, cand_ptr, CAND, NS: tl.constexpr, OB: tl.constexpr, LOG_NB: tl.constexpr,
    ASM: tl.constexpr, L1: tl.constexpr = False,
):  # fmt: skip
    """``_row_threshold`` with SLACK = 0 (the exact K-th key, or the smallest key when the buffer holds
    K or fewer), reading the buffer fewer times: after the first level only the keys of the bucket
    that holds the K-th key matter, usually a few dozen of the buffer's thousands, so they are copied
    to ``cand_ptr`` (this program's scratch of CAND keys) and the later levels histogram those alone.
    Each level over the buffer is a full read plus a histogram (the select's costly step); the copy is
    one read. A bucket larger than CAND keeps its levels on the buffer."""
    tau = tl.full([], _I64_MIN, tl.int64)
    if tl.sum(slots) > K:
        lo, hi = _key_bounds(th_row)
        s, base = _level_digits(lo, hi, LOG_NB)
        hist = _level_hist(row_ptr, slots, lo, hi, s, base, NS, OB, LOG_NB, L1)
        done, lo, above, hi = _level_pick(hist, 0, K, 0, lo, hi, s, base, LOG_NB)
        tau = lo
        if done == 0:
            n_b = tl.sum(tl.where(tl.arange(0, 1 << LOG_NB) == (lo >> s) - base, hist, 0))  # keys in [lo, hi]
            src = row_ptr
            if n_b <= CAND:
                n_b = _compact(row_ptr, slots, lo, hi, cand_ptr, NS, OB, ASM, L1)
                src = cand_ptr
                slots = _balanced_slots(n_b, NS)  # n keys stored contiguously
            tau = _select_threshold(src, slots, K, 0, lo, hi, above, NS, OB, LOG_NB)
    return tau


@triton.jit
def _head_logits(kt, qT, RELU: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """The per-head indexer logits of a key tile, ``kt @ qT`` (ReLU'd with RELU), as the scan and the
    rescue both take them: the same upcast and dot precision in both. NaN stays NaN through the ReLU
    (+inf too); the callers rank non-finite head sums as NaN."""
    if UPCAST:
        kt = kt.to(tl.float32)
    if IEEE:
        acc = tl.dot(kt, qT, input_precision="ieee")
    else:
        acc = tl.dot(kt, qT)
    if RELU:
        acc = tl.maximum(acc, 0.0, propagate_nan=tl.PropagateNan.ALL)
    return acc


@triton.jit
def _mono_score(mono):
    """The fp32 score of an int32 mono: the inverse of the order-preserving image (a NaN-ranked mono
    decodes to a NaN)."""
    return tl.where(mono >= 0, mono, mono ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _key_index(x):
    """The key index a key holds (int64): the inverse of ``((mono + 1) << 32) - 1 - index``."""
    return (((x >> 32) + 1) << 32) - 1 - x


@triton.jit
def _kept_keys(row_ptr, slots, ob, tau, NS: tl.constexpr, OB: tl.constexpr, L1: tl.constexpr = False):
    """Entries ``ob + [0, OB)`` of a row's slots: keys, which of them are >= tau, their int32 indices."""
    x, m = _load_slots(row_ptr, slots, ob, NS, OB, L1)
    return x, m & (x >= tau), _key_index(x).to(tl.int32)


@triton.jit
def _balanced_slots(n, NS: tl.constexpr):
    """Slot fill counts of n keys stored contiguously: slot j holds entries j, j + NS, ... < n."""
    return (n - tl.arange(0, NS) + NS - 1) // NS


@triton.jit
def _append_keys(
    sc, offs_n, start, end, th_key, fill, slot_base, mono_lo, mono_hi, nan_seen, row_on,
    BN: tl.constexpr, SC: tl.constexpr, EDGE: tl.constexpr, CHECK_NAN: tl.constexpr, ASM_STORE: tl.constexpr,
    STOP_FULL: tl.constexpr,
):  # fmt: skip
    """The scan's selection of one tile's scores ``sc[key, row]``: each key >= its row's threshold key
    ``th_key`` goes to the row's slot for its key offset, at entry ``fill`` (``slot_base``: entry 0).
    ``EDGE``: the tile crosses a row's window (a key outside it is skipped); an inner tile's keys are
    all visible, so it spares the two compares per score.

    Per score this is sm_90 code of few instructions (``compile_sm90.py hytopk_scan_small --loops``):
    ``sc + 0.0`` turns -0.0 into +0.0 (tie rule) in one add, the order-preserving image is a shift
    and an xor, the key is (mono, ~index) as two words with no arithmetic, and the threshold test
    is one 64-bit compare of keys."""
    # mono: order-preserving int32 image (-0.0 as +0.0, every non-finite score just above masked,
    # as naive.hytopk_scores_block ranks it)
    bits = (sc + 0.0).to(tl.int32, bitcast=True)
    mono = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    finite = tl.abs(sc) < float("inf")
    mono = tl.where(finite, mono, _NAN_MONO)
    # _sort_key(mono, index) as two words: mono in the high word, 2**32 - 1 - index in the low
    key = (mono.to(tl.int64) << 32) | (offs_n ^ -1).to(tl.uint32, bitcast=True).to(tl.int64)[:, None]
    keep = key >= th_key[None, :]
    if EDGE:
        vis = (offs_n[:, None] >= start[None, :]) & (offs_n[:, None] <= end[None, :])
        keep = keep & vis
        if CHECK_NAN:
            nan_seen = tl.maximum(nan_seen, tl.max((vis & ~finite).to(tl.int32), axis=0))
    elif CHECK_NAN:
        nan_seen = tl.maximum(nan_seen, tl.max((~finite).to(tl.int32), axis=0))
    if STOP_FULL > 0:
        keep = keep & (fill < SC)
    if STOP_FULL == 2:
        keep = keep & row_on[None, :]
    _put_in_layout(slot_base + fill.to(tl.int64) * BN, key, keep, False, ASM_STORE)
    fill += keep.to(tl.int32)
    mono_lo = tl.minimum(mono_lo, mono)
    mono_hi = tl.maximum(mono_hi, mono)
    return fill, mono_lo, mono_hi, nan_seen


@triton.jit
def hytopk_scan_kernel(
    q_ptr, k_ptr, k_desc, w_ptr, start_ptr, buf_ptr, cnt_ptr, th_ptr, nan_ptr, dbg_ptr, redo_ptr,
    list_ptr, n_list_ptr, S, T, I0, R, SEG0, LOCAL_TILES, KS, NK,
    s_qb, s_qs, s_qh, s_qd, s_kb, s_kt, s_kd, s_wb, s_ws, s_wh, s_sb, s_ss,
    H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    BQ: tl.constexpr, BN: tl.constexpr, SC: tl.constexpr, SEG: tl.constexpr,
    RELU: tl.constexpr, CHECK_NAN: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    SCORE_ONLY: tl.constexpr, TMA: tl.constexpr, ASM_STORE: tl.constexpr, STOP_FULL: tl.constexpr,
):  # fmt: skip
    """Scores tiles ``[SEG0, SEG0 + SEG)`` of the key windows of BQ query rows (queries I0 + [0, R)
    of batch program_id(1)) and appends every key >= the row's threshold ``th[b, r]`` to the row's
    slotted buffer ``buf[b, r]`` (SC * BN keys); the slot fill counts live in ``cnt[b, r, 0:BN]``
    between launches. The caller refines full rows between launches, so no slot overflows here.

    ``KS`` > 1 scores a sample instead (the threshold pre-pass, ``host``): the NK keys behind k are
    every KS-th key of the sequence, key j standing at position j * KS, and a row sees the samples
    inside its window; stored indices are sample numbers. ``KS`` = 1 and NK = T is the plain scan.

    ``STOP_FULL`` > 0: the launch covers whole windows with no refine to make room (after the
    pre-pass, whose thresholds need not rise), and a full slot takes no more keys. 1: a row that
    filled a slot is flagged in ``redo[b, r]`` for a second chance (``hytopk_redo_kernel`` raises its
    threshold to the K-th key it holds, a lower bound of its true K-th key, and empties it). 2: only flagged rows
    scan, and one that fills a slot again leaves with an empty buffer (fill counts 0), so
    ``hytopk_short_rows_kernel`` lists it and the rescue rebuilds it: exact, no key dropped unseen.
    The flagged rows come as a list (``list[b, 0:n_list[b]]``, ascending, from
    ``hytopk_flagged_rows_kernel``), BQ of them a program, so a program's key tiles serve BQ
    flagged rows of similar windows instead of the one or two flagged among BQ neighbours."""
    b = tl.program_id(1)
    rq = tl.arange(0, BQ)
    jj = tl.arange(0, BN)
    cols = tl.arange(0, BQ * HP)
    # The block's queries, transposed: N = BQ * HP columns of (query, head). On Hopper a thread of
    # the wgmma accumulator holds every 8-column group's column pair 2 * (lane % 4) + {0, 1}. With
    # BQ a multiple of 4, column c = ((gq * HP / 2 + gh) * 4 + l) * 2 + e holds query gq * 4 + l
    # and head gh * 2 + e, so a thread holds all heads of one query: the head sum needs no shuffles
    # and each (key, query) score lives in one thread, not four (the selection that follows ran 4x
    # redundantly with the plain order c = query * HP + head, which smaller BQ keeps). gq is the
    # outermost digit, so warpgroups that split N still own whole queries.
    if BQ % 4 == 0:
        c_q = (cols // (4 * HP)) * 4 + (cols // 2) % 4
        c_h = ((cols // 8) % (HP // 2)) * 2 + cols % 2
    else:
        c_q = cols // HP
        c_h = cols % HP
    if STOP_FULL == 2:  # listed rows; R marks an empty place (a program past the list has none)
        n_list = tl.load(n_list_ptr + b)
        grp = tl.cdiv(n_list, BQ) - 1 - tl.program_id(0)  # the latest (longest) rows first
        at = grp * BQ + rq  # grp < 0 puts every place below 0 (masks as blocks: see row_on below)
        r_loc = tl.load(list_ptr + b * R + at, mask=(at >= 0) & (at < n_list), other=R)
        at_c = grp * BQ + c_q
        c_r = tl.load(list_ptr + b * R + at_c, mask=(at_c >= 0) & (at_c < n_list), other=R)
    else:
        blk = tl.cdiv(R, BQ) - 1 - tl.program_id(0)  # longest (latest) rows first: better tail balance
        r_loc = blk * BQ + rq
        c_r = blk * BQ + c_q
    row_ok = r_loc < R
    qi = I0 + r_loc
    start = (tl.load(start_ptr + b * s_sb + qi * s_ss, mask=row_ok, other=0) + KS - 1) // KS
    end = tl.where(row_ok, (T - S + qi) // KS, -1)  # inclusive; query i sits at key position T - S + i
    live = row_ok & (start <= end)
    lo = tl.min(tl.where(live, start, T))
    hi = tl.max(tl.where(live, end, -1))
    first = lo // BN
    last = hi // BN
    n_tiles = tl.where(hi >= lo, last - first + 1, 0)
    n_local = tl.minimum(n_tiles, LOCAL_TILES)
    # busy: this block's windows reach tile SEG0 (else only masked ops run). Compared as a block,
    # not a scalar: the interpreter turns scalar-bool & block-bool into an int mask.
    row_on = row_ok & ((rq * 0 + n_tiles) > SEG0)

    c_ok = (c_r < R) & (c_h < H) & ((cols * 0 + n_tiles) > SEG0)
    d = tl.arange(0, DP)
    q_rows = q_ptr + b * s_qb + (I0 + c_r).to(tl.int64) * s_qs + c_h * s_qh
    qT = tl.load(q_rows[None, :] + d[:, None] * s_qd, mask=c_ok[None, :] & (d[:, None] < D), other=0.0)
    w_rows = w_ptr + b * s_wb + (I0 + c_r).to(tl.int64) * s_ws + c_h * s_wh
    wv = tl.load(w_rows, mask=c_ok, other=0.0)
    if UPCAST:
        qT = qT.to(tl.float32)

    row_base = (b * R + r_loc).to(tl.int64)
    buf_rows = buf_ptr + row_base * (SC * BN)  # [BQ] row buffers
    # the rows' state from the previous launch: threshold tau as (mono, largest index that ties)
    # and fill[j, r] = keys in slot j of row r
    th_mono = tl.load(th_ptr + row_base * 4, mask=row_on, other=0)
    th_idx = tl.load(th_ptr + row_base * 4 + 1, mask=row_on, other=0)
    th_key = _sort_key(th_mono, th_idx)  # _key_bounds' tau
    # smallest / largest mono this launch scores, per (key offset, row): a range holding every key
    # it stores (unmasked: one op per score, and a wider range is still a valid bound), so the
    # refine and finalize kernels start their radix selects without a min/max pass
    mono_lo = tl.full([BN, BQ], _I32_MAX, tl.int32)
    mono_hi = tl.full([BN, BQ], _I32_MIN, tl.int32)
    cnt_at = cnt_ptr + row_base[None, :] * BN + jj[:, None]
    fill = tl.load(cnt_at, mask=row_on[None, :], other=0)
    # entry 0 of slot j of row r (an append's address is then one multiply-add from fill)
    slot_base = buf_rows[None, :] + jj[:, None]
    # the block's windows' common part: a tile inside it needs no visibility test per score
    # (every row live, else an edge tile for all: a dead row's vis is what keeps it empty)
    start_max = tl.max(tl.where(live, start, T))
    end_min = tl.min(tl.where(live, end, -1))
    nan_seen = tl.zeros([BQ], tl.int32)
    if CHECK_NAN:
        nan_seen = tl.load(nan_ptr + b * R + r_loc, mask=row_on, other=0)
    if SCORE_ONLY:
        score_sum = tl.load(dbg_ptr + b * R + r_loc, mask=row_on, other=0.0)

    # The tile loop is the kernel's only loop, so Triton software-pipelines it (key tiles through
    # the copy engine with TMA: on an H200 at T = 128K the scan took 143-146 ms against 150-154 ms
    # with pointer loads, which also hold address registers; 3 stages or 2x the queries per program
    # were slower: shared memory and registers then allow fewer programs per SM); keeping the refine
    # (radix select + compaction) in another kernel also keeps its registers and shared memory
    # from lowering this kernel's occupancy (on an H200 the scan was register-limited with it inside).
    for it in range(SEG0, tl.minimum(SEG0 + SEG, n_tiles)):
        # The tiles next to the diagonal first (recent keys are usually the strongest, so tau
        # rises early), then the rest of the window ascending (later ties lose: few re-entries).
        if it < n_local:
            tile = last - it
        else:
            tile = first + (it - n_local)
        offs_n = tile * BN + jj
        if TMA:  # a [1, BN, DP] box of the [B, T, D] keys (k_desc); the copy engine zero-fills past T and D
            kt = tl.reshape(k_desc.load([b, tile * BN, 0]), (BN, DP))
        else:
            k_rows = k_ptr + b * s_kb + offs_n.to(tl.int64) * s_kt
            kt = tl.load(k_rows[:, None] + d[None, :] * s_kd, mask=(offs_n[:, None] < NK) & (d[None, :] < D), other=0.0)
        # acc[key, query x head]: the head sum stays inside each thread's accumulator registers
        acc = _head_logits(kt, qT, RELU, IEEE, UPCAST) * wv[None, :]
        if HP != H:
            acc = tl.where(c_h[None, :] < H, acc, 0.0)  # padded heads add nothing (not even NaN)
        if BQ % 4 == 0:  # [BN, BQ] indexer scores: sum over (gh, e), keep (gq, l)
            sc = tl.sum(tl.sum(tl.reshape(acc, (BN, BQ // 4, HP // 2, 4, 2)), axis=4), axis=2)
            sc = tl.reshape(sc, (BN, BQ))
        else:
            sc = tl.sum(tl.reshape(acc, (BN, BQ, HP)), axis=2)
        if SCORE_ONLY:
            vis = (offs_n[:, None] >= start[None, :]) & (offs_n[:, None] <= end[None, :])
            score_sum += tl.sum(tl.where(vis, sc, 0.0), axis=0)
        elif (tile * BN >= start_max) & (tile * BN + BN - 1 <= end_min):  # every key visible to every row
            fill, mono_lo, mono_hi, nan_seen = _append_keys(
                sc, offs_n, start, end, th_key, fill, slot_base, mono_lo, mono_hi, nan_seen, row_on,
                BN, SC, False, CHECK_NAN, ASM_STORE, STOP_FULL,
            )  # fmt: skip
        else:  # a tile on a window's edge (the causal diagonal, a window's start)
            fill, mono_lo, mono_hi, nan_seen = _append_keys(
                sc, offs_n, start, end, th_key, fill, slot_base, mono_lo, mono_hi, nan_seen, row_on,
                BN, SC, True, CHECK_NAN, ASM_STORE, STOP_FULL,
            )  # fmt: skip

    if STOP_FULL > 0:  # a full slot may have turned keys away
        full = tl.max((fill >= SC).to(tl.int32), axis=0)
        if STOP_FULL == 1:  # a second chance
            tl.store(redo_ptr + b * R + r_loc, full, mask=row_on & (full > 0))
        else:  # the rescue (fill 0 lists the row)
            fill = tl.where(full[None, :] > 0, 0, fill)
    tl.store(cnt_at, fill, mask=row_on[None, :])
    if not SCORE_ONLY:
        rng = th_ptr + row_base * 4 + 2
        tl.store(rng, tl.minimum(tl.load(rng, mask=row_on, other=0), tl.min(mono_lo, axis=0)), mask=row_on)
        rng += 1
        tl.store(rng, tl.maximum(tl.load(rng, mask=row_on, other=0), tl.max(mono_hi, axis=0)), mask=row_on)
    if CHECK_NAN:
        tl.store(nan_ptr + b * R + r_loc, nan_seen, mask=row_on)
    if SCORE_ONLY:
        tl.store(dbg_ptr + b * R + r_loc, score_sum, mask=row_on)


@triton.jit
def _empty_row(th_row, cnt_row, NS: tl.constexpr):
    """A row's buffer and stored key range emptied (its threshold kept), as a scan starts it."""
    tl.store(th_row + 2, _I32_MAX)
    tl.store(th_row + 3, _I32_MIN)
    tl.store(cnt_row + tl.arange(0, NS), tl.zeros([NS], tl.int32))


@triton.jit
def hytopk_refine_kernel(
    buf_ptr, cnt_ptr, th_ptr, refine_ptr, R, K, SLACK, LIMIT,
    NS: tl.constexpr, SC: tl.constexpr, OB: tl.constexpr, LOG_NB: tl.constexpr, ASM_STORE: tl.constexpr,
    PRESAMPLE: tl.constexpr,
):  # fmt: skip
    """Refines row program_id(0) of batch program_id(1) if a slot holds more than LIMIT keys: a new
    threshold with K <= #{keys >= tau} <= K + SLACK (exact: no key below it can be in the top K),
    the survivors compacted to the front (a balanced slot layout) and the row's tau raised.

    ``PRESAMPLE``: the threshold pre-pass's refine (SLACK = 0, every row): tau becomes the row's K-th
    sample key (or stays the smallest key with K samples or fewer) with every key of its score passing
    (tau index = max), and the buffer and stored range start empty, as the main scan expects: the
    samples themselves are not kept, so nothing is compacted. Its select runs the later radix levels
    over a copy of the r-th sample's bucket, placed past the samples (``_exact_threshold``)."""
    row = (tl.program_id(1) * R + tl.program_id(0)).to(tl.int64)
    slots = tl.load(cnt_ptr + row * NS + tl.arange(0, NS))
    row_ptr = buf_ptr + row * (SC * NS)
    if PRESAMPLE:  # the buffer past its deepest slot is free: the select's candidate copy goes there
        depth = tl.max(slots)
        tau = _exact_threshold(row_ptr, th_ptr + row * 4, slots, K, row_ptr + depth * NS, (SC - depth) * NS,
                               NS, OB, LOG_NB, ASM_STORE)  # fmt: skip
        tl.store(th_ptr + row * 4, (tau >> 32).to(tl.int32))
        tl.store(th_ptr + row * 4 + 1, _I32_MAX)  # tau index
        _empty_row(th_ptr + row * 4, cnt_ptr + row * NS, NS)
    elif tl.max(slots) > LIMIT:
        tau = _row_threshold(row_ptr, th_ptr + row * 4, slots, K, SLACK, NS, OB, LOG_NB)  # n <= K: only rebalance
        kept = _compact(row_ptr, slots, tau, _I64_MAX, row_ptr, NS, OB, ASM_STORE)
        t_hi = tau >> 32
        t_idx = tl.minimum(_key_index(tau), _I32_MAX)
        tl.store(th_ptr + row * 4, t_hi.to(tl.int32))
        tl.store(th_ptr + row * 4 + 1, t_idx.to(tl.int32))
        tl.store(cnt_ptr + row * NS + tl.arange(0, NS), _balanced_slots(kept, NS))
        tl.store(refine_ptr + row, tl.load(refine_ptr + row) + 1)


@triton.jit
def hytopk_redo_kernel(
    buf_ptr, cnt_ptr, th_ptr, list_ptr, n_list_ptr, R, K,
    NS: tl.constexpr, SC: tl.constexpr, OB: tl.constexpr, LOG_NB: tl.constexpr,
):  # fmt: skip
    """The second chance of the rows the one-launch scan flagged full (``list[b, 0:n_list[b]]``, from
    ``hytopk_flagged_rows_kernel``; batch program_id(1), persistent over the list): tau rises to the
    K-th key the row holds (keys of a part of its window, so no larger than its true K-th key; with K
    keys or fewer it stays), and the buffer and stored range start empty for the rescan. Walking the
    list spares launching a program for every row of the chunk when few or none are flagged."""
    b = tl.program_id(1)
    for i in range(tl.program_id(0), tl.load(n_list_ptr + b), tl.num_programs(0)):
        row = (b * R + tl.load(list_ptr + b * R + i)).to(tl.int64)
        slots = tl.load(cnt_ptr + row * NS + tl.arange(0, NS))
        if tl.sum(slots) > K:
            tau = _row_threshold(buf_ptr + row * (SC * NS), th_ptr + row * 4, slots, K, 0, NS, OB, LOG_NB)
            tl.store(th_ptr + row * 4, (tau >> 32).to(tl.int32))
            tl.store(th_ptr + row * 4 + 1, tl.minimum(_key_index(tau), _I32_MAX).to(tl.int32))
        _empty_row(th_ptr + row * 4, cnt_ptr + row * NS, NS)


@triton.jit
def hytopk_finalize_kernel(
    buf_ptr, cnt_ptr, th_ptr, bm_ptr, rw_ptr, idx_ptr, score_ptr, lse_ptr,
    I0, R, S, K, KOUT, n_rows, n_words, CAND, s_ib, s_is, s_ob, s_os,
    NS: tl.constexpr, SC: tl.constexpr, OB: tl.constexpr, LOG_NB: tl.constexpr, BLOCK_W: tl.constexpr,
    WRITE_SCORES: tl.constexpr, WRITE_LSE: tl.constexpr, ASM_STORE: tl.constexpr, L1_BUF: tl.constexpr,
):  # fmt: skip
    """Exact top K of each row's buffer in index order: int32 indices (+ fp32 scores), -1 / -inf padded;
    with ``WRITE_LSE`` also the log-sum-exp of the kept scores, fp32 [B, S] (-inf without a kept key, NaN
    with a NaN score): the indexer KL's normaliser over the selection, from scores this pass holds anyway.

    Persistent: program p handles rows p, p + P, ... of the B * R rows (P = the grid) with its own
    scratch: a bitmap of ``n_words`` int32 (all zero between rows) and ``n_words`` int64 words
    ``rank << 32 | bits``, whose first CAND (<= n_words) first hold the threshold's candidate keys
    (``_exact_threshold``; CAND = 0 keeps every radix level on the buffer). Index order comes from
    the bitmap, not a sort (keys are unique indices below T): the kept keys OR their bits in, a
    prefix sum of popcounts over the words gives each word's first rank, and a key's output slot is
    ``rank[word] + set bits below it``. On an H200 the
    earlier compaction + in-register sort of K keys was 60% of this kernel, with heavy bank conflicts.
    ``L1_BUF``: the passes over a row's buffer (first radix level, bucket copy, marking, writing) read
    it through L1, so the later ones can hit there (``_load_slots``).
    """
    pid = tl.program_id(0)
    bm = bm_ptr + pid.to(tl.int64) * n_words
    rw = rw_ptr + pid.to(tl.int64) * n_words
    for rr in range(pid, n_rows, tl.num_programs(0)):
        b = rr // R
        r = rr % R
        row = (b * R + r).to(tl.int64)
        row_ptr = buf_ptr + row * (SC * NS)
        slots = tl.load(cnt_ptr + row * NS + tl.arange(0, NS))
        # exactly K keys >= tau, or all; the word table is free until the ranks below: it holds the candidates
        tau = _exact_threshold(row_ptr, th_ptr + row * 4, slots, K, rw, CAND, NS, OB, LOG_NB, ASM_STORE, L1_BUF)
        depth = tl.max(slots)
        # the word range the kept keys span and (WRITE_LSE) their largest score's mono, per element
        # until the loop ends: one reduction a row instead of one a step (each a round through shared memory)
        w_lo = tl.full([OB, NS], _I32_MAX, tl.int32)
        w_hi = tl.full([OB, NS], -1, tl.int32)
        m_hi = tl.full([OB, NS], _I32_MIN, tl.int32)
        for ob in range(0, depth, OB):  # kept keys -> bitmap
            x, keep, idx = _kept_keys(row_ptr, slots, ob, tau, NS, OB, L1_BUF)
            _put_in_layout(bm + (idx >> 5), 1 << (idx & 31), keep, True, ASM_STORE)
            w_lo = tl.minimum(w_lo, tl.where(keep, idx >> 5, _I32_MAX))
            w_hi = tl.maximum(w_hi, tl.where(keep, idx >> 5, -1))
            if WRITE_LSE:
                m_hi = tl.maximum(m_hi, tl.where(keep, (x >> 32).to(tl.int32), _I32_MIN))
        w_lo = tl.min(w_lo)
        w_hi = tl.max(w_hi)
        if WRITE_LSE:  # the exponent reference: the largest kept score (kept scores are finite or NaN-ranked)
            m_mono = tl.max(m_hi)
            m_row = tl.where(m_mono > _NAN_MONO, _mono_score(m_mono), 0.0)
        tl.debug_barrier()
        kept = tl.zeros([], tl.int32)
        for w0 in range(w_lo, w_hi + 1, BLOCK_W):  # first rank of each word; the bitmap back to 0
            offs = w0 + tl.arange(0, BLOCK_W)
            mw = offs <= w_hi
            word = tl.load(bm + offs, mask=mw, other=0, cache_modifier=".cg")
            rank, kept = word_ranks(word, kept, ASM_STORE)
            tl.store(rw + offs, (rank.to(tl.int64) << 32) | (word.to(tl.int64) & 0xFFFFFFFF), mask=mw)
            tl.store(bm + offs, tl.zeros_like(word), mask=mw)
        tl.debug_barrier()
        out_idx = idx_ptr + b * s_ib + (I0 + r).to(tl.int64) * s_is
        out_score = score_ptr + b * s_ob + (I0 + r).to(tl.int64) * s_os
        # WRITE_LSE: sums of exp(score - m_row) per element; a NaN-ranked key's score is a NaN, so it
        # makes its sum NaN
        l_el = tl.zeros([OB, NS], tl.float32)
        for ob in range(0, depth, OB):  # each kept key to its slot in index order
            x, keep, idx = _kept_keys(row_ptr, slots, ob, tau, NS, OB, L1_BUF)
            v = tl.load(rw + (idx >> 5), mask=keep, other=0, cache_modifier=".cg")
            slot = bit_slot((v >> 32).to(tl.int32), v.to(tl.int32), idx & 31, ASM_STORE)
            _put_in_layout(out_idx + slot, idx, keep, False, ASM_STORE)
            if WRITE_SCORES or WRITE_LSE:
                score = _mono_score((x >> 32).to(tl.int32))
                if WRITE_SCORES:
                    _put_in_layout(out_score + slot, score, keep, False, ASM_STORE)
                if WRITE_LSE:
                    l_el += tl.where(keep, tl.exp(score - m_row), 0.0)
        if WRITE_LSE:
            l_row = tl.sum(l_el)
            lse = tl.where(l_row != l_row, float("nan"), lse_value(m_row, l_row, float("-inf"), False))
            tl.store(lse_ptr + b * S + I0 + r, lse)
        for p0 in range(kept, KOUT, BLOCK_W):  # fewer than K visible keys: pad
            offs = p0 + tl.arange(0, BLOCK_W)
            tl.store(out_idx + offs, tl.full([BLOCK_W], -1, tl.int32), mask=offs < KOUT)
            if WRITE_SCORES:
                tl.store(out_score + offs, tl.full([BLOCK_W], float("-inf"), tl.float32), mask=offs < KOUT)
        tl.debug_barrier()  # the next row reuses the scratch


@triton.jit
def _rescored_keys(
    k_ptr, qT, wv, n0, start, end, T, s_kt, s_kd,
    H: tl.constexpr, HR: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BK: tl.constexpr,
    RELU: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """One query row's keys ``n0 + [0, BK)``, scored as the scan scores them: int64 keys, monos and
    which of them the row sees."""
    offs_n = n0 + tl.arange(0, BK)
    d = tl.arange(0, DP)
    kt = tl.load(k_ptr + offs_n[:, None].to(tl.int64) * s_kt + d[None, :] * s_kd,
                 mask=(offs_n[:, None] < T) & (d[None, :] < D), other=0.0)  # fmt: skip
    acc = tl.where(tl.arange(0, HR)[None, :] < H, _head_logits(kt, qT, RELU, IEEE, UPCAST) * wv[None, :], 0.0)
    sc = tl.sum(acc, axis=1)
    bits = sc.to(tl.int32, bitcast=True)
    bits = tl.where(bits == _I32_MIN, 0, bits)
    mono = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    mono = tl.where(tl.abs(sc) < float("inf"), mono, _NAN_MONO)
    return _sort_key(mono, offs_n), mono, (offs_n >= start) & (offs_n <= end)


@triton.jit
def hytopk_short_rows_kernel(
    cnt_ptr, start_ptr, rows_ptr, n_ptr, stat_ptr, S, T, I0, R, K, n_rows, s_sb, s_ss,
    NS: tl.constexpr, BR: tl.constexpr,
):  # fmt: skip
    """Lists the rows (of the chunk's n_rows = B * R) whose buffer holds fewer keys than their top K,
    i.e. whose threshold pre-pass estimate lay above their K-th key, or which filled a slot twice (the
    scan's ``STOP_FULL`` = 2 empties them): their numbers go to
    ``rows_ptr[0:n]``, n to ``n_ptr`` (zero before the launch) and to ``stat_ptr`` (a running count).

    A small kernel of its own so that the rescue, which holds many registers, only starts programs
    for rows that need it: its persistent walk over every row took 1.4 ms per call at 128K (H100) with
    nothing to rescue."""
    rr = tl.program_id(0) * BR + tl.arange(0, BR)
    ok = rr < n_rows
    r = rr % R
    qi = I0 + r
    slots = cnt_ptr + rr.to(tl.int64)[:, None] * NS + tl.arange(0, NS)[None, :]
    held = tl.sum(tl.load(slots, mask=ok[:, None], other=0), 1)
    start = tl.load(start_ptr + (rr // R) * s_sb + qi * s_ss, mask=ok, other=0)
    need = tl.minimum(K, tl.maximum(T - S + qi - start + 1, 0))
    short = (ok & (held < need)).to(tl.int32)
    n_short = tl.sum(short)
    if n_short > 0:
        first = tl.atomic_add(n_ptr, n_short)
        tl.store(rows_ptr + first + tl.cumsum(short, 0) - short, rr, mask=short > 0)
        tl.atomic_add(stat_ptr, n_short.to(tl.int64))


@triton.jit
def hytopk_flagged_rows_kernel(redo_ptr, rows_ptr, n_ptr, R, BR: tl.constexpr):
    """Lists batch program_id(0)'s rows that the one-launch scan flagged full (``redo[b, r]`` > 0) in
    ascending order: ``rows[b, 0:n]``, n to ``n_ptr[b]``. One program walks the batch's R rows, so
    the list is sorted (neighbouring entries have windows of similar length, which the second pass's
    programs share) and needs no atomics or zeroing."""
    b = tl.program_id(0)
    n = 0
    for r0 in range(0, R, BR):
        r = r0 + tl.arange(0, BR)
        flag = (tl.load(redo_ptr + b * R + r, mask=r < R, other=0) > 0).to(tl.int32)
        tl.store(rows_ptr + b * R + n + tl.cumsum(flag, 0) - flag, r, mask=flag > 0)
        n += tl.sum(flag)
    tl.store(n_ptr + b, n)


@triton.jit
def hytopk_rescue_kernel(
    q_ptr, k_ptr, w_ptr, start_ptr, buf_ptr, cnt_ptr, th_ptr, rows_ptr, n_ptr,
    S, T, I0, R, K,
    s_qb, s_qs, s_qh, s_qd, s_kb, s_kt, s_kd, s_wb, s_ws, s_wh, s_sb, s_ss,
    H: tl.constexpr, HR: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, NS: tl.constexpr, SC: tl.constexpr,
    BK: tl.constexpr, LOG_NB: tl.constexpr, RELU: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    ASM_STORE: tl.constexpr,
):  # fmt: skip
    """Completes every row that ``hytopk_short_rows_kernel`` listed (``rows_ptr[0:n_ptr[0]]``): its
    buffer holds fewer keys than its top K because the threshold pre-pass's estimate lay above the
    row's K-th key, or because its keys filled a slot in both one-launch scans (``host``: both rare by design).

    Such a row's buffer holds only keys above its true K-th key, so it is rebuilt from the keys
    themselves: a radix select whose every level rescores the row's window (no buffer can hold it),
    then its K keys >= the exact K-th key written to the front of the buffer (a balanced slot layout)
    and the row state set as a refine sets it. Persistent: program p takes listed rows p, p + P, ...;
    with an empty list every program returns at once."""
    for w in range(tl.program_id(0), tl.load(n_ptr), tl.num_programs(0)):
        rr = tl.load(rows_ptr + w)
        _rescue_row(
            q_ptr, k_ptr, w_ptr, start_ptr, buf_ptr, cnt_ptr, th_ptr, S, T, I0, R, K, rr // R, rr % R,
            s_qb, s_qs, s_qh, s_qd, s_kb, s_kt, s_kd, s_wb, s_ws, s_wh, s_sb, s_ss,
            H, HR, D, DP, NS, SC, BK, LOG_NB, RELU, IEEE, UPCAST, ASM_STORE,
        )  # fmt: skip


@triton.jit
def _rescue_row(
    q_ptr, k_ptr, w_ptr, start_ptr, buf_ptr, cnt_ptr, th_ptr, S, T, I0, R, K, b, r,
    s_qb, s_qs, s_qh, s_qd, s_kb, s_kt, s_kd, s_wb, s_ws, s_wh, s_sb, s_ss,
    H: tl.constexpr, HR: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, NS: tl.constexpr, SC: tl.constexpr,
    BK: tl.constexpr, LOG_NB: tl.constexpr, RELU: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    ASM_STORE: tl.constexpr,
):  # fmt: skip
    """``hytopk_rescue_kernel`` on row r of batch b (listed: it holds fewer keys than its top K)."""
    row = (b * R + r).to(tl.int64)
    qi = I0 + r
    start = tl.load(start_ptr + b * s_sb + qi * s_ss)
    end = T - S + qi
    n_vis = tl.maximum(end - start + 1, 0)
    need = tl.minimum(K, n_vis)
    h = tl.arange(0, HR)
    d = tl.arange(0, DP)
    q_row = q_ptr + b * s_qb + qi.to(tl.int64) * s_qs
    qT = tl.load(q_row + h[None, :] * s_qh + d[:, None] * s_qd, mask=(h[None, :] < H) & (d[:, None] < D), other=0.0)
    if UPCAST:
        qT = qT.to(tl.float32)
    wv = tl.load(w_ptr + b * s_wb + qi.to(tl.int64) * s_ws + h * s_wh, mask=h < H, other=0.0)
    k_seq = k_ptr + b * s_kb
    n_lo = start // BK * BK
    m_lo = tl.full([], _I32_MAX, tl.int32)  # the monos' range bounds the first level
    m_hi = tl.full([], _I32_MIN, tl.int32)
    for n0 in range(n_lo, end + 1, BK):
        _, mono, vis = _rescored_keys(k_seq, qT, wv, n0, start, end, T, s_kt, s_kd, H, HR, D, DP, BK, RELU, IEEE, UPCAST)
        m_lo = tl.minimum(m_lo, tl.min(tl.where(vis, mono, _I32_MAX)))
        m_hi = tl.maximum(m_hi, tl.max(tl.where(vis, mono, _I32_MIN)))
    lo = m_lo.to(tl.int64) << 32
    hi = ((m_hi.to(tl.int64) + 1) << 32) - 1
    tau = tl.full([], _I64_MIN, tl.int64)  # need = every visible key: keep them all
    if need < n_vis:
        above = tl.zeros([], tl.int32)
        done = tl.zeros([], tl.int32)
        while done == 0:  # _select_threshold with SLACK = 0, each level rescoring the window
            s, base = _level_digits(lo, hi, LOG_NB)
            hist = tl.zeros([1 << LOG_NB], tl.int32)
            for n0 in range(n_lo, end + 1, BK):
                key, _, vis = _rescored_keys(
                    k_seq, qT, wv, n0, start, end, T, s_kt, s_kd, H, HR, D, DP, BK, RELU, IEEE, UPCAST
                )
                hist += _bucket_counts(key, vis & (key >= lo) & (key <= hi), s, base, LOG_NB)
            done, lo, above, hi = _level_pick(hist, above, need, 0, lo, hi, s, base, LOG_NB)
        tau = lo
    row_ptr = buf_ptr + row * (SC * NS)
    kept = tl.zeros([], tl.int32)
    for n0 in range(n_lo, end + 1, BK):
        key, _, vis = _rescored_keys(k_seq, qT, wv, n0, start, end, T, s_kt, s_kd, H, HR, D, DP, BK, RELU, IEEE, UPCAST)
        keep = (vis & (key >= tau)).to(tl.int32)
        _put_in_layout(row_ptr + kept + tl.cumsum(keep, 0) - keep, key, keep > 0, False, ASM_STORE)
        kept += tl.sum(keep)
    tl.store(cnt_ptr + row * NS + tl.arange(0, NS), _balanced_slots(kept, NS))
    tl.store(th_ptr + row * 4, (tau >> 32).to(tl.int32))
    tl.store(th_ptr + row * 4 + 1, tl.minimum(_key_index(tau), _I32_MAX).to(tl.int32))
    tl.store(th_ptr + row * 4 + 2, m_lo)
    tl.store(th_ptr + row * 4 + 3, m_hi)
