"""The model stacks the benchmarks share (public Transformers + hyscale_hf API only), and their arms.

Two stacks, random init (timing needs the shapes, not the weights):
- ``glm5``: GLM-5's attention and indexer dimensions (hidden 6144, 64 heads, q_lora 2048, kv_lora
  512, qk_nope 192, rope 64, v 256, 32 indexer heads of dim 128, topk 2048) with few layers, dense
  MLPs and a 32000-token vocabulary so a stack fits one GPU (``GLM5``).
- ``smollm2``: a dense Llama with SmolLM2-135M's dimensions (30 layers, hidden 576, 9 query / 3 KV
  heads of dim 64, a 49152-token vocabulary), the converted-dense-model case: ``patch_model`` adds
  an indexer sized from the attention (2 x 64) and keeps 2048 keys per query (``SMOLLM2``).

Each has a toy twin for CPU smoke runs of the scripts (``STACKS[name]["tiny"]``). ``make_arm``
builds one arm of a stack: ``hyscale`` (patched), ``dense`` (SDPA, no indexer), ``native`` (the
unpatched DSA model, glm5 only), ``replay_off`` and ``lean_off`` (patched with one feature off),
``tiled`` (patched with ``tile_tokens``) and ``tiled_offload`` (``tile_tokens`` and
``offload_activations``).
"""

from __future__ import annotations

import time

import torch

from ..kernels import chunked_cross_entropy

GLM5 = dict(
    hidden_size=6144, num_attention_heads=64, num_key_value_heads=64, q_lora_rank=2048, kv_lora_rank=512,
    qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, index_n_heads=32, index_head_dim=128,
    index_topk=2048, intermediate_size=12288, moe_intermediate_size=2048, n_routed_experts=8,
    num_experts_per_tok=2, n_shared_experts=1, vocab_size=32000,
)
TINY = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=24,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, index_n_heads=4, index_head_dim=16,
    index_topk=8, intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4,
    num_experts_per_tok=2, n_shared_experts=1, vocab_size=128,
)
_INDEXER_KEYS = ("index_n_heads", "index_head_dim", "index_topk")
SMOLLM2 = dict(
    hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
    vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True,
)
TINY_LLAMA = dict(
    hidden_size=48, intermediate_size=96, num_attention_heads=3, num_key_value_heads=1, head_dim=16,
    vocab_size=128, rope_theta=10000.0, tie_word_embeddings=True,
)
# name -> full dims, toy dims, default layer count, and what the dense arm is built as
STACKS = {
    "glm5": {"dims": GLM5, "tiny": TINY, "layers": 2, "label": "GLM-5-shaped"},
    "smollm2": {"dims": SMOLLM2, "tiny": TINY_LLAMA, "layers": 30, "label": "SmolLM2-135M-shaped Llama"},
}
ARMS = ("hyscale", "native", "dense", "replay_off", "lean_off", "tiled", "tiled_offload")
TILE_TOKENS = 65536  # the tiled arms' tile_tokens unless make_arm is given one


def build_model(dims: dict, layers: int, max_t: int, device, dtype, *, model_type: str = "glm_moe_dsa",
                attn_implementation: str = "eager"):
    """A random-init causal LM with ``dims``: ``glm_moe_dsa`` (MLA + indexer) or ``deepseek_v3``
    (the same MLA attention, dense, no indexer). All layers use dense MLPs."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = dict(dims)
    if model_type == "glm_moe_dsa":
        extra["indexer_types"] = ["full"] * layers
    else:
        for key in _INDEXER_KEYS:
            extra.pop(key)
    config = AutoConfig.for_model(
        model_type, num_hidden_layers=layers, first_k_dense_replace=layers, n_group=1, topk_group=1,
        max_position_embeddings=max(max_t, 4096), pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra,
    )
    config.use_cache = False
    torch.manual_seed(0)
    with torch.device(device):  # initialise the weights where they will live
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    return model.train()


def build_llama(dims: dict, layers: int, max_t: int, device, dtype, *, attn_implementation: str = "sdpa"):
    """A random-init dense ``LlamaForCausalLM`` with ``dims`` (the converted-dense-model stack)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(num_hidden_layers=layers, max_position_embeddings=max(max_t, 4096), pad_token_id=0,
                         bos_token_id=1, eos_token_id=2, use_cache=False, **dims)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    return model.train()


