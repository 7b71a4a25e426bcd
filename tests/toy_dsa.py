"""A tiny DSA-style causal LM patched through the family contract of ``hyscale_hf.families.register_family``,
registered as family ``hyscale_toy_dsa``.

It lets the training pieces (callback, recall metric, PEFT helper) be tested on a model whose
patched attention is a few readable lines, independently of the real model families: GQA attention
(2 query heads, 1 KV head, no positional encoding), a lightning indexer submodule named
``indexer`` fed detached inputs, the dense warm-up / sparse stages read from ``state.config``, the
KL loss joined through ``attach_indexer_loss``, and the selection reported to ``observe_selection``.
Unpatched, the model runs dense attention and has no indexer loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from hyscale_hf import hytopk, indexer_kl_loss, sparse_attention
from hyscale_hf.families import _FAMILIES, register_family
from hyscale_hf.indexer import attach_indexer_loss
from hyscale_hf.training import observe_selection

MODEL_TYPE = "hyscale_toy_dsa"


@dataclass(repr=False)
class ToyDsaConfig(PreTrainedConfig):
    model_type = MODEL_TYPE
    vocab_size: int = 64
    hidden_size: int = 32
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    head_dim: int = 16
    index_topk: int = 8
    index_n_heads: int = 2
    index_head_dim: int = 8


class ToyIndexer(nn.Module):
    def __init__(self, config: ToyDsaConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.wq = nn.Linear(config.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)

    def forward(self, x: torch.Tensor):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)
        w = self.weights_proj(x).float() * self.n_heads**-0.5
        return q, self.wk(x), w


class ToyAttention(nn.Module):
    def __init__(self, config: ToyDsaConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=False)
        self.indexer = ToyIndexer(config)
        self.scale = self.head_dim**-0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, 1, self.head_dim)
        v = self.v_proj(x).view(B, T, 1, self.head_dim)
        state = getattr(self, "_hyscale_state", None)
        if state is None or state.config.dense_warmup:
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2).expand(B, self.n_heads, T, -1),
                v.transpose(1, 2).expand(B, self.n_heads, T, -1), is_causal=True, scale=self.scale,
            ).transpose(1, 2)
            idx = lse = None
        if state is None:
            return self.o_proj(o.reshape(B, T, -1))
        cfg = state.config
        iq, ik, iw = self.indexer(x.detach())
        if not cfg.dense_warmup:
            idx = hytopk(iq, ik, iw, cfg.topk, backend=cfg.backend)
            o, lse = sparse_attention(q, k, v, idx, scale=self.scale, return_lse=True, backend=cfg.backend)
        observe_selection(state, iq, ik, iw, q, k, scale=self.scale)
        if self.training and torch.is_grad_enabled() and cfg.indexer_loss_coef > 0:
            loss = indexer_kl_loss(iq, ik, iw, q, k, idx, attn_lse=lse, scale=self.scale, backend=cfg.backend)
            o = attach_indexer_loss(o, loss, state)
        return self.o_proj(o.reshape(B, T, -1))


class ToyLayer(nn.Module):
    def __init__(self, config: ToyDsaConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.hidden_size)
        self.self_attn = ToyAttention(config)
        self.mlp_norm = nn.RMSNorm(config.hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(config.hidden_size, 2 * config.hidden_size), nn.GELU(), nn.Linear(2 * config.hidden_size, config.hidden_size)
        )

    def forward(self, x):
        x = x + self.self_attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class ToyDsaForCausalLM(PreTrainedModel):
    config_class = ToyDsaConfig
    base_model_prefix = "model"

    def __init__(self, config: ToyDsaConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(ToyLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids=None, labels=None, attention_mask=None, **kwargs):
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
        return CausalLMOutput(loss=loss, logits=logits)


def _apply(model: ToyDsaForCausalLM, state):
    cfg = model.config
    state.config.topk = state.config.topk or cfg.index_topk
    attns = [m for m in model.modules() if isinstance(m, ToyAttention)]
    for attn in attns:
        attn._hyscale_state = state

    def undo():
        for attn in attns:
            del attn._hyscale_state

    return undo


if MODEL_TYPE not in _FAMILIES:
    register_family(MODEL_TYPE, _apply, "dsa")


def tiny_toy_model(seed: int = 0, **overrides) -> ToyDsaForCausalLM:
    torch.manual_seed(seed)
    return ToyDsaForCausalLM(ToyDsaConfig(**overrides))
