"""Sparse attention's public function and autograd wrapper (GQA/MHA and MLA absorbed).

The Triton path: ``host.py`` launches the kernels of ``triton_kernels.py`` (whose docstring gives
the design). The torch path: ``masked_dense`` (matmuls over all keys under the selection's mask)
where the key range is short, else ``naive.sparse_attention_reference`` (autograd through gathers).
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F

from ..checks import (
    check_dim,
    check_indices,
    check_num_keys,
    check_same_device,
    check_sorted_rows,
    check_tensor,
    resolve_backend,
)
from .forward_op import sparse_attention_forward
from .head_probs import HeadProbs, prob_sum_pass
from .host import (
    HAS_TRITON,
    KeyLists,
    SparseAttentionConfig,
    padded_head_dims,
    resolve_config,
    sparse_attention_bwd,
    triton_dtype_reason,
    v_grad_flows_into_k,
)
from .masked_dense import fits as masked_dense_fits
from .masked_dense import sparse_attention_masked_dense
from .naive import sparse_attention_reference


class _SparseAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, indices, scale, merge_dv, deterministic, config, unique, head_probs):
        o, lse, lists = sparse_attention_forward(q, k, v, indices, scale, config, unique=unique)
        rows = (indices,) if head_probs is not None else ()  # the slots the head sums are placed on
        ctx.save_for_backward(q, k, v, lists.idx, lists.num, lists.bits, o, lse, *rows)
        ctx.tile_q, ctx.mean_union = lists.tile_q, lists.mean_union
        ctx.scale, ctx.merge_dv, ctx.deterministic = scale, merge_dv, deterministic
        ctx.config, ctx.head_probs = config, head_probs
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, idx, num, bits, o, lse, *rows = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        lists = KeyLists(idx, num, bits, ctx.tile_q, ctx.mean_union)
        psum = None
        if ctx.head_probs is not None:
            psum = torch.zeros(rows[0].shape, dtype=torch.float32, device=q.device)
        dq, dk, dv, psum_done = sparse_attention_bwd(
            q, k, v, lists, o, lse, do, dlse, ctx.scale, ctx.merge_dv, ctx.deterministic, ctx.config, psum=psum
        )
        if ctx.head_probs is not None:
            ctx.head_probs.value = psum if psum_done else prob_sum_pass(q, k, rows[0], lse, ctx.scale, "triton")
            ctx.head_probs.tiles = lists if lists.tile_q else None
        return dq, dk, dv, None, None, None, None, None, None, None


def triton_sparse_attention(q, k, v, indices, scale, deterministic: bool = False, config=None, unique: bool = False,
                            head_probs: HeadProbs | None = None):
    """Differentiable Triton sparse attention: (o [B, S, Hq, Dv] in q's dtype, lse [B, S, Hq] fp32)."""
    merge_dv = v_grad_flows_into_k(k, v)
    return _SparseAttentionFn.apply(
        q, k, v, indices.contiguous(), float(scale), merge_dv, bool(deterministic), resolve_config(config),
        bool(unique), head_probs,
    )


def _pad_last(x: torch.Tensor, width: int) -> torch.Tensor:
    """x zero-padded to ``width`` in its last dim (differentiable: the gradient is sliced back)."""
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    *,
    scale: float | None = None,
    return_lse: bool = False,
    backend: str = "auto",
    deterministic: bool | None = None,
    config: SparseAttentionConfig | None = None,
    check_range: bool = True,
    unique_indices: bool = False,
    head_probs: HeadProbs | None = None,
):
    """``o[b, i, h] = sum_{s in S_i} softmax_s(scale * q[b, i, h] . k[b, s, g(h)]) v[b, s, g(h)]``.

    ``S_i`` is the set in ``indices[b, i]`` (one set per query, shared by all heads; ``-1``
    entries are skipped; a repeated index counts once per occurrence, as in the reference).
    ``g(h) = h // (Hq // Hkv)`` maps query heads to KV heads.
    MLA absorbed form: ``Hkv = 1``, ``k`` the latent rows ``[B, T, 1, 576]`` and ``v`` a view of
    their first 512 dims (``k[..., :512]``); gradients of both add into ``k``'s buffer.

    Args:
        q: ``[B, S, Hq, Dqk]`` bf16/fp16/fp32 (fp64 for gradcheck).
        k: ``[B, T, Hkv, Dqk]``; Hq must be a multiple of Hkv.
        v: ``[B, T, Hkv, Dv]``.
        indices: int32 ``[B, S, K]`` with entries in ``[-1, T)``.
        scale: softmax scale; default ``Dqk ** -0.5``.
        return_lse: also return the fp32 log-sum-exp ``[B, S, Hq]`` (``-inf`` for a query with no
            selected key, whose output is 0). The lse is differentiable too.
        backend: ``"auto"`` | ``"torch"`` | ``"triton"``. The Triton kernel takes q, k, v of one
            dtype (fp16/bf16/fp32) and every head dim: it tiles ``Dv`` a power of two >= 16 and
            ``Dqk`` a power of two >= 16 plus an optional power-of-two tail >= 16 (80 = 64 + 16,
            576 = 512 + 64), and other widths are zero-padded to the next such one
            (``host.padded_head_dims``: Dqk 24 -> 32, 112 -> 128; Dv 8 -> 16, 80/96/112 -> 128;
            padded copies of q, k, v then live for the backward, and the output is sliced back).
            ``"auto"`` uses the reference only for fp64 or mixed dtypes (and off CUDA).
        deterministic: Triton backward only. ``False``: dK/dV accumulate with fp32 atomics (fastest;
            the summation order, hence the last bits, vary between runs). ``True``: an ordered,
            atomic-free accumulation through a scratch buffer of at most ``config.det_scratch_bytes``
            (4 GiB) per chunk of queries (bit-reproducible, slower). ``None``
            (default) follows ``torch.are_deterministic_algorithms_enabled()``.
        config: Triton only: tile shapes and kernel variants (``SparseAttentionConfig``; None = the
            measured defaults, ``host.DEFAULT_CONFIG``). The tuning script sweeps it.
        check_range: read the indices' range and raise on entries outside ``[-1, T)`` (one host
            sync). ``False`` only for indices known to be in range, such as ``hytopk``'s: patched
            models pass it, so a training step does not wait on the GPU once per layer for it.
        unique_indices: the caller guarantees that no query lists a key twice (``hytopk``'s
            selections, windows). The Triton path's GQA query tiles then skip their repeat check,
            another host sync per call; a repeated key would then count once, not twice.
        head_probs: a ``HeadProbs`` to receive the head-summed probabilities ``[B, S, K]`` fp32 on each
            query's index slots (the indexer KL's target, as ``indexer_kl.attention_prob_sum`` gives it):
            filled in this call's backward on the Triton path (by the backward kernel itself unless it is
            the deterministic one), in its forward on the torch path. Every row must list its keys in
            ascending order, each once, with its -1 slots after them (``hytopk``'s rows; query tiles
            place a key's sum by its rank): checked with the range unless ``check_range=False``.

    Returns:
        ``o`` ``[B, S, Hq, Dv]`` in q's dtype (and ``lse`` when asked); differentiable in q, k, v.
        Non-finite logits, per (query, head): a NaN or ``+inf`` among the selected ones gives
        ``o = NaN`` and ``lse = NaN``; only ``-inf`` logits count as no key (``o = 0``,
        ``lse = -inf``). A NaN/inf value of a key reaches only the queries that select it, except
        on the Triton path's GQA query tiles, where it turns the tile's other queries NaN too.
        Empty inputs (``B``, ``S`` or ``T`` = 0) are fine: ``T = 0`` means every index is ``-1``,
        so ``o = 0`` and ``lse = -inf``. Zero heads or zero-width heads are a ``ValueError``.
        Validation reads index values once (one host sync, for the range check) and never on
        meta or fake tensors, which are checked by shape only.
    """
    check_tensor("q", q, 4, "[B, S, Hq, Dqk]")
    B, S, Hq, Dqk = q.shape
    kdoc = f"[B={B}, T, Hkv, Dqk={Dqk}]"
    check_tensor("k", k, 4, kdoc)
    check_dim("k", k, 0, B, kdoc)
    check_dim("k", k, 3, Dqk, kdoc)
    T, Hkv = k.shape[1], k.shape[2]
    if Hq < 1:
        raise ValueError(f"q must have Hq >= 1 heads (shape [B, S, Hq, Dqk]), got shape {tuple(q.shape)}")
    if Dqk < 1:
        raise ValueError(f"q must have Dqk >= 1 dims per head (shape [B, S, Hq, Dqk]), got shape {tuple(q.shape)}")
    check_num_keys("k", T)
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"q has Hq = {Hq} heads, not a multiple of k's Hkv = {Hkv} heads")
    vdoc = f"[B={B}, T={T}, Hkv={Hkv}, Dv]"
    check_tensor("v", v, 4, vdoc)
    for dim, size in ((0, B), (1, T), (2, Hkv)):
        check_dim("v", v, dim, size, vdoc)
    Dv = v.shape[3]
    if Dv < 1:
        raise ValueError(f"v must have Dv >= 1 dims per head (shape {vdoc}), got shape {tuple(v.shape)}")
    check_same_device(q=q, k=k, v=v, indices=indices)
    check_indices(indices, B, S, T, check_range=check_range)
    if head_probs is not None:
        if not isinstance(head_probs, HeadProbs):
            raise TypeError(f"head_probs must be a HeadProbs or None, got {type(head_probs).__name__}")
        if check_range:
            check_sorted_rows(indices)
    if not isinstance(unique_indices, bool):
        raise TypeError(f"unique_indices must be a bool, got {type(unique_indices).__name__}")
    if deterministic is not None and not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool or None, got {type(deterministic).__name__}")
    if scale is None:
        scale = Dqk**-0.5
    elif not isinstance(scale, numbers.Real) or isinstance(scale, bool):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    elif not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    unsupported = triton_dtype_reason(q, k, v) if HAS_TRITON else "no Triton"
    if backend == "auto" and unsupported is not None:
        backend = "torch"
    chosen = resolve_backend(backend, q.device, HAS_TRITON)
    if chosen == "triton":
        if unsupported is not None:
            raise ValueError(f"backend='triton' cannot take these inputs: {unsupported}")
        if deterministic is None:
            deterministic = torch.are_deterministic_algorithms_enabled()
        # Head dims the kernels do not tile are zero-padded: zero columns of q and k add nothing
        # to a logit, zero columns of v give output columns that are sliced off.
        dqk_p, dv_p = padded_head_dims(Dqk, Dv)
        if (dqk_p, dv_p) == (Dqk, Dv):
            o, lse = triton_sparse_attention(q, k, v, indices, scale, deterministic=deterministic, config=config,
                                             unique=unique_indices, head_probs=head_probs)
        else:
            q_p, k_p, v_p = _pad_last(q, dqk_p), _pad_last(k, dqk_p), _pad_last(v, dv_p)
            o, lse = triton_sparse_attention(q_p, k_p, v_p, indices, scale, deterministic=deterministic, config=config,
                                             unique=unique_indices, head_probs=head_probs)
            if dv_p != Dv:
                o = o[..., :Dv].contiguous()  # a tensor of its own, like the unpadded path's
    elif masked_dense_fits(q, k, v, indices):  # short key ranges: matmuls over all keys beat per-query gathers
        o, lse = sparse_attention_masked_dense(q, k, v, indices, scale)
    else:
        o, lse = sparse_attention_reference(q, k, v, indices, scale)
    if head_probs is not None and chosen != "triton":
        head_probs.value = prob_sum_pass(q, k, indices, lse, scale, "torch")
    return (o, lse) if return_lse else o
