"""kernels/triton_math.py: round_like_torch gives torch's round-to-nearest-even bf16 (ties, NaN,
infinities, subnormals), exp_like_torch torch's exp within an ulp, and the online log-sum-exp
(lse_step, lse_step_rows, lse_value) torch.logsumexp over blocks, under Triton's interpreter on a CPU
(tests/conftest.py turns it on) or compiled on a GPU."""

import os

import pytest
import torch

from hyscale_hf.kernels.lm_loss import host

pytestmark = pytest.mark.skipif(not host.HAS_TRITON or (os.environ.get("TRITON_INTERPRET") != "1"
                                                        and not torch.cuda.is_available()),
                                reason="needs Triton on a GPU or under the interpreter")

if host.HAS_TRITON:
    import triton
    import triton.language as tl

    from hyscale_hf.kernels.triton_math import exp_like_torch, lse_step, lse_step_rows, lse_value, round_like_torch

    @triton.jit
    def _round_and_exp(x_ptr, bf_ptr, e_ptr, n, BLOCK: tl.constexpr, PRECISE_EXP: tl.constexpr,
                       INTERPRET: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        tl.store(bf_ptr + offs, round_like_torch(x, tl.bfloat16, INTERPRET), mask=mask)
        tl.store(e_ptr + offs, exp_like_torch(x, PRECISE_EXP), mask=mask)

    @triton.jit
    def _row_lse(x_ptr, out_ptr, rows_out_ptr, n, ROWS: tl.constexpr, BLOCK: tl.constexpr, BASE2: tl.constexpr):
        """Row 0 of x [ROWS, n] one block at a time with lse_step, all rows with lse_step_rows."""
        r = tl.arange(0, ROWS)
        m = tl.full([], float("-inf"), tl.float32)
        l = tl.zeros([], tl.float32)
        m_rows = tl.full([ROWS], float("-inf"), tl.float32)
        l_rows = tl.zeros([ROWS], tl.float32)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + r[:, None] * n + offs[None, :], mask=offs[None, :] < n, other=float("-inf"))
            m, l = lse_step(m, l, tl.load(x_ptr + offs, mask=offs < n, other=float("-inf")), BASE2)
            m_rows, l_rows = lse_step_rows(m_rows, l_rows, x, BASE2)
        tl.store(out_ptr, lse_value(m, l, float("-inf"), BASE2))
        tl.store(rows_out_ptr + r, lse_value(m_rows, l_rows, 7.0, BASE2))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # exp(3e38) under numpy
def test_round_and_exp_like_torch():
    device = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    one_ulp = 2.0**-8  # bf16 spacing at 1
    special = [1 + one_ulp / 2, 1 + 3 * one_ulp / 2, -(1 + one_ulp / 2), 1e-40, -0.0, float("inf"),
               float("-inf"), float("nan"), 3.0e38, 1 + one_ulp / 2 + 2**-20]
    x = torch.cat([torch.tensor(special), torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 30])
    x = x.to(device)
    bf = torch.empty(x.shape, dtype=torch.bfloat16, device=device)
    e = torch.empty_like(x)
    _round_and_exp[(triton.cdiv(x.numel(), 256),)](x, bf, e, x.numel(), BLOCK=256, PRECISE_EXP=device == "cuda",
                                                  INTERPRET=device == "cpu")
    want = x.to(torch.bfloat16)
    same = (bf == want) | (bf.isnan() & want.isnan())
    assert bool(same.all()), x[~same].tolist()
    assert torch.equal(bf.view(torch.int16)[4], want.view(torch.int16)[4])  # -0.0 keeps its sign
    finite = x.abs() < 80
    torch.testing.assert_close(e[finite], torch.exp(x[finite]), rtol=2e-7, atol=0)


@pytest.mark.parametrize("base2", [False, True])
def test_online_lse_matches_logsumexp(base2):
    """Several blocks, a row whose keys are all -inf (EMPTY comes back), a row whose first blocks are
    all -inf (no NaN from exp(-inf - -inf)), and large values (the running max rescales)."""
    device = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    n, block = 100, 32
    x = torch.randn(4, n, generator=torch.Generator().manual_seed(1)) * 20
    x[1] = float("-inf")
    x[2, :70] = float("-inf")
    x[3, 50] = 80.0
    x = x.to(device)
    out = torch.empty(1, device=device)
    rows = torch.empty(4, device=device)
    _row_lse[(1,)](x, out, rows, n, ROWS=4, BLOCK=block, BASE2=base2)
    # base 2: x is log2-scaled, so the natural lse is logsumexp(x * ln 2)
    want = torch.logsumexp(x.double() * (0.6931471805599453 if base2 else 1.0), dim=1).float()
    want[1] = 7.0  # the EMPTY given for rows with no finite key
    torch.testing.assert_close(rows, want, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(out, want[:1], rtol=1e-6, atol=1e-5)
