"""Activation offload to pinned host memory (``HyScaleConfig.offload_activations``; docs/design.md section 11).

What a checkpointed layer keeps from forward to backward is its inputs (the hidden states above all)
and its replayed selections; the indexer-loss gradients held for backward (``indexer.indexer_loss_once``)
come on top. ``HostOffload`` moves them to pinned host memory and back:

- ``hooks()``: ``torch.autograd.graph.saved_tensors_hooks`` to wrap around a layer's checkpoint call.
  Non-reentrant checkpoint saves its inputs through the hooks active at the call; inside the layer its
  own hooks take over, so only the inputs come here.
- ``stash(tensors)`` / ``fetch(handles)``: the same for tensors held by hand; ``pack`` / ``unpack``
  for one tensor (selection replay keeps the selections this way: ``replay._Region``).

The device-to-host copy runs on a side stream after the compute stream has produced the tensor
(``record_stream`` keeps its memory from reuse until the copy is done). When backward asks for a
tensor, the one of the same kind packed just before it (the previous layer's) starts its way back on
the side stream, so it is there when that layer's backward begins. Tensors below ``min_bytes`` and CPU
tensors stay where they are (what ``torch.autograd.graph.save_on_cpu`` also does for CPU tensors).
"""

from __future__ import annotations

import contextlib
import itertools
import weakref

import torch

MIN_BYTES = 1 << 20


class _Handle:
    """One offloaded tensor: its host copy, the event of that copy, and (once fetched) the device copy."""

    __slots__ = ("host", "device", "copied", "fetched", "arrived", "kind", "seq", "__weakref__")

    def __init__(self, host, device, copied, kind: str, seq: int) -> None:
        self.host, self.device, self.copied, self.kind, self.seq = host, device, copied, kind, seq
        self.fetched = None  # device tensor prefetched on the side stream
        self.arrived = None  # its event


class HostOffload:
    """Offloads saved tensors to pinned host memory, with prefetch (see the module doc).

    ``devices``: the device types whose tensors move (``"cuda"``). A ``"cpu"`` entry makes CPU tensors
    take the same path with plain copies (no streams): the bookkeeping can then be tested without a GPU.
    """

    def __init__(self, min_bytes: int = MIN_BYTES, devices: tuple[str, ...] = ("cuda",)) -> None:
        self.min_bytes, self.devices = min_bytes, tuple(devices)
        self._streams: dict = {}
        self._live: dict[str, list] = {}  # kind -> weak references to handles not yet fetched, in packing order
        self._seq = itertools.count()
        self.stats = {"offloaded": 0, "offloaded_bytes": 0, "prefetched": 0, "fetched_on_demand": 0}

    # --- the saved-tensor hooks and the by-hand interface

    def hooks(self, kind: str = "input"):
        return torch.autograd.graph.saved_tensors_hooks(lambda t: self.pack(t, kind), self.unpack)

    def stash(self, tensors, kind: str = "stash"):
        return tuple(None if t is None else self.pack(t, kind) for t in tensors)

    def fetch(self, handles):
        return tuple(None if h is None else self.unpack(h) for h in handles)

    # --- pack / unpack

    def pack(self, t: torch.Tensor, kind: str = "input"):
        size = t.numel() * t.element_size()
        if t.device.type not in self.devices or size == 0 or size < self.min_bytes:
            return t
        if t.device.type != "cuda":
            host, copied = t.detach().clone(), None
        else:
            main = torch.cuda.current_stream(t.device)
            side = self._side(t.device)
            host = torch.empty(t.shape, dtype=t.dtype, layout=t.layout, pin_memory=True)
            side.wait_stream(main)  # t is complete
            with torch.cuda.stream(side):
                host.copy_(t, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(side)
            t.record_stream(side)  # t's memory is not reused before the copy has read it
        handle = _Handle(host, t.device, copied, kind, next(self._seq))
        live = self._live.setdefault(kind, [])
        if len(live) > 256:  # handles of graphs freed without a backward
            live[:] = [r for r in live if r() is not None]
        live.append(weakref.ref(handle))
        self.stats["offloaded"] += 1
        self.stats["offloaded_bytes"] += size
        self.stats[f"offloaded_{kind}"] = self.stats.get(f"offloaded_{kind}", 0) + 1
        return handle

    def unpack(self, packed):
        if not isinstance(packed, _Handle):
            return packed
        cuda = packed.device.type == "cuda"
        if packed.fetched is not None:
            out = packed.fetched
            if cuda:
                main = torch.cuda.current_stream(packed.device)
                main.wait_event(packed.arrived)
                out.record_stream(main)
            packed.fetched = packed.arrived = None
            self.stats["prefetched"] += 1
        else:
            if cuda:
                torch.cuda.current_stream(packed.device).wait_event(packed.copied)
                out = packed.host.to(packed.device, non_blocking=True)
            else:
                out = packed.host.clone()
            self.stats["fetched_on_demand"] += 1
        self._forget(packed)
        self._prefetch_before(packed)
        return out

    # --- internals

    def _side(self, device) -> torch.cuda.Stream:
        key = torch.device(device).index
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device)
        return self._streams[key]

    def _forget(self, handle: _Handle) -> None:
        live = self._live.get(handle.kind, [])
        live[:] = [r for r in live if r() is not None and r() is not handle]

    def _prefetch_before(self, handle: _Handle) -> None:
        """Start the way back of the live handle of the same kind packed last before ``handle``."""
        earlier = [h for h in (r() for r in self._live.get(handle.kind, [])) if h is not None and h.seq < handle.seq]
        if not earlier:
            return
        target = max(earlier, key=lambda h: h.seq)
        if target.fetched is not None:
            return
        if target.device.type != "cuda":
            target.fetched = target.host.clone()
            return
        side = self._side(target.device)
        with torch.cuda.stream(side):
            side.wait_event(target.copied)
            target.fetched = target.host.to(target.device, non_blocking=True)
            target.arrived = torch.cuda.Event()
            target.arrived.record(side)


def model_offload(state) -> HostOffload | None:
    """The patched model's ``HostOffload`` while its live ``config.offload_activations`` is on, else None."""
    if state is None or not state.config.offload_activations:
        return None
    if state.offloader is None:
        state.offloader = HostOffload()
    return state.offloader


def offload_context(offload: HostOffload | None):
    """``offload.hooks()`` or a context that does nothing."""
    return offload.hooks() if offload is not None else contextlib.nullcontext()
