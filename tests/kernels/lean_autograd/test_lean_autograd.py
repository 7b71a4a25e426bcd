"""rms_norm and swiglu_mlp: the same forward bits as the plain torch code, the same gradients,
fewer saved bytes. (rms_norm has no float64 gradcheck: like Transformers' RMSNorm it computes its
statistics in fp32 whatever the input dtype; its gradients are compared with autograd's in fp32.)"""

import pytest
import torch

from hyscale_hf.kernels import rms_norm, swiglu_mlp
from hyscale_hf.kernels.lean_autograd.naive import rms_norm_reference, swiglu_mlp_reference


def saved_bytes(fn, *args) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``fn(*args)`` runs, leaving
    out the inputs themselves (held by the caller anyway)."""
    inputs = {a.untyped_storage().data_ptr() for a in args if torch.is_tensor(a)}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in inputs:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(seen.values())


def grads(fn, *args, seed=1):
    out = fn(*args)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return out, torch.autograd.grad((out.float() * w.float()).sum(), [a for a in args if torch.is_tensor(a)])


def norm_inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(3, 7, 64, generator=g) * 3).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(64, generator=g)).to(dtype).requires_grad_()
    return x, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_forward_is_bit_identical_and_gradients_match(dtype):
    x, w = norm_inputs(dtype)
    out, (dx, dw) = grads(lambda x, w: rms_norm(x, w, 1e-6), x, w)
    ref, (rdx, rdw) = grads(lambda x, w: rms_norm_reference(x, w, 1e-6), x, w)
    assert torch.equal(out, ref)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(dx, rdx, **tol)
    torch.testing.assert_close(dw, rdw, **tol)


def test_rms_norm_saves_no_fp32_copy_of_a_bf16_input():
    _, w = norm_inputs(torch.bfloat16)
    x = torch.randn(512, 64).to(torch.bfloat16).requires_grad_()
    lean = saved_bytes(lambda x, w: rms_norm(x, w, 1e-6), x, w)
    plain = saved_bytes(lambda x, w: rms_norm_reference(x, w, 1e-6), x, w)
    assert lean == 512 * 4  # the fp32 inverse RMS per row, nothing else beyond the inputs
    assert plain >= 512 * 64 * 4  # the plain code keeps an fp32 copy of x


def mlp_inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, 16, generator=g).to(dtype).requires_grad_()
    ws = [(torch.randn(*s, generator=g) * 0.3).to(dtype).requires_grad_() for s in ((40, 16), (40, 16), (16, 40))]
    return x, *ws


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_mlp_forward_is_bit_identical_and_gradients_match(dtype):
    args = mlp_inputs(dtype)
    out, got = grads(swiglu_mlp, *args)
    ref, want = grads(swiglu_mlp_reference, *args)
    assert torch.equal(out, ref)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)


def test_swiglu_mlp_gradcheck_in_float64():
    assert torch.autograd.gradcheck(swiglu_mlp, mlp_inputs(torch.float64))


def test_swiglu_mlp_saves_two_intermediate_tensors_instead_of_four():
    args = mlp_inputs(torch.float32)
    lean, plain = saved_bytes(swiglu_mlp, *args), saved_bytes(swiglu_mlp_reference, *args)
    inter = 2 * 5 * 40 * 4
    assert lean == 2 * inter and plain == 4 * inter


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_mlp_without_output_saves_the_same_and_gives_the_same_gradients(dtype):
    """compute_output=False (a caller that drops the output): zeros out, the same saved tensors, and
    a backward fed the same output gradient gives the same gradients bit for bit."""
    args = mlp_inputs(dtype)
    out = swiglu_mlp(*args)
    skipped = swiglu_mlp(*args, compute_output=False)
    assert skipped.shape == out.shape and skipped.dtype == out.dtype and not skipped.any()
    assert saved_bytes(lambda *a: swiglu_mlp(*a, compute_output=False), *args) == saved_bytes(swiglu_mlp, *args)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    for a, b in zip(torch.autograd.grad(skipped, args, dy), torch.autograd.grad(out, args, dy)):
        assert torch.equal(a, b)


def test_swiglu_mlp_weights_without_grad():
    x, wg, wu, wd = mlp_inputs(torch.float32)
    (dx,) = torch.autograd.grad(swiglu_mlp(x, wg.detach(), wu.detach(), wd.detach()).sum(), [x])
    (rdx,) = torch.autograd.grad(swiglu_mlp_reference(x, wg, wu, wd).sum(), [x])
    torch.testing.assert_close(dx, rdx)


def test_bad_shapes_name_the_argument():
    x, wg, wu, wd = mlp_inputs(torch.float32)
    with pytest.raises(ValueError, match="w_up"):
        swiglu_mlp(x, wg, wu[:-1], wd)
    with pytest.raises(ValueError, match="w_down"):
        swiglu_mlp(x, wg, wu, wd[:, :-1])
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(15), 1e-6)


def test_under_autocast_with_fp32_weights_the_same_as_plain_autograd():
    # Trainer(bf16=True) over fp32 weights: the forward's matmuls run in bf16, backward runs outside
    # autocast, and every gradient comes back in its input's dtype.
    args = mlp_inputs(torch.float32)
    x, w = norm_inputs(torch.float32)
    results = []
    for mlp, norm in ((swiglu_mlp_reference, rms_norm_reference), (swiglu_mlp, rms_norm)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = mlp(*args)
            normed = norm(x, w, 1e-6)
        assert out.dtype == torch.bfloat16
        grads = torch.autograd.grad(out.float().pow(2).sum() + normed.float().pow(2).sum(), [*args, x, w])
        results.append((out, normed, grads))
    (ref_out, ref_normed, ref_grads), (out, normed, grads) = results
    assert torch.equal(out, ref_out) and torch.equal(normed, ref_normed)
    for a, b in zip(grads, ref_grads):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
