"""Context parallelism: one sequence split over the ranks of a process group (docs/design.md section 12).

``enable_context_parallel(model, group)`` makes a patched model take the *whole* batch on every rank of
``group`` (the same batch on each) and work on its own share of the tokens:

- Layout: the T tokens are cut into ``2 * N`` equal chunks; rank ``r`` holds chunk ``r`` and chunk
  ``2N - 1 - r`` (head + tail), so every rank has the same causal work (a chunk late in the sequence
  sees many keys, its partner few).
- A forward pre-hook on the model shards what the model reads per token (``input_ids`` or
  ``inputs_embeds``, ``position_ids``, made global first when absent, the padding mask, the labels,
  shifted over the whole sequence before they are cut) and keeps the whole sequence's mask and
  positions in a ``ContextBatch`` that reaches the attention layers as a keyword argument (so a
  checkpoint recompute sees its own forward's batch).
- Token-wise modules (embeddings, norms, MLPs, the LM head and loss) run on the rank's tokens only.
  Each patched attention layer all-gathers its keys (the indexer keys, and the attention's keys: the
  MLA latent row, or K and V) with ``gather_tokens``, whose backward reduce-scatters their gradients to
  the ranks that own them; then it selects, attends and takes the indexer loss for its own queries
  (``model_patches/_cp_attention.py``).
- Losses: every loss a rank returns (the LM loss through ``num_items_in_batch``, the indexer KL
  through ``ContextBatch.loss_count``) is its tokens' sum over the whole sequence's count, times N.
  Averaging gradients over the group, as DDP and FSDP2 do, then gives the one-process gradient, and
  the mean over ranks of the logged losses is the one-process loss.

Torch only; the model must be patched (``patch_model``) first.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .state import add_undo, base_model, patch_state

BATCH_KWARG = "_hyscale_cp"  # the keyword argument the ContextBatch travels in, model -> layers


@dataclass(frozen=True)
class ContextParallel:
    """The process group one sequence is split over, and this rank's place in it."""

    group: object  # a ProcessGroup (None: the default group)
    rank: int
    size: int

    @classmethod
    def of(cls, group=None) -> ContextParallel:
        """From a ``ProcessGroup``, a 1-D ``DeviceMesh`` (e.g. ``mesh["cp"]``) or None (the default group)."""
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("context parallelism needs torch.distributed initialised (accelerate launch / torchrun)")
        if hasattr(group, "get_group"):  # a DeviceMesh
            if group.ndim != 1:
                raise ValueError(f"group must be a 1-D DeviceMesh (e.g. mesh['cp']), got {group.ndim} dimensions")
            group = group.get_group()
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    def chunk_length(self, T: int) -> int:
        if T % (2 * self.size):
            raise ValueError(f"context parallelism over {self.size} ranks needs a sequence length that is a multiple "
                             f"of {2 * self.size} (2 chunks per rank); got {T} tokens: pad or pack to a multiple")
        return T // (2 * self.size)

    def chunks(self, T: int, rank: int | None = None) -> tuple[tuple[int, int], tuple[int, int]]:
        """The global ``(start, end)`` of the two chunks ``rank`` (default: this one) holds, in local order."""
        L, r = self.chunk_length(T), self.rank if rank is None else rank
        return (r * L, (r + 1) * L), ((2 * self.size - 1 - r) * L, (2 * self.size - r) * L)

    def local_positions(self, T: int, device=None) -> torch.Tensor:
        """int64 ``[2 * L]``: the global index of each of this rank's tokens."""
        return torch.cat([torch.arange(a, b, device=device) for a, b in self.chunks(T)])

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of ``x`` (the whole sequence along ``dim``)."""
        (a0, b0), (a1, b1) = self.chunks(x.shape[dim])
        return torch.cat([x.narrow(dim, a0, b0 - a0), x.narrow(dim, a1, b1 - a1)], dim=dim)


def gather_tokens(x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """The whole sequence of a per-token tensor ``x [B, 2L, ...]`` (each rank's share), in global order;
    differentiable: backward sums every rank's gradient of a token onto the rank that holds it."""
    return _GatherTokens.apply(x, cp)


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
        ctx.cp = cp
        # Token dim first, so that all_gather_into_tensor stacks the ranks' shares along it.
        local = x.movedim(1, 0).contiguous()
        parts = local.new_empty((cp.size * local.shape[0], *local.shape[1:]))
        dist.all_gather_into_tensor(parts, local, group=cp.group)
        L = local.shape[0] // 2
        order = _global_order(cp, L, parts.device)
        return parts.index_select(0, order).movedim(0, 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cp = ctx.cp
        g = grad.movedim(1, 0)
        L = g.shape[0] // (2 * cp.size)
        # Rank-major order (rank 0's two chunks, rank 1's, ...): reduce-scatter hands each rank its share.
        by_rank = g.index_select(0, _rank_order(cp, L, g.device)).contiguous()
        mine = by_rank.new_empty((2 * L, *by_rank.shape[1:]))
        dist.reduce_scatter_tensor(mine, by_rank, group=cp.group)
        return mine.movedim(0, 1), None


def _rank_order(cp: ContextParallel, L: int, device) -> torch.Tensor:
    """Global token index of each row of the rank-major stack of shares."""
    T = 2 * cp.size * L
    return torch.cat([torch.arange(a, b, device=device) for r in range(cp.size) for a, b in cp.chunks(T, r)])


def _global_order(cp: ContextParallel, L: int, device) -> torch.Tensor:
    """Row of the rank-major stack that holds each global token (the inverse of ``_rank_order``)."""
    rank_order = _rank_order(cp, L, device)
    return torch.empty_like(rank_order).scatter_(0, rank_order, torch.arange(rank_order.numel(), device=device))


@dataclass
class ContextBatch:
    """One forward's whole-sequence facts, which every layer of every rank shares.

    Attributes:
        cp: the group.
        T: tokens in the whole sequence; this rank holds ``cp.chunks(T)``.
        attention_mask: bool ``[B, T]`` padding mask of the whole sequence, or None.
        position_ids: int64 ``[B or 1, T]`` positions of the whole sequence (packed sequences restart them).
        cu_seqlens: int32 packed-sequence boundaries of the whole sequence (``cu_seq_lens_q``), or None.
        loss_count: the indexer KL's divisor, a 0-dim fp32 tensor: the queries that count over the whole
            batch (real ones), divided by ``cp.size`` (module docstring).
        cache: what the attention layers derive once per forward from these (packed-sequence starts).
    """

    cp: ContextParallel
    T: int
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor | None
    loss_count: torch.Tensor
    cache: dict = field(default_factory=dict)

    def local_chunks(self) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """``((local start, local end), (global start, global end))`` of this rank's two chunks."""
        (a0, b0), (a1, b1) = self.cp.chunks(self.T)
        L = b0 - a0
        return [((0, L), (a0, b0)), ((L, 2 * L), (a1, b1))]


_SHARDED = ("input_ids", "inputs_embeds", "attention_mask", "position_ids", "labels", "token_type_ids")
_UNSUPPORTED = ("past_key_values", "cache_position")


class _ShardInputs:
    """Forward pre-hook of the patched root: whole-batch inputs in, this rank's share out."""

    def __init__(self, cp: ContextParallel, state) -> None:
        self.cp, self.state = cp, state

    def __call__(self, module, args, kwargs):
        if BATCH_KWARG in kwargs or self.state.context_parallel is None:  # a nested call, or paused
            return None
        if args:  # the class's signature: an instance forward (lm_loss_chunk's) takes *args
            names = [n for n in inspect.signature(type(module).forward).parameters if n != "self"]
            kwargs = {**dict(zip(names, args)), **kwargs}
        if kwargs.get("output_attentions"):
            raise ValueError("context parallelism does not return attention weights (output_attentions=True)")
        for name in _UNSUPPORTED:
            if kwargs.get(name) is not None:
                raise ValueError(f"context parallelism runs training-style forwards over a whole sequence; "
                                 f"{name} is not supported (no KV cache, no generation)")
        ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
        ref = ids if ids is not None else embeds
        if ref is None:
            raise ValueError("context parallelism needs input_ids or inputs_embeds")
        B, T, device = ref.shape[0], ref.shape[1], ref.device
        self.cp.chunk_length(T)  # validates T before any work
        _check_same_batch(self.cp, ids if ids is not None else embeds)
        mask = kwargs.get("attention_mask")
        if mask is not None and (mask.dim() != 2 or tuple(mask.shape) != (B, T)):
            raise ValueError(f"context parallelism needs a 2-D attention_mask [batch, tokens] = {(B, T)}, got "
                             f"{tuple(mask.shape)}")
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(T, device=device)[None].expand(B, T)
        cu = kwargs.pop("cu_seq_lens_q", None)
        if cu is None:
            cu = kwargs.get("cu_seq_lens_k")
        for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
            kwargs.pop(name, None)  # they describe the whole sequence; the layers get it from the batch
        real = B * T if mask is None else mask.bool().sum()
        batch = ContextBatch(self.cp, T, None if mask is None else mask.bool(), positions,
                             None if cu is None else cu.to(device=device, dtype=torch.int32),
                             torch.as_tensor(real, dtype=torch.float32, device=device) / self.cp.size)
        labels = kwargs.get("labels")
        if labels is not None:
            # Shift over the whole sequence before cutting it: a chunk's last label is the next chunk's first token.
            shift = kwargs.get("shift_labels")
            if shift is None:
                shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
            count = kwargs.get("num_items_in_batch")
            if count is None:
                count = (shift != -100).sum()
            local = self.cp.shard(shift)
            kwargs.update(labels=local, shift_labels=local, num_items_in_batch=count / self.cp.size)
        kwargs["position_ids"] = positions
        for name in _SHARDED:
            value = kwargs.get(name)
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == T:
                kwargs[name] = self.cp.shard(value)
        kwargs["use_cache"] = False
        kwargs[BATCH_KWARG] = batch
        return (), kwargs


def _check_same_batch(cp: ContextParallel, tensor: torch.Tensor) -> None:
    """Every rank of the group must hold the same batch: a few statistics compared across it (one small
    collective per forward), so a data loader that splits batches over these ranks fails here."""
    t = tensor.detach().double()
    weight = torch.arange(1, t.shape[1] + 1, device=t.device, dtype=t.dtype).view(1, -1, *([1] * (t.dim() - 2)))
    stats = torch.stack([t.sum(), (t * weight).sum(), torch.tensor(float(t.numel()), device=t.device, dtype=t.dtype)])
    gathered = stats.new_empty(cp.size * 3)
    dist.all_gather_into_tensor(gathered, stats, group=cp.group)
    gathered = gathered.view(cp.size, 3)
    if not torch.allclose(gathered, gathered[:1].expand_as(gathered), rtol=1e-6, atol=0):
        raise ValueError("context parallelism: the ranks of the group got different batches; every rank of a context-"
                         "parallel group must be given the same whole sequences (shard the data over data-parallel "
                         "ranks only)")


def enable_context_parallel(model: torch.nn.Module, group=None) -> torch.nn.Module:
    """Split every forward's sequence over ``group`` (a ``ProcessGroup``, a 1-D ``DeviceMesh`` such as
    ``mesh["cp"]``, or None for the default group); returns ``model``. The model must be patched. Undone
    by ``disable_context_parallel`` and by ``unpatch_model``. Every rank calls the model with the same
    whole-sequence batch; outputs (logits, hidden states) are the rank's own tokens, in the order
    ``ContextParallel.local_positions`` gives."""
    state = patch_state(model)
    if state is None:
        raise ValueError("enable_context_parallel needs a model patched by hyscale_hf.patch_model")
    if state.context_parallel is not None:
        raise ValueError("context parallelism is already enabled on this model")
    cp = ContextParallel.of(group)
    root = base_model(model)
    handle = root.register_forward_pre_hook(_ShardInputs(cp, state), with_kwargs=True, prepend=True)
    state.context_parallel = cp

    def undo():
        handle.remove()
        state.context_parallel = None

    state.cp_undo = undo
    add_undo(model, _Undo(state))
    return model


class _Undo:
    def __init__(self, state) -> None:
        self.state = state

    def __call__(self) -> None:
        if self.state.cp_undo is not None:
            self.state.cp_undo()
            self.state.cp_undo = None


def disable_context_parallel(model: torch.nn.Module) -> torch.nn.Module:
    """Undo ``enable_context_parallel``: forwards take whole sequences on each rank again; returns ``model``."""
    state = patch_state(model)
    if state is None or state.context_parallel is None:
        raise ValueError("context parallelism is not enabled on this model")
    state.cp_undo()
    state.cp_undo = None
    return model


@contextmanager
def context_parallel_paused(model: torch.nn.Module):
    """Forwards inside run whole sequences on each rank alone (e.g. an evaluation in the middle of a
    context-parallel training run); a no-op where context parallelism is not enabled."""
    state = patch_state(model)
    cp = None if state is None else state.context_parallel
    if cp is None:
        yield
        return
    state.context_parallel = None
    try:
        yield
    finally:
        state.context_parallel = cp
