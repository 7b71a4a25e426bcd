"""rotary_embedding: the torch path and the Triton kernel (Triton's interpreter on a CPU-only host,
tests/conftest.py) against the de-interleave + rotate_half reference, bit for bit, forward and backward;
its argument errors. The check against each family's own Transformers function is in
tests/model_patches/test_fused_rope.py."""

import pytest
import torch

from hyscale_hf.kernels.rope import op, rotary_embedding
from hyscale_hf.kernels.rope.naive import rotary_embedding_reference

pytestmark = pytest.mark.skipif(not op.HAS_TRITON, reason="needs Triton")

# (heads, head dim, rotated dims, rotated first): a whole rotary head (MLA's q_rot), an indexer head
# rotated on its first half (GLM-5) or its last dims (HunYuan), an odd head count and pair count.
SHAPES = [(3, 16, None, True), (2, 24, 8, True), (2, 20, 12, False), (5, 6, 6, True)]


def tables(B, S, r, dtype, g, symmetric):
    """cos, sin [B, S, r] as Transformers' rotary embeddings make them (cat(freqs, freqs)) or, for the
    plain layout, with unrelated halves (it reads the whole table)."""
    half = torch.randn(B, S, r // 2 if symmetric else r, generator=g) * 3
    ang = torch.cat([half, half], -1) if symmetric else half
    return ang.cos().to(dtype), ang.sin().to(dtype)


def inputs(B, S, H, D, r, dtype, interleaved, seed=0, strided=False):
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(B, S, H, D + 5 if strided else D, generator=g) * 4
    x = (wide[..., 2:2 + D] if strided else wide).to(dtype)  # strided: a split view, as q_rot is
    cos, sin = tables(B, S, r or D, dtype, g, symmetric=interleaved)
    return x, cos, sin, torch.randn(B, S, H, D, generator=g).to(dtype)


def run(x, cos, sin, dy, **kw):
    x = x.detach().requires_grad_()
    y = rotary_embedding(x, cos, sin, **kw) if "reference" not in kw else None
    if y is None:
        kw.pop("reference")
        y = rotary_embedding_reference(x, cos, sin, **kw)
    y.backward(dy)
    return y.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("H, D, r, first", SHAPES)
def test_torch_path_is_the_reference_bit_for_bit(dtype, interleaved, H, D, r, first):
    x, cos, sin, dy = inputs(2, 5, H, D, r, dtype, interleaved)
    kw = dict(interleaved=interleaved, rotary_dims=r, rotary_first=first)
    y, dx = run(x, cos, sin, dy, backend="torch", **kw)
    y_ref, dx_ref = run(x, cos, sin, dy, reference=True, **kw)
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("H, D, r, first", SHAPES)
@pytest.mark.parametrize("strided", [False, True])
def test_triton_is_the_torch_path_bit_for_bit(dtype, interleaved, H, D, r, first, strided):
    # 2 x 7 x H rows: not a multiple of the kernel's 16-row blocks
    x, cos, sin, dy = inputs(2, 7, H, D, r, dtype, interleaved, seed=1, strided=strided)
    kw = dict(interleaved=interleaved, rotary_dims=r, rotary_first=first)
    y, dx = run(x, cos, sin, dy, backend="triton", **kw)
    y_ref, dx_ref = run(x, cos, sin, dy, backend="torch", **kw)
    assert y.is_contiguous() and y.shape == x.shape
    assert_same_bits(y, y_ref)
    assert_same_bits(dx, dx_ref)


def assert_same_bits(a, b):
    """Bit for bit, but under the CPU interpreter for bfloat16: its float32 -> bfloat16 conversion
    truncates (triton/runtime/interpreter.py) where the GPU rounds to nearest even, and a result
    rounds twice (its two products, which may nearly cancel, then their sum): there it may be off by
    an ulp of the products (inputs and tables are below 4 * 4 in magnitude here) and one of itself.
    The GPU test below checks bfloat16 bit for bit."""
    if a.dtype == torch.bfloat16 and a.device.type == "cpu":
        eps = torch.finfo(torch.bfloat16).eps
        torch.testing.assert_close(a, b, atol=2 * eps * 4 * b.float().abs().max().item(), rtol=2 * eps)
    else:
        assert torch.equal(a, b)


def test_strided_gradient_and_tables():
    """A non-contiguous output gradient (as a slice of a wider gradient arrives) and sliced tables."""
    x, cos, sin, _ = inputs(1, 6, 2, 8, None, torch.float16, True, seed=2)
    wide_dy = torch.randn(1, 6, 2, 12).half()
    dy = wide_dy[..., 4:]
    wide_cos, wide_sin = torch.cat([cos, cos], 1), torch.cat([sin, sin], 1)
    cos_v, sin_v = wide_cos[:, 6:], wide_sin[:, 6:]
    for backend in ("triton", "torch"):
        y, dx = run(x, cos_v, sin_v, dy, backend=backend, interleaved=True)
        if backend == "triton":
            y_t, dx_t = y, dx
    assert_same_bits(y_t, y)
    assert_same_bits(dx_t, dx)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_one_table_for_the_batch(backend):
    x, cos, sin, dy = inputs(3, 5, 2, 8, None, torch.float16, True, seed=3)
    y, dx = run(x, cos[:1], sin[:1], dy, backend=backend, interleaved=True)
    y_ref, dx_ref = run(x, cos[:1].expand(3, -1, -1), sin[:1].expand(3, -1, -1), dy, reference=True, interleaved=True)
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)


