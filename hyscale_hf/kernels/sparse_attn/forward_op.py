"""The sparse attention's forward kernels as a dispatcher-visible op, so a checkpoint can keep their output.

Under gradient checkpointing a layer's forward runs twice: once in forward, once in backward's
recompute, which rebuilds what the backward reads. The attention's output ``o`` and ``lse`` are among
that (the attention's own backward and the output projection's read them), so the recompute reran the
forward kernels: for a converted SmolLM2 at 128K tokens about a sixth of the step's kernel time.
``hyscale::sparse_attention_forward`` (the kernels' launch, ``host.forward_launch``) lets the replay
policy (``hyscale_hf.replay``) keep its outputs where they are small: ``keep`` marks a call whose
``o`` and ``lse`` take no more memory than the selection the replay keeps anyway (``output_is_small``:
GQA rows such as 9 heads x 64, 1.2 KB a token against 8 KB of top-2048 indices; not MLA's 64 heads x
512 latent dims, 64 KB a token). The key lists are built outside the op (``host.forward_plan``): the
recompute builds them again for the backward.
"""

from __future__ import annotations

import torch

from ..kept_ops import kept_call
from .host import KeyLists, forward_launch, forward_plan


@torch.library.custom_op("hyscale::sparse_attention_forward", mutates_args=())
def sparse_attention_forward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    idx: torch.Tensor,
    num: torch.Tensor,
    bits: torch.Tensor,
    tile_q: int,
    scale: float,
    launch: list[int],
    keep: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [B, S, Hq, Dv] in q's dtype, lse [B, S, Hq] fp32) over the key lists (idx, num, bits, tile_q).
    ``keep`` is read only by the replay policy (``kept_by_replay``)."""
    return forward_launch(q, k, v, KeyLists(idx, num, bits, tile_q), scale, launch)


@sparse_attention_forward_op.register_fake
def _(q, k, v, idx, num, bits, tile_q, scale, launch, keep):
    B, S, Hq, _ = q.shape
    return q.new_empty(B, S, Hq, v.shape[3]), q.new_empty(B, S, Hq, dtype=torch.float32)


def output_is_small(q: torch.Tensor, v: torch.Tensor, indices: torch.Tensor) -> bool:
    """o and lse of a token take no more bytes than its index row (``Hq * (Dv * size + 4) <= K * 4``)."""
    Hq, Dv = q.shape[2], v.shape[3]
    return Hq * (Dv * q.element_size() + 4) <= indices.shape[2] * indices.element_size()


def kept_by_replay(args: tuple, kwargs: dict) -> bool:
    """The ``keep`` argument of one call of the op, as a selective-checkpoint policy receives it."""
    return bool(kwargs["keep"] if "keep" in kwargs else args[9])


def sparse_attention_forward(q, k, v, indices, scale: float, config, unique: bool = False):
    """o, lse and the key lists (saved for the backward) of ``indices``, the kernels run through the op."""
    lists, run, launch = forward_plan(q, k, v, indices, config, unique=unique)
    # a replaying checkpoint keeps small outputs (hyscale_hf.replay)
    o, lse = kept_call(sparse_attention_forward_op, q, k, v, run.idx, run.num, run.bits, run.tile_q, float(scale),
                       launch, output_is_small(q, v, indices))
    return o, lse, lists