def make_arm(stack: str, arm: str, dims: dict, layers: int, max_t: int, device, dtype, *,
             tile_tokens: int = TILE_TOKENS, saved: str | None = None, **patch_options):
    """``(model, AdamW)`` of one arm of ``stack`` ("glm5" or "smollm2"), with non-reentrant gradient
    checkpointing on every layer. ``native`` exists for the DSA stack only. ``patch_options`` go to
    ``patch_model`` in the patched arms (e.g. ``lm_loss_chunk``). ``saved`` (smollm2 only): the
    folder of a converted dense model the main job saved, loaded instead of a random-init Llama
    (``trained.load_saved``: the patched arms get its trained indexer, ``dense`` is the model
    without it; ``dims`` and ``layers`` are then the saved model's own)."""
    import hyscale_hf

    if arm not in ARMS:
        raise ValueError(f"arm must be one of {ARMS}, got {arm!r}")
    if saved is not None and stack != "smollm2":
        raise ValueError(f"saved: a converted dense model runs as the smollm2 stack, not {stack!r}")
    if stack == "smollm2":
        if arm == "native":
            raise ValueError("arm 'native' is the unpatched DSA model; the smollm2 stack is dense: use 'dense'")
        if saved is not None:
            from .trained import load_saved

            model = load_saved(saved, device, dtype, patch=False)[0].train()
            model.config.use_cache = False
        else:
            model = build_llama(dims, layers, max_t, device, dtype)
    elif arm == "dense":
        model = build_model(dims, layers, max_t, device, dtype, model_type="deepseek_v3", attn_implementation="sdpa")
    else:
        impl = "sdpa" if arm == "native" and torch.device(device).type == "cuda" else "eager"
        model = build_model(dims, layers, max_t, device, dtype, attn_implementation=impl)
    if arm == "hyscale":
        hyscale_hf.patch_model(model, **patch_options)
    elif arm == "replay_off":
        hyscale_hf.patch_model(model, selection_replay=False, **patch_options)
    elif arm == "lean_off":
        hyscale_hf.patch_model(model, lean_activations=False, **patch_options)
    elif arm in ("tiled", "tiled_offload"):
        hyscale_hf.patch_model(model, tile_tokens=tile_tokens, offload_activations=arm == "tiled_offload",
                               **patch_options)
    enable_checkpointing(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=torch.device(device).type == "cuda")
    return model, optimizer


def enable_checkpointing(model) -> None:
    """Non-reentrant gradient checkpointing on every decoder layer (Transformers 5.17 and newer)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # Transformers 5.23+
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # 5.17
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def step_loss(model, ids: torch.Tensor, loss_chunk: int = 0) -> torch.Tensor:
    """The next-token loss of a benchmark step: ``model(input_ids=ids, labels=ids).loss``, or with
    ``loss_chunk`` the LM head and cross-entropy run that many tokens at a time
    (``kernels.chunked_cross_entropy``), the same for every arm, so the [T, vocab] logits (and their
    fp32 copy and gradient) never exist whole. A patched model gets the same loss with
    ``patch_model(model, lm_loss_chunk=chunk)``."""
    if not loss_chunk:
        return model(input_ids=ids, labels=ids).loss
    hidden = model.model(input_ids=ids).last_hidden_state
    return chunked_cross_entropy(hidden[:, :-1], model.get_output_embeddings(), ids[:, 1:], loss_chunk)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, device, reps: int) -> list[float]:
    """Wall time of ``fn`` in ms, ``reps`` times, synchronising the device around each call."""
    out = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append((time.perf_counter() - t0) * 1e3)
    return out
