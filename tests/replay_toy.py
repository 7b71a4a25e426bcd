"""A toy DSA stack for the selection-replay tests: Transformers checkpointing layers whose attention
runs HyTopK (or, for IndexShare "shared" layers, reuse_indices) and sparse attention, with the
indexer KL loss attached, as a patched model does. Inside ``toy_family()`` it is the registered
family "hyscale_toy", so ``patch_model`` drives it like a real model."""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutput

from hyscale_hf import families, hytopk, indexer_kl_loss, sparse_attention
from hyscale_hf.families import register_family
from hyscale_hf.indexer import attach_indexer_loss
from hyscale_hf.patching import supported_model_types
from hyscale_hf.replay import reuse_indices


class IndexHolder(dict):
    """Where a "full" layer leaves its indices for the "shared" layers after it. A dict subclass that
    pytree does not know, so it passes through forward-argument processing as one object (torch
    2.11's FSDP2 rebuilds plain dict arguments on the way in, and the writes would land in a copy)."""


# Megatron-LM PRs 6793/7010: a holder that outlives one forward call. Layers built with
# ``global_holder=True`` read the shared indices from here, so a later micro-batch overwrites them.
GLOBAL_HOLDER = IndexHolder()


class ToyConfig(PretrainedConfig):
    model_type = "hyscale_toy"

    def __init__(self, vocab_size=32, hidden_size=32, num_heads=2, head_dim=8, index_heads=2,
                 index_dim=8, topk=4, layer_types=("full", "shared", "full", "shared"),
                 global_holder=False, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.index_heads = index_heads
        self.index_dim = index_dim
        self.topk = topk
        self.layer_types = list(layer_types)
        self.global_holder = global_holder
        super().__init__(**kwargs)


class ToyAttention(nn.Module):
    def __init__(self, cfg: ToyConfig, layer_idx: int):
        super().__init__()
        types = cfg.layer_types
        shared = types[layer_idx] == "shared"
        # IndexShare: a shared layer takes the indices of the last full layer before it.
        self.source = max(i for i in range(layer_idx + 1) if types[i] == "full")
        self.cfg, self.shared, self.state = cfg, shared, None
        h, H, D = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        self.q_proj = nn.Linear(h, H * D, bias=False)
        self.kv_proj = nn.Linear(h, 2 * D, bias=False)  # one KV head (MQA)
        self.o_proj = nn.Linear(H * D, h, bias=False)
        if not shared:
            self.index_q = nn.Linear(h, cfg.index_heads * cfg.index_dim, bias=False)
            self.index_k = nn.Linear(h, cfg.index_dim, bias=False)
            self.index_w = nn.Linear(h, cfg.index_heads, bias=False)

    def forward(self, x, holder):
        cfg = self.cfg
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, cfg.num_heads, cfg.head_dim)
        k, v = self.kv_proj(x).view(B, T, 1, 2 * cfg.head_dim).split(cfg.head_dim, dim=-1)
        if self.shared:
            indices = reuse_indices(holder[self.source])
        else:
            xd = x.detach()
            iq = self.index_q(xd).view(B, T, cfg.index_heads, cfg.index_dim)
            ik = self.index_k(xd)
            iw = self.index_w(xd).float()
            indices = hytopk(iq, ik, iw, cfg.topk, backend="torch")
            holder[self.source] = indices
        o, lse = sparse_attention(q, k, v, indices, return_lse=True, backend="torch")
        o = self.o_proj(o.reshape(B, T, -1))
        if not self.shared and self.state is not None and self.training and torch.is_grad_enabled():
            loss = indexer_kl_loss(iq, ik, iw, q.detach(), k.detach(), indices, attn_lse=lse.detach(),
                                   backend="torch")
            o = attach_indexer_loss(o, loss, self.state)
        return o


class ToyLayer(GradientCheckpointingLayer):
    def __init__(self, cfg: ToyConfig, layer_idx: int):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.hidden_size)
        self.attn = ToyAttention(cfg, layer_idx)
        self.mlp = nn.Sequential(nn.Linear(cfg.hidden_size, 2 * cfg.hidden_size), nn.GELU(),
                                 nn.Linear(2 * cfg.hidden_size, cfg.hidden_size))

    def forward(self, x, holder=None):
        x = x + self.attn(self.norm(x), holder)
        return x + self.mlp(x)


class ToyModel(PreTrainedModel):
    config_class = ToyConfig
    supports_gradient_checkpointing = True
    _no_split_modules = ["ToyLayer"]

    def __init__(self, cfg: ToyConfig):
        super().__init__(cfg)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(ToyLayer(cfg, i) for i in range(len(cfg.layer_types)))
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.3)

    def get_input_embeddings(self):
        return self.embed

    def set_input_embeddings(self, value):
        self.embed = value

    def forward(self, input_ids, labels=None, **kwargs):
        holder = GLOBAL_HOLDER if self.config.global_holder else IndexHolder()  # one per forward call
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, holder=holder)
        logits = self.head(x).float()
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return CausalLMOutput(loss=loss, logits=logits)


def _apply(model, state):
    attns = [m for m in model.modules() if isinstance(m, ToyAttention)]
    for m in attns:
        m.state = state

    def undo():
        for m in attns:
            m.state = None

    return undo


@contextlib.contextmanager
def toy_family():
    """Register "hyscale_toy" only while the replay tests run: registry-contract tests elsewhere
    expect every registered family to be a real one (there is no public unregister)."""
    if "hyscale_toy" not in supported_model_types():
        register_family("hyscale_toy", _apply, "dsa")
    try:
        yield
    finally:
        families._FAMILIES.pop("hyscale_toy", None)


def make_toy(seed: int = 0, **config) -> ToyModel:
    torch.manual_seed(seed)
    return ToyModel(ToyConfig(**config)).train()
