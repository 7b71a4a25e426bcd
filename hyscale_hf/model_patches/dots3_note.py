"""dots.3 note (``dots3_note``, text ``dots3_note_text``): MLA with DSA "indexed" layers interleaved with
sliding-window MLA layers.

What this family does (Transformers' ``Dots3NoteTextAttention`` / ``Dots3NoteTextIndexer``):
- ``config.layer_types[i]`` is "indexed_attention" (MLA + lightning indexer), "sliding_attention"
  (MLA over the last ``sliding_window`` keys, its own head sizes) or "full_attention" (dense MLA);
- the normalised Q and KV latents are rescaled by ``sqrt(hidden / rank)`` before projection (the
  indexer takes the rescaled Q latent), and the key's RoPE part gets its own RMSNorm;
- interleaved RoPE in the attention and the indexer (first ``qk_rope_head_dim`` dims of an indexer
  head); ReLU on the per-head indexer logits; no IndexShare;
- a per-head ``sigmoid(g_proj(x))`` output gate before ``o_proj``.
Patched, indexed layers select with HyTopK; sliding-window layers run the same sparse attention
over their window (exact, O(T * W)); full layers run dense attention without a mask tensor.
Transformers 5.17 does not have this model: the family is skipped there.
"""

import torch

from ..families import register_family
from ._mla_dsa import MLADSAFamily, load_family_module, patch_mla_dsa_model

_modeling = load_family_module("dots3_note")

if _modeling is not None:

    class Dots3NoteFamily(MLADSAFamily):
        model_type = "dots3_note"
        attention_class = _modeling.Dots3NoteTextAttention
        main_rope = staticmethod(_modeling.apply_rotary_pos_emb_interleave)
        main_rope_interleaved = True
        indexer_rope = staticmethod(_modeling.apply_rotary_pos_emb_interleave)
        indexer_rope_interleaved = True
        indexer_rope_first = True
        relu = True
        returns_indices = False
        mlp_ends_layer = True  # the decoder layer ends in residual + self.mlp(x)

        def query(self, attn, x, position_ids):
            if attn.q_a_proj is None:
                raise ValueError("dots3_note attention without q_lora_rank is not supported (its indexer needs it)")
            q_resid = attn.q_a_layernorm(attn.q_a_proj(x)) * attn.q_lora_scale
            q = attn.q_b_proj(q_resid).view(*x.shape[:-1], attn.num_heads, attn.qk_head_dim)
            q_nope, q_rot = torch.split(q, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
            return q_nope, q_rot, q_resid, None

        def latent_kv(self, attn, x):
            compressed = attn.kv_a_proj_with_mqa(x)
            kv_pass, k_rot = torch.split(compressed, [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
            latent = attn.kv_a_layernorm(kv_pass.contiguous()) * attn.kv_lora_scale
            return latent, attn.k_rope_only_layernorm(k_rot)

        def apply_main_rope(self, attn, q_rot, k_rot, cos, sin):
            q_dtype, k_dtype = q_rot.dtype, k_rot.dtype  # indexed layers get fp32 cos/sin
            q_rot, k_rot = super().apply_main_rope(attn, q_rot, k_rot, cos, sin)
            return q_rot.to(q_dtype), k_rot.to(k_dtype)

        def finish_output(self, attn, x, o, gate):
            g = attn.g_proj(x).view(*x.shape[:-1], -1, 1)
            return (o * g.sigmoid()).reshape(*o.shape[:2], -1)

        def sliding_window(self, attn):
            return attn.sliding_window

        def is_shared_layer(self, attn):
            return False

    FAMILY = Dots3NoteFamily()

    def apply(model, state):
        return patch_mla_dsa_model(model, state, FAMILY)

    register_family("dots3_note", apply, kind="dsa")
    register_family("dots3_note_text", apply, kind="dsa")
