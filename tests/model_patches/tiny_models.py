"""Tiny DSA models built offline from configs (vocab 128, hidden 64, 2-5 layers) for the patch tests.

``build(model_type, **overrides)`` returns ``(model, text_config)``: a seeded fp32 model in eval mode
using Transformers' eager attention (the unpatched reference). ``overrides`` apply to the text
config. Families whose Transformers module is missing raise ``pytest.skip``.
"""

from __future__ import annotations

import importlib

import pytest
import torch

VOCAB = 128

# MLA dims kept tiny but distinct (nope 16, rope 8, v 12, kv_lora 24) so a mix-up of any two shows.
# 16 indexer heads make an all-heads-ReLU'd (exactly 0.0) score rare, so score ties at the top-k
# boundary, where the unpatched torch.topk and the tie rule may differ, do not occur in the tests.
_MLA = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
    topk_group=1, q_lora_rank=32, kv_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
    index_topk=8, index_head_dim=16, index_n_heads=16, max_position_embeddings=16384, pad_token_id=0,
    bos_token_id=1, eos_token_id=2, initializer_range=0.2,
)

_DOTS3_TEXT = dict(
    first_k_dense_replace=3, shared_experts_intermediate_size=32, head_dim=24,
    layer_types=["indexed_attention", "sliding_attention", "indexed_attention"], num_hidden_layers=3,
    sliding_window=5, swa_num_attention_heads=2, swa_num_key_value_heads=2, swa_q_lora_rank=16,
    swa_kv_lora_rank=20, swa_head_dim=20, swa_qk_nope_head_dim=12, swa_v_head_dim=10,
)

FAMILY_KWARGS = {
    "glm_moe_dsa": dict(first_k_dense_replace=1, num_hidden_layers=3, indexer_types=["full", "shared", "full"]),
    "deepseek_v32": dict(first_k_dense_replace=1),
    "axk2": dict(first_k_dense_replace=1),
    "hy_v4": dict(hc_mult=2, num_hidden_layers=3, indexer_types=["full", "shared", "full"], learnable_sink_init=0.5),
    # 5 layers: layer 1 stores its KV for layer 2 ("reuse", IndexShare "shared") and layer 4
    # ("reuse_but_indexer"); layer 3 is a NoPE layer.
    "mistral_large4": dict(
        first_k_dense_replace=5, num_hidden_layers=5, no_rope_layers=[1, 1, 1, 0, 1], kv_source_layers=[0, 1, 1, 3, 1],
        indexer_types=["full", "full", "shared", "full", "full"],
    ),
    "dots3_note_text": _DOTS3_TEXT,
    "dots3_note": {**_DOTS3_TEXT, "num_hidden_layers": 2, "layer_types": ["indexed_attention", "sliding_attention"],
                   "first_k_dense_replace": 1},
}

# model_type -> Transformers module name
MODULE = {"dots3_note_text": "dots3_note"}


def has_family(model_type: str) -> bool:
    name = MODULE.get(model_type, model_type)
    try:
        importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    except ImportError:
        return False
    return True


def _require(model_type: str) -> None:
    if not has_family(model_type):
        pytest.skip(f"the installed Transformers has no {model_type}")


def _text_kwargs(model_type: str, overrides: dict) -> dict:
    kwargs = {**_MLA, **FAMILY_KWARGS[model_type], **overrides}
    if model_type == "mistral_large4":
        kwargs.pop("q_lora_rank")  # no Q-LoRA in Mistral Large 4
    return kwargs


def _config_and_class(model_type: str, overrides: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    text = _text_kwargs(model_type, overrides)
    if model_type == "mistral_large4":
        from transformers.models.mistral_large4 import modeling_mistral_large4 as m

        vision = dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, patch_size=4, image_size=16, head_dim=8)
        config = AutoConfig.for_model("mistral_large4", text_config=text, vision_config=vision)
        return config, m.MistralLarge4ForConditionalGeneration
    if model_type == "dots3_note":
        from transformers.models.dots3_note import modeling_dots3_note as m

        vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=4,
                      moe_intermediate_size=16, num_local_experts=2, adapter_in_dim=16, adapter_out_dim=64,
                      mlp_layer_types=["dense"])
        audio = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                     downsample_hidden_size=8, adapter_input_size=16, adapter_out_dim=64, feature_size=16)
        config = AutoConfig.for_model("dots3_note", text_config=text, vision_config=vision, audio_config=audio)
        return config, m.Dots3NoteForConditionalGeneration
    return AutoConfig.for_model(model_type, **text), AutoModelForCausalLM


def tiny_config(model_type: str, **overrides):
    _require(model_type)
    return _config_and_class(model_type, overrides)[0]


def build(model_type: str, seed: int = 0, **overrides):
    """(model, text_config): a seeded fp32 tiny model of ``model_type`` in eval mode (eager attention)."""
    _require(model_type)
    config, cls = _config_and_class(model_type, overrides)
    torch.manual_seed(seed)
    if cls.__name__.startswith("AutoModel"):
        model = cls.from_config(config, attn_implementation="eager", dtype=torch.float32)
    else:
        model = cls._from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():  # non-trivial norms, sinks and scalings so a wrong scale or dropped term cannot hide
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight", "sinks", "softmax_scaling.scale", "alpha")):
                p.add_(0.3 * torch.randn_like(p))
    return model.eval(), config.get_text_config(decoder=True)
