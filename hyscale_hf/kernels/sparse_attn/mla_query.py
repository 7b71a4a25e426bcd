"""MLA's absorbed query: the MLA sparse attention op (forward, and its backward's rebuild), its
reference and the MLA model patches build it the same way."""

from __future__ import annotations

import torch


def absorbed_query(q_nope, q_rot, w_uk):
    """MLA's absorbed query ``[q_nope . W_UK per head, q_rot]`` [B, S, H, C + R], in q_nope's dtype."""
    q_latent = torch.einsum("bshn,hnc->bshc", q_nope, w_uk.to(q_nope.dtype))
    return torch.cat([q_latent, q_rot.to(q_latent.dtype)], dim=-1)
