"""A few deterministic Trainer steps on the CPU, shared by the replay tests that compare training with
and without gradient checkpointing."""

from __future__ import annotations


def trained_parameters(model, data, output_dir, *, checkpointing: bool, learning_rate: float, **extra) -> dict:
    """Train ``model`` 3 steps (batch 2, seeded) on ``data``; its parameters afterwards, by name."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(output_dir), max_steps=3, per_device_train_batch_size=2,
                             learning_rate=learning_rate, report_to=[], save_strategy="no", use_cpu=True, seed=0,
                             data_seed=0, dataloader_num_workers=0, gradient_checkpointing=checkpointing,
                             disable_tqdm=True, **extra)
    Trainer(model=model, args=args, train_dataset=data).train()
    return {n: p.detach().clone() for n, p in model.named_parameters()}