def test_auto_takes_the_torch_path_where_the_kernel_cannot():
    x, cos, sin, dy = inputs(1, 4, 2, 8, None, torch.float32, False)
    cos = cos.detach().requires_grad_()
    y = rotary_embedding(x, cos, sin, interleaved=False)  # fp32 and a table that learns: torch
    y.backward(dy)
    assert cos.grad is not None
    x16, c16, s16, _ = inputs(1, 4, 2, 8, None, torch.bfloat16, False)
    with pytest.raises(ValueError, match="float16 and bfloat16"):
        rotary_embedding(x, c16.float(), s16.float(), interleaved=False, backend="triton")
    with pytest.raises(ValueError, match="not x's"):
        rotary_embedding(x16, c16.float(), s16.float(), interleaved=False, backend="triton")


@pytest.mark.parametrize("kw, match", [
    (dict(rotary_dims=7), "rotary_dims must be even"),
    (dict(rotary_dims=10), "rotary_dims must be even and in"),
    (dict(backend="fast"), "backend must be"),
])
def test_bad_arguments(kw, match):
    x, cos, sin, _ = inputs(1, 3, 2, 8, None, torch.bfloat16, True)
    with pytest.raises(ValueError, match=match):
        rotary_embedding(x, cos, sin, interleaved=True, **kw)


def test_bad_tables():
    x, cos, sin, _ = inputs(1, 3, 2, 8, None, torch.bfloat16, True)
    with pytest.raises(ValueError, match=r"cos must be \[B=1 \(or 1\), S=3, r=4\]"):
        rotary_embedding(x, cos, sin, interleaved=True, rotary_dims=4)
    with pytest.raises(ValueError, match="x must have rank 4"):
        rotary_embedding(x[0], cos, sin, interleaved=True)


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved, H, D, r", [(True, 64, 64, None), (True, 32, 128, 64), (False, 32, 128, 64)],
                         ids=["glm5_q_rot", "glm5_indexer", "plain_indexer"])
def test_gpu_kernel_is_the_torch_path(interleaved, H, D, r):
    g = torch.Generator(device="cuda").manual_seed(0)
    S = 4099
    x = (torch.randn(1, S, H, D + 64, device="cuda", generator=g) * 4).bfloat16()[..., 64:]
    half = torch.randn(1, S, (r or D) // 2, device="cuda", generator=g) * 3
    ang = torch.cat([half, half], -1)
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    dy = torch.randn(1, S, H, D, device="cuda", generator=g).bfloat16()
    kw = dict(interleaved=interleaved, rotary_dims=r)
    y, dx = run(x, cos, sin, dy, **kw)  # auto: the kernel on CUDA
    y_ref, dx_ref = run(x, cos, sin, dy, backend="torch", **kw)
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
