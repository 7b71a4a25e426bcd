"""``HyScaleConfig.lm_loss_chunk``: the causal-LM loss without the ``[B, T, vocab]`` logits.

Transformers' ``*ForCausalLM.forward`` applies ``lm_head`` to every position and then calls
``self.loss_function(logits=..., labels=...)``. When labels are given, the patched forward runs the
model's own forward with the head submodule swapped for an identity and the loss function replaced,
so the "logits" that reach the loss are the final hidden states and ``kernels.chunked_cross_entropy``
calls the real head module (hooks included) a chunk at a time. The output then carries the loss and
``logits=None``. A model whose forward changes the head's output before the loss (logit scaling,
soft-capping) is refused at call time, never silently given a different loss. Without labels the
model's forward runs as is.
"""

from __future__ import annotations

import types

from torch import nn

from ..kernels import chunked_cross_entropy
from ..state import PatchState


class _IdentityHead(nn.Module):
    """Stands in for the LM head during one forward: passes the hidden states on and remembers them,
    to check that the loss receives them as they are."""

    def __init__(self) -> None:
        super().__init__()
        self.output = None

    def forward(self, hidden_states):
        self.output = hidden_states
        return hidden_states


def _head_name(model: nn.Module) -> str | None:
    head = model.get_output_embeddings()
    return next((name for name, m in model._modules.items() if m is head and head is not None), None)


def _forward_with_chunked_loss(self, *args, **kwargs):
    if kwargs.get("labels") is None:
        return type(self).forward(self, *args, **kwargs)
    if kwargs.get("return_dict") is False:
        raise ValueError("HyScaleConfig.lm_loss_chunk returns logits=None in a ModelOutput; call with return_dict=True")
    name = _head_name(self)
    if name is None:
        raise RuntimeError(f"HyScaleConfig.lm_loss_chunk: {type(self).__name__}'s output embedding is no longer one "
                           "of its direct submodules")
    head = self._modules[name]  # called as a module chunk by chunk: its hooks (FSDP, PEFT) run as usual
    stand_in = _IdentityHead()
    chunk = self._hyscale_lm_loss_chunk

    def loss_function(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
                      shift_labels=None, **_):
        if logits is not stand_in.output:
            raise RuntimeError(
                f"HyScaleConfig.lm_loss_chunk: {type(self).__name__} changes the LM head's output before its loss "
                "(logit scaling or soft-capping); the chunked loss cannot reproduce it: leave lm_loss_chunk unset"
            )
        if shift_labels is None:
            shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        return chunked_cross_entropy(logits, head, shift_labels, chunk, ignore_index=ignore_index,
                                     num_items_in_batch=num_items_in_batch)

    had_loss_function, previous_loss_function = "_loss_function" in self.__dict__, self.__dict__.get("_loss_function")
    self._modules[name] = stand_in
    self.loss_function = loss_function
    try:
        out = type(self).forward(self, *args, **kwargs)
    finally:
        self._modules[name] = head
        if had_loss_function:
            self._loss_function = previous_loss_function
        else:
            del self._loss_function
    out["logits"] = None
    return out


class _ChunkedLossUndo:
    def __init__(self, model: nn.Module | None) -> None:
        self.model = model

    def __call__(self) -> None:
        if self.model is not None:
            self.model.__dict__.pop("forward", None)
            self.model.__dict__.pop("_hyscale_lm_loss_chunk", None)
            self.model = None


def apply_chunked_lm_loss(model: nn.Module, state: PatchState) -> _ChunkedLossUndo:
    """Give ``model`` (a Transformers causal LM) the chunked-loss forward when
    ``state.config.lm_loss_chunk`` is set; returns the undo."""
    chunk = state.config.lm_loss_chunk
    if chunk is None:
        return _ChunkedLossUndo(None)
    has_head = hasattr(model, "get_output_embeddings") and _head_name(model) is not None
    if not has_head or not callable(getattr(model, "loss_function", None)):
        raise ValueError(
            f"HyScaleConfig.lm_loss_chunk needs a causal LM whose output embedding (lm_head) is a direct submodule "
            f"and which has a loss_function; {type(model).__name__} does not: leave lm_loss_chunk unset"
        )
    if "forward" in model.__dict__:
        raise ValueError(
            f"HyScaleConfig.lm_loss_chunk: {type(model).__name__} already carries an instance forward "
            "(another patch or hook); the chunked loss would bypass or be bypassed by it"
        )
    model._hyscale_lm_loss_chunk = chunk
    model.forward = types.MethodType(_forward_with_chunked_loss, model)
    return _ChunkedLossUndo(model)

