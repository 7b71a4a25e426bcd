"""MLA's absorbed query: the MLA sparse attention op (forward, and its backward's rebuild), its
reference and the MLA model patches build it the same way."""

from __future__ import annotations

import torch


def absorbed_query(q_nope, q_rot, w_uk):
    """MLA's absorbed query ``[q_nope . W_UK per head, q_rot]`` [B, S, H, C + R], in q_nope's dtype.

    Where autograd need not see it (the sparse op's forward and its backward's rebuild), the per-head
    product is written straight into the query's first C columns and q_rot copied after it: the same
    batched product as ``einsum`` + ``cat`` (the same bits), without the product's own buffer and the
    concatenation's pass over it.
    torch.compile cannot trace a product into a strided ``out=``: compiled code takes einsum + cat.
    """
    w = w_uk.to(q_nope.dtype)
    tracked = torch.is_grad_enabled() and (q_nope.requires_grad or q_rot.requires_grad or w.requires_grad)
    if tracked or torch.compiler.is_compiling():
        q_latent = torch.einsum("bshn,hnc->bshc", q_nope, w)
        return torch.cat([q_latent, q_rot.to(q_latent.dtype)], dim=-1)
    B, S, H, N = q_nope.shape
    C, R = w.shape[-1], q_rot.shape[-1]
    out = torch.empty(B, S, H, C + R, dtype=q_nope.dtype, device=q_nope.device)
    torch.bmm(q_nope.reshape(B * S, H, N).transpose(0, 1), w, out=out.view(B * S, H, C + R).transpose(0, 1)[..., :C])
    out[..., C:] = q_rot
    return out
