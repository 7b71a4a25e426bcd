"""Hunyuan V4 (``hy_v4``): MLA with attention sinks and an output gate, DSA indexer with IndexShare.

What this family does (Transformers' ``HYV4Attention`` / ``HYV4Indexer``):
- non-interleaved (half-split) RoPE in the main attention and in the indexer, where it sits on the
  *last* ``qk_rope_head_dim`` dims of an indexer head ("flipped");
- the indexer key's LayerNorm runs in its weight dtype (fp32 on 5.24) and is cast back;
- ReLU on the per-head indexer logits;
- per-head learnable attention sinks: one extra softmax logit with no value, so the output over the
  selected keys is scaled by ``sigmoid(lse - sink)`` (this needs the sparse attention's lse to carry
  gradients, as the torch backend's does);
- a per-channel ``sigmoid(gate_proj(x))`` output gate before ``o_proj``;
- IndexShare "full"/"shared" layers as in GLM-5.2.
"""

import torch

from ..families import register_family
from ._mla_dsa import MLADSAFamily, load_family_module, patch_mla_dsa_model

_modeling = load_family_module("hy_v4")
if _modeling is not None and not hasattr(_modeling, "apply_rotary_pos_emb"):
    # Transformers 5.25 moved hy_v4 to interleaved RoPE (apply_rotary_pos_emb_interleave); this patch
    # computes the half-split layout of 5.17-5.24, so it does not register there and patch_model
    # refuses the model rather than patching it with the wrong rotation.
    _modeling = None

if _modeling is not None:

    class HYV4Family(MLADSAFamily):
        model_type = "hy_v4"
        attention_class = _modeling.HYV4Attention
        main_rope = staticmethod(_modeling.apply_rotary_pos_emb)
        main_rope_interleaved = False
        indexer_rope = staticmethod(_modeling.apply_rotary_pos_emb)
        indexer_rope_interleaved = False
        indexer_rope_first = False
        relu = True
        returns_indices = True

        def query(self, attn, x, position_ids):
            q_nope, q_rot, q_resid, _ = super().query(attn, x, position_ids)
            gate = attn.gate_proj(x).view(*x.shape[:-1], attn.num_heads, attn.gate_projection_size)
            return q_nope, q_rot, q_resid, gate

        def finish_output(self, attn, x, o, gate):
            return (o * torch.sigmoid(gate)).reshape(*o.shape[:2], -1)

        def sinks(self, attn):
            return attn.sinks

        def indexer_key(self, indexer, x):
            return indexer.k_norm(indexer.wk(x).to(indexer.k_norm.weight.dtype)).to(x.dtype)

    FAMILY = HYV4Family()

    def apply(model, state):
        return patch_mla_dsa_model(model, state, FAMILY)

    register_family(FAMILY.model_type, apply, kind="dsa")
