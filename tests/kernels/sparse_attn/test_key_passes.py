"""The MLA backward's key passes: ``key_passes`` (each row's keys regrouped by key range) against the
torch reference, bit for bit, and ``host.row_delta`` against torch; under Triton's CPU interpreter
without CUDA (tests/conftest.py sets TRITON_INTERPRET=1), tiny shapes. The Gluon kernel that walks
the passes is checked on the GPU (test_gpu.py, test_mla_gpu.py: ``key_passes`` ids)."""

import pytest
import torch

from hyscale_hf.kernels.sparse_attn.naive import key_passes_reference

triton = pytest.importorskip("triton")
from hyscale_hf.kernels.sparse_attn import host  # noqa: E402
from hyscale_hf.kernels.sparse_attn.key_passes import key_pass_width, key_passes  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def assert_same(idx, t0, count, T, passes, align=1, grain=1):
    got = key_passes(idx, t0, count, T, passes, align, grain)
    want = key_passes_reference(idx, t0, count, T, passes, align, grain)
    idx_p, perm, off = got
    assert idx_p.shape == want[0].shape and off.shape == want[2].shape
    assert torch.equal(idx_p, want[0]) and torch.equal(perm, want[1]) and torch.equal(off, want[2])
    return got


@pytest.mark.parametrize(("passes", "align", "grain"), [(1, 1, 1), (3, 1, 1), (8, 1, 1), (3, 8, 64), (8, 8, 16)])
def test_matches_reference_and_keeps_every_pair(passes, align, grain):
    g = torch.Generator().manual_seed(passes)
    B, S, L, T = 2, 7, 1100, 3000  # L over the kernel's 1024-slot step
    idx = torch.randint(-1, T, (B, S, L), generator=g).to(torch.int32)
    idx[0, 3] = -1  # a row without keys
    idx = idx.to(DEVICE)
    idx_p, perm, off = assert_same(idx, 2, 4, T, passes, align, grain)
    assert idx_p.shape[2] == key_pass_width(L, passes, align, grain) and idx_p.shape[2] % grain == 0
    rows = idx[:, 2:6]
    span = -(-T // passes)
    for b in range(B):
        for r in range(4):
            row = rows[b, r].long()
            is_key = torch.zeros(idx_p.shape[2], dtype=torch.bool, device=idx.device)
            for p in range(passes):
                # pass p's keys, in slot order, from a multiple of align
                slots = torch.nonzero((row >= 0) & (row // span == p)).flatten()
                first = int(off[b, r, p])
                assert first % align == 0 and first >= (int(off[b, r, p - 1]) if p else 0)
                assert torch.equal(perm[b, r, first : first + len(slots)].long(), slots)
                assert torch.equal(idx_p[b, r, first : first + len(slots)].long(), row[slots])
                is_key[first : first + len(slots)] = True
                if p == passes - 1:  # the walk ends at the last key, rounded up to grain
                    assert int(off[b, r, passes]) == -(-(first + len(slots)) // grain) * grain
            # every other slot: no key, no original slot
            assert bool((idx_p[b, r][~is_key] == -1).all()) and bool((perm[b, r][~is_key] == -1).all())
            assert int(is_key.sum()) == int((row >= 0).sum())
    assert int(off[0, 1, -1]) == 0


def test_refuses_what_it_cannot_walk():
    idx = torch.zeros(1, 4, 8, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="passes"):
        key_passes(idx, 0, 4, 8, 0)
    with pytest.raises(ValueError, match="idx must be int32"):
        key_passes(idx.long(), 0, 4, 8, 2)
    with pytest.raises(ValueError, match="align"):
        key_passes(idx, 0, 4, 8, 2, align=6)
    with pytest.raises(ValueError, match="grain"):
        key_passes(idx, 0, 4, 8, 2, align=8, grain=12)


def test_pass_count_follows_the_accumulator_bytes():
    acc = torch.empty(1, 1000, 1, 576)  # 2.3 MB of fp32
    config = host.SparseAttentionConfig
    assert host.key_pass_count(acc, config(mla_bwd_pass_bytes=0)) == 1
    assert host.key_pass_count(acc, config(mla_bwd_pass_bytes=1 << 30)) == 1
    assert host.key_pass_count(acc, config(mla_bwd_pass_bytes=1 << 20)) == 3


@pytest.mark.parametrize("name", ["mla_bwd_pass_bytes", "det_scratch_bytes"])
@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_config_refuses_byte_counts_that_are_not_counts(name, value):
    with pytest.raises(ValueError, match=name):
        host.SparseAttentionConfig(**{name: value})


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


def test_dq_kernel_reads_the_regrouped_rows_up_to_the_walk_end():
    # The split backward's dQ kernel over a chunk's regrouped slots (the Gluon key-pass path, which
    # only a GPU runs): row t - t0 of idx_p and of off[..., P] (the walk's end, a multiple of its
    # BLOCK_N), dS in the regrouped order and wider than the selection. dS past the walk's end is
    # NaN: the kernel must not read it.
    from hyscale_hf.kernels.sparse_attn import triton_kernels

    g = torch.Generator().manual_seed(0)
    B, S, L, T, H, D1, D2, passes, t0, count, block_n = 1, 9, 44, 40, 4, 32, 16, 3, 3, 5, 16
    idx = torch.randint(-1, T, (B, S, L), generator=g).to(torch.int32)
    idx[0, 5] = -1  # a row without keys: dq 0
    k = torch.randn(B, T, 1, D1 + D2, generator=g)
    idx_p, _, off = key_passes(idx.to(DEVICE), t0, count, T, passes, 8, block_n)
    W = idx_p.shape[2]
    ds = torch.randn(B, count, H, W, generator=g)
    walked = torch.arange(W)[None, None, :] < off[..., passes, None].cpu()
    ds = torch.where((walked & (idx_p.cpu() >= 0))[:, :, None, :], ds, 0.0)  # zeros over -1 slots
    ds = torch.where(walked[:, :, None, :], ds, float("nan"))
    dq = torch.zeros(B, S, H, D1 + D2)
    dq_num = off[:, :, passes]
    k_, ds_, dq_ = k.to(DEVICE), ds.to(DEVICE), dq.to(DEVICE)
    triton_kernels.sparse_attn_bwd_dq_kernel[(count * 2, B)](
        ds_, k_, idx_p, dq_num, dq_, *ds_.stride()[:3], *k_.stride(), *idx_p.stride(), *dq_num.stride(),
        *dq_.stride(), t0, t0, W, 1, H, 1, D1=D1, D2=D2, SLAB=16, BLOCK_H=H, BLOCK_N=block_n, DOT_PREC="ieee",
    )  # fmt: skip
    keys = torch.where(idx_p.cpu() >= 0, idx_p.cpu(), 0).long()
    rows = k[0, keys[0], 0]  # [count, W, D]
    want = torch.einsum("chw,cwd->chd", torch.nan_to_num(ds[0]) * (idx_p.cpu()[0] >= 0)[:, None, :], rows)
    torch.testing.assert_close(dq_.cpu()[0, t0 : t0 + count], want, rtol=1e-5, atol=1e-5)
    assert not dq_.cpu()[0, :t0].any() and not dq_.cpu()[0, t0 + count :].any()
    assert not dq_.cpu()[0, 5].any()
