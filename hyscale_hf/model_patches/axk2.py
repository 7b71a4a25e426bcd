"""A.X K2 (``axk2``): MLA with a fused query/gate projection and a DeepSeek-V3.2-style indexer.

What this family does (Transformers' ``AXK2Attention`` / ``AXK2Indexer``):
- no ``q_b_proj``: ``q_gate_proj(cat(q_a_layernorm(q), q))`` yields the queries and a per-channel
  output gate, applied as ``sigmoid(gate)`` in fp32 before ``o_proj``; the indexer's query input
  is the normalised ``q_a_layernorm`` output;
- interleaved RoPE in the main attention, half-split RoPE in the indexer (first dims);
- ReLU on the per-head indexer logits; no IndexShare.
"""

import torch

from ..families import register_family
from ._mla_dsa import MLADSAFamily, load_family_module, patch_mla_dsa_model

_modeling = load_family_module("axk2")

if _modeling is not None:

    class AXK2Family(MLADSAFamily):
        model_type = "axk2"
        attention_class = _modeling.AXK2Attention
        main_rope = staticmethod(_modeling.apply_rotary_pos_emb_interleave)
        main_rope_interleaved = True
        indexer_rope = staticmethod(_modeling.apply_rotary_pos_emb)
        indexer_rope_interleaved = False
        indexer_rope_first = True
        relu = True
        returns_indices = False
        mlp_ends_layer = True  # the decoder layer ends in residual + self.mlp(x)

        def query(self, attn, x, position_ids):
            q_compressed = attn.q_a_proj(x)
            q_resid = attn.q_a_layernorm(q_compressed)
            fused = attn.q_gate_proj(torch.cat([q_resid, q_compressed], dim=-1))
            fused = fused.view(*x.shape[:-1], attn.num_heads, attn.qk_head_dim + attn.v_head_dim)
            q, gate = torch.split(fused, [attn.qk_head_dim, attn.v_head_dim], dim=-1)
            q_nope, q_rot = torch.split(q, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
            return q_nope, q_rot, q_resid, gate.reshape(*x.shape[:-1], -1)

        def finish_output(self, attn, x, o, gate):
            o = o.reshape(*o.shape[:2], -1)
            return (o * torch.sigmoid(gate.float())).to(o.dtype)

    FAMILY = AXK2Family()

    def apply(model, state):
        return patch_mla_dsa_model(model, state, FAMILY)

    register_family(FAMILY.model_type, apply, kind="dsa")
