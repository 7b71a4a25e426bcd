"""Shared test inputs and a brute-force oracle for the top-k contract (docs/design.md section 2).

The oracle sorts Python tuples, independent of the int64-key trick the reference uses.
"""

from __future__ import annotations

import math

import torch


def brute_force_topk(scores_row, visible_row, topk):
    """Indices (ascending, -1 padded) of the top-k visible entries: score desc, index asc,
    -0.0 == +0.0, NaN below -inf."""

    def rank(i):
        s = float(scores_row[i])
        if math.isnan(s):
            return (1, 0.0, i)  # after every number
        return (0, -s, i)  # -(-0.0) == 0.0 == -(+0.0): equal ranks, index decides

    order = sorted((i for i in range(len(scores_row)) if visible_row[i]), key=rank)
    chosen = sorted(order[:topk])
    return chosen + [-1] * (topk - len(chosen))


def integer_inputs(B, S, T, H, D, *, lo=-3, hi=4, dtype=torch.float32, generator=None):
    """Small-integer q, k, w: every product and sum is exact in fp32, so all backends agree bitwise."""
    g = generator
    q = torch.randint(lo, hi, (B, S, H, D), generator=g).to(dtype)
    k = torch.randint(lo, hi, (B, T, D), generator=g).to(dtype)
    w = torch.randint(0, 3, (B, S, H), generator=g).float()
    return q, k, w


def adversarial_inputs(kind, B, S, T, H, D, generator=None):
    """Inputs whose score rows stress the tie rule; integer-valued so scores are exact."""
    g = generator
    if kind == "zero_plateau":  # ReLU zeroes most keys: far more than K exact-zero ties
        q = torch.randint(1, 3, (B, S, H, D), generator=g).float()
        k = -torch.randint(1, 3, (B, T, D), generator=g).float()
        k[:, ::7] = torch.randint(1, 3, (B, (T + 6) // 7, D), generator=g).float()
        w = torch.ones(B, S, H)
    elif kind == "all_zero":
        q = torch.zeros(B, S, H, D)
        k = torch.randint(-3, 4, (B, T, D), generator=g).float()
        w = torch.ones(B, S, H)
    elif kind == "monotone_up":  # score rises with the key index
        q = torch.ones(B, S, H, D)
        k = torch.arange(T).float()[None, :, None].expand(B, T, D).contiguous()
        w = torch.ones(B, S, H)
    elif kind == "monotone_down":
        q = torch.ones(B, S, H, D)
        k = (T - torch.arange(T)).float()[None, :, None].expand(B, T, D).contiguous()
        w = torch.ones(B, S, H)
    elif kind == "one_bucket":  # every score equal and positive: one huge histogram bucket
        q = torch.ones(B, S, H, D)
        k = torch.ones(B, T, D)
        w = torch.ones(B, S, H)
    elif kind == "negative_zero":  # w < 0 and relu off give -0.0 next to +0.0
        q = torch.randint(-1, 2, (B, S, H, D), generator=g).float()
        k = torch.randint(-1, 2, (B, T, D), generator=g).float()
        w = -torch.ones(B, S, H)
    else:
        raise ValueError(kind)
    return q, k, w


ADVERSARIAL_KINDS = ("zero_plateau", "all_zero", "monotone_up", "monotone_down", "one_bucket", "negative_zero")
