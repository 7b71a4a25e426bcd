"""Causal-LM cross-entropy computed a token chunk at a time, so the ``[N, vocab]`` logits never exist.

At long context the LM head dominates memory once attention is sparse: GLM-5's 154K-token
vocabulary makes the bf16 logits of a 128K-token sequence 40 GB, and the loss's fp32 copy and its
gradient as much again. Two paths compute the same loss:

- **Gradients in forward** (an ``nn.Linear`` head without hooks, the usual LM head): each chunk's
  logits are formed once; the cross-entropy and its gradient over them (one Triton kernel on CUDA,
  written into the logits' buffer) give the chunk's share of the hidden states' gradient and of the
  head's, which backward only scales by the loss's gradient. Three head-sized products per chunk
  instead of four, and two passes over the logits instead of about ten; held from forward to
  backward: the hidden states' gradient (the size of the hidden states) and the head's.
- **Checkpointed chunks** (any other head: a PEFT/LoRA wrapper, an FSDP unit or a module with hooks,
  which must see the head called as a module; and under torch.compile): each chunk goes through the
  head and the cross-entropy under non-reentrant checkpointing; forward keeps only the per-chunk loss
  sums, backward recomputes one chunk's logits at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from ..checks import check_backend, has_values, resolve_backend
from . import host

_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = tuple(f"_global{name}" for name in _HOOKS)


def _plain_linear(head) -> bool:
    """Whether calling ``head`` is ``F.linear(x, head.weight, head.bias)`` and nothing else: an
    ``nn.Linear`` itself (not a subclass such as a LoRA layer), no module hooks on it or global ones,
    parameters that are plain tensors (an FSDP2 head is one while its root module runs; a DTensor
    is not)."""
    if type(head) is not nn.Linear or any(getattr(head, name) for name in _HOOKS):
        return False
    if any(getattr(nn.modules.module, name, None) for name in _GLOBAL_HOOKS):
        return False
    return all(p is None or type(p) in (torch.Tensor, nn.Parameter) for p in (head.weight, head.bias))


class _LinearCrossEntropy(torch.autograd.Function):
    """``sum_rows CE(F.linear(h, weight, bias), y) * scale`` with every gradient formed in forward."""

    @staticmethod
    def forward(ctx, h, weight, bias, y, chunk, ignore_index, scale, compute_dtype, use_triton):
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        # Autocast would cast the head's inputs at each F.linear: cast once, as it would, and run the
        # products in that dtype with autocast off (so the gradient products are not cast again).
        with torch.autocast(h.device.type, enabled=False):
            w = weight.to(compute_dtype)
            b = None if bias is None else bias.to(compute_dtype)
            dh = torch.empty_like(h) if need_h else None
            dw = torch.zeros_like(weight) if need_w else None
            db = torch.zeros(weight.shape[0], dtype=torch.float32, device=h.device) if need_b else None
            total = torch.zeros((), dtype=torch.float32, device=h.device)
            for c0 in range(0, h.shape[0], chunk):
                hc = h[c0 : c0 + chunk].to(compute_dtype)
                g = F.linear(hc, w, b)  # the chunk's logits, then (in place) their gradient
                total += host.cross_entropy_grad_(g, y[c0 : c0 + chunk], scale, ignore_index, use_triton)
                if need_h:
                    dh[c0 : c0 + chunk] = g @ w
                if need_w:
                    if dw.dtype == g.dtype:
                        dw.addmm_(g.t(), hc)
                    else:
                        dw += g.t() @ hc
                if need_b:
                    db += g.sum(0, dtype=torch.float32)
                del g
        ctx.save_for_backward(dh, dw, None if db is None else db.to(bias.dtype))
        return total * scale

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        # The gradients were formed for a loss gradient of 1; any other (a loss scale, a sum of losses
        # with weights) scales them here: exact for 1, one more rounding otherwise.
        dh, dw, db = (None if t is None else t * grad for t in ctx.saved_tensors)
        return dh, dw, db, None, None, None, None, None, None


def _fused_dtype_and_kernel(h: torch.Tensor, weight: torch.Tensor, backend: str) -> tuple[torch.dtype, bool]:
    """(dtype of the head's products, whether the Triton kernel computes the cross-entropy)."""
    device = h.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    if dtype not in host.TRITON_DTYPES:
        if backend == "triton":
            raise ValueError(f"backend='triton' takes float16, bfloat16 and float32 heads, got {dtype}; "
                             "use backend='torch' (or 'auto')")
        return dtype, False
    return dtype, resolve_backend(backend, h.device, host.HAS_TRITON) == "triton"


def chunked_cross_entropy(
    hidden: torch.Tensor,
    head,
    labels: torch.Tensor,
    chunk: int,
    *,
    ignore_index: int = -100,
    num_items_in_batch: torch.Tensor | int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """``F.cross_entropy(head(hidden).float(), labels, ignore_index=ignore_index)``, ``chunk`` rows at a time.

    Args:
        hidden: ``[N, H]`` (or ``[..., H]``, flattened) inputs of the head.
        head: callable ``[n, H] -> [n, vocab]`` (the LM head module). A plain ``nn.Linear`` gets its
            gradients in forward (module docstring); anything else is called as a module per chunk.
        labels: ``[N]`` (or matching leading dims) target ids in ``[0, vocab)``, already shifted;
            ``ignore_index`` rows count for nothing.
        chunk: rows per chunk (positive).
        num_items_in_batch: when given, the loss is the sum divided by it (Transformers' convention for
            gradient accumulation); else the mean over rows that are not ignored (NaN when all are).
        backend: the cross-entropy over a plain head's logits: ``"auto"`` (the Triton kernel on CUDA,
            else torch), ``"torch"`` or ``"triton"``.

    Returns: fp32 scalar loss, differentiable in ``hidden`` and the head's parameters. The gradients
    equal the whole-logits loss's but for the order in which chunks add up, and on the Triton path
    the last bits of fp32 ``exp`` and of the softmax's sums.
    """
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk <= 0:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    check_backend(backend)
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1).to(h.device)
    if y.shape[0] != h.shape[0]:
        raise ValueError(f"labels has {y.shape[0]} entries but hidden has {h.shape[0]} rows")
    if num_items_in_batch is None:
        denominator = (y != ignore_index).sum()
    elif torch.is_tensor(num_items_in_batch):
        denominator = num_items_in_batch.to(h.device)
    else:
        denominator = num_items_in_batch

    if torch.is_grad_enabled() and not torch.compiler.is_compiling() and _plain_linear(head):
        vocab = head.weight.shape[0]
        if y.numel() and has_values(y):  # the kernel reads the logit at each label: refuse bad ones first
            bad = (y != ignore_index) & ((y < 0) | (y >= vocab))
            if bool(bad.any()):
                raise ValueError(f"labels must be in [0, {vocab}) or ignore_index={ignore_index}; "
                                 f"got {y[bad][:8].tolist()}")
        dtype, use_triton = _fused_dtype_and_kernel(h, head.weight, backend)
        scale = (1.0 / torch.as_tensor(denominator, dtype=torch.float32, device=h.device)).reshape(())
        return _LinearCrossEntropy.apply(h, head.weight, head.bias, y.long(), chunk, ignore_index, scale, dtype,
                                         use_triton)

    def piece(hc, yc):
        return F.cross_entropy(head(hc).float(), yc, ignore_index=ignore_index, reduction="sum")

    total = None
    for c0 in range(0, h.shape[0], chunk):
        args = (h[c0 : c0 + chunk], y[c0 : c0 + chunk])
        part = checkpoint(piece, *args, use_reentrant=False) if torch.is_grad_enabled() else piece(*args)
        total = part if total is None else total + part
    if total is None:  # no rows at all
        total = h.new_zeros((), dtype=torch.float32)
    return total / denominator
