"""scripts/probe_atomics.py: its kernel adds what it claims to add (Triton interpreter, tiny sizes).

The probe times atomic adds of [BN, 576] tiles into the selected key rows; its figures mean
something only if the atomic variant adds each pair's tile to that pair's key row, in both tile
layouts.
"""

import os

import pytest
import torch

from tests.support.scripts import load_script

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the kernel under the interpreter")


@pytest.mark.parametrize("trans", [False, True], ids=["rows", "transposed"])
def test_atomic_variant_adds_every_pair_once(trans):
    probe = load_script("probe_atomics")
    T, L, bn = 3, 32, 16
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 5, (T, L), generator=gen, dtype=torch.int32)
    idx[1, 7:20] = -1  # skipped slots
    # fp32 operands (the probe times bf16 ones; the interpreter's bf16 products are not exact)
    a = torch.randn(bn, 64, generator=gen)
    b = torch.randn(64, 576, generator=gen)
    acc = torch.zeros(T + 5, 576)
    probe.probe_kernel[(T,)](acc, idx, a, b, L, MODE=probe.ATOMIC, BN=bn, TRANS=trans)
    tile = a @ b  # [bn, 576]: slot j of a block adds row j % bn
    want = torch.zeros_like(acc)
    for t in range(T):
        for j in range(L):
            if idx[t, j] >= 0:
                want[idx[t, j]] += tile[j % bn]
    torch.testing.assert_close(acc, want, rtol=1e-4, atol=1e-3)
