"""Property-based tests of sparse_attention (hypothesis): both backends on drawn inputs.

Shapes: B, S, T in {0, 1, small} (T = 0: every index -1), Hq in {1, 2, 3, 5, 32, 64} over a
dividing Hkv, odd head dims (the Triton path zero-pads them), K around T, index rows with -1
holes, repeats, causal windows or nothing at all, and v a view of k (MLA-like). Values: ties
(equal keys), zeros, -0.0, NaN, +-inf and huge ranges. The torch backend is checked against a
dense fp64 oracle written here (a count-weighted softmax over all T keys, which also counts a
repeated index once per occurrence), the Triton backend against the torch reference
(``naive.sparse_attention_reference``) in forward and backward; bad sizes must raise an error
that names the argument. On the CPU interpreter the Triton inputs are fp32 (its bf16 ``tl.dot``
is not faithful); on a GPU bf16/fp16 are drawn too. Budget: the hypothesis profile
(tests/support/hypothesis_profiles.py).
"""

import math

import pytest
import torch
from hypothesis import example, given, note
from hypothesis import strategies as st

from hyscale_hf import sparse_attention
from hyscale_hf.kernels.sparse_attn import SparseAttentionConfig, host
from hyscale_hf.kernels.sparse_attn.naive import sparse_attention_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy under the interpreter: inf - inf
HEADS = {1: [1], 2: [1, 2], 3: [1, 3], 5: [1, 5], 32: [1, 2, 4], 64: [1, 2]}  # Hq: Hkv that divide it
DQK = [1, 3, 8, 16, 24, 40, 48, 80]
DV = [1, 5, 8, 16, 24]
DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if DEV == "cuda" else [])
MODS = ["zeros", "signed_zeros", "ties", "nan", "inf", "huge"]
# forward/backward tolerance of the Triton path against the reference, by input dtype
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}
# small key blocks: several per query even at these sizes; tile_rows picked per example
CONFIGS = {
    "tiled": SparseAttentionConfig(fwd={"BLOCK_N": 16}, bwd={"BLOCK_N": 16}, fwd_tiled={"BLOCK_N": 32},
                                   bwd_tiled={"BLOCK_N": 32}),
    "per-token": SparseAttentionConfig(fwd={"BLOCK_N": 16}, bwd={"BLOCK_N": 16}, tile_rows=0),
}  # fmt: skip


@st.composite
def attention_cases(draw):
    Hq = draw(st.sampled_from(sorted(HEADS)))
    v_view = draw(st.booleans())
    Dqk = draw(st.sampled_from(DQK))
    Dv = draw(st.sampled_from([d for d in DV if d <= Dqk] if v_view else DV))  # DV holds 1 <= every Dqk
    T = draw(st.sampled_from([0, 1]) | st.integers(2, 12))
    return dict(
        B=draw(st.sampled_from([0, 1, 1, 2])), S=draw(st.sampled_from([0, 1]) | st.integers(2, 8)), T=T,
        Hq=Hq, Hkv=draw(st.sampled_from(HEADS[Hq])), Dqk=Dqk, Dv=Dv, v_view=v_view,
        K=draw(st.sampled_from([1, max(1, T - 1), max(1, T), T + 1]) | st.integers(1, 2 * T + 3)),
        rows=draw(st.sampled_from(["random", "distinct", "causal", "empty"])),
        dtype=draw(st.sampled_from(DTYPES)), mods=sorted(draw(st.sets(st.sampled_from(MODS), max_size=2))),
        scale=draw(st.sampled_from([None, 0.5, 3.0])), config=draw(st.sampled_from(sorted(CONFIGS))),
        deterministic=draw(st.booleans()), seed=draw(st.integers(0, 2**16)),
    )  # fmt: skip


def sprinkle(x, value, g, frac=0.1):
    return torch.where(torch.rand(x.shape, generator=g) < frac, torch.tensor(value, dtype=x.dtype), x)


