"""DeepSeek-V3.2 (``deepseek_v32``): MLA + lightning indexer on every layer.

What this family does (Transformers' ``DeepseekV32Attention`` / ``DeepseekV32Indexer``):
- interleaved RoPE in the main MLA attention, but the non-interleaved (half-split) layout in the
  indexer, on the first ``qk_rope_head_dim`` dims of an indexer head;
- ReLU on the per-head indexer logits (as in DeepSeek's reference indexer);
- no IndexShare: every layer runs its own indexer.
"""

from ..families import register_family
from ._mla_dsa import MLADSAFamily, load_family_module, patch_mla_dsa_model

_modeling = load_family_module("deepseek_v32")

if _modeling is not None:

    class DeepseekV32Family(MLADSAFamily):
        model_type = "deepseek_v32"
        attention_class = _modeling.DeepseekV32Attention
        main_rope = staticmethod(_modeling.apply_rotary_pos_emb_interleave)
        main_rope_interleaved = True
        indexer_rope = staticmethod(_modeling.apply_rotary_pos_emb)
        indexer_rope_interleaved = False
        indexer_rope_first = True
        relu = True
        returns_indices = False
        mlp_ends_layer = True  # the decoder layer ends in residual + self.mlp(x)

    FAMILY = DeepseekV32Family()

    def apply(model, state):
        return patch_mla_dsa_model(model, state, FAMILY)

    register_family(FAMILY.model_type, apply, kind="dsa")
