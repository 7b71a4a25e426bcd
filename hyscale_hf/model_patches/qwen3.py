"""Qwen3 (model_type "qwen3"): dense family, lightning indexer added (see _dense_common).

Qwen3's per-head q/k RMSNorms stay in the family's own forward, which still runs.
"""

from transformers.models.qwen3 import modeling_qwen3

from ..families import register_family
from ._dense_common import make_dense_apply

apply = make_dense_apply(modeling_qwen3.Qwen3Attention, modeling_qwen3.apply_rotary_pos_emb, mlp_ends_layer=True)

register_family("qwen3", apply, kind="dense")
