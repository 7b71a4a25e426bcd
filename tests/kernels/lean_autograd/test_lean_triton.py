"""The Triton path of rms_norm and swiglu_mlp (``backend="triton"``; on a CPU-only host under Triton's
interpreter, which tests/conftest.py turns on): the naive compositions' outputs and gradients within
the dtype's rounding, the same saved bytes as the torch path, the backend and dtype errors.
``blocks="small"`` shrinks the block sizes so that rows loop over several column blocks (RMSNorm's
two-pass kernels, several SwiGLU column blocks) and several row tiles share a backward program."""

import pytest
import torch
import torch.nn.functional as F

from hyscale_hf.kernels import rms_norm, swiglu_mlp
from hyscale_hf.kernels.lean_autograd import host
from hyscale_hf.kernels.lean_autograd.naive import rms_norm_reference, swiglu_mlp_reference

from .test_lean_autograd import grads, saved_bytes

pytestmark = pytest.mark.skipif(not host.HAS_TRITON, reason="needs Triton")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Gradient tolerances: bf16 / fp16 gradients differ by an ulp or two where the kernels sum in fp32
# what torch sums after rounding each product (dw), or sum in another order.
GRAD_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
            torch.float16: dict(atol=5e-3, rtol=5e-3)}


@pytest.fixture(params=["default", "small"])
def blocks(request, monkeypatch):
    if request.param == "small":
        for name, value in (("MAX_BLOCK_N", 32), ("LOOP_BLOCK_N", 32), ("TILE_ELEMENTS", 64), ("EW_BLOCK_N", 16)):
            monkeypatch.setattr(host, name, value)
    return request.param


def triton_rms(x, w):
    return rms_norm(x, w, 1e-6, backend="triton")


def triton_mlp(*args):
    return swiglu_mlp(*args, backend="triton")


def norm_inputs(dtype, shape=(3, 5, 100), w_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(w_dtype or dtype).requires_grad_()
    return x, w


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_the_reference(dtype, blocks):
    x, w = norm_inputs(dtype)  # 15 rows of 100: not a power of 2; "small" blocks loop over 4 blocks
    out, (dx, dw) = grads(triton_rms, x, w)
    ref, (rdx, rdw) = grads(lambda x, w: rms_norm_reference(x, w, 1e-6), x, w)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out, ref)  # the dtype's default tolerance: an ulp or two
    torch.testing.assert_close(dx, rdx, **GRAD_TOL[dtype])
    torch.testing.assert_close(dw, rdw, **GRAD_TOL[dtype])


@pytest.mark.parametrize("x_dtype, w_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                                              (torch.float16, torch.bfloat16)])
def test_rms_norm_with_mixed_dtypes_promotes_as_torch(x_dtype, w_dtype):
    x, w = norm_inputs(x_dtype, shape=(6, 48), w_dtype=w_dtype)
    out, (dx, dw) = grads(triton_rms, x, w)
    ref, (rdx, rdw) = grads(lambda x, w: rms_norm_reference(x, w, 1e-6), x, w)
    assert out.dtype == ref.dtype == torch.promote_types(x_dtype, w_dtype)
    assert dx.dtype == x_dtype and dw.dtype == w_dtype
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(dx, rdx, **GRAD_TOL[torch.bfloat16])
    torch.testing.assert_close(dw, rdw, **GRAD_TOL[torch.bfloat16])


def test_rms_norm_strided_inputs_and_an_expanded_gradient(blocks):
    base = torch.randn(9, 128, dtype=torch.float32)
    for x in (base[:, 5:105], base.t()[:100].t()):  # a row stride of 128; a column stride of 9 (copied)
        x = x.detach().requires_grad_()
        w = torch.randn(100, requires_grad=True)
        # .sum() hands backward a gradient expanded from a scalar (all strides 0)
        got = torch.autograd.grad(triton_rms(x, w).sum(), [x, w])
        want = torch.autograd.grad(rms_norm_reference(x, w, 1e-6).sum(), [x, w])
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_rms_norm_gradient_of_one_input_only(blocks):
    x, w = norm_inputs(torch.float32, shape=(7, 40))
    (dx,) = torch.autograd.grad(triton_rms(x, w.detach()).pow(2).sum(), [x])
    (dw,) = torch.autograd.grad(triton_rms(x.detach(), w).pow(2).sum(), [w])
    rdx, rdw = torch.autograd.grad(rms_norm_reference(x, w, 1e-6).pow(2).sum(), [x, w])
    torch.testing.assert_close(dx, rdx, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dw, rdw, atol=1e-5, rtol=1e-5)


def test_rms_norm_saves_what_the_torch_path_saves():
    x, w = norm_inputs(torch.bfloat16, shape=(512, 64))
    lean = saved_bytes(triton_rms, x, w)
    assert lean == saved_bytes(lambda x, w: rms_norm(x, w, 1e-6, backend="torch"), x, w) == 512 * 4


def mlp_inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, 16, generator=g).to(dtype).requires_grad_()
    ws = [(torch.randn(*s, generator=g) * 0.3).to(dtype).requires_grad_() for s in ((40, 16), (40, 16), (16, 40))]
    return x, *ws


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_mlp_matches_the_reference(dtype, blocks):
    args = mlp_inputs(dtype)  # I = 40: "small" blocks make 3 column blocks, the last one masked
    out, got = grads(triton_mlp, *args)
    ref, want = grads(swiglu_mlp_reference, *args)
    torch.testing.assert_close(out, ref)
    tol = GRAD_TOL[dtype] if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_swiglu_elementwise_kernels_round_as_torch(dtype, blocks):
    # silu in fp32 rounded to the dtype, then each product rounded: where exp agrees, the same bits.
    g = torch.Generator().manual_seed(3)
    gate, up, d_prod = ((torch.randn(37, 70, generator=g) * s).to(dtype) for s in (4, 1, 1))
    act = F.silu(gate)
    d_gate, d_up = host.swiglu_grads(d_prod.clone(), gate, up)
    for got, want in ((host.swiglu_product(gate, up), act * up), (d_up, d_prod * act),
                      (d_gate, torch.ops.aten.silu_backward(d_prod * up, gate))):
        torch.testing.assert_close(got, want, atol=0, rtol=0) if dtype == torch.bfloat16 else \
            torch.testing.assert_close(got, want)