def build_indices(case, g):
    B, S, T, K = case["B"], case["S"], case["T"], case["K"]
    if case["rows"] == "empty" or T == 0:
        return torch.full((B, S, K), -1, dtype=torch.int32)
    if case["rows"] == "random":  # holes and repeats
        return torch.randint(-1, T, (B, S, K), generator=g, dtype=torch.int32)
    idx = torch.full((B, S, K), -1, dtype=torch.int32)
    for b in range(B):
        for i in range(S):
            if case["rows"] == "causal":  # as HyTopK returns them: ascending, -1 padded
                n = T - S + i + 1 if S <= T else min(T, i + 1)
                keys = torch.randperm(max(n, 0), generator=g)[:K].sort().values
            else:  # distinct, unsorted, a few holes
                keys = torch.randperm(T, generator=g)[:K]
                keys = keys[torch.rand(keys.shape, generator=g) > 0.2]
            idx[b, i, : keys.numel()] = keys.to(torch.int32)
    return idx


def build(case):
    g = torch.Generator().manual_seed(case["seed"])
    B, S, T, Hq, Hkv, Dqk, Dv = (case[n] for n in ("B", "S", "T", "Hq", "Hkv", "Dqk", "Dv"))
    q = torch.randn(B, S, Hq, Dqk, generator=g)
    k = torch.randn(B, T, Hkv, Dqk, generator=g)
    v = torch.randn(B, T, Hkv, Dv, generator=g)
    mods = case["mods"]
    if "zeros" in mods:
        q = q * (torch.rand(q.shape, generator=g) < 0.5)
        k = k * (torch.rand(k.shape, generator=g) < 0.5)
    if "signed_zeros" in mods:
        q, k = sprinkle(q, -0.0, g, 0.3), sprinkle(k, 0.0, g, 0.3)
        q = torch.where(q == 0, -0.0, q)
    if "ties" in mods and T > 1:  # equal keys (and values): equal logits at different indices
        pick = torch.randint(0, max(1, T // 3), (T,), generator=g)
        k, v = k[:, pick], v[:, pick]
    if "huge" in mods:  # logits up to ~1e3 apart (a saturated softmax), tiny or large values
        # (v only within 2**+-8: dq and dk cancel terms of size |dO . v|, so their fp32 error grows with |v|)
        q = q * 2.0 ** int(torch.randint(-4, 6, (1,), generator=g))
        v = v * 2.0 ** int(torch.randint(-8, 9, (1,), generator=g))
    for mod, value in (("nan", float("nan")), ("inf", float("inf"))):
        if mod in mods:
            which = int(torch.randint(3, (1,), generator=g))
            sign = -1.0 if mod == "inf" and int(torch.randint(2, (1,), generator=g)) else 1.0
            q, k, v = [sprinkle(x, sign * value, g, 0.05) if i == which else x for i, x in enumerate((q, k, v))]
    idx = build_indices(case, g)
    dt = case["dtype"]
    q = q.to(dt).to(DEV).requires_grad_()
    k = k.to(dt).to(DEV).requires_grad_()
    v = k[..., :Dv] if case["v_view"] else v.to(dt).to(DEV).requires_grad_()
    return q, k, v, idx.to(DEV)


def dense_oracle(q, k, v, idx, scale):
    """fp64 attention over all T keys, each weighted by how often the query lists it (0: masked)."""
    q, k, v = q.detach().double().cpu(), k.detach().double().cpu(), v.detach().double().cpu()
    idx = idx.cpu()
    B, S, Hq, _ = q.shape
    T, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    counts = torch.zeros(B, S, T + 1, dtype=torch.float64)
    counts.scatter_add_(2, torch.where(idx >= 0, idx, T).long(), torch.ones(idx.shape, dtype=torch.float64))
    counts = counts[..., :T]
    listed = counts > 0  # [B, S, T]
    kr = k.repeat_interleave(G, 2)  # [B, T, Hq, D]
    vr = v.repeat_interleave(G, 2)
    logits = torch.einsum("bshd,bthd->bsht", q, kr) * scale
    logits = torch.where(listed[:, :, None], logits + counts.log()[:, :, None], -math.inf)
    lse = torch.logsumexp(logits, -1)
    # the rule for non-finite logits: only -inf (or none listed) = no key; NaN or +inf: NaN
    p = torch.where(listed[:, :, None], torch.exp(logits - torch.where(lse == -math.inf, 0.0, lse)[..., None]), 0.0)
    v_listed = torch.where(listed[..., None, None], vr[:, None], 0.0)  # unlisted keys: not even 0 * NaN
    o = torch.einsum("bsht,bsthd->bshd", p, v_listed)
    return o, torch.where(lse == math.inf, math.nan, lse)


def grads_of(o, lse, leaves, seed=1):
    g = torch.Generator().manual_seed(seed)
    wo = torch.randn(o.shape, generator=g).to(o.device)
    wl = torch.randn(lse.shape, generator=g).to(o.device)
    loss = (o.float() * wo).sum() + (torch.where(torch.isinf(lse), 0.0, lse) * wl).sum()
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [torch.zeros_like(x) if d is None else d for d, x in zip(grads, leaves)]


def close(a, b, tol, what):
    torch.testing.assert_close(a.float().cpu(), b.float().cpu(), atol=tol, rtol=tol, equal_nan=True, msg=lambda m: f"{what}: {m}")


def _case(**kw):
    base = dict(B=1, S=6, T=10, Hq=2, Hkv=1, Dqk=16, Dv=16, v_view=False, K=8, rows="random", dtype=torch.float32,
                mods=[], scale=None, config="tiled", deterministic=False, seed=0)  # fmt: skip
    return base | kw


@given(case=attention_cases())
# explicit examples: the CI budget always covers many heads, real head dims (padded) and MLA-like v
@example(case=_case(Hq=64, Hkv=2, Dqk=112, Dv=80, rows="causal", deterministic=True, seed=1))
@example(case=_case(B=2, S=5, Hq=32, Hkv=4, Dqk=80, Dv=24, K=12, mods=["ties"], seed=2))
@example(case=_case(Hq=5, Hkv=1, Dqk=48, Dv=16, v_view=True, rows="distinct", config="per-token",
                    mods=["signed_zeros", "zeros"], seed=3))
@example(case=_case(S=4, T=6, K=5, mods=["inf", "nan"], seed=4))
def test_property_both_backends_match_the_reference(case):
    note(repr(case))
    q, k, v, idx = build(case)
    scale = case["scale"] if case["scale"] is not None else case["Dqk"] ** -0.5
    finite = all(bool(torch.isfinite(x).all()) for x in (q, k, v))
    # torch backend against the dense oracle (fp32 inputs: fp32 rounding)
    o, lse = sparse_attention(q, k, v, idx, scale=case["scale"], return_lse=True, backend="torch")
    assert o.shape == (case["B"], case["S"], case["Hq"], case["Dv"]) and o.dtype == q.dtype
    assert lse.shape == o.shape[:3] and lse.dtype == torch.float32
    o_or, lse_or = dense_oracle(q, k, v, idx, scale)
    # saturated softmaxes (logits ~1e3 apart) magnify fp32 rounding in exp
    huge = 100 if "huge" in case["mods"] else 1
    tol = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}[q.dtype] * huge
    close(o, o_or, tol, "torch o")
    close(lse, lse_or, tol, "torch lse")
    empty = (idx < 0).all(-1)
    assert bool((o[empty] == 0).all()) and bool((lse[empty] == -math.inf).all())
    if not host.HAS_TRITON:
        return
    leaves = [q, k] + ([v] if v.is_leaf else [])
    o_t, lse_t = sparse_attention(
        q, k, v, idx, scale=case["scale"], return_lse=True, backend="triton", config=CONFIGS[case["config"]],
        deterministic=case["deterministic"],
    )  # fmt: skip
    o_r, lse_r = sparse_attention_reference(q, k, v, idx, scale)
    tol = TOL[q.dtype] * huge
    if case["config"] == "tiled" and not bool(torch.isfinite(v).all()):
        # The documented exception (docs/design.md section 4): in a GQA query tile a NaN or inf value
        # also reaches the tile's other queries (0 * NaN in the tile's P @ V), as NaN; nothing else.
        o_t = torch.where(torch.isnan(o_t) & ~torch.isnan(o_r), o_r.detach().to(o_t.dtype), o_t)
    close(o_t, o_r, tol, "triton o")
    close(lse_t, lse_r, tol, "triton lse")
    if finite and o.numel():  # gradients (NaN/inf inputs: forward only)
        # dq and dk cancel terms of size |dO . v| (dS = p * (dp - delta)): their rounding error scales
        # with (|dO| |v| + |dlse|) * |q or k| * scale (randn weights: |dO|, |dlse| < ~5)
        big = lambda x: float(x.detach().abs().max()) if x.numel() else 0.0
        bound = (5 + 5 * big(v)) * max(big(q), big(k)) * abs(scale)
        g_tol = TOL[q.dtype] * (10 if q.dtype != torch.float32 else 1)
        for g_t, g_r, name in zip(grads_of(o_t, lse_t, leaves), grads_of(o_r, lse_r, leaves), "qkv"):
            atol = g_tol * max(1.0, bound) if name != "v" else g_tol
            torch.testing.assert_close(g_t.float().cpu(), g_r.float().cpu(), atol=atol, rtol=g_tol * huge,
                                       msg=lambda m, name=name: f"triton d{name}: {m}")  # fmt: skip


BAD = {
    "Hq % Hkv": (dict(Hq=3, Hkv=2), ValueError, "not a multiple"),
    "Hq=0": (dict(Hq=0), ValueError, "q must have Hq >= 1"),
    "Dqk=0": (dict(Dqk=0), ValueError, "q must have Dqk >= 1"),
    "Dv=0": (dict(Dv=0), ValueError, "v must have Dv >= 1"),
    "K=0": (dict(K=0), ValueError, "indices must have K > 0"),
    "index >= T": (dict(index=99), ValueError, r"indices must lie in \[-1"),
    "index < -1": (dict(index=-2), ValueError, r"indices must lie in \[-1"),
    "int64 indices": (dict(idx_dtype=torch.int64), TypeError, "indices must have dtype"),
    "k dims": (dict(k_Dqk=5), ValueError, "k must have shape"),
    "scale str": (dict(scale="1"), TypeError, "scale must be a real number"),
    "scale inf": (dict(scale=math.inf), ValueError, "scale must be finite"),
}


@given(
    bad=st.sampled_from(sorted(BAD)), backend=st.sampled_from(["torch", "triton"]),
    B=st.integers(1, 2), S=st.integers(1, 4), T=st.integers(1, 6),
)  # fmt: skip
def test_property_bad_sizes_raise_errors_that_name_the_argument(bad, backend, B, S, T):
    change, error, match = BAD[bad]
    Hq, Hkv, Dqk, Dv, K = (change.get(n, d) for n, d in (("Hq", 2), ("Hkv", 1), ("Dqk", 8), ("Dv", 8), ("K", 3)))
    q = torch.zeros(B, S, Hq, Dqk, device=DEV)
    k = torch.zeros(B, T, Hkv, change.get("k_Dqk", Dqk), device=DEV)
    v = torch.zeros(B, T, Hkv, Dv, device=DEV)
    idx = torch.zeros(B, S, K, dtype=change.get("idx_dtype", torch.int32), device=DEV)
    if "index" in change:
        idx[0, 0, 0] = change["index"]
    with pytest.raises(error, match=match):
        sparse_attention(q, k, v, idx, scale=change.get("scale"), backend=backend)
