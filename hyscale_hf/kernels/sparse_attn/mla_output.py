"""MLA's value up-projection in absorbed form: per head ``o[b, s, h] = o_latent[b, s, h] @ W_UV[h]^T``.

``einsum("bshc,hvc->bshv")`` runs it as one batched product over heads, whose output is head-major
([H, B*S, V]) and reaches the caller as a permuted view: reshaping it to o_proj's [B, S, H * V] input
then copies all of it (GLM-5 at 128K tokens: 4 GiB, in forward and in the checkpoint's recompute).
Here each product writes straight into a token-major buffer through a strided ``out=`` view (as
``mla_query.absorbed_query`` does), and backward does the same for the latent's gradient, so the
result is contiguous and the reshape is a view. The same batched products as the einsum's; a BLAS
may pick another kernel for the strided output, so the bits can differ within rounding.
"""

from __future__ import annotations

import torch


def _per_head(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """a [B, S, H, K] @ w [H, K, N] per head -> [B, S, H, N], contiguous."""
    B, S, H, K = a.shape
    N = w.shape[-1]
    out = torch.empty(B, S, H, N, dtype=a.dtype, device=a.device)
    torch.bmm(a.reshape(B * S, H, K).transpose(0, 1), w, out=out.view(B * S, H, N).transpose(0, 1))
    return out


class _AbsorbedOutputFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o_latent, w_uv):
        ctx.save_for_backward(o_latent, w_uv)
        return _per_head(o_latent, w_uv.transpose(1, 2))

    @staticmethod
    def backward(ctx, g):
        o_latent, w_uv = ctx.saved_tensors
        d_latent = d_w = None
        if ctx.needs_input_grad[0]:
            d_latent = _per_head(g, w_uv)
        if ctx.needs_input_grad[1]:
            B, S, H, V = g.shape
            # [H, V, B*S] @ [H, B*S, C]: both strided views, no copy
            d_w = torch.bmm(g.reshape(B * S, H, V).permute(1, 2, 0), o_latent.reshape(B * S, H, -1).transpose(0, 1))
        return d_latent, d_w


def absorbed_output(o_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """``einsum("bshc,hvc->bshv", o_latent, w_uv)`` [B, S, H, V], contiguous; both in one dtype.

    Args:
        o_latent: ``[B, S, H, C]`` the attention's output in the latent space.
        w_uv: ``[H, V, C]`` the value up-projection.
    """
    if o_latent.dim() != 4 or w_uv.dim() != 3 or w_uv.shape[0] != o_latent.shape[2] or w_uv.shape[2] != o_latent.shape[3]:
        raise ValueError(f"o_latent must be [B, S, H, C] and w_uv [H, V, C], got {list(o_latent.shape)} and "
                         f"{list(w_uv.shape)}")
    if o_latent.dtype != w_uv.dtype:
        raise ValueError(f"o_latent and w_uv must share one dtype, got {o_latent.dtype} and {w_uv.dtype}")
    if torch.compiler.is_compiling():  # a product into a strided out= does not trace
        return torch.einsum("bshc,hvc->bshv", o_latent, w_uv)
    return _AbsorbedOutputFn.apply(o_latent, w_uv)
