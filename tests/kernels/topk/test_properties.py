"""Property-based tests of hytopk (hypothesis): both backends on drawn inputs, degenerate ones included.

Shapes: B, S in {0, 1, small}, T >= S, H in {1, 2, 3, 5, 32, 64}, odd head dims, topk around T,
windows (window_start [B] or [B, S], past the query too) and packed sequences (cu_seqlens).
Values are exact: small integers times powers of two (so every product and partial sum is exact
in fp32 and any summation order gives the same bits), with ties, zeros, -0.0, NaN, +-inf and huge
ranges (scales up to 2**64, where products overflow: the non-finite rule of docs/design.md
section 2). The torch backend is checked against a brute-force sort (``topk_cases``), the Triton
backend bit for bit against the torch reference (``naive.hytopk_reference``); bad sizes must
raise an error that names the argument. The budget is the hypothesis profile's
(tests/support/hypothesis_profiles.py).
"""

import pytest
import torch
from hypothesis import example, given, note
from hypothesis import strategies as st

from hyscale_hf.kernels import hytopk
from hyscale_hf.kernels.topk import HyTopKConfig, host, hytopk_triton
from hyscale_hf.kernels.topk.naive import hytopk_reference, indexer_scores
from hyscale_hf.kernels.windows import query_windows
from tests.support.hytopk_cases import assert_same
from tests.support.topk_cases import brute_force_topk

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy under the interpreter: inf - inf
HEADS = [1, 2, 3, 5, 32, 64]
DIMS = [1, 3, 5, 8, 16, 24, 33]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
MODS = ["zeros", "signed_zeros", "ties", "nan", "inf", "huge"]
# 16-key tiles and slots ceil(K / 16) + 2 deep: rows longer than 3 tiles are refined
TINY_BUFFER = {"config": HyTopKConfig(BQ=2, BN=16, CH=8), "cap": 1}


def scales(dtype, g):
    """Power-of-two exponents (a, b, c) for q, k, w: exact products, and either no overflow
    anywhere (a + b <= 94) or an overflow of every nonzero product (a + b = 128), never in
    between, where it would depend on the summation order. fp16 holds only small exponents;
    tensor cores (bf16/fp16 on a GPU) are not relied on for overflow."""
    if dtype == torch.float16:
        e = [-8, 0, 8]
    elif dtype == torch.float32 or DEV == "cpu":
        e = [-30, 0, 30, 64]
    else:
        e = [-30, 0, 30]
    pick = lambda choices: choices[int(torch.randint(len(choices), (1,), generator=g))]
    return pick(e), pick(e), pick([-20, 0, 16])


def sprinkle(x, value, g, frac=0.1):
    if x.numel() == 0:
        return x
    return torch.where(torch.rand(x.shape, generator=g) < frac, torch.tensor(value), x)


@st.composite
def hytopk_cases(draw):
    B = draw(st.sampled_from([0, 1, 1, 2]))
    S = draw(st.sampled_from([0, 1]) | st.integers(2, 10))
    T = S + draw(st.sampled_from([0, 1]) | st.integers(2, 12))
    H = draw(st.sampled_from(HEADS))
    D = draw(st.sampled_from(DIMS))
    dtype = draw(st.sampled_from(DTYPES))
    topk = draw(st.sampled_from(["1", "T-1", "T", "T+1", "any"]))
    topk = {"1": 1, "T-1": max(1, T - 1), "T": max(1, T), "T+1": T + 1}.get(topk) or draw(st.integers(1, 2 * T + 3))
    windows = draw(st.sampled_from(["none", "ws[B]", "ws[B,S]", "packed"]))
    if windows == "packed" and not (B == 1 and S == T):
        windows = "none"
    mods = draw(st.sets(st.sampled_from(MODS), max_size=2))
    return dict(
        B=B, S=S, T=T, H=H, D=D, dtype=dtype, topk=topk, windows=windows, mods=sorted(mods),
        relu=draw(st.booleans()), tiny_buffer=draw(st.booleans()), seed=draw(st.integers(0, 2**16)),
    )  # fmt: skip


