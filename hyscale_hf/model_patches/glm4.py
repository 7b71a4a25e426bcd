"""Glm4 (model_type "glm4"): dense family, lightning indexer added (see _dense_common).

GLM-4 rotates only part of each head (partial_rotary_factor) with interleaved pairs; its own
apply_rotary_pos_emb does both, and the indexer uses it.
"""

from transformers.models.glm4 import modeling_glm4

from ..families import register_family
from ._dense_common import make_dense_apply

# GLM-4 normalises the MLP output before the residual add (post_mlp_layernorm saves it)
apply = make_dense_apply(modeling_glm4.Glm4Attention, modeling_glm4.apply_rotary_pos_emb, mlp_ends_layer=False)

register_family("glm4", apply, kind="dense")
