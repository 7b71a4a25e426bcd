"""HyTopK's public function and custom op: exact top-k of the lightning-indexer scores.

The custom op ``torch.ops.hyscale.hytopk`` is what selective checkpointing sees (selection replay);
its body runs the Triton path (``host.hytopk_triton``) or the torch reference (``naive``).
"""

from __future__ import annotations

import torch

from ..checks import (
    check_cu_seqlens,
    check_dim,
    check_num_keys,
    check_same_device,
    check_tensor,
    check_topk,
    resolve_backend,
)
from ..kept_ops import kept_call
from . import selection_counts
from .host import HAS_TRITON, hytopk_triton
from .naive import hytopk_reference, selected_lse

# ----------------------------------------------------------------------------- custom op


@torch.library.custom_op("hyscale::hytopk", mutates_args=())
def hytopk_op(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    topk: int,
    cu_seqlens: torch.Tensor | None,
    window_start: torch.Tensor | None,
    relu: bool,
    check_nan: bool,
    backend: str,
    return_scores: bool = True,
    return_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dispatcher-visible HyTopK: (indices int32 [B, S, topk], scores fp32 [B, S, topk], lse fp32 [B, S]).

    With ``return_scores=False`` the scores are ``[B, S, 0]`` (the Triton path then never writes
    them: at 1M tokens and topk 2048 they would be another 8 GiB); with ``return_lse=False`` the
    lse is ``[B, 0]``. A replaying checkpoint keeps all three outputs.
    """
    selection_counts.record_selection_run()  # replayed selections never get here (selection_stats)
    if backend == "triton":
        return hytopk_triton(
            q, k, w, topk, cu_seqlens=cu_seqlens, window_start=window_start, relu=relu, check_nan=check_nan,
            return_scores=return_scores, return_lse=return_lse,
        )  # fmt: skip
    indices, scores = hytopk_reference(
        q, k, w, topk, cu_seqlens=cu_seqlens, window_start=window_start, relu=relu, check_nan=check_nan
    )
    return indices, (scores if return_scores else scores[..., :0].clone()), selected_lse(scores, return_lse)


@hytopk_op.register_fake
def _(q, k, w, topk, cu_seqlens, window_start, relu, check_nan, backend, return_scores=True, return_lse=False):
    B, S = q.shape[:2]
    n_scores = topk if return_scores else 0
    return (q.new_empty(B, S, topk, dtype=torch.int32), q.new_empty(B, S, n_scores, dtype=torch.float32),
            q.new_empty(B, S if return_lse else 0, dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    # A selection is not differentiable and the scores are a by-product to inspect; the indexer
    # learns from indexer_kl_loss (docs/design.md section 2). Without this registration the
    # outputs of a call on inputs that need grad claimed requires_grad and failed in backward
    # ("no autograd formula was registered").
    ctx.mark_non_differentiable(*output)


def _backward(ctx, d_indices, d_scores, d_lse):  # never called: the outputs are non-differentiable
    return (None,) * 11


hytopk_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- public function


def hytopk(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    topk: int,
    *,
    cu_seqlens: torch.Tensor | None = None,
    window_start: torch.Tensor | None = None,
    relu: bool = True,
    return_scores: bool = False,
    return_lse: bool = False,
    check_nan: bool = False,
    backend: str = "auto",
):
    """Exact top-k of the lightning-indexer scores, without a score table.

    ``I[b, i, s] = sum_h w[b, i, h] * ReLU(q[b, i, h, :] . k[b, s, :])`` for every key ``s``
    visible to query ``i``, which sits at key position ``T - S + i``: visible means
    ``start <= s <= T - S + i``, with ``start`` the first key of the query's packed sequence
    (``cu_seqlens``) or ``window_start`` (e.g. the first non-pad key), else 0.

    Selection rule (unique set): score descending, then key index ascending; ``-0.0`` equals
    ``+0.0``; invisible keys are never selected. Non-finite scores: a score is NaN when the
    weighted head sum is not finite (a head's dot product ``q . k`` of ``+inf`` or NaN, from an fp32
    overflow or a NaN/inf input, always makes it so; ReLU takes a ``-inf`` one to its exact 0). NaN scores rank
    below every finite score (among themselves by key index), are returned as NaN, and raise
    ``ValueError`` with ``check_nan=True``. Both backends follow this rule. (An overflow shows as
    inf or NaN depending on the summation order, hence one class for both; only a dot product
    whose partial sums leave the fp32 range while its total would not can still overflow in one
    summation order and not in another.)

    Args:
        q: indexer queries ``[B, S, H, D]``, bf16/fp16/fp32.
        k: indexer keys ``[B, T, D]`` (one key per token, shared by the heads), same dtype family.
        w: per-query head weights ``[B, S, H]``, fp32 (scales folded in). ``H >= 1`` and
            ``D >= 1`` (else ``ValueError``); ``T <= 2**31``.
        topk: ``0 < K <= 2**31 - 1``. With K >= visible keys every visible key is returned.
        cu_seqlens: optional int32/int64 ``[N + 1]`` packed-sequence offsets (needs B = 1, S = T).
        window_start: optional integer ``[B]`` or ``[B, S]``: first visible key per row/query.
            Values <= 0 add no bound; a value past the query's position (also one > T) leaves
            that query no visible key: its row is all ``-1``.
        relu: apply ReLU to each head's logit (family-specific; default on).
        return_scores: also return the fp32 scores of the selected keys.
        return_lse: also return each query's log-sum-exp of the selected keys' scores, fp32 ``[B, S]``
            (``-inf`` for a query without a key, NaN where a selected score is NaN): the indexer KL's
            normaliser over the selection (``indexer_kl_loss_given_target(..., index_lse=...)``), which
            the Triton path forms from the scores its final selection holds anyway (no score table,
            no ``[B, S, topk]`` scores written).
        check_nan: raise ``ValueError`` if a visible key scores NaN, i.e. is not finite (the
            Triton path then syncs).
        backend: ``"auto"`` | ``"torch"`` | ``"triton"`` (see ``hyscale_hf.kernels``). The Triton
            kernel never writes the score table: extra memory is the outputs plus a candidate
            scratch of about ``host.SCRATCH_BYTES`` (1 GiB), reused over query chunks, and the final
            selection's index bitmaps (at most ``host.FINALIZE_SCRATCH_BYTES``, 128 MiB). It computes in
            fp32 from bf16/fp16/fp32 inputs (fp32 dot products in IEEE mode) and is deterministic;
            fp64 inputs and ``min(topk, T) > 4096`` take the torch path (same exact contract).
            On sm_90 (Hopper) with 32 or 64 heads and at least 64K keys per sequence, the scoring
            pass runs a warp-specialised Gluon kernel (same contract). Inputs longer than one
            chunk of the scratch alternate their query chunks between the current CUDA stream and
            a side stream, which waits for the current stream first and is joined back into it
            before the call returns (``HyTopKConfig.lanes``; neither step waits on the host).
            ``hytopk_stats()`` counts the rows whose candidate buffer was refined. Tile shapes and
            kernel variants are chosen per call through ``hyscale_hf.kernels.topk.hytopk_triton``
            (``HyTopKConfig``; also its scan-only and scoring-only profiles).

    Returns:
        ``indices`` int32 ``[B, S, topk]``: selected key indices sorted ascending, ``-1`` padded;
        with ``return_scores`` also ``scores`` fp32 ``[B, S, topk]`` aligned with ``indices``
        (``-inf`` in padded slots; the Triton path returns a zero score as ``+0.0``, and with
        continuous inputs the Triton scores can differ from the reference's in the last bits
        because the head sum runs in another order); with ``return_lse`` then ``lse`` fp32 ``[B, S]``
        (the tuple in that order). No output carries a gradient (the
        scores are not differentiable; the indexer trains through ``indexer_kl_loss``). Empty
        inputs (``B``, ``S`` or ``T`` = 0) give outputs of that shape (``T = 0``: all ``-1``).
    """
    check_tensor("q", q, 4, "[B, S, H, D]")
    B, S, H, D = q.shape
    check_tensor("k", k, 3, f"[B={B}, T, D={D}]")
    check_dim("k", k, 0, B, f"[B={B}, T, D={D}]")
    check_dim("k", k, 2, D, f"[B={B}, T, D={D}]")
    T = k.shape[1]
    check_tensor("w", w, 3, f"[B={B}, S={S}, H={H}] float32", dtypes=(torch.float32, torch.float64))
    check_dim("w", w, 0, B, f"[B={B}, S={S}, H={H}]")
    check_dim("w", w, 1, S, f"[B={B}, S={S}, H={H}]")
    check_dim("w", w, 2, H, f"[B={B}, S={S}, H={H}]")
    check_topk(topk)
    # No heads (or zero-width heads) would make every score an empty sum, 0: a selection of the
    # first K keys that no indexer means. Refused rather than defined.
    if H < 1:
        raise ValueError(f"q must have H >= 1 heads (shape [B, S, H, D]), got shape {tuple(q.shape)}")
    if D < 1:
        raise ValueError(f"q must have D >= 1 dims per head (shape [B, S, H, D]), got shape {tuple(q.shape)}")
    check_num_keys("k", T)
    if S > T:
        raise ValueError(f"q has S = {S} queries but k has only T = {T} keys; need S <= T")
    check_same_device(q=q, k=k, w=w, cu_seqlens=cu_seqlens, window_start=window_start)
    check_cu_seqlens(cu_seqlens, B, S, T, q.device)
    if window_start is not None:
        check_tensor("window_start", window_start, window_start.dim(), "[B] or [B, S] integer",
                     dtypes=(torch.int32, torch.int64))
        if tuple(window_start.shape) not in ((B,), (B, S)):
            raise ValueError(f"window_start must have shape [B={B}] or [B={B}, S={S}], got {tuple(window_start.shape)}")
    chosen = resolve_backend(backend, q.device, HAS_TRITON)
    # a replaying checkpoint keeps the op's outputs (hyscale_hf.replay)
    indices, scores, lse = kept_call(hytopk_op, q, k, w, topk, cu_seqlens, window_start, relu, check_nan, chosen,
                                     return_scores, return_lse)
    outputs = (indices,) + ((scores,) if return_scores else ()) + ((lse,) if return_lse else ())
    return outputs if len(outputs) > 1 else indices
