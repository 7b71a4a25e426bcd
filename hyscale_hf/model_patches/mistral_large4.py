"""Mistral Large 4 (``mistral_large4``, the image-text-to-text model): MLA without Q-LoRA, a
DSA indexer with IndexShare, NoPE layers and cross-layer KV sharing.

What this family does (Transformers' ``MistralLarge4TextAttention`` / ``MistralLarge4TextIndexer``):
- queries come from ``q_proj(x)`` (no Q-LoRA); the indexer's queries from ``wq_b(q_input_norm(x))``;
- both are scaled per head and position by ``softmax_scaling`` (``scale * log(pos + 1) + bias``,
  which can be negative, so it multiplies the queries and is not folded into the head weights);
- interleaved RoPE (LeRoPE frequencies from the model's rotary embedding) in attention and indexer,
  on the first ``qk_rope_head_dim`` dims; layers with ``no_rope_layers[i] == 0`` use no RoPE at all
  (their whole query/key head is "nope");
- KV sharing: a "reuse" layer has no ``kv_a_proj_with_mqa`` and attends over the latents its source
  layer stored in ``shared_kv_states`` during the same forward (already rotated, full length);
- ReLU on the per-head indexer logits; IndexShare "full"/"shared" layers as in GLM-5.2.
Transformers 5.17 does not have this model: the family is skipped there.
"""

import torch

from ..families import register_family
from ._mla_dsa import MLADSAFamily, load_family_module, patch_mla_dsa_model

_modeling = load_family_module("mistral_large4")

if _modeling is not None:

    class MistralLarge4Family(MLADSAFamily):
        model_type = "mistral_large4"
        attention_class = _modeling.MistralLarge4TextAttention
        main_rope = staticmethod(_modeling.apply_rotary_pos_emb_interleave)
        main_rope_interleaved = True
        indexer_rope = staticmethod(_modeling.apply_rotary_pos_emb_interleave)
        indexer_rope_interleaved = True
        indexer_rope_first = True
        relu = True
        returns_indices = True
        mlp_ends_layer = True  # the decoder layer ends in residual + self.mlp(x)

        def query(self, attn, x, position_ids):
            q = attn.q_proj(x).view(*x.shape[:-1], attn.num_heads, attn.qk_head_dim)
            q_nope, q_rot = torch.split(q, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
            return q_nope, q_rot, x, None

        def latent_kv(self, attn, x):
            if attn.is_kv_shared_layer:
                return None, None  # read from shared_kv_states in all_keys
            return super().latent_kv(attn, x)

        def apply_main_rope(self, attn, q_rot, k_rot, cos, sin):
            if not attn.use_rope:
                return q_rot, k_rot
            if k_rot is None:  # KV-sharing layer: its keys were rotated by the source layer
                return self.main_rope(q_rot, None, cos, sin, unsqueeze_dim=2)[0], None
            return super().apply_main_rope(attn, q_rot, k_rot, cos, sin)

        def scale_query(self, attn, q_nope, q_rot, position_ids):
            if position_ids is None:
                raise ValueError("mistral_large4 attention needs position_ids (its queries are scaled by position)")
            q = attn.softmax_scaling(torch.cat([q_nope, q_rot], dim=-1), position_ids, head_dim_first=False)
            return torch.split(q, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)

        def all_keys(self, attn, latent, k_rot, cache, queries, kwargs):
            shared = kwargs.get("shared_kv_states")
            slot = "rope" if attn.use_rope else "nope"
            if attn.is_kv_shared_layer:
                k_pass, k_rot = shared[slot]  # [B, 1, T, C], [B, 1, T, R] stored by the source layer
                return k_pass[:, 0], k_rot[:, 0], k_pass.shape[2] - queries
            latent, k_rot, past = super().all_keys(attn, latent, k_rot, cache, queries, kwargs)
            if attn.store_full_length_kv:
                shared[slot] = (latent[:, None], k_rot[:, None])
            return latent, k_rot, past

        def indexer_query(self, indexer, x, q_input, position_ids):
            q = indexer.wq_b(indexer.q_input_norm(x)).view(*x.shape[:-1], indexer.n_heads, indexer.head_dim)
            return indexer.softmax_scaling(q, position_ids, head_dim_first=False)

        def indexer_uses_rope(self, indexer):
            return bool(indexer.use_rope)

    FAMILY = MistralLarge4Family()

    def apply(model, state):
        return patch_mla_dsa_model(model, state, FAMILY)

    register_family("mistral_large4", apply, kind="dsa")
