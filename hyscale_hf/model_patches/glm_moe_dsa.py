"""GLM-5 / 5.1 / 5.2 (``glm_moe_dsa``): MLA + lightning indexer with IndexShare.

What this family does (Transformers' ``GlmMoeDsaAttention`` / ``GlmMoeDsaIndexer``):
- interleaved RoPE in both the main attention and the indexer (rope on the first
  ``qk_rope_head_dim`` dims of an indexer head);
- ReLU on the per-head indexer logits (Transformers' GLM indexer applies it; Megatron-LM documents
  it off for GLM-5: pass ``relu=False`` to follow Megatron instead);
- IndexShare (GLM-5.2): ``config.indexer_types[i]`` is "full" (own indexer) or "shared" (no indexer
  weights; reuses the previous full layer's indices, handed down the decoder layers as
  ``prev_topk_indices`` within one forward call and taken through ``share_selection`` so selective
  checkpointing saves them).
"""

from ..families import register_family
from ._mla_dsa import MLADSAFamily, load_family_module, patch_mla_dsa_model

_modeling = load_family_module("glm_moe_dsa")

if _modeling is not None:

    class GlmMoeDsaFamily(MLADSAFamily):
        model_type = "glm_moe_dsa"
        attention_class = _modeling.GlmMoeDsaAttention
        main_rope = staticmethod(_modeling.apply_rotary_pos_emb_interleave)
        main_rope_interleaved = True
        indexer_rope = staticmethod(_modeling.apply_rotary_pos_emb_interleave)
        indexer_rope_interleaved = True
        indexer_rope_first = True
        relu = True
        returns_indices = True
        mlp_ends_layer = True  # the decoder layer ends in residual + self.mlp(x)

    FAMILY = GlmMoeDsaFamily()

    def apply(model, state):
        return patch_mla_dsa_model(model, state, FAMILY)

    register_family(FAMILY.model_type, apply, kind="dsa")
