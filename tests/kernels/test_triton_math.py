"""kernels/triton_math.py: round_like_torch gives torch's round-to-nearest-even bf16 (ties, NaN,
infinities, subnormals) and exp_like_torch torch's exp within an ulp, under Triton's interpreter on
a CPU (tests/conftest.py turns it on) or compiled on a GPU."""

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

    from hyscale_hf.kernels.triton_math import exp_like_torch, round_like_torch

    @triton.jit
    def _round_and_exp(x_ptr, bf_ptr, e_ptr, n, BLOCK: tl.constexpr, PRECISE_EXP: tl.constexpr,
                       INTERPRET: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        tl.store(bf_ptr + offs, round_like_torch(x, tl.bfloat16, INTERPRET), mask=mask)
        tl.store(e_ptr + offs, exp_like_torch(x, PRECISE_EXP), mask=mask)


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