def test_swiglu_mlp_saves_what_the_torch_path_saves():
    args = mlp_inputs(torch.float32)
    assert saved_bytes(triton_mlp, *args) == saved_bytes(lambda *a: swiglu_mlp(*a, backend="torch"), *args)


def test_swiglu_mlp_weights_without_grad():
    x, wg, wu, wd = mlp_inputs(torch.float32)
    (dx,) = torch.autograd.grad(triton_mlp(x, wg.detach(), wu.detach(), wd.detach()).sum(), [x])
    (rdx,) = torch.autograd.grad(swiglu_mlp_reference(x, wg, wu, wd).sum(), [x])
    torch.testing.assert_close(dx, rdx)


def test_under_autocast_with_fp32_weights():
    args = mlp_inputs(torch.float32)
    x, w = norm_inputs(torch.float32, shape=(3, 7, 64))
    results = []
    for mlp, norm in ((swiglu_mlp_reference, rms_norm_reference), (triton_mlp, lambda x, w, eps: triton_rms(x, w))):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, normed = mlp(*args), norm(x, w, 1e-6)
        assert out.dtype == torch.bfloat16 and normed.dtype == torch.float32
        g = torch.autograd.grad(out.float().pow(2).sum() + normed.float().pow(2).sum(), [*args, x, w])
        results.append((out, normed, g))
    (ref_out, ref_normed, ref_grads), (out, normed, got) = results
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(normed, ref_normed)
    for a, b in zip(got, ref_grads):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


def test_empty_inputs():
    x = torch.zeros(0, 64, requires_grad=True)
    w = torch.ones(64, requires_grad=True)
    out = triton_rms(x, w)
    assert out.shape == (0, 64)
    dx, dw = torch.autograd.grad(out.sum(), [x, w])
    assert dx.shape == (0, 64) and torch.equal(dw, torch.zeros(64))


def test_bad_backend_and_dtype_errors_name_the_argument(monkeypatch):
    x, w = norm_inputs(torch.float32, shape=(2, 8))
    mlp = mlp_inputs(torch.float32)
    for bad in ("cuda", None, "Triton"):
        with pytest.raises(ValueError, match="backend must be 'auto', 'torch' or 'triton'"):
            rms_norm(x, w, 1e-6, backend=bad)
        with pytest.raises(ValueError, match="backend must be"):
            swiglu_mlp(*mlp, backend=bad)
    with pytest.raises(ValueError, match="x is float64"):
        triton_rms(x.double(), w)
    with pytest.raises(ValueError, match="w_down is float64"):
        triton_mlp(*mlp[:3], mlp[3].double())
    # "auto" takes float64 to the torch path (CPU tensors: always the torch path)
    x64, w64 = x.double(), w.double()
    assert torch.equal(rms_norm(x64, w64, 1e-6), rms_norm_reference(x64, w64, 1e-6))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            triton_rms(x, w)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, width", [(4096, 6144), (512, 20000)], ids=["glm5_hidden", "looped_row"])
def test_gpu_auto_path_against_torch_path(rows, width):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(rows, width, device="cuda", generator=g) * 2).bfloat16().requires_grad_()
    w = (1 + 0.1 * torch.randn(width, device="cuda", generator=g)).bfloat16().requires_grad_()
    dy = torch.randn(rows, width, device="cuda", generator=g).bfloat16()
    out = rms_norm(x, w, 1e-6)  # auto: the Triton kernels on CUDA
    ref = rms_norm(x, w, 1e-6, backend="torch")
    assert (out != ref).float().mean() < 1e-3  # an ulp where an fp32 inverse RMS differs in its last bit
    torch.testing.assert_close(out, ref)
    dx, dw = torch.autograd.grad(out, [x, w], dy)
    dx2, dw2 = torch.autograd.grad(rms_norm(x, w, 1e-6), [x, w], dy)
    assert torch.equal(dx, dx2) and torch.equal(dw, dw2)  # deterministic: no atomics
    rdx, rdw = torch.autograd.grad(ref, [x, w], dy)
    torch.testing.assert_close(dx, rdx, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(dw.float(), rdw.float(), atol=1e-2 * rdw.abs().max().item(), rtol=1e-2)

    inter = 2048 if width > 8192 else 12288
    xm = (torch.randn(rows, width, device="cuda", generator=g)).bfloat16().requires_grad_()
    ws = [(torch.randn(*s, device="cuda", generator=g) * s[1] ** -0.5).bfloat16().requires_grad_()
          for s in ((inter, width), (inter, width), (width, inter))]
    out = swiglu_mlp(xm, *ws)
    ref = swiglu_mlp(xm, *ws, backend="torch")
    torch.testing.assert_close(out, ref)
    dyo = torch.randn(out.shape, device="cuda", generator=g).bfloat16()
    got = torch.autograd.grad(out, [xm, *ws], dyo)
    want = torch.autograd.grad(ref, [xm, *ws], dyo)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2 * b.abs().max().item(), rtol=2e-2)
