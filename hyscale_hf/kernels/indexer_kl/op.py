"""Indexer KL loss: trains the lightning indexer to match the main attention's distribution.

Host launches of the Triton kernels (``triton_kernels.py``, whose docstring derives the one-pass
loss), the autograd wrapper and the public function. The torch path (and the dense warm-up loss)
is ``masked_dense`` (matmuls over every key under a mask) where the key range is short on a CPU,
else ``naive.indexer_kl_loss_reference``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton

from ..checks import (
    check_cu_seqlens,
    check_dim,
    check_indices,
    check_same_device,
    check_sorted_rows,
    check_tensor,
    resolve_backend,
)
from ..sparse_attn.host import KeyLists
from . import tiled
from . import triton_kernels as kernels
from .masked_dense import fits as masked_dense_fits
from .masked_dense import indexer_kl_masked_dense
from .naive import (
    attention_prob_sum_reference,
    indexer_kl_given_target_reference,
    indexer_kl_loss_reference,
    reduce_kl,
)
from .tiled import BLOCK_N, indexer_kl_backward_tiled, indexer_kl_forward_tiled

_LOG2E = 1.4426950408889634

# ----------------------------------------------------------------------------- host launches

_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(n))


@dataclass(frozen=True)
class IndexerKLConfig:
    """Launch tiles of the Triton indexer-loss kernels on CUDA; ``IndexerKLConfig()`` is what runs.

    One dict per kernel: ``lse`` (the attention lse pass, when ``attn_lse`` is not given), ``fwd``
    (the loss, scoring the attention too), ``fwd_given`` (the loss with its target given: only the
    indexer is scored) and ``bwd`` (its gradients); keys ``BLOCK_K`` (selected keys per step),
    ``BLOCK_DA`` (attention dims per step; only where the attention is read), ``num_warps``,
    ``num_stages``. Picked by ``scripts/bench_indexer_loss.py --sweep`` on one H200 (K = 2048,
    bf16): in the forward at T = 16384 3 stages took MLA (64 heads x 576) from 17.4 to 14.1 ms and
    left GQA (32/8 x 128) at ~20 ms, and 8 warps were slower everywhere. The given-target forward
    takes 128 keys a step (4 warps, 2 stages): at 128K tokens 12.7 ms against 21.0 with the
    forward's tiles (the benchmark's realistic selection), 48 -> 31 ms over the two layers of the
    GLM-5-shaped step (``scripts/profile_step.py``). The backward keeps 64 keys, 4 warps, 2 stages:
    128 keys were faster on the synthetic selections (60.1 against 70.0 ms at 128K) but not in that
    step's profile, on the step's own selections (150 against 144 ms). The lse pass shares the
    forward's loop nest and tiles. Under the CPU interpreter the kernels run 16-wide tiles whatever
    the config.
    """

    lse: dict = field(default_factory=lambda: {"BLOCK_K": 64, "BLOCK_DA": 64, "num_warps": 4, "num_stages": 3})
    fwd: dict = field(default_factory=lambda: {"BLOCK_K": 64, "BLOCK_DA": 64, "num_warps": 4, "num_stages": 3})
    fwd_given: dict = field(default_factory=lambda: {"BLOCK_K": 128, "num_warps": 4, "num_stages": 2})
    bwd: dict = field(default_factory=lambda: {"BLOCK_K": 64, "num_warps": 4, "num_stages": 2})


# What ``config=None`` means (read at call time).
DEFAULT_CONFIG = IndexerKLConfig()
_INTERPRETER_TILES = {"BLOCK_K": 16, "BLOCK_DA": 16}


def _launch_config(kernel: str, device: torch.device, config: IndexerKLConfig | None, dqk: int | None = None) -> dict:
    if config is None:
        config = DEFAULT_CONFIG
    elif not isinstance(config, IndexerKLConfig):
        raise TypeError(f"config must be an IndexerKLConfig or None, got {type(config).__name__}")
    cfg = dict(getattr(config, kernel)) if device.type == "cuda" else dict(_INTERPRETER_TILES)
    if kernel == "bwd":
        cfg.pop("BLOCK_DA", None)
    elif kernel == "fwd_given":  # the attention is unread: its tile is the smallest that compiles
        cfg["BLOCK_DA"] = 16
    else:
        cfg["BLOCK_DA"] = min(cfg["BLOCK_DA"], _pow2(dqk))
    return cfg


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs get true fp32 products (Triton's default for fp32 dot is tf32); 16-bit inputs
    # run on the tensor cores with fp32 accumulation either way.
    return "ieee" if dtype == torch.float32 else "tf32"


def _common_dtype(name_a, a, name_b, b):
    if a.dtype not in _TRITON_DTYPES or b.dtype not in _TRITON_DTYPES:
        raise ValueError(
            f"the Triton indexer loss takes fp16/bf16/fp32 {name_a}/{name_b}, got {a.dtype}/{b.dtype}; "
            "use backend='torch' (the exact reference) for float64"
        )
    dt = torch.promote_types(a.dtype, b.dtype)
    return a.to(dt), b.to(dt)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def attention_lse_triton(attn_q, attn_k, indices, scale, *, config=None):
    """Per-head attention log-sum-exp over each query's selected keys: fp32 [B, S, Hq]."""
    attn_q, attn_k = _common_dtype("attn_q", attn_q, "attn_k", attn_k)
    attn_q, attn_k = _last_dim_contiguous(attn_q), _last_dim_contiguous(attn_k)
    indices = indices.contiguous()
    B, S, Hq, Dqk = attn_q.shape
    Hkv = attn_k.shape[2]
    G = Hq // Hkv
    cfg = _launch_config("lse", attn_q.device, config, Dqk)
    lse = torch.empty(B, S, Hq, dtype=torch.float32, device=attn_q.device)
    if B * S == 0:
        return lse
    kernels.attn_lse_kernel[(S, B)](
        indices, attn_q, attn_k, lse,
        S, indices.shape[2], Dqk, G, Hkv,
        indices.stride(0), indices.stride(1), *attn_q.stride()[:3], *attn_k.stride()[:3],
        scale * _LOG2E,
        BLOCK_G=_pow2(G), PRECISION=_precision(attn_q.dtype), **cfg,
    )
    return lse


