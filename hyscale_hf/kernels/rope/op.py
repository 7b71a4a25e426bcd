"""``rotary_embedding``: RoPE on some dims of every head, forward and backward in one pass each.

Transformers applies RoPE as a handful of elementwise ops (slices, four products, a sum and a
difference, a concatenation), each one pass over the rotated tensor, and the indexer's RoPE on part
of a head adds a split and a concatenation of its own; autograd then runs as many passes backward,
in the forward, in a checkpointed layer's recompute and in backward. On the Triton path here each
direction is one kernel that reads the input once and writes the whole head (the other dims copied),
with the same roundings as the torch ops (``triton_kernels.py``), so the results are the same bits.

The torch path is those ops: Transformers' interleaved RoPE as it is written since 5.24 (products of
the even and odd slices, the first half of the tables), and its plain RoPE (``rotate_half``) in the
same slice form, which computes the same bits. ``naive.rotary_embedding_reference`` is the
de-interleave + ``rotate_half`` form, the tests' oracle.
"""

from __future__ import annotations

import torch

from ..checks import check_backend, check_same_device, check_tensor, resolve_backend

try:  # Triton is a Linux x86-64 dependency; elsewhere only the torch path exists.
    import triton

    from . import triton_kernels as kernels
except ImportError:  # pragma: no cover
    triton = None

HAS_TRITON = triton is not None
# Dtypes the kernel takes: 16-bit, where every product of two inputs is exact in fp32 before its rounding.
TRITON_DTYPES = (torch.float16, torch.bfloat16)
BLOCK_ROWS = 16


def _torch_rope(x, cos, sin, interleaved: bool, r: int, rot0: int) -> torch.Tensor:
    rot = x[..., rot0:rot0 + r]
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)
    if interleaved:
        c1, s1 = c[..., : r // 2], s[..., : r // 2]
        c2, s2 = c1, s1
        a1, a2 = rot[..., 0::2], rot[..., 1::2]
    else:
        c1, c2 = c[..., : r // 2], c[..., r // 2:]
        s1, s2 = s[..., : r // 2], s[..., r // 2:]
        a1, a2 = rot[..., : r // 2], rot[..., r // 2:]
    parts = [a1 * c1 - a2 * s1, a2 * c2 + a1 * s2]
    if rot0 > 0:
        parts.insert(0, x[..., :rot0])
    if rot0 + r < x.shape[-1]:
        parts.append(x[..., rot0 + r:])
    return torch.cat(parts, dim=-1)


def _launch(x, cos, sin, interleaved: bool, r: int, rot0: int, bwd: bool) -> torch.Tensor:
    B, S, H, D = x.shape
    out = torch.empty(B, S, H, D, dtype=x.dtype, device=x.device)
    rows = B * S * H
    if rows == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():  # one set of table strides, unit last
        cos, sin = cos.contiguous(), sin.contiguous()
    table_b = cos.stride(0) if cos.shape[0] == B else 0  # one table for the whole batch
    kernels.rope_kernel[(triton.cdiv(rows, BLOCK_ROWS),)](
        x, cos, sin, out, rows, S, H,
        x.stride(0), x.stride(1), x.stride(2), table_b, cos.stride(1), *out.stride()[:3],
        D=D, ROT0=rot0, HALF=r // 2, BLOCK_HALF=triton.next_power_of_2(max(r // 2, 1)),
        BLOCK_D=triton.next_power_of_2(D), BLOCK_M=BLOCK_ROWS, INTERLEAVED=interleaved, BWD=bwd,
        enable_fp_fusion=False,  # else a product and the sum fuse into one multiply-add: another rounding
    )  # fmt: skip
    return out


class _RopeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, interleaved, r, rot0):
        ctx.save_for_backward(cos, sin)
        ctx.args = (interleaved, r, rot0)
        return _launch(x, cos, sin, interleaved, r, rot0, bwd=False)

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        return _launch(g, cos, sin, *ctx.args, bwd=True), None, None, None, None, None


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool,
                     rotary_dims: int | None = None, rotary_first: bool = True, backend: str = "auto") -> torch.Tensor:
    """RoPE on the first (``rotary_first``) or last ``rotary_dims`` dims of every head of ``x``.

    Args:
        x: ``[B, S, H, D]`` (any strides; the kernel reads rows with a unit last stride).
        cos, sin: ``[B, S, r]`` tables (or ``[1, S, r]``, one for the batch), ``r = rotary_dims``
            (default D), in x's dtype for the kernel:
            Transformers' rotary embeddings (``cat(freqs, freqs)``; the interleaved form reads the first half).
        interleaved: the rotated dims are pairs (x0, x1), (x2, x3), ... and come out de-interleaved (the
            rotated first members, then the second), as Transformers' ``apply_rotary_pos_emb_interleave``;
            otherwise halves, as its ``apply_rotary_pos_emb`` (``rotate_half``).
        backend: ``"auto"`` (Triton on CUDA for float16 / bfloat16 x with tables of its dtype that need no
            gradient, else torch), ``"torch"`` or ``"triton"``.

    Returns: ``[B, S, H, D]`` contiguous (torch path: as its ``cat`` makes it), the rotated dims in place
    of the input's and the others copied. Both paths give the bits of the torch ops.
    """
    check_backend(backend)
    check_tensor("x", x, 4, "[B, S, H, D]")
    B, S, H, D = x.shape
    r = D if rotary_dims is None else int(rotary_dims)
    if not (0 < r <= D and r % 2 == 0):
        raise ValueError(f"rotary_dims must be even and in (0, D={D}], got {rotary_dims}")
    doc = f"[B={B} (or 1), S={S}, r={r}]"
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(name, t, 3, doc)
        if t.shape[0] not in (1, B) or tuple(t.shape[1:]) != (S, r):
            raise ValueError(f"{name} must be {doc}, got {list(t.shape)}")
    check_same_device(x=x, cos=cos, sin=sin)
    rot0 = 0 if rotary_first else D - r
    reasons = []
    if x.dtype not in TRITON_DTYPES:
        reasons.append(f"x is {x.dtype} (the kernel takes float16 and bfloat16)")
    if cos.dtype != x.dtype or sin.dtype != x.dtype:
        reasons.append(f"cos / sin are {cos.dtype} / {sin.dtype}, not x's {x.dtype}")
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        reasons.append("cos / sin need a gradient (the kernel gives only x's)")
    if backend == "auto" and reasons:
        backend = "torch"
    if resolve_backend(backend, x.device, HAS_TRITON) == "torch":
        return _torch_rope(x, cos, sin, interleaved, r, rot0)
    if reasons:
        raise ValueError(f"backend='triton' cannot take these inputs: {'; '.join(reasons)}")
    return _RopeFn.apply(x, cos, sin, bool(interleaved), r, rot0)
