"""Qwen2 (model_type "qwen2"): dense family, lightning indexer added (see _dense_common).

Layers listed as "sliding_attention" (use_sliding_window) intersect their window with the selection.
"""

from transformers.models.qwen2 import modeling_qwen2

from ..families import register_family
from ._dense_common import make_dense_apply

apply = make_dense_apply(modeling_qwen2.Qwen2Attention, modeling_qwen2.apply_rotary_pos_emb, mlp_ends_layer=True)

register_family("qwen2", apply, kind="dense")
