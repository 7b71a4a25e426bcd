"""Tiny DSA models built offline from configs (vocab 128, hidden 64, 2-3 layers) for the patch tests.

``build(model_type, **overrides)`` returns ``(model, config)`` in fp32 eval mode, seeded, with the
eager attention of Transformers as the unpatched reference. Families whose Transformers module is
missing raise ``pytest.skip``.
"""

from __future__ import annotations

import importlib

import pytest
import torch

VOCAB = 128

# MLA dims kept tiny but distinct (nope 16, rope 8, v 12, kv_lora 24) so a mix-up of any two shows.
_MLA = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
    topk_group=1, q_lora_rank=32, kv_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
    index_topk=8, index_head_dim=16, index_n_heads=8, max_position_embeddings=16384, pad_token_id=0,
    bos_token_id=1, eos_token_id=2, initializer_range=0.2,
)

FAMILY_KWARGS = {
    "glm_moe_dsa": dict(first_k_dense_replace=1, num_hidden_layers=3, indexer_types=["full", "shared", "full"]),
    "deepseek_v32": dict(first_k_dense_replace=1),
    "axk2": dict(first_k_dense_replace=1),
    "hy_v4": dict(hc_mult=2, num_hidden_layers=3, indexer_types=["full", "shared", "full"], learnable_sink_init=0.5),
}


def has_family(model_type: str) -> bool:
    try:
        importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    except ImportError:
        return False
    return True


def tiny_config(model_type: str, **overrides):
    from transformers import AutoConfig

    if not has_family(model_type):
        pytest.skip(f"the installed Transformers has no {model_type}")
    kwargs = {**_MLA, **FAMILY_KWARGS[model_type], **overrides}
    return AutoConfig.for_model(model_type, **kwargs)


def build(model_type: str, seed: int = 0, attn_implementation: str = "eager", **overrides):
    """(model, config): a seeded fp32 tiny causal LM of ``model_type`` in eval mode."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    with torch.no_grad():  # non-trivial norms/sinks so a wrong scale or a dropped term cannot hide
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight") or name.endswith("sinks"):
                p.add_(0.3 * torch.randn_like(p))
    return model.eval(), config
