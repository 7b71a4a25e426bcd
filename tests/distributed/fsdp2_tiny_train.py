"""Train a tiny patched Llama for a few steps with accelerate, under FSDP2 or in one process.

Run by tests/distributed/test_fsdp2_cpu.py, twice on the same data:

- ``accelerate launch --config_file scripts/accelerate/fsdp2_cpu_gloo.yaml`` (2 processes; each
  takes half of every global batch; accelerate's FSDP2 path shards the decoder layers, embeddings and
  the added indexer parameters);
- plain ``python`` (one process, the whole global batch, no sharding).

Every sequence has the same length and no padding, so the mean of the two ranks' mean losses is the
one-process mean loss (LM loss: mean over tokens; indexer KL loss: mean over queries), and FSDP2's
gradient averaging makes the two runs take the same optimizer steps. The run writes, from rank 0,
``result.json`` (per-step LM and indexer losses averaged over ranks, selection counters) and
``logits.pt`` (eval logits after training), and saves the trained model twice: ``final/`` through
``accelerator.get_state_dict`` + ``save_pretrained`` (a Transformers checkpoint with the indexer
weights and the ``hyscale_indexer`` record), and ``state/`` through ``accelerator.save_state`` (the
config's SHARDED_STATE_DICT: torch.distributed.checkpoint shards) with ``config.json`` beside it.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM

import hyscale_hf

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
    """Decoder layers that are FSDP2 units of their own (directly, or under a CheckpointWrapper)."""
    from torch.distributed.fsdp import FSDPModule

    layers = model.get_decoder().layers
    return [type(getattr(m, "_checkpoint_wrapped_module", m)).__name__ for m in layers
            if isinstance(getattr(m, "_checkpoint_wrapped_module", m), FSDPModule)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--replay", action="store_true", help="checkpoint layers with hyscale_hf.wrap_layers_for_replay")
    parser.add_argument("--save", action="store_true")
    args = parser.parse_args()

    accelerator = Accelerator()
    rank, world = accelerator.process_index, accelerator.num_processes
    if GLOBAL_BATCH % world:
        raise ValueError(f"global batch {GLOBAL_BATCH} does not split over {world} processes")
    per_rank = GLOBAL_BATCH // world

    # Patch (which creates the indexer parameters) and wrap before prepare: FSDP2 shards what exists then.
    model = hyscale_hf.patch_model(tiny_llama(), **PATCH)
    if args.replay:
        hyscale_hf.wrap_layers_for_replay(model)
    state = hyscale_hf.patching.patch_state(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    if accelerator.is_main_process:
        print(f"distributed_type={accelerator.distributed_type} world={world} model={type(model).__name__}", flush=True)

    if args.replay:
        hyscale_hf.reset_selection_stats()
    lm_losses, indexer_losses = [], []
    model.train()
    for batch in batches(args.steps):
        x = batch[rank * per_rank : (rank + 1) * per_rank].to(accelerator.device)
        loss = model(input_ids=x, labels=x, use_cache=False).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        indexer_loss = torch.tensor(state.pop_indexer_loss(), device=accelerator.device)
        lm_losses.append(accelerator.reduce(loss.detach(), "mean").item())
        indexer_losses.append(accelerator.reduce(indexer_loss, "mean").item())

    result = {"world": world, "lm_losses": lm_losses, "indexer_losses": indexer_losses,
              "distributed_type": str(accelerator.distributed_type), "sharded_layers": sharded_layers(model)}
    if args.replay:
        counts = hyscale_hf.selection_stats()
        result["selection_stats"] = {k: accelerator.reduce(torch.tensor(v), "sum").item() for k, v in counts.items()}

    model.eval()
    with torch.no_grad():
        logits = model(input_ids=eval_tokens().to(accelerator.device)).logits

    if args.save:
        full = accelerator.get_state_dict(model)  # gathered on every rank's CPU (FSDP2: full_state_dict)
        if accelerator.is_main_process:
            accelerator.unwrap_model(model).save_pretrained(args.out / "final", state_dict=full)
        accelerator.save_state(args.out / "state")
        if accelerator.is_main_process:
            accelerator.unwrap_model(model).config.save_pretrained(args.out / "state")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        torch.save(logits.cpu(), args.out / "logits.pt")
        (args.out / "result.json").write_text(json.dumps(result))
    accelerator.end_training()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
