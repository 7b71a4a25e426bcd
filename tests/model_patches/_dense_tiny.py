"""Tiny dense models for the dense-family tests, built offline from configs (no downloads)."""

from __future__ import annotations

import torch
from transformers import (
    Glm4Config,
    Glm4ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 128
PAD = 0
# Small indexer for tiny models: 2 heads of dim 8 (RoPE on 4 of them).
INDEXER = {"index_n_heads": 2, "index_head_dim": 8}

_COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
    attention_dropout=0.0,
)

# name -> (config class, model class, extra config kwargs). "mistral_sw" and "qwen2_sw" exercise a
# sliding window shorter than the test sequences (all layers for Mistral, the second layer for Qwen2).
VARIANTS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen2_sw": (Qwen2Config, Qwen2ForCausalLM, {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 8}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "mistral_sw": (MistralConfig, MistralForCausalLM, {"sliding_window": 5}),
    "glm4": (Glm4Config, Glm4ForCausalLM, {"head_dim": 16}),  # partial rotary: 8 of 16 dims, interleaved
}
FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "glm4"]


def tiny_model(variant: str, seed: int = 0, attn_implementation: str = "sdpa"):
    config_cls, model_cls, extra = VARIANTS[variant]
    torch.manual_seed(seed)
    config = config_cls(**_COMMON, **extra)
    config._attn_implementation = attn_implementation
    model = model_cls(config).float()
    return model


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=g)
