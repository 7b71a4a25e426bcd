"""Llama (model_type "llama"): dense family, lightning indexer added (see _dense_common).

Llama-style RoPE (half-split pairs) on the indexer's first rope dims.
"""

from transformers.models.llama import modeling_llama

from ..families import register_family
from ._dense_common import make_dense_apply

apply = make_dense_apply(modeling_llama.LlamaAttention, modeling_llama.apply_rotary_pos_emb, mlp_ends_layer=True)

register_family("llama", apply, kind="dense")
