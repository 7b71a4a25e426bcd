"""Mistral (model_type "mistral"): dense family, lightning indexer added (see _dense_common).

A configured sliding_window is intersected with the selection (per-query window_start).
"""

from transformers.models.mistral import modeling_mistral

from ..families import register_family
from ._dense_common import make_dense_apply

apply = make_dense_apply(modeling_mistral.MistralAttention, modeling_mistral.apply_rotary_pos_emb, mlp_ends_layer=True)

register_family("mistral", apply, kind="dense")
