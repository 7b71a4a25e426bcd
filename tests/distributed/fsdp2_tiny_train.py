"""Train tiny patched models for a few steps with accelerate, under FSDP2 or in one process.

Run by tests/distributed/test_fsdp2_cpu.py, twice on the same data:

- ``accelerate launch --config_file scripts/accelerate/fsdp2_cpu_gloo.yaml`` (2 processes; each
  takes half of every global batch; accelerate's FSDP2 path shards the decoder layers, embeddings and
  the indexer parameters);
- plain ``python`` (one process, the whole global batch, no sharding).

Every sequence has the same length and no padding, so the mean of the two ranks' mean losses is the
one-process mean loss (LM loss: mean over tokens; indexer KL loss: mean over queries), and FSDP2's
gradient averaging makes the two runs take the same optimizer steps.

``--phases`` (see ``PHASES``): ``full`` (Llama with an added indexer, all parameters,
``wrap_layers_for_replay``), ``lora`` (LoRA + the indexers as PEFT ``modules_to_save``, Transformers'
checkpointing with replay), ``glm5`` (tiny glm_moe_dsa, ``wrap_layers_for_replay``). Each phase
writes to ``OUT/<phase>/``, from rank 0: ``result.json`` (per-step LM and indexer losses averaged over
ranks, selection counters summed over ranks) and ``logits.pt`` (eval logits after training); with
``--save`` also ``final/`` through ``accelerator.get_state_dict`` + ``save_pretrained`` (a
Transformers checkpoint, or the adapter for ``lora``) and, for ``full``, ``state/`` through
``accelerator.save_state`` (the config's SHARDED_STATE_DICT: torch.distributed.checkpoint shards)
with ``config.json`` beside it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from pathlib import Path

import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM

import hyscale_hf
from hyscale_hf.state import patch_state

VOCAB, LENGTH, GLOBAL_BATCH = 128, 32, 4
# Small indexer, and a top-k well below the sequence length so the selection is real.
PATCH = dict(topk=6, index_n_heads=2, index_head_dim=8, indexer_loss_coef=1.0, backend="torch")


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        attention_dropout=0.0, tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).float()


def batches(steps: int) -> list[torch.Tensor]:
    """Two global batches, alternating: the model memorises them, so the loss falls step by step."""
    g = torch.Generator().manual_seed(1)
    pair = [torch.randint(3, VOCAB, (GLOBAL_BATCH, LENGTH), generator=g) for _ in range(2)]
    return [pair[i % 2] for i in range(steps)]


def eval_tokens() -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(2))


def sharded_layers(model: torch.nn.Module) -> list[str]:
    """Decoder layers that are FSDP2 units of their own: the layer itself, or the CheckpointWrapper around
    it (accelerate 1.15 shards the wrapped layer, 1.16 the wrapper; either way one unit per layer)."""
    from torch.distributed.fsdp import FSDPModule

    layers = model.get_decoder().layers
    names = []
    for m in layers:
        inner = getattr(m, "_checkpoint_wrapped_module", m)
        if isinstance(m, FSDPModule) or isinstance(inner, FSDPModule):
            name = type(inner).__name__
            names.append(name.removeprefix("FSDP") if isinstance(inner, FSDPModule) else name)  # fully_shard renames
    return names


def tiny_glm5() -> torch.nn.Module:
    """A tiny GLM-5 (glm_moe_dsa: MLA, MoE, IndexShare layers full/shared/full) from the patch tests."""
    from tests.model_patches.tiny_models import build

    model, _ = build("glm_moe_dsa", seed=0)
    return model


# name -> (model, patch options, LoRA, checkpointing, what --save writes)
PHASES = {
    # All parameters; layers wrapped by hyscale_hf.wrap_layers_for_replay (the FSDP2 recipe).
    "full": ("llama", PATCH, False, "wrap", ("final", "state")),
    # LoRA on q/v + the indexers as PEFT modules_to_save, under Transformers' checkpointing (patch_model
    # gave it the replay policy): PEFT cannot save modules_to_save inside checkpoint_wrapper'd layers.
    "lora": ("llama", PATCH, True, "transformers", ("final",)),
    # GLM-5 shaped: its own indexer (index_topk 8 < 32 tokens), IndexShare, MoE; wrapped for replay; its
    # norms, MLPs and MLA query side in tiles of 12 tokens, selections through the offload's store (CPU
    # tensors stay where they are, so the store holds them as they are).
    "glm5": ("glm_moe_dsa", dict(indexer_loss_coef=1.0, backend="torch", tile_tokens=12, offload_activations=True),
             False, "wrap", ("final",)),
}


def build(phase: str) -> torch.nn.Module:
    """The patched model, in the order FSDP2 needs: patch (creates the indexer parameters), then PEFT,
    then the checkpointing, all before ``accelerator.prepare`` shards what exists."""
    family, options, lora, checkpointing, _ = PHASES[phase]
    model = hyscale_hf.patch_model(tiny_llama() if family == "llama" else tiny_glm5(), **options)
    if lora:
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                            modules_to_save=hyscale_hf.indexer_modules_to_save(model))
        model = get_peft_model(model, config)
    if checkpointing == "wrap":  # checkpoint_wrapper around each decoder layer, with the replay policy
        hyscale_hf.wrap_layers_for_replay(model)
        model.config.use_cache = False  # a KV cache filled in forward would be appended to again in recompute
    elif checkpointing == "transformers":
        model.gradient_checkpointing_enable()
    return model


def train(accelerator: Accelerator, phase: str, steps: int, out: Path, save: bool) -> None:
    rank, world = accelerator.process_index, accelerator.num_processes
    if GLOBAL_BATCH % world:
        raise ValueError(f"global batch {GLOBAL_BATCH} does not split over {world} processes")
    per_rank = GLOBAL_BATCH // world
    model = build(phase)
    state = patch_state(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    if accelerator.is_main_process:
        print(f"{phase}: distributed_type={accelerator.distributed_type} world={world} "
              f"model={type(model).__name__}", flush=True)

    hyscale_hf.reset_selection_stats()
    lm_losses, indexer_losses = [], []
    model.train()
    for batch in batches(steps):
        x = batch[rank * per_rank : (rank + 1) * per_rank].to(accelerator.device)
        loss = model(input_ids=x, labels=x).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        indexer_loss = torch.tensor(state.pop_indexer_loss(), device=accelerator.device)
        lm_losses.append(accelerator.reduce(loss.detach(), "mean").item())
        indexer_losses.append(accelerator.reduce(indexer_loss, "mean").item())

    counts = hyscale_hf.selection_stats()
    result = {
        "world": world, "lm_losses": lm_losses, "indexer_losses": indexer_losses,
        "distributed_type": str(accelerator.distributed_type), "sharded_layers": sharded_layers(model),
        "selection_stats": {k: accelerator.reduce(torch.tensor(v), "sum").item() for k, v in counts.items()},
        "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
    }

    model.eval()
    with torch.no_grad():
        logits = model(input_ids=eval_tokens().to(accelerator.device)).logits

    writes = PHASES[phase][4] if save else ()
    if "final" in writes:
        full = accelerator.get_state_dict(model)  # FSDP2: a full state dict on every rank's CPU
        if accelerator.is_main_process:
            accelerator.unwrap_model(model).save_pretrained(out / "final", state_dict=full)
    if "state" in writes:
        accelerator.save_state(out / "state")  # SHARDED_STATE_DICT: torch.distributed.checkpoint shards
        if accelerator.is_main_process:
            accelerator.unwrap_model(model).config.save_pretrained(out / "state")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(logits.cpu(), out / "logits.pt")
        (out / "result.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, from {list(PHASES)}")
    parser.add_argument("--save", action="store_true")
    args = parser.parse_args()
    phases = args.phases.split(",")
    unknown = sorted(set(phases) - set(PHASES))
    if unknown:
        raise ValueError(f"--phases: unknown {unknown}; known: {list(PHASES)}")

    accelerator = Accelerator()
    for phase in phases:
        # One Accelerator per phase: they share the process state and group, not the prepared objects.
        # They also share the FSDP plugin, whose first prepare fixed the layer classes to wrap from that
        # model's _no_split_modules: clear them so the next model family gets its own.
        plugin = getattr(accelerator.state, "fsdp_plugin", None) if accelerator.is_fsdp2 else None
        if plugin is not None and "FSDP_TRANSFORMER_CLS_TO_WRAP" not in os.environ:
            plugin.transformer_cls_names_to_wrap = None
        train(Accelerator(), phase, args.steps, args.out / phase, args.save)
    # Once in CI a rank aborted at exit ("terminate called without an active exception", SIGABRT) after
    # the last phase: Gloo's worker threads can still hold work objects (and tensors) when the
    # interpreter finalises. Free the phases' objects and leave the group together, while Python is alive.
    gc.collect()
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
