"""The indexer's own key cache for generate(): kept on the Transformers cache layer it belongs to.

A patched dense attention layer needs, at every decode / chunked-prefill step, the indexer keys of
every token its KV cache still holds. They live on that layer's cache object: the first time a layer
is used, its class is swapped *for that one object* to a subclass that also carries
``hyscale_index_keys [B, T_kept, D]`` and applies every cache operation Transformers performs on
keys (beam reordering, cropping for assisted decoding, batch repeat/select, reset, offloading) to
them too. A new ``generate()`` call builds a new cache, so nothing leaks between calls; a cache the
user passes back in continues where it stopped. Supported layers: ``DynamicLayer`` and its
subclasses that keep their keys in ``.keys`` (``DynamicSlidingWindowLayer``). Quantized and static
sliding-window layers (whose returned keys are not the retained tokens in order) are refused with a
clear error.

Static caches (``StaticLayer``: preallocated buffers filled in place, for ``torch.compile``) return all
``max_cache_len`` slots with the filled ones first. Their layer objects become Transformers' own
``StaticIndexedLayer`` (a subclass of ``StaticLayer`` with a preallocated indexer-key buffer, written
in place and kept in step by its crop / reset / reorder), the layout DSA models use; the patched layer
then sees ``max_cache_len`` keys whose unfilled slots are invisible and its queries at the slots the
cache just wrote (``static_query_offset``: a device tensor, so compiled decoding never syncs).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin, DynamicLayer, StaticLayer, StaticSlidingWindowLayer

try:  # Transformers' static layer with an indexer-key buffer (DSA models); absent from older releases
    from transformers.cache_utils import StaticIndexedLayer
except ImportError:  # pragma: no cover
    StaticIndexedLayer = None


class _IndexerKeysMixin(CacheLayerMixin):
    """Adds ``hyscale_index_keys`` to a cache layer and mirrors the layer's key operations on it.

    Derives from ``CacheLayerMixin`` (the common base of cache layers) so that swapping a layer
    object's class to ``(_IndexerKeysMixin, its class)`` keeps a compatible object layout.
    """

    hyscale_index_keys: torch.Tensor | None = None

    def _hyscale_kept(self) -> int:
        keys = getattr(self, "keys", None)
        return 0 if keys is None or keys.numel() == 0 else keys.shape[-2]

    def hyscale_update_index_keys(self, new_keys: torch.Tensor, num_keys: int) -> torch.Tensor:
        """Append ``new_keys [B, S, D]``; return the indexer keys of the ``num_keys`` keys attention sees.

        Called after the layer's own ``update``; stores (detached) as many trailing keys as the layer kept.
        """
        past = self.hyscale_index_keys
        if past is not None and (past.shape[0] != new_keys.shape[0] or past.shape[-1] != new_keys.shape[-1]):
            raise RuntimeError(
                f"hyscale_hf indexer key cache holds shape {tuple(past.shape)} but the new keys are "
                f"{tuple(new_keys.shape)}: the KV cache was reshaped by an operation hyscale_hf does not mirror"
            )
        full = new_keys if past is None else torch.cat([past.to(new_keys.dtype), new_keys], dim=1)
        if full.shape[1] != num_keys:
            raise RuntimeError(
                f"hyscale_hf indexer key cache is out of sync with the KV cache: attention sees {num_keys} keys, "
                f"the indexer has {full.shape[1]} (past {0 if past is None else past.shape[1]} + new "
                f"{new_keys.shape[1]}). Was the cache edited by an operation hyscale_hf does not mirror?"
            )
        kept = self._hyscale_kept()
        self.hyscale_index_keys = full[:, full.shape[1] - kept :].detach() if kept else None
        return full

    # ---- operations Transformers applies to cache layers, mirrored on the indexer keys

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.hyscale_index_keys is not None:
            self.hyscale_index_keys = self.hyscale_index_keys.index_select(
                0, beam_idx.to(self.hyscale_index_keys.device)
            )

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if self.hyscale_index_keys is None:
            return
        # Drop the trailing tokens the layer dropped, then keep what the layer kept (a sliding layer
        # may also shrink back to its window). A positive value is Transformers' legacy "final
        # length" form (before 5.18), which only full layers accept.
        idx = self.hyscale_index_keys
        if tokens_to_remove < 0:
            idx = idx[:, : max(0, idx.shape[1] + tokens_to_remove)]
        elif tokens_to_remove > 0 and not getattr(self, "is_sliding", False):
            idx = idx[:, :tokens_to_remove]
        kept = self._hyscale_kept()
        self.hyscale_index_keys = idx[:, idx.shape[1] - kept :] if kept else None

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.hyscale_index_keys is not None:
            self.hyscale_index_keys = self.hyscale_index_keys.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.hyscale_index_keys is not None:
            self.hyscale_index_keys = self.hyscale_index_keys[indices, ...]

    def reset(self) -> None:
        super().reset()
        # Transformers < 5.18 zeroes the keys in place (same length); later versions drop them.
        idx = self.hyscale_index_keys
        keep_zeroed = idx is not None and self._hyscale_kept() == idx.shape[1]
        self.hyscale_index_keys = torch.zeros_like(idx) if keep_zeroed else None

    def offload(self) -> None:
        super().offload()
        if self.hyscale_index_keys is not None:
            self.hyscale_index_keys = self.hyscale_index_keys.to("cpu", non_blocking=True)

    def prefetch(self) -> None:
        super().prefetch()
        device = getattr(self, "device", None)
        if self.hyscale_index_keys is not None and device is not None and self.hyscale_index_keys.device != device:
            self.hyscale_index_keys = self.hyscale_index_keys.to(device, non_blocking=True)


_INDEXED_CLASSES: dict[type, type] = {}


def _indexed_class(cls: type) -> type:
    if cls not in _INDEXED_CLASSES:
        _INDEXED_CLASSES[cls] = type(f"HyScaleIndexed{cls.__name__}", (_IndexerKeysMixin, cls), {})
    return _INDEXED_CLASSES[cls]


def _is_supported(layer) -> bool:
    # Quantized layers subclass DynamicLayer but keep part of their keys outside ``.keys``.
    return isinstance(layer, DynamicLayer) and not any("Quantized" in c.__name__ for c in type(layer).__mro__)


def is_static_layer(cache, layer_idx: int) -> bool:
    """Whether the cache layer of ``layer_idx`` is a (full-attention) static layer."""
    layers = getattr(cache, "layers", None)
    return layers is not None and layer_idx < len(layers) and isinstance(layers[layer_idx], StaticLayer)


def static_index_keys(cache, layer_idx: int, new_keys: torch.Tensor) -> torch.Tensor:
    """Write this call's indexer keys ``[B, S, D]`` into a static layer's indexer buffer; returns the whole
    buffer ``[B, max_cache_len, D]`` (its unfilled slots are invisible to every query)."""
    layer = cache.layers[layer_idx]
    if isinstance(layer, StaticSlidingWindowLayer) or StaticIndexedLayer is None:
        raise TypeError(
            f"hyscale_hf dense patches support static caches of full-attention layers (Transformers >= 5.2x with "
            f"StaticIndexedLayer); layer {layer_idx} of the cache is a {type(layer).__name__}"
        )
    if not isinstance(layer, StaticIndexedLayer):
        # A subclass of StaticLayer with extra attributes only, so the object's layout stays valid.
        layer.__class__ = StaticIndexedLayer
        layer.indexer_keys = layer.indexer_position_ids = None
        # A tensor already: 5.17's lazy initialisation moves it to the keys' device, later versions make it.
        layer.indexer_cumulative_length = torch.zeros((), dtype=torch.long)
        layer.is_indexer_initialized = False
    return layer.update_indexer(new_keys.detach())


def static_query_offset(cache, layer_idx: int, queries: int) -> torch.Tensor:
    """The slot of this call's first query in a static layer (0-dim device tensor), after the layer's
    ``update`` wrote them."""
    return cache.layers[layer_idx].cumulative_length - queries


def indexer_cache_layer(cache, layer_idx: int):
    """The cache layer of ``layer_idx``, given indexer-key support on first use."""
    layers = getattr(cache, "layers", None)
    if layers is None or layer_idx >= len(layers):
        raise TypeError(
            f"hyscale_hf dense patches need a transformers Cache with per-layer objects (DynamicCache); "
            f"got {type(cache).__name__}"
        )
    layer = layers[layer_idx]
    if isinstance(layer, _IndexerKeysMixin):
        return layer
    if not _is_supported(layer):
        raise TypeError(
            f"hyscale_hf dense patches support DynamicCache layers (full or sliding window); layer {layer_idx} "
            f"of the cache is a {type(layer).__name__} (quantized caches are not supported)"
        )
    layer.__class__ = _indexed_class(type(layer))
    layer.hyscale_index_keys = None
    return layer
