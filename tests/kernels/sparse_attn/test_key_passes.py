"""The MLA backward's key passes: ``key_passes`` (each row's keys regrouped by key range) against the
torch reference, bit for bit, and ``host.row_delta`` against torch; under Triton's CPU interpreter
without CUDA (tests/conftest.py sets TRITON_INTERPRET=1), tiny shapes. The Gluon kernel that walks
the passes is checked on the GPU (test_gpu.py, test_mla_gpu.py: ``key_passes`` ids)."""

import pytest
import torch

from hyscale_hf.kernels.sparse_attn.naive import key_passes_reference

triton = pytest.importorskip("triton")
from hyscale_hf.kernels.sparse_attn import host  # noqa: E402
from hyscale_hf.kernels.sparse_attn.key_passes import key_passes  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def assert_same(idx, t0, count, T, passes):
    got = key_passes(idx, t0, count, T, passes)
    want = key_passes_reference(idx, t0, count, T, passes)
    idx_p, perm, off = got
    assert idx_p.shape == want[0].shape and off.shape == want[2].shape
    assert torch.equal(idx_p, want[0]) and torch.equal(perm, want[1]) and torch.equal(off, want[2])
    return got


@pytest.mark.parametrize("passes", [1, 3, 8])
def test_matches_reference_and_keeps_every_pair(passes):
    g = torch.Generator().manual_seed(passes)
    B, S, L, T = 2, 7, 1100, 3000  # L over the kernel's 1024-slot step
    idx = torch.randint(-1, T, (B, S, L), generator=g).to(torch.int32)
    idx[0, 3] = -1  # a row without keys
    idx = idx.to(DEVICE)
    idx_p, perm, off = assert_same(idx, 2, 4, T, passes)
    rows = idx[:, 2:6]
    for b in range(B):
        for r in range(4):
            n = int(off[b, r, -1])
            assert n == int((rows[b, r] >= 0).sum())
            # the regrouped slots hold exactly the row's keys at their original slots, by range
            assert torch.equal(rows[b, r].long()[perm[b, r, :n].long()], idx_p[b, r, :n].long())
            assert bool((idx_p[b, r, n:] == -1).all())
            # perm is a permutation of the row's slots: the slots without a key follow, in slot order
            assert torch.equal(perm[b, r].sort().values, torch.arange(perm.shape[2], device=perm.device, dtype=perm.dtype))
            assert bool((rows[b, r][perm[b, r, n:].long()] < 0).all()) and bool((perm[b, r, n:].diff() > 0).all())
            span = -(-T // passes)
            for p in range(passes):
                seg = idx_p[b, r, off[b, r, p] : off[b, r, p + 1]]
                assert bool(((seg // span) == p).all())
    assert int(off[0, 1, -1]) == 0


def test_refuses_what_it_cannot_walk():
    idx = torch.zeros(1, 4, 8, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="passes"):
        key_passes(idx, 0, 4, 8, 0)
    with pytest.raises(ValueError, match="idx must be int32"):
        key_passes(idx.long(), 0, 4, 8, 2)


def test_pass_count_follows_the_accumulator_bytes():
    acc = torch.empty(1, 1000, 1, 576)  # 2.3 MB of fp32
    config = host.SparseAttentionConfig
    assert host.key_pass_count(acc, config(mla_bwd_pass_bytes=0)) == 1
    assert host.key_pass_count(acc, config(mla_bwd_pass_bytes=1 << 30)) == 1
    assert host.key_pass_count(acc, config(mla_bwd_pass_bytes=1 << 20)) == 3


@pytest.mark.parametrize("with_dlse", [False, True])
def test_row_delta_matches_torch(with_dlse):
    g = torch.Generator().manual_seed(0)
    B, S, H, D = 2, 6, 5, 32
    o = torch.randn(B, S, H, D, generator=g).to(torch.bfloat16).to(DEVICE)
    do = torch.randn(B, S, H, D, generator=g).to(torch.bfloat16).to(DEVICE)
    dlse = torch.randn(B, S, H, generator=g).to(DEVICE) if with_dlse else None
    got = host.row_delta(o, do, dlse, 1, 4)
    want = (do.float() * o.float()).sum(-1)[:, 1:5]
    if with_dlse:
        want = want - dlse[:, 1:5]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_row_delta_takes_the_models_output_gradient_past_2_to_the_31_elements():
    # In the patched model dO is a view of [H, S, Dv] storage, so its head stride is S * Dv: from
    # S = 65K on, 63 heads of it pass 2^31 elements (a 32-bit offset wrapped and faulted at 128K).
    S, H, D = 69632, 64, 512
    do = torch.randn(H, S, D, device="cuda", dtype=torch.bfloat16).transpose(0, 1)[None]
    o = torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16)
    assert (H - 1) * do.stride(2) >= 2**31
    t0, count = S - 4096, 4096
    got = host.row_delta(o, do, None, t0, count)
    want = (do[:, t0:].float() * o[:, t0:].float()).sum(-1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-3)
