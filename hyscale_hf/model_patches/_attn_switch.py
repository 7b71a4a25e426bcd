"""The attention implementation a patched model reports, and the one it runs (docs/design.md section 8).

A patched layer needs Transformers to take two decisions its way: the model-level mask (the registered
``ATTN_IMPLEMENTATION``'s mask function returns the 2-D padding mask, never a ``[B, 1, S, T]`` tensor),
and, in a dense family's own attention forward, the attention function (``ATTN_IMPLEMENTATION``'s,
which runs the indexer and sparse attention). Both read ``config._attn_implementation`` when they run.
The config itself keeps the implementation the user chose ("eager", "sdpa", ...): the model reports it,
``set_attn_implementation`` changes it as on any model, and ``unpatch_model`` leaves a model that runs
it. ``ATTN_IMPLEMENTATION`` is in the config only while a patched call runs:

- every Transformers model in the patched model (the causal LM, its base model, a language model
  inside a composite) gets a forward pre-hook and an always-called forward hook that set and restore it,
  and its ``generate`` runs with it in place (generation builds masks outside the forward too:
  ``prepare_inputs_for_generation`` for a static cache);
- a patched dense attention module sets it around its own forward, which also runs alone, in a
  checkpoint's recompute during backward.

What the chosen implementation means while patched: the layers run hyscale_hf's attention either way;
its dense parts (the warm-up stage, layers without DSA) run SDPA, with PyTorch's math backend when the
choice is "eager" (eager attention's arithmetic) and its default backends otherwise.
"""

from __future__ import annotations

import contextlib
import inspect

from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import PreTrainedModel

from ._dsa_step import ATTN_IMPLEMENTATION

_ATTR = "_attn_implementation_internal"  # what the config's _attn_implementation property reads


class AttnSwitch:
    """Puts ``ATTN_IMPLEMENTATION`` into ``configs`` for the duration of a call (nestable; an object, so a
    deepcopy of the patched model gets its own)."""

    def __init__(self, configs: list) -> None:
        self.configs = configs
        self._saved: list[list] = []

    def enter(self) -> None:
        self._saved.append([_get(c) for c in self.configs])
        for c in self.configs:
            _set(c, ATTN_IMPLEMENTATION)

    def exit(self) -> None:
        if self._saved:
            for c, value in zip(self.configs, self._saved.pop()):
                _set(c, value)

    @contextlib.contextmanager
    def active(self):
        self.enter()
        try:
            yield
        finally:
            self.exit()

    def chosen(self):
        """The implementation the user chose (the first patched config's, outside the patched call)."""
        value = self._saved[0][0] if self._saved else _get(self.configs[0])
        return value.get("", None) if isinstance(value, dict) else value

    def dense_kernel(self):
        """The SDPA backends for the dense parts: the math backend when the choice is "eager"."""
        return sdpa_kernel(SDPBackend.MATH) if self.chosen() == "eager" else contextlib.nullcontext()


def _get(config):
    return config._attn_implementation


def _set(config, value) -> None:
    # Past the property's setter where there is one: the setter also rewrites sub-configs, which the
    # patched (text) configs do not need twice per call.
    if isinstance(getattr(type(config), "_attn_implementation", None), property) and _ATTR in config.__dict__:
        config.__dict__[_ATTR] = value
    else:
        config._attn_implementation = value


class _Enter:
    def __init__(self, switch: AttnSwitch) -> None:
        self.switch = switch

    def __call__(self, module, args, kwargs=None):
        self.switch.enter()


class _Exit:
    def __init__(self, switch: AttnSwitch) -> None:
        self.switch = switch

    def __call__(self, module, args, output):
        self.switch.exit()


class _RemoveHooks:
    """Undo of ``install``: removes the hooks by id (an object holding the modules, so a deepcopy of the
    model removes the copy's own hooks)."""

    def __init__(self, entries: list) -> None:
        self.entries = entries

    def __call__(self) -> None:
        for module, pre_id, post_id in self.entries:
            module._forward_pre_hooks.pop(pre_id, None)
            module._forward_hooks.pop(post_id, None)
            module._forward_hooks_always_called.pop(post_id, None)
        self.entries = []


class SwitchedGenerate:
    """A model's ``generate`` run with ``ATTN_IMPLEMENTATION`` in place (``previous``: an instance
    ``generate`` that was there, else the class's)."""

    def __init__(self, owner: nn.Module, previous, switch: AttnSwitch) -> None:
        self.owner, self.previous, self.switch = owner, previous, switch
        original = self._original()
        self.__doc__ = original.__doc__
        self.__signature__ = inspect.signature(original)

    def _original(self):
        return self.previous if self.previous is not None else type(self.owner).generate.__get__(self.owner)

    def __call__(self, *args, **kwargs):
        with self.switch.active():
            return self._original()(*args, **kwargs)


def install(model: nn.Module, switch: AttnSwitch, undo) -> None:
    """Give every Transformers model in ``model`` the hooks that put ``ATTN_IMPLEMENTATION`` in place
    while it runs, and its switched ``generate`` (changes through ``undo``)."""
    entries = []
    for m in model.modules():
        if isinstance(m, PreTrainedModel):
            pre = m.register_forward_pre_hook(_Enter(switch))
            post = m.register_forward_hook(_Exit(switch), always_call=True)
            entries.append((m, pre.id, post.id))
            if callable(getattr(m, "generate", None)):
                undo.set_attr(m, "generate", SwitchedGenerate(m, m.__dict__.get("generate"), switch))
    undo.add(_RemoveHooks(entries))