def _finite_lse(attn_lse: torch.Tensor) -> torch.Tensor:
    # As the reference: a non-finite lse (a query without keys) counts as 0.
    return torch.where(torch.isfinite(attn_lse), attn_lse, torch.zeros_like(attn_lse)).float().contiguous()


def attention_prob_sum_triton(attn_q, attn_k, indices, lse, scale, *, config=None):
    """The target P [B, S, K] fp32 alone (``attn_prob_sum_kernel``)."""
    attn_q, attn_k = _common_dtype("attn_q", attn_q, "attn_k", attn_k)
    attn_q, attn_k = _last_dim_contiguous(attn_q), _last_dim_contiguous(attn_k)
    indices = indices.contiguous()
    B, S, Hq, Dqk = attn_q.shape
    Hkv, K = attn_k.shape[2], indices.shape[2]
    target = torch.empty(B, S, K, dtype=torch.float32, device=attn_q.device)
    if B * S == 0:
        return target
    cfg = _launch_config("lse", attn_q.device, config, Dqk)  # the lse pass's loop nest and tiles
    kernels.attn_prob_sum_kernel[(S, B)](
        indices, attn_q, attn_k, _finite_lse(lse), target,
        S, K, Dqk, Hq // Hkv, Hkv,
        indices.stride(0), indices.stride(1), *attn_q.stride()[:3], *attn_k.stride()[:3],
        scale * _LOG2E,
        BLOCK_G=_pow2(Hq // Hkv), PRECISION=_precision(attn_q.dtype), **cfg,
    )
    return target


def indexer_kl_forward_triton(index_q, index_k, index_w, attn_q, attn_k, indices, attn_lse, scale, relu,
                              *, save_target=True, config=None, target=None, tiles=None):
    """Per-query KL [B, S] fp32, plus (P [B, S, K] fp32 or None, Z [B, S], lseI [B, S]) for backward.
    With ``target`` (P given, fp32 [B, S, K]) the attention tensors are not read (pass None for them,
    and for attn_lse) and P is returned as given; with ``tiles`` too (query tiles a program holds:
    ``indexer_kl_loss_given_target`` decides) the kernel walks the attention's query tiles (``tiled.py``)."""
    index_q, index_k = _common_dtype("index_q", index_q, "index_k", index_k)
    index_q, index_k = map(_last_dim_contiguous, (index_q, index_k))
    index_w = _last_dim_contiguous(index_w.float())
    indices = indices.contiguous()
    B, S, H, D = index_q.shape
    K = indices.shape[2]
    dev = index_q.device
    kl = torch.empty(B, S, dtype=torch.float32, device=dev)
    z = torch.empty(B, S, dtype=torch.float32, device=dev)
    lse_i = torch.empty(B, S, dtype=torch.float32, device=dev)
    p_given = target is not None
    if p_given:
        target = target.float().contiguous()
        # the attention arguments are unread under P_GIVEN: stand-ins of the right types
        attn_q, attn_k, lse, scale = index_q[:, :, :1, :1], index_k[:, :, None, :1], kl[..., None], 1.0
        save_target = True
    else:
        attn_q, attn_k = _common_dtype("attn_q", attn_q, "attn_k", attn_k)
        attn_q, attn_k = _last_dim_contiguous(attn_q), _last_dim_contiguous(attn_k)
        if attn_lse is None:
            attn_lse = attention_lse_triton(attn_q, attn_k, indices, scale, config=config)
        lse = _finite_lse(attn_lse)
        target = torch.empty(B, S, K, dtype=torch.float32, device=dev) if save_target else kl
    Hq, Dqk = attn_q.shape[2:]
    Hkv = attn_k.shape[2]
    if B * S == 0:
        return kl, (target if save_target else None), z, lse_i
    if p_given and tiles is not None:
        kl, z, lse_i = indexer_kl_forward_tiled(index_q, index_k, index_w, indices, target, tiles, relu,
                                                _precision(index_q.dtype))
        return kl, target, z, lse_i
    cfg = _launch_config("fwd_given" if p_given else "fwd", dev, config, Dqk)
    kernels.indexer_kl_fwd_kernel[(S, B)](
        index_q, index_k, index_w, indices, attn_q, attn_k, lse,
        kl, target, z, lse_i,
        S, K, H, D, Dqk, Hq // Hkv, Hkv,
        *index_q.stride()[:3], *index_k.stride()[:2], *index_w.stride()[:2], *indices.stride()[:2],
        *attn_q.stride()[:3], *attn_k.stride()[:3],
        scale * _LOG2E,
        RELU=relu, STORE_P=save_target, P_GIVEN=p_given,
        BLOCK_H=_pow2(H), BLOCK_D=_pow2(D), BLOCK_G=_pow2(Hq // Hkv),
        PRECISION_I=_precision(index_q.dtype), PRECISION_A=_precision(attn_q.dtype), **cfg,
    )
    return kl, (target if save_target else None), z, lse_i


def indexer_kl_backward_triton(grad_kl, index_q, index_k, index_w, indices, target, z, lse_i, relu,
                               *, config=None, tiles=None):
    """Gradients (d index_q, d index_k, d index_w) of sum(grad_kl * KL). d index_k is accumulated with
    fp32 atomics, so its bits can vary between runs (summation order); the others are deterministic.
    With ``tiles`` the kernel walks the attention's query tiles (``tiled.py``)."""
    return _gradient_pass(grad_kl, index_q, index_k, index_w, indices, target, z, lse_i, relu, config, tiles)[1:]


def indexer_kl_one_pass_triton(grad_kl, index_q, index_k, index_w, indices, target, index_lse, relu,
                               *, config=None, tiles=None):
    """``(kl [B, S] fp32, d index_q, d index_k, d index_w)``: the given-target loss per query and the
    gradients of sum(grad_kl * KL) from one pass of the backward kernels (``ONE_PASS``), with the
    indexer's log-sum-exp over each query's selected keys given (``index_lse`` fp32 [B, S]) instead of
    formed by the forward's pass; Z is summed from ``target`` in the same kernel."""
    return _gradient_pass(grad_kl, index_q, index_k, index_w, indices, target, None, index_lse, relu, config, tiles)


def _gradient_pass(grad_kl, index_q, index_k, index_w, indices, target, z, lse_i, relu, config, tiles):
    """The backward kernels' launch: ``(kl or None, dq, dk, dw)``; the one pass where ``z`` is None."""
    q_dtype, k_dtype, w_dtype = index_q.dtype, index_k.dtype, index_w.dtype
    index_q, index_k = _common_dtype("index_q", index_q, "index_k", index_k)
    index_q, index_k = _last_dim_contiguous(index_q), _last_dim_contiguous(index_k)
    index_w = _last_dim_contiguous(index_w.float())
    indices = indices.contiguous()
    lse_i = lse_i.float().contiguous()
    B, S, H, D = index_q.shape
    T, K = index_k.shape[1], indices.shape[2]
    dev = index_q.device
    one_pass = z is None
    dq = torch.empty(B, S, H, D, dtype=q_dtype, device=dev)
    dw = torch.empty(B, S, H, dtype=torch.float32, device=dev)
    dk = torch.zeros(B, T, D, dtype=torch.float32, device=dev)
    kl = torch.zeros(B, S, dtype=torch.float32, device=dev) if one_pass else None
    if B * S > 0 and tiles is not None:
        indexer_kl_backward_tiled(grad_kl, index_q, index_k, index_w, indices, target, z, lse_i, tiles, relu,
                                  _precision(index_q.dtype), dq, dw, dk, kl=kl)
    elif B * S > 0:
        cfg = _launch_config("bwd", dev, config)
        kernels.indexer_kl_bwd_kernel[(S, B)](
            index_q, index_k, index_w, indices, target, lse_i if one_pass else z, lse_i, grad_kl,
            dq, dw, dk, kl if one_pass else lse_i,
            S, K, H, D, T,
            *index_q.stride()[:3], *index_k.stride()[:2], *index_w.stride()[:2], *indices.stride()[:2],
            *grad_kl.stride(),
            RELU=relu, ONE_PASS=one_pass, BLOCK_H=_pow2(H), BLOCK_D=_pow2(D), PRECISION=_precision(index_q.dtype),
            **cfg,
        )
    return kl, dq, dk.to(k_dtype), dw.to(w_dtype)


# ----------------------------------------------------------------------------- autograd wrapper


def _indexer_grads(ctx, grad_kl):
    """Backward of the Triton KL functions below: gradients to index_q, index_k, index_w (their first
    three inputs) from what their forward saved (and the query tiles' lists, if it walked them); None
    for every other input."""
    index_q, index_k, index_w, indices, target, z, lse_i, *lists = ctx.saved_tensors
    tiles = KeyLists(*lists, ctx.tile_q) if lists else None
    dq, dk, dw = indexer_kl_backward_triton(
        grad_kl, index_q, index_k, index_w, indices, target, z, lse_i, ctx.relu, config=ctx.config, tiles=tiles
    )
    need = ctx.needs_input_grad
    return (dq if need[0] else None, dk if need[1] else None, dw if need[2] else None) + (None,) * (len(need) - 3)


class _IndexerKLSparse(torch.autograd.Function):
    """Per-query sparse-stage KL [B, S]; gradients to index_q, index_k, index_w only."""

    @staticmethod
    def forward(ctx, index_q, index_k, index_w, attn_q, attn_k, indices, attn_lse, scale, relu, config):
        needs_grad = any(ctx.needs_input_grad[:3])
        kl, target, z, lse_i = indexer_kl_forward_triton(
            index_q, index_k, index_w, attn_q, attn_k, indices, attn_lse, scale, relu,
            save_target=needs_grad, config=config,
        )
        if needs_grad:
            ctx.save_for_backward(index_q, index_k, index_w, indices, target, z, lse_i)
        ctx.relu, ctx.config, ctx.tile_q = relu, config, 0
        return kl

    @staticmethod
    def backward(ctx, grad_kl):
        return _indexer_grads(ctx, grad_kl)


class _IndexerKLGivenTarget(torch.autograd.Function):
    """Per-query KL [B, S] with the target P given; gradients to index_q, index_k, index_w only."""

    @staticmethod
    def forward(ctx, index_q, index_k, index_w, indices, target, relu, config, tiles):
        kl, target, z, lse_i = indexer_kl_forward_triton(
            index_q, index_k, index_w, None, None, indices, None, None, relu, config=config, target=target,
            tiles=tiles,
        )
        lists = () if tiles is None else (tiles.idx, tiles.num, tiles.bits)
        if any(ctx.needs_input_grad[:3]):
            ctx.save_for_backward(index_q, index_k, index_w, indices, target, z, lse_i, *lists)
        ctx.relu, ctx.config, ctx.tile_q = relu, config, 0 if tiles is None else tiles.tile_q
        return kl

    @staticmethod
    def backward(ctx, grad_kl):
        return _indexer_grads(ctx, grad_kl)


class _IndexerKLOnePass(torch.autograd.Function):
    """``sum(weight * KL)`` (fp32 scalar) with the target and the indexer's selection lse given; the one
    pass computes the gradients with the loss, in forward, and backward scales them by the incoming
    gradient (exact where it is 1, as for the reductions' own weights)."""

    @staticmethod
    def forward(ctx, index_q, index_k, index_w, indices, target, index_lse, weight, relu, config, tiles):
        kl, dq, dk, dw = indexer_kl_one_pass_triton(weight, index_q, index_k, index_w, indices, target, index_lse,
                                                    relu, config=config, tiles=tiles)
        if any(ctx.needs_input_grad[:3]):
            ctx.save_for_backward(dq, dk, dw)
        return (weight * kl).sum()

    @staticmethod
    def backward(ctx, grad_loss):
        need = ctx.needs_input_grad
        if not ctx.saved_tensors:
            return (None,) * len(need)
        # a 0-dim fp32 factor keeps the gradients' dtypes and scales in fp32 (one rounding)
        grads = tuple(g * grad_loss if n else None for g, n in zip(ctx.saved_tensors, need[:3]))
        return grads + (None,) * (len(need) - 3)


def indexer_kl_loss_triton(index_q, index_k, index_w, attn_q, attn_k, indices, *, attn_lse, scale, relu,
                           reduction, config=None):
    """Sparse-stage loss through the Triton kernels; the same reductions as the reference."""
    attn_lse = None if attn_lse is None else attn_lse.detach()
    kl = _IndexerKLSparse.apply(index_q, index_k, index_w, attn_q.detach(), attn_k.detach(), indices,
                                attn_lse, scale, relu, config)
    return reduce_kl(kl, (indices >= 0).any(-1), reduction)


# ----------------------------------------------------------------------------- public function


def indexer_kl_loss(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    index_w: torch.Tensor,
    attn_q: torch.Tensor,
    attn_k: torch.Tensor,
    indices: torch.Tensor | None = None,
    *,
    attn_lse: torch.Tensor | None = None,
    scale: float | None = None,
    relu: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    window_start: torch.Tensor | None = None,
    reduction: str = "mean",
    backend: str = "auto",
    config: IndexerKLConfig | None = None,
    check_range: bool = True,
):
    """``KL(p[i] || softmax(I[i]))`` per query, averaged (DeepSeek-V3.2-Exp, section 2.1).

    ``I[i, s] = sum_h index_w[i, h] * ReLU(index_q[i, h] . index_k[s])`` are the indexer logits;
    ``p[i]`` is the main attention's probabilities summed over heads and L1-normalised, computed
    from ``attn_q``, ``attn_k`` (and ``attn_lse`` when given) and detached: the loss trains only
    the indexer (gradients reach ``index_q``, ``index_k``, ``index_w``).

    Sparse stage (``indices`` given): both distributions live on each query's selected set.
    Dense warm-up (``indices=None``): over every visible key (causal, ``cu_seqlens`` and
    ``window_start`` as in ``hytopk``), computed a query chunk at a time so memory stays
    O(chunk * T) in forward and backward.

    Args:
        index_q: ``[B, S, H, D]``; index_k: ``[B, T, D]``; index_w: ``[B, S, H]`` fp32.
        attn_q: ``[B, S, Hq, Dqk]``; attn_k: ``[B, T, Hkv, Dqk]`` (MLA absorbed: Hkv = 1, the
            latent rows with rope dims).
        indices: int32 ``[B, S, K]`` (``-1`` skipped) or None for the dense warm-up loss.
        attn_lse: optional fp32 ``[B, S, Hq]``: the attention's own log-sum-exp over the same key
            set (sparse_attention's ``lse`` in the sparse stage); recomputed when None.
        scale: the attention's softmax scale; default ``Dqk ** -0.5``.
        relu: the indexer's ReLU flag (as in ``hytopk``).
        reduction: ``"mean"`` over queries with a key, ``"sum"``, or ``"none"`` (``[B, S]``).
        backend: ``"auto"`` | ``"torch"`` | ``"triton"``. The Triton kernels cover the sparse stage
            for fp16/bf16/fp32 inputs (``"auto"`` picks them on CUDA; float64 and the dense warm-up
            run on the torch reference, and asking ``"triton"`` for those is a ``ValueError``).
        config: Triton only: launch tiles of its kernels (``IndexerKLConfig``; None = the measured
            defaults, ``op.DEFAULT_CONFIG``).
        check_range: as in ``sparse_attention``: ``False`` skips the host sync that reads the
            range of ``indices``, for indices known to be in range.

    Returns:
        The loss (fp32 scalar, or ``[B, S]`` with ``reduction="none"``).

    Triton sparse stage: forward and backward read only the selected keys. Saved for backward:
    the target probabilities ``[B, S, K]`` fp32 plus two fp32 numbers per query (no attention
    tensor is read again). ``d index_k`` is summed with fp32 atomics, so its last bits can vary
    between runs; ``d index_q`` and ``d index_w`` are deterministic. The backward feeds
    ``dI * w`` to the tensor cores in the inputs' dtype (bf16/fp16 rounding, as ``dS`` in flash
    attention); fp32 inputs use exact fp32 products.
    """
    B, S, H, D, T = _check_index_tensors(index_q, index_k, index_w)
    check_tensor("attn_q", attn_q, 4, f"[B={B}, S={S}, Hq, Dqk]")
    check_dim("attn_q", attn_q, 0, B, f"[B={B}, S={S}, Hq, Dqk]")
    check_dim("attn_q", attn_q, 1, S, f"[B={B}, S={S}, Hq, Dqk]")
    Hq, Dqk = attn_q.shape[2:]
    adoc = f"[B={B}, T={T}, Hkv, Dqk={Dqk}]"
    check_tensor("attn_k", attn_k, 4, adoc)
    for dim, size in ((0, B), (1, T), (3, Dqk)):
        check_dim("attn_k", attn_k, dim, size, adoc)
    if Hq % attn_k.shape[2]:
        raise ValueError(f"attn_q has Hq = {Hq} heads, not a multiple of attn_k's Hkv = {attn_k.shape[2]}")
    if attn_lse is not None:
        ldoc = f"[B={B}, S={S}, Hq={Hq}] float32"
        check_tensor("attn_lse", attn_lse, 3, ldoc, dtypes=(torch.float32, torch.float64))
        for dim, size in ((0, B), (1, S), (2, Hq)):
            check_dim("attn_lse", attn_lse, dim, size, ldoc)
    if S > T:
        raise ValueError(f"index_q has S = {S} queries but index_k has only T = {T} keys; need S <= T")
    check_same_device(index_q=index_q, index_k=index_k, index_w=index_w, attn_q=attn_q, attn_k=attn_k,
                      indices=indices, attn_lse=attn_lse)
    if indices is not None:
        check_indices(indices, B, S, T, check_range=check_range)
    else:
        check_cu_seqlens(cu_seqlens, B, S, T, index_q.device)
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if scale is None:
        scale = Dqk**-0.5
    if backend == "triton" and indices is None:
        raise ValueError("backend='triton' covers the sparse stage (indices given); the dense warm-up loss "
                         "(indices=None) runs on the chunked torch path: use backend='auto' or 'torch'")
    kernel_dtypes = all(t.dtype in _TRITON_DTYPES for t in (index_q, index_k, attn_q, attn_k))
    if backend == "triton" and not kernel_dtypes:
        raise ValueError("backend='triton' computes in fp32 from fp16/bf16/fp32 inputs; float64 inputs need "
                         "backend='torch' (the exact reference)")
    chosen = resolve_backend(backend, index_q.device,
                             indices is not None and kernel_dtypes)
    if chosen == "triton":
        return indexer_kl_loss_triton(index_q, index_k, index_w, attn_q, attn_k, indices, attn_lse=attn_lse,
                                      scale=scale, relu=relu, reduction=reduction, config=config)
    if masked_dense_fits(index_q, index_k, index_w, attn_q, attn_k, indices):  # short key ranges on a CPU
        kl, has_key = indexer_kl_masked_dense(index_q, index_k, index_w, attn_q, attn_k, indices, attn_lse=attn_lse,
                                              scale=scale, relu=relu, cu_seqlens=cu_seqlens, window_start=window_start)
        return reduce_kl(kl, has_key, reduction)
    return indexer_kl_loss_reference(
        index_q, index_k, index_w, attn_q, attn_k, indices, attn_lse=attn_lse, scale=scale, relu=relu,
        cu_seqlens=cu_seqlens, window_start=window_start, reduction=reduction,
    )


def _check_tiles(tiles, index_q: torch.Tensor) -> None:
    """``tiles`` must be query tiles over index_q's B x S queries (``union_tiles``' shapes), on its device."""
    B, S = index_q.shape[:2]
    if not isinstance(tiles, KeyLists):
        raise TypeError(f"tiles must be a sparse_attn KeyLists (HeadProbs.tiles) or None, got {type(tiles).__name__}")
    if tiles.tile_q < 1:
        raise ValueError(f"tiles must be query tiles (tile_q >= 1), got per-token lists (tile_q = {tiles.tile_q})")
    n = -(-S // tiles.tile_q)
    union, num, bits = tiles.idx, tiles.num, tiles.bits
    # the kernels read the membership words in whole blocks of tiled.BLOCK_N union slots
    words = -(-union.shape[2] // BLOCK_N) * BLOCK_N // 32 if union.dim() == 3 else 0
    want = f"union [B={B}, {n}, U], num [B={B}, {n}], bits [{B * n * tiles.tile_q}, >= {words}] int32"
    ok = (union.dim() == 3 and tuple(union.shape[:2]) == (B, n) and tuple(num.shape) == (B, n)
          and bits.dim() == 2 and bits.shape[0] == B * n * tiles.tile_q and bits.shape[1] >= words
          and all(t.dtype == torch.int32 for t in (union, num, bits)))
    if not ok:
        raise ValueError(f"tiles of {tiles.tile_q} queries over S = {S} need {want}; got union "
                         f"{tuple(union.shape)}, num {tuple(num.shape)}, bits {tuple(bits.shape)} "
                         f"({union.dtype}, {num.dtype}, {bits.dtype})")
    check_same_device(index_q=index_q, tiles=union)


def _check_index_tensors(index_q, index_k, index_w):
    """(B, S, H, D, T) of the indexer's outputs, after their checks."""
    check_tensor("index_q", index_q, 4, "[B, S, H, D]")
    B, S, H, D = index_q.shape
    kdoc = f"[B={B}, T, D={D}]"
    check_tensor("index_k", index_k, 3, kdoc)
    check_dim("index_k", index_k, 0, B, kdoc)
    check_dim("index_k", index_k, 2, D, kdoc)
    wdoc = f"[B={B}, S={S}, H={H}] float32"
    check_tensor("index_w", index_w, 3, wdoc, dtypes=(torch.float32, torch.float64))
    for dim, size in ((0, B), (1, S), (2, H)):
        check_dim("index_w", index_w, dim, size, wdoc)
    return B, S, H, D, index_k.shape[1]


def attention_prob_sum(
    attn_q: torch.Tensor,
    attn_k: torch.Tensor,
    indices: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    *,
    backend: str = "auto",
    config: IndexerKLConfig | None = None,
    check_range: bool = True,
) -> torch.Tensor:
    """The sparse-stage KL target ``P[b, s, j] = sum_h exp(scale * attn_q[b, s, h] . attn_k[b, idx, g(h)]
    - lse[b, s, h])`` with ``idx = indices[b, s, j]`` (0 where it is -1; a non-finite lse counts as 0),
    as ``indexer_kl_loss_given_target`` takes it: ``indexer_kl_loss``'s attention part as a pass of its own.

    Args:
        attn_q: ``[B, S, Hq, Dqk]``; attn_k: ``[B, T, Hkv, Dqk]``; indices: int32 ``[B, S, K]``;
        lse: fp32 ``[B, S, Hq]``, the attention's log-sum-exp over the same keys.
        backend, config, check_range: as in ``indexer_kl_loss`` (``config.lse``'s tiles).

    Returns:
        ``P`` fp32 ``[B, S, K]``, without gradient.
    """
    check_tensor("attn_q", attn_q, 4, "[B, S, Hq, Dqk]")
    B, S, Hq, Dqk = attn_q.shape
    adoc = f"[B={B}, T, Hkv, Dqk={Dqk}]"
    check_tensor("attn_k", attn_k, 4, adoc)
    check_dim("attn_k", attn_k, 0, B, adoc)
    check_dim("attn_k", attn_k, 3, Dqk, adoc)
    if Hq % attn_k.shape[2]:
        raise ValueError(f"attn_q has Hq = {Hq} heads, not a multiple of attn_k's Hkv = {attn_k.shape[2]}")
    ldoc = f"[B={B}, S={S}, Hq={Hq}] float32"
    check_tensor("lse", lse, 3, ldoc, dtypes=(torch.float32, torch.float64))
    for dim, size in ((0, B), (1, S), (2, Hq)):
        check_dim("lse", lse, dim, size, ldoc)
    check_same_device(attn_q=attn_q, attn_k=attn_k, indices=indices, lse=lse)
    check_indices(indices, B, S, attn_k.shape[1], check_range=check_range)
    attn_q, attn_k, lse = attn_q.detach(), attn_k.detach(), lse.detach()
    kernel_dtypes = all(t.dtype in _TRITON_DTYPES for t in (attn_q, attn_k))
    if backend == "triton" and not kernel_dtypes:
        raise ValueError("backend='triton' takes fp16/bf16/fp32 attn_q/attn_k; float64 needs backend='torch'")
    if resolve_backend(backend, attn_q.device, kernel_dtypes) == "triton":
        return attention_prob_sum_triton(attn_q, attn_k, indices, lse, scale, config=config)
    return attention_prob_sum_reference(attn_q, attn_k, indices, lse, scale)


def indexer_kl_loss_given_target(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    index_w: torch.Tensor,
    indices: torch.Tensor,
    target: torch.Tensor,
    *,
    relu: bool = True,
    reduction: str = "mean",
    backend: str = "auto",
    config: IndexerKLConfig | None = None,
    check_range: bool = True,
    tiles: KeyLists | None = None,
    index_lse: torch.Tensor | None = None,
):
    """``indexer_kl_loss``'s sparse stage with its target given: ``KL(p[i] || softmax(I[i]))`` on each
    query's selected keys, ``p = P / sum(P)`` from ``target`` (``attention_prob_sum``'s P, or the one
    a sparse attention's backward left in a ``HeadProbs``). Only the indexer is scored.

    Args:
        index_q, index_k, index_w, relu, reduction, backend, config, check_range: as in ``indexer_kl_loss``.
        indices: int32 ``[B, S, K]``; a slot with -1 counts as no key whatever ``target`` holds there (so
            masking a query's indices to -1 drops it from the loss).
        target: fp32 ``[B, S, K]``, unnormalised, read without gradient.
        tiles: the query tiles' key lists of the attention that produced ``target`` (``HeadProbs.tiles``,
            a ``sparse_attn`` ``KeyLists`` with ``tile_q >= 1`` built from these indices or from the same
            indices before some queries were masked to -1). The Triton kernels then walk each tile's
            union of keys once instead of every query's keys (``tiled.py``): the same loss and gradients
            up to fp32 summation order. Rows of ``indices`` must then list their keys ascending, each
            once, -1 after them (``hytopk``'s rows; checked with the range). Tiles of more rows (queries
            x indexer heads) than one program holds, the torch backend, and on CUDA unions wider than
            ``tiled.CUDA_MAX_UNION_SHARE`` of a tile's pairs (``CUDA_MAX_UNION_SHARE_ONE_PASS`` with
            ``index_lse``), where the per-query kernels are faster, use the per-query path.
        index_lse: fp32 ``[B, S]``, the log-sum-exp of each query's indexer logits over its selected keys
            (``hytopk(..., return_lse=True)``'s, from the same index_q / index_k / index_w and indices),
            or None. Given, the loss is ``KL(p || exp(I - index_lse))`` and its gradient to the logits
            ``exp(I - index_lse) - p``: the KL and its gradient where ``index_lse`` is the logits' lse, as
            the selection's is up to fp32 summation order. The Triton kernels then need no forward pass
            (which forms that lse): one pass gives the loss and the gradients, computed in forward and
            held until backward (``reduction`` "mean" or "sum" only: it needs the queries' weights
            up front). It is trusted, not checked against the logits.

    Returns:
        The loss (fp32 scalar, or ``[B, S]`` with ``reduction="none"``), with the gradients of
        ``indexer_kl_loss`` for the same target (Triton: the same kernels' backward).
    """
    B, S, H, D, T = _check_index_tensors(index_q, index_k, index_w)
    tdoc = f"[B={B}, S={S}, K] float32"
    check_tensor("target", target, 3, tdoc, dtypes=(torch.float32, torch.float64))
    check_dim("target", target, 0, B, tdoc)
    check_dim("target", target, 1, S, tdoc)
    check_same_device(index_q=index_q, index_k=index_k, index_w=index_w, indices=indices, target=target)
    check_indices(indices, B, S, T, check_range=check_range)
    if target.shape[2] != indices.shape[2]:
        raise ValueError(f"target has K = {target.shape[2]} slots but indices has {indices.shape[2]}")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if index_lse is not None:
        ldoc = f"[B={B}, S={S}] float32"
        check_tensor("index_lse", index_lse, 2, ldoc, dtypes=(torch.float32, torch.float64))
        check_dim("index_lse", index_lse, 0, B, ldoc)
        check_dim("index_lse", index_lse, 1, S, ldoc)
        check_same_device(index_q=index_q, index_lse=index_lse)
        if reduction == "none":
            raise ValueError("index_lse needs reduction 'mean' or 'sum': its one pass computes the gradients with the "
                             "loss, so every query's weight must be known then")
        index_lse = index_lse.detach()
    if tiles is not None:
        _check_tiles(tiles, index_q)
        if check_range:
            check_sorted_rows(indices, "with tiles")
    kernel_dtypes = all(t.dtype in _TRITON_DTYPES for t in (index_q, index_k)) and target.dtype == torch.float32
    if backend == "triton" and not kernel_dtypes:
        raise ValueError("backend='triton' takes fp16/bf16/fp32 index_q/index_k and an fp32 target; "
                         "use backend='torch' (the exact reference) for float64")
    target = target.detach()
    if resolve_backend(backend, index_q.device, kernel_dtypes) == "triton":
        one_pass = index_lse is not None
        if tiles is not None and not tiled.takes_tiles(tiles, H, D, indices.shape[2], index_q.device, one_pass):
            tiles = None  # more rows than one program holds, or (CUDA) a union too wide: the per-query kernels
        indices = indices.contiguous()
        has_key = (indices >= 0).any(-1)
        if index_lse is not None:
            weight = has_key.float()
            if reduction == "mean":  # the queries' weights of reduce_kl's mean, on the device (no sync)
                weight = weight / has_key.sum().clamp_min(1)
            return _IndexerKLOnePass.apply(index_q, index_k, index_w, indices, target, index_lse, weight, relu,
                                           config, tiles)
        kl = _IndexerKLGivenTarget.apply(index_q, index_k, index_w, indices, target, relu, config, tiles)
        return reduce_kl(kl, has_key, reduction)
    return indexer_kl_given_target_reference(index_q, index_k, index_w, indices, target, relu=relu,
                                             reduction=reduction, index_lse=index_lse)