def build(case):
    B, S, T, H, D, dtype = (case[n] for n in ("B", "S", "T", "H", "D", "dtype"))
    g = torch.Generator().manual_seed(case["seed"])
    q = torch.randint(-3, 4, (B, S, H, D), generator=g).float()
    k = torch.randint(-3, 4, (B, T, D), generator=g).float()
    w = torch.randint(-4, 5, (B, S, H), generator=g).float() / 8
    mods = case["mods"]
    if "zeros" in mods:  # most scores exactly 0: ties far beyond K
        q = q * (torch.rand(q.shape, generator=g) < 0.3)
        k = k * (torch.rand(k.shape, generator=g) < 0.3)
    if "signed_zeros" in mods:
        q = sprinkle(q, -0.0, g, 0.3)
        w = sprinkle(w, -0.0, g, 0.3)
    if "ties" in mods and T > 1:  # repeated keys: equal scores at different indices
        k = k[:, torch.randint(0, max(1, T // 3), (T,), generator=g)]
    if "huge" in mods:
        a, b, c = scales(dtype, g)
        q, k, w = q * 2.0**a, k * 2.0**b, w * 2.0**c
    if "nan" in mods:
        which = int(torch.randint(3, (1,), generator=g))
        q, k, w = [sprinkle(x, float("nan"), g, 0.05) if i == which else x for i, x in enumerate((q, k, w))]
    if "inf" in mods:
        which = int(torch.randint(3, (1,), generator=g))
        sign = 1.0 if int(torch.randint(2, (1,), generator=g)) else -1.0
        q, k, w = [sprinkle(x, sign * float("inf"), g, 0.05) if i == which else x for i, x in enumerate((q, k, w))]
    kw = {}
    if case["windows"] == "ws[B]":
        kw["window_start"] = torch.randint(-2, T + 4, (B,), generator=g)
    elif case["windows"] == "ws[B,S]":
        kw["window_start"] = torch.randint(-2, T + 4, (B, S), generator=g).to(torch.int32)
    elif case["windows"] == "packed":
        cuts = torch.randint(0, T + 1, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g)
        kw["cu_seqlens"] = torch.cat([torch.tensor([0]), cuts.sort().values, torch.tensor([T])]).to(torch.int32)
    kw = {n: t.to(DEV) for n, t in kw.items()}
    return q.to(dtype).to(DEV), k.to(dtype).to(DEV), w.to(DEV), kw


def brute_force(q, k, w, topk, relu, **windows):
    """Indices by a Python sort of the reference scores (``indexer_scores``: the non-finite rule)."""
    B, S = q.shape[:2]
    T = k.shape[1]
    scores = indexer_scores(q.cpu(), k.cpu(), w.cpu(), relu=relu, **{n: t.cpu() for n, t in windows.items()})
    start, end = query_windows(B, S, T, **{n: t.cpu() for n, t in windows.items()})
    out = torch.full((B, S, topk), -1, dtype=torch.int32)
    for b in range(B):
        for i in range(S):
            vis = [int(start[b, i]) <= s <= int(end[b, i]) for s in range(T)]
            out[b, i] = torch.tensor(brute_force_topk(scores[b, i].tolist(), vis, topk), dtype=torch.int32)
    return out, scores


def _case(**kw):
    base = dict(B=1, S=6, T=9, H=2, D=8, dtype=torch.float32, topk=4, windows="none", mods=[], relu=True,
                tiny_buffer=False, seed=0)  # fmt: skip
    return base | kw


@given(case=hytopk_cases())
# explicit examples: the CI budget always covers the many-head, packed and overflowing inputs too
@example(case=_case(S=8, T=20, H=64, D=33, dtype=torch.bfloat16, topk=20, windows="ws[B,S]", mods=["ties", "zeros"],
                    tiny_buffer=True, seed=1))
@example(case=_case(S=12, T=12, H=32, D=24, dtype=torch.float16, topk=5, windows="packed", mods=["signed_zeros"],
                    relu=False, seed=2))
@example(case=_case(B=2, H=1, D=5, topk=9, windows="ws[B]", mods=["huge", "inf"], seed=3))
@example(case=_case(S=5, T=11, H=5, D=16, dtype=torch.bfloat16, topk=10, mods=["huge", "nan"], relu=False,
                    tiny_buffer=True, seed=4))
def test_property_both_backends_match_the_reference(case):
    note(repr(case))
    q, k, w, windows = build(case)
    topk, relu = case["topk"], case["relu"]
    idx, sc = hytopk(q, k, w, topk, relu=relu, return_scores=True, backend="torch", **windows)
    want, scores = brute_force(q, k, w, topk, relu, **windows)
    assert idx.shape == (case["B"], case["S"], topk) and idx.dtype == torch.int32
    assert torch.equal(idx.cpu(), want)
    gathered = scores.gather(-1, want.clamp_min(0).long()).masked_fill(want < 0, float("-inf"))
    torch.testing.assert_close(sc.cpu(), gathered, rtol=0, atol=0, equal_nan=True)
    assert not bool(torch.isinf(sc[idx >= 0]).any())  # a selected key never scores +-inf
    ref = hytopk_reference(q, k, w, topk, relu=relu, **windows)
    if host.HAS_TRITON:
        if case["tiny_buffer"]:
            got = hytopk_triton(q, k, w, topk, relu=relu, **windows, **TINY_BUFFER)
        else:
            got = hytopk(q, k, w, topk, relu=relu, return_scores=True, backend="triton", **windows)
        assert_same(got, ref, repr(case))
    visible_nan = bool(torch.isnan(scores[scores != float("-inf")]).any())
    if visible_nan or {"nan", "inf", "huge"} & set(case["mods"]):  # check_nan raises iff a visible key scores NaN
        for backend in ["torch"] + (["triton"] if host.HAS_TRITON else []):
            if visible_nan:
                with pytest.raises(ValueError, match="non-finite"):
                    hytopk(q, k, w, topk, relu=relu, check_nan=True, backend=backend, **windows)
            else:
                hytopk(q, k, w, topk, relu=relu, check_nan=True, backend=backend, **windows)


BAD = {
    "topk=0": (dict(topk=0), ValueError, "topk must be > 0"),
    "topk<0": (dict(topk=-3), ValueError, "topk must be > 0"),
    "topk=2**31": (dict(topk=2**31), ValueError, r"topk must be <= 2\*\*31 - 1"),
    "topk float": (dict(topk=2.0), TypeError, "topk must be an int"),
    "H=0": (dict(H=0), ValueError, "q must have H >= 1"),
    "D=0": (dict(D=0), ValueError, "q must have D >= 1"),
    "S>T": (dict(extra_queries=1), ValueError, "need S <= T"),
    "w fp16": (dict(w_dtype=torch.float16), TypeError, "w must have dtype"),
    "ws shape": (dict(ws_len=3), ValueError, "window_start must have shape"),
}


@given(
    bad=st.sampled_from(sorted(BAD)), backend=st.sampled_from(["torch", "triton"]),
    B=st.integers(0, 2), S=st.integers(0, 5), extra=st.integers(0, 4),
)  # fmt: skip
def test_property_bad_sizes_raise_errors_that_name_the_argument(bad, backend, B, S, extra):
    change, error, match = BAD[bad]
    T = S + extra
    H, D = change.get("H", 2), change.get("D", 8)
    S_q = T + 1 if "extra_queries" in change else S
    q = torch.zeros(B, S_q, H, D, device=DEV)
    k = torch.zeros(B, T, D, device=DEV)
    w = torch.zeros(B, S_q, H, device=DEV, dtype=change.get("w_dtype", torch.float32))
    kw = {"window_start": torch.zeros(change["ws_len"], dtype=torch.int64, device=DEV)} if "ws_len" in change else {}
    with pytest.raises(error, match=match):
        hytopk(q, k, w, change.get("topk", 3), backend=backend, **kw)
