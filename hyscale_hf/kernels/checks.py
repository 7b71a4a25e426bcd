"""Argument checks shared by the public ops: every error names the argument and what was expected."""

from __future__ import annotations

import os

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Indices are int32 and the kernels take sizes as int32: K and T beyond this cannot be represented.
INT32_MAX = 2**31 - 1


def has_values(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements can be read: not a meta tensor, nor a fake one (shape propagation,
    torch.compile). Checks of values skip tensors without them; shapes are still checked."""
    if t.device.type == "meta":
        return False
    try:
        from torch._subclasses.fake_tensor import is_fake
    except ImportError:  # pragma: no cover
        return True
    return not is_fake(t)


def check_tensor(name: str, x, rank: int, shape_doc: str, dtypes=FLOAT_DTYPES) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {shape_doc}, got {type(x).__name__}")
    if x.dim() != rank:
        raise ValueError(f"{name} must have rank {rank} (shape {shape_doc}), got shape {tuple(x.shape)}")
    if dtypes is not None and x.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {x.dtype}")


def check_dim(name: str, x: torch.Tensor, dim: int, expected: int, shape_doc: str) -> None:
    if x.shape[dim] != expected:
        raise ValueError(
            f"{name} must have shape {shape_doc}; size {x.shape[dim]} at dim {dim} does not match "
            f"{expected}, got shape {tuple(x.shape)}"
        )


def check_same_device(**tensors) -> None:
    items = [(n, t) for n, t in tensors.items() if t is not None]
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}; all inputs must share one device")


def check_topk(topk) -> None:
    if not isinstance(topk, int) or isinstance(topk, bool):
        raise TypeError(f"topk must be an int, got {type(topk).__name__}")
    if topk <= 0:
        raise ValueError(f"topk must be > 0, got {topk}")
    if topk > INT32_MAX:  # refused here, before an output of [B, S, topk] is allocated
        raise ValueError(f"topk must be <= 2**31 - 1 (indices and the kernels' sizes are int32), got {topk}")


def check_num_keys(name: str, num_keys: int) -> None:
    """T keys: int32 indices address at most 2**31 of them."""
    if num_keys > INT32_MAX + 1:
        raise ValueError(f"{name} must have T <= 2**31 keys (indices are int32), got T = {num_keys}")


def check_indices(indices, batch: int, queries: int, num_keys: int, check_range: bool = True) -> None:
    """indices: int32 [B, S, K], entries in [-1, T)."""
    doc = f"[B={batch}, S={queries}, K] int32"
    check_tensor("indices", indices, 3, doc, dtypes=(torch.int32,))
    check_dim("indices", indices, 0, batch, doc)
    check_dim("indices", indices, 1, queries, doc)
    if indices.shape[2] <= 0:
        raise ValueError(f"indices must have K > 0 entries per query, got shape {tuple(indices.shape)}")
    if check_range and indices.numel() and not torch.compiler.is_compiling() and has_values(indices):
        # One host sync. Out-of-range indices would make the kernels read outside k and v, so this
        # check stays in eager runs; meta and fake tensors (shape propagation) have no values to read,
        # and torch.compile cannot trace the read (a patched forward compiles with fullgraph=True).
        lo, hi = torch.stack(torch.aminmax(indices)).tolist()  # one host sync, not two
        if lo < -1 or hi >= num_keys:
            raise ValueError(
                f"indices must lie in [-1, {num_keys}) (T = {num_keys} keys, -1 = empty slot); got min {lo}, max {hi}"
            )


def check_cu_seqlens(cu_seqlens, batch: int, queries: int, num_keys: int, device) -> None:
    """cu_seqlens: int32/int64 [N + 1], 0 = c_0 < ... < c_N = T, with B = 1 and S = T."""
    if cu_seqlens is None:
        return
    check_tensor("cu_seqlens", cu_seqlens, 1, "[num_seqs + 1] int32", dtypes=(torch.int32, torch.int64))
    if batch != 1:
        raise ValueError(f"cu_seqlens (packed sequences) needs batch size B = 1, got B = {batch}")
    if queries != num_keys:
        raise ValueError(f"cu_seqlens needs S == T (queries are the packed keys), got S = {queries}, T = {num_keys}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but the inputs are on {device}")
    if not has_values(cu_seqlens):
        return
    c = cu_seqlens.tolist()
    if len(c) < 2 or c[0] != 0 or c[-1] != num_keys or any(b < a for a, b in zip(c, c[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to T = {num_keys} (non-decreasing), got {c}")


def check_backend(backend: str) -> None:
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")


def triton_usable(device: torch.device) -> bool:
    """True where Triton kernels can run on tensors of ``device``: CUDA, or the CPU interpreter."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def resolve_backend(backend: str, device: torch.device, triton_available: bool) -> str:
    """Map ``backend`` to "torch" or "triton"; ``triton_available`` says the op has a Triton kernel."""
    check_backend(backend)
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if (triton_available and device.type == "cuda" and triton_usable(device)) else "torch"
    if not triton_available:
        raise ValueError("backend='triton' was asked for, but this op has no Triton kernel in this build")
    if not triton_usable(device):
        raise ValueError(
            f"backend='triton' cannot run on {device} tensors: use CUDA tensors, or set TRITON_INTERPRET=1 "
            "in the environment before importing hyscale_hf to run the kernel under Triton's CPU interpreter"
        )
    return "triton"


def check_sorted_rows(indices: torch.Tensor, why: str = "with head_probs") -> None:
    """Raise unless every row of ``indices`` lists its keys in ascending order with its -1 slots after
    them (``hytopk``'s rows): query tiles place a key's value by its rank among the row's keys (the
    attention's head sums, the indexer KL's tiles; one host sync). ``why`` names the option that needs
    it in the message."""
    if indices.shape[-1] < 2 or not indices.numel() or torch.compiler.is_compiling() or not has_values(indices):
        return
    nxt, cur = indices[..., 1:], indices[..., :-1]
    if bool(((nxt >= 0) & ((cur < 0) | (nxt <= cur))).any()):
        raise ValueError(f"indices: {why} every row must list its keys in ascending order, each once, "
                         "with its -1 slots after them (as hytopk returns them)")
