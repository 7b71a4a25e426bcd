"""The lightning indexer added to dense models, and the wiring that trains indexers.

``LightningIndexer`` is the module a dense family's patch adds to each attention layer (see
``hyscale_hf/model_patches/_dense_common.py`` for how it is attached, cached during generation and
saved). ``indexer_loss_once`` / ``attach_indexer_loss`` add each indexer layer's KL loss to training
without touching the loop.

A patched attention module passes its output through ``indexer_loss_once``: the forward value is
unchanged (the Trainer's loss stays the LM loss), and backward injects ``coef * d(indexer_loss)``
into the graph. Because the indexer's inputs are detached and the KL target is detached, that
gradient reaches only the indexer's parameters, and the LM loss never reaches the indexer (top-k
indices carry no gradient).

The loss is computed once per layer and step. Its gradient with respect to the indexer's outputs
(q, k, w) is taken in the forward, right after the loss, and kept until backward carries it into
the indexer; a checkpoint recompute of the layer then has nothing to redo for the loss (before, the
KL forward ran a second time there, the largest kernel of a converted model's step). The price is
those gradients held from forward to backward: ``S * (H * D + D + H)`` elements per layer (for a
2 x 64 indexer in bf16 about 1/20 of the replayed selection's ``S * K`` int32 at top-2048; for
GLM-5's 32 x 128 about as much as it).

``deferred_indexer_loss`` computes it in backward instead, where the attention's backward has left
the KL's target (the sparse stage, ``model_patches/_dsa_step._deferred_target``): no
pass of its own over the attention's keys, and nothing held from forward to backward.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from .offload import model_offload
from .replay import replaying
from .state import PatchState, in_backward


class _AttachLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, loss: torch.Tensor, coef: float) -> torch.Tensor:
        ctx.coef = coef
        ctx.loss_meta = (loss.shape, loss.dtype, loss.device)
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad_hidden: torch.Tensor):
        shape, dtype, device = ctx.loss_meta
        return grad_hidden, torch.full(shape, ctx.coef, dtype=dtype, device=device), None


class _LossWithGradient(torch.autograd.Function):
    """The value of a loss whose gradient with respect to ``tensors`` was already computed (``grads``).

    Backward hands out ``grads`` scaled by the incoming gradient, so the loss joins the graph (through
    ``attach_indexer_loss``) exactly as the loss itself would, without its graph or saved tensors.
    ``offload`` (a ``HostOffload`` or None) holds ``grads`` in host memory until then.
    """

    @staticmethod
    def forward(ctx, value: torch.Tensor, grads: tuple, offload, *tensors: torch.Tensor) -> torch.Tensor:
        # An attribute, not save_for_backward: no checkpoint recomputes it.
        ctx.offload, ctx.grads = offload, grads if offload is None else offload.stash(grads)
        return value.detach().clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grads = ctx.grads if ctx.offload is None else ctx.offload.fetch(ctx.grads)
        return (None, None, None, *(g if g is None else (g * grad).to(g.dtype) for g in grads))


def _keep(t: torch.Tensor) -> torch.Tensor:
    return t


def indexer_loss_once(hidden: torch.Tensor, index: tuple, loss_fn, state: PatchState) -> torch.Tensor:
    """``hidden`` unchanged, with the indexer loss ``loss_fn(*index)`` joined to training, computed once.

    ``index`` holds the indexer's outputs (tensors with the graph to its parameters); ``loss_fn`` maps
    them to the loss. In the forward the loss and its gradient with respect to ``index`` are computed
    on detached copies, outside any checkpoint's saved-tensor hooks, and the loss joins through
    ``attach_indexer_loss`` as a ``_LossWithGradient``. The recompute of a checkpoint with selection
    replay (Transformers' gradient checkpointing on a patched model) returns ``hidden``: the forward's
    loss already carries the gradient. Under ``torch.compile`` (which cannot trace
    ``autograd.grad``) the loss joins the traced graph as it is.
    """
    if torch.compiler.is_compiling():
        return attach_indexer_loss(hidden, loss_fn(*index), state)
    if _replayed_recompute():
        return hidden
    loss, grads = _loss_and_grads(index, loss_fn, state)
    if grads is None:
        return attach_indexer_loss(hidden, loss, state)  # recorded only
    return attach_indexer_loss(hidden, _LossWithGradient.apply(loss, grads, model_offload(state), *index), state)


class _DeferredLoss(torch.autograd.Function):
    """The indexer loss of a layer whose attention leaves its KL target in ``head_probs`` in backward.

    ``anchor`` is an input of that attention, passed through; as the attention consumes the result,
    autograd runs this backward only after the attention's, when the target is there. Backward then
    computes the loss ``loss_fn(target, indices, *index, tiles=...)`` (``tiles``: the query tiles the
    attention walked, or None) and its gradient with respect to ``index`` (the
    indexer's outputs) on detached leaves, records the loss, and hands the gradient, scaled by the one
    the loss carrier (the second output, 0 in forward) receives, to the indexer. ``indices`` and ``index``
    are saved tensors, so a checkpoint drops and recomputes them like the layer's others: forward and
    recompute run this node alike, nothing is held from forward to backward but the saved tensors.
    """

    @staticmethod
    def forward(ctx, anchor, head_probs, loss_fn, state, indices, *index):
        ctx.head_probs, ctx.loss_fn, ctx.state = head_probs, loss_fn, state
        ctx.needs = [t.requires_grad for t in index]
        ctx.save_for_backward(indices, *index)
        return anchor.view_as(anchor), torch.zeros((), dtype=torch.float32, device=anchor.device)

    @staticmethod
    def backward(ctx, grad_anchor, grad_loss):
        indices, *index = ctx.saved_tensors
        target, tiles = ctx.head_probs.take(), ctx.head_probs.take_tiles()
        loss, grads = _loss_and_grads(tuple(index), lambda *t: ctx.loss_fn(target, indices, *t, tiles=tiles),
                                      ctx.state)
        ctx.state.record_indexer_loss(loss)
        if grads is None or grad_loss is None:
            return (grad_anchor, None, None, None, None, *(None for _ in index))
        return (grad_anchor, None, None, None, None,
                *(g if g is None else (g * grad_loss).to(g.dtype) for g in grads))


def deferred_indexer_loss(anchor: torch.Tensor, head_probs, loss_fn, indices: torch.Tensor, index: tuple,
                          state: PatchState) -> tuple[torch.Tensor, torch.Tensor]:
    """``(anchor', carrier)``: feed ``anchor'`` to the attention that fills ``head_probs`` in its backward
    and join ``carrier`` with ``attach_indexer_loss(..., record=False)``; the loss
    ``loss_fn(target, indices, *index, tiles=...)`` is computed in backward, once per layer and step, and recorded then."""
    return _DeferredLoss.apply(anchor, head_probs, loss_fn, state, indices, *index)


def _replayed_recompute() -> bool:
    # A replaying checkpoint's recompute: its forward computed the loss and the gradient is on its way.
    # Other recomputes compute it: a reentrant checkpoint ran its forward without grad, and a
    # non-reentrant one without the replay context only keeps its recompute's saved tensors.
    return in_backward() and replaying()


def _loss_and_grads(index: tuple, loss_fn, state: PatchState):
    """``(loss detached, gradients of the loss with respect to index)``, on detached leaves outside any
    saved-tensor hooks; gradients None when no gradient is wanted (the loss is then only recorded)."""
    needs = [t.requires_grad for t in index]
    with torch.autograd.graph.saved_tensors_hooks(_keep, _keep), torch.enable_grad():
        leaves = tuple(t.detach().requires_grad_(need) for t, need in zip(index, needs))
        loss = loss_fn(*leaves)
        wanted = [leaf for leaf in leaves if leaf.requires_grad]
        if float(state.config.indexer_loss_coef) == 0.0 or not loss.requires_grad or not wanted:
            return loss.detach(), None
        found = iter(torch.autograd.grad(loss, wanted, materialize_grads=True))
    return loss.detach(), tuple(next(found) if need else None for need in needs)


class TiledIndexerLoss:
    """``indexer_loss_once`` for a layer whose queries run in parts: tiles (``HyScaleConfig.tile_tokens``)
    or the chunks of context parallelism.

    ``keys`` is the layer's indexer key ``[B, T, D]`` (with its graph to the indexer). Each
    ``add((q, k, w), loss_fn)`` takes one part's queries ``q [B, s, H, D]`` and weights ``w [B, s, H]`` (a
    tile's own tensors, or slices of the layer's) with the keys it sees, ``k = keys[:, :end]``, and
    computes that part's loss ``loss_fn(q, k, w)`` (its share of the layer's loss) and its gradients at
    once, so one part's loss inputs exist at a time. The query-side gradients join the graph right away
    (``_LossWithGradient``, into the offload's host memory when it is on); the key gradient adds up in
    fp32 over the parts. ``join`` attaches the summed loss to the layer output as ``indexer_loss_once``
    does (recorded once per layer). Nothing is computed in a replaying recompute.
    """

    def __init__(self, keys: torch.Tensor, state: PatchState) -> None:
        self.keys, self.state = keys, state
        self.compiling = torch.compiler.is_compiling()
        self.skip = not self.compiling and _replayed_recompute()
        self.total = None
        self.key_grad = None
        self.terms: list[torch.Tensor] = []  # zero-valued losses that carry each part's query-side gradients

    def add(self, parts: tuple, loss_fn) -> None:
        if self.skip:
            return
        if self.compiling:
            loss, grads = loss_fn(*parts), None
        else:
            loss, grads = _loss_and_grads(parts, loss_fn, self.state)
        self.total = loss if self.total is None else self.total + loss
        if grads is None:
            return
        gq, gk, gw = grads
        if gk is not None:
            if self.key_grad is None:
                self.key_grad = torch.zeros(self.keys.shape, dtype=torch.float32, device=self.keys.device)
            self.key_grad[:, : gk.shape[1]].add_(gk)  # every later part sees these keys again
        q, _, w = parts
        if gq is not None or gw is not None:
            self.terms.append(_LossWithGradient.apply(torch.zeros((), dtype=loss.dtype, device=loss.device),
                                                      (gq, gw), model_offload(self.state), q, w))

    def join(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.skip or self.total is None:
            return hidden
        if self.compiling or (self.key_grad is None and not self.terms):
            return attach_indexer_loss(hidden, self.total, self.state)
        if self.key_grad is None:
            loss = self.total
        else:
            grads = (self.key_grad.to(self.keys.dtype),)
            loss = _LossWithGradient.apply(self.total, grads, model_offload(self.state), self.keys)
        for term in self.terms:
            loss = loss + term
        return attach_indexer_loss(hidden, loss, self.state)


def attach_indexer_loss(hidden: torch.Tensor, loss: torch.Tensor, state: PatchState, record: bool = True) -> torch.Tensor:
    """Return ``hidden`` unchanged, with ``state.config.indexer_loss_coef * loss`` joined to the graph.

    Records the detached loss in ``state`` for logging (not during checkpoint recompute, which
    would count it twice; not with ``record=False``, for a deferred loss that records itself in
    backward). A loss that needs no gradient is only recorded.

    Where the gradient is joined depends on ``hidden``: if it requires grad (the base model trains),
    the loss rides on it, so any loss computed from the model's output reaches it. If it does not
    (the dense warm-up, where everything but the indexer is frozen), joining it there would make
    every later layer build a graph and run a backward for nothing but carrying the indexer's
    gradient; the loss waits in ``state.pending_losses`` instead and ``sink_pending_losses`` joins
    it to the model's output at the end of its forward.
    """
    if record and not in_backward():
        state.record_indexer_loss(loss)
    coef = float(state.config.indexer_loss_coef)
    if coef == 0.0 or not loss.requires_grad or not torch.is_grad_enabled():
        return hidden
    if not hidden.requires_grad:
        if not in_backward():  # a recompute's loss is never backpropagated: the forward's is
            state.pending_losses.append(loss)
        return hidden
    return _AttachLoss.apply(hidden, loss, coef)


def before_forward(state: PatchState, model: torch.nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook of a patched model: forget the pending losses of an earlier forward that never
    reached an output, and while ``state.base_frozen`` is set feed the model detached input embeddings.

    Only the indexer trains then, on inputs it detaches itself, so the base needs no autograd graph.
    It would build one anyway wherever its input embeddings require grad: Transformers' gradient
    checkpointing marks them so (``enable_input_require_grads``, for adapters), and the LM loss's
    backward then runs through every frozen layer for nothing. Embedding the ids here, detached, is
    the same computation without that graph.
    """
    state.pending_losses.clear()
    if not (state.base_frozen and torch.is_grad_enabled() and kwargs.get("inputs_embeds") is None):
        return None
    if "inputs_embeds" not in inspect.signature(model.forward).parameters or not hasattr(model, "get_input_embeddings"):
        return None  # not a Transformers-style model: it runs as called (correct, only slower)
    positional = "input_ids" not in kwargs and len(args) > 0
    ids = args[0] if positional else kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or _sharded(model.get_input_embeddings()):
        # FSDP2 gathers a sharded embedding only inside the root's forward, after this hook: run as called
        return None
    with torch.no_grad():  # detached too: the Transformers hook marks even a no-grad output as requiring grad
        embeds = model.get_input_embeddings()(ids).detach()
    return (args[1:] if positional else args), {**kwargs, "input_ids": None, "inputs_embeds": embeds}


def _sharded(module: nn.Module) -> bool:
    """Whether ``module``'s parameters are DTensors (FSDP2 shards) rather than plain tensors."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed support
        return False
    return any(isinstance(p, DTensor) for p in module.parameters(recurse=False))


def sink_pending_losses(state: PatchState, output):
    """Join the losses waiting in ``state.pending_losses`` to a model output (forward hook).

    The output's ``loss`` carries them when there is one, else its ``logits`` (a loss computed
    from either then backpropagates into the indexer). Values are unchanged. Raises
    ``RuntimeError`` when the output holds neither: the indexer would silently not train.
    """
    if not state.pending_losses:
        return output
    total = torch.stack([x.float() for x in state.pending_losses]).sum()
    state.pending_losses.clear()
    for key in ("loss", "logits"):
        value = output.get(key) if hasattr(output, "get") else None
        if isinstance(value, torch.Tensor):
            # A copy, not the Function's view of its input: callers modify a returned loss in place.
            output[key] = _AttachLoss.apply(value, total, float(state.config.indexer_loss_coef)).clone()
            return output
    raise RuntimeError(
        "hyscale_hf: the indexer loss of this forward has no output to ride on (the base model is frozen and "
        f"the {type(output).__name__} output has neither loss nor logits); call the patched model itself"
    )


class _LossSinkHooks:
    """Forward pre-hook and hook of a patched root for ``indexer.before_forward`` / ``sink_pending_losses``
    (an object holding the state, so that a deep copy of the model hooks the copy's state)."""

    def __init__(self, state: PatchState) -> None:
        self.state = state

    def before(self, module, args, kwargs):
        return before_forward(self.state, module, args, kwargs)

    def after(self, module, args, output):
        return sink_pending_losses(self.state, output)


def install_loss_sink(model: torch.nn.Module, state: PatchState):
    """Hooks on the patched root for ``before_forward`` and ``sink_pending_losses``; returns their undo."""
    hooks = _LossSinkHooks(state)
    handles = [model.register_forward_pre_hook(hooks.before, with_kwargs=True), model.register_forward_hook(hooks.after)]
    return _RemoveHooks(model, handles)


class _RemoveHooks:
    """Removes forward hooks by id. ``RemovableHandle`` holds a weak reference to the original
    module's hook dict, so after ``copy.deepcopy`` of a patched model it would unhook the original."""

    _DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
              "_forward_hooks_always_called")

    def __init__(self, module: torch.nn.Module, handles) -> None:
        self.module, self.ids = module, [h.id for h in handles]

    def __call__(self) -> None:
        for name in self._DICTS:
            hooks = getattr(self.module, name, {})
            for hook_id in self.ids:
                hooks.pop(hook_id, None)


# ----------------------------------------------------------------------------- lightning indexer


def rope_frequency_subset(num_pairs: int, keep_pairs: int, device=None) -> torch.Tensor:
    """Evenly spaced frequency indices (int64 ``[keep_pairs]``, on ``device``) out of a RoPE table of ``num_pairs``.

    RoPE tables are geometric (``theta_j = base^(-2j/R)``), so every ``stride``-th frequency is the
    table of a smaller RoPE with the same base spanning the same wavelengths, high and low.
    """
    return torch.arange(keep_pairs, dtype=torch.int64, device=device) * num_pairs // keep_pairs


class LightningIndexer(nn.Module):
    """The lightning indexer added to a dense model's attention layer (DeepSeek-V3.2 layout).

    ``I[t, s] = sum_h w[t, h] * ReLU(q[t, h] . k[s])`` with, from the layer's hidden states ``x``:
    ``q = wq(x)`` (``H`` heads of dim ``D``), one key ``k = LayerNorm(wk(x))`` of dim ``D`` shared by
    the heads, and ``w = weights_proj(x) * H^-0.5 * D^-0.5`` in fp32 (both positive scales folded
    into ``w``, docs/design.md section 2). RoPE rotates the first ``rope_dim`` dims of ``q`` and ``k`` with
    the model's own rotary tables and layout (``apply_rotary``: the family's
    ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)``); ``rope_dim`` smaller than the model's
    rotary dim keeps an evenly spaced subset of its frequencies.

    Initialisation (a locality prior, so the first selections are the recent keys rather than noise):
    the projections are normal(0, ``init_std``) like the model's own weights; ``wq`` and the key
    LayerNorm carry a bias of 1 on the RoPE dims, so every head starts with a constant RoPE component
    on q and k whose dot product ``sum_j cos(theta_j (t - s))`` peaks at distance 0 and falls with
    distance (RoPE's long-range decay); ``weights_proj`` starts with bias 1, so every head's weight
    starts positive. Training replaces the prior through the KL loss.

    Args:
        hidden_size: width of the hidden states ``x``.
        n_heads: indexer heads ``H``.
        head_dim: indexer head dim ``D`` (even).
        rope_dim: dims of q and k rotated by RoPE (even, ``0 <= rope_dim <= D``).
        apply_rotary: the family's ``apply_rotary_pos_emb``; required when ``rope_dim > 0``.
        init_std: std of the projection weights (the model's ``initializer_range``).
        eps: LayerNorm epsilon of the key.

    ``forward(x, cos, sin)``: ``x [B, S, hidden]``, ``cos``/``sin`` ``[B or 1, S, R]`` (the model's
    rotary tables, ``R >= rope_dim``) -> ``q [B, S, H, D]``, ``k [B, S, D]`` in ``x``'s dtype and
    ``w [B, S, H]`` fp32.
    """

    def __init__(
        self,
        hidden_size: int,
        n_heads: int,
        head_dim: int,
        rope_dim: int,
        *,
        apply_rotary=None,
        init_std: float = 0.02,
        eps: float = 1e-6,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("n_heads", n_heads), ("head_dim", head_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if head_dim % 2:
            raise ValueError(f"head_dim must be even, got {head_dim}")
        if not isinstance(rope_dim, int) or rope_dim < 0 or rope_dim % 2 or rope_dim > head_dim:
            raise ValueError(f"rope_dim must be an even int in [0, head_dim={head_dim}], got {rope_dim!r}")
        if rope_dim and not callable(apply_rotary):
            raise TypeError("apply_rotary must be the family's apply_rotary_pos_emb when rope_dim > 0")
        if init_std <= 0:
            raise ValueError(f"init_std must be > 0, got {init_std}")
        self.n_heads, self.head_dim, self.rope_dim = n_heads, head_dim, rope_dim
        self.init_std = float(init_std)
        self.apply_rotary = apply_rotary
        factory = {"dtype": dtype, "device": device}
        self.wq = nn.Linear(hidden_size, n_heads * head_dim, bias=True, **factory)
        self.wk = nn.Linear(hidden_size, head_dim, bias=False, **factory)
        self.k_norm = nn.LayerNorm(head_dim, eps=eps, **factory)
        self.weights_proj = nn.Linear(hidden_size, n_heads, bias=True, **factory)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The locality-prior initialisation described in the class docstring."""
        for linear in (self.wq, self.wk, self.weights_proj):
            linear.weight.normal_(0.0, self.init_std)
        rope_bias = torch.zeros(self.head_dim)
        rope_bias[: self.rope_dim] = 1.0
        self.wq.bias.copy_(rope_bias.repeat(self.n_heads))
        self.k_norm.weight.fill_(1.0)
        self.k_norm.bias.copy_(rope_bias)
        self.weights_proj.bias.fill_(1.0)

    def extra_repr(self) -> str:
        return f"n_heads={self.n_heads}, head_dim={self.head_dim}, rope_dim={self.rope_dim}"

    def _rope_tables(self, cos: torch.Tensor, sin: torch.Tensor):
        """The model's ``[.., R]`` tables (two copies of R/2 frequencies) cut to ``rope_dim``."""
        R = cos.shape[-1]
        if R % 2 or R < self.rope_dim:
            raise ValueError(f"the rotary tables have {R} dims; the indexer needs an even number >= rope_dim={self.rope_dim}")
        if R == self.rope_dim:
            return cos, sin
        sel = rope_frequency_subset(R // 2, self.rope_dim // 2, cos.device)  # built there: no host-to-GPU copy
        cut = lambda t: torch.cat([t[..., sel], t[..., sel]], dim=-1)  # noqa: E731
        return cut(cos), cut(sin)

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None):
        B, S, _ = x.shape
        H, D, r = self.n_heads, self.head_dim, self.rope_dim
        q = self.wq(x).view(B, S, H, D)
        k = self.k_norm(self.wk(x))
        if r:
            if cos is None or sin is None:
                raise ValueError("the indexer applies RoPE: pass the model's rotary tables cos and sin")
            cos_r, sin_r = self._rope_tables(cos, sin)
            q_rot, k_rot = self.apply_rotary(q[..., :r], k[:, :, None, :r], cos_r, sin_r, unsqueeze_dim=2)
            q = torch.cat([q_rot.to(q.dtype), q[..., r:]], dim=-1)
            k = torch.cat([k_rot[:, :, 0].to(k.dtype), k[..., r:]], dim=-1)
        w = self.weights_proj(x).float() * (H**-0.5 * D**-0.5)
        return q, k, w
