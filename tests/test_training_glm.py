"""The indexer recipe on a tiny patched GLM-5 (glm_moe_dsa, with an IndexShare layer) under the Trainer:
warm-up freezing, loss isolation, recall, selection-replay counters in the logs, and LoRA."""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer, TrainingArguments

import hyscale_hf
from hyscale_hf import HyScaleCallback, indexer_modules_to_save, indexer_parameter_names
from tests.model_patches.tiny_models import VOCAB, build

SEQ = 64


class Blocks(torch.utils.data.Dataset):
    def __init__(self, n=32, seq=SEQ, seed=0):
        self.ids = torch.randint(3, VOCAB, (n, seq), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_glm(**overrides):
    model, _ = build("glm_moe_dsa")
    return hyscale_hf.patch_model(model, **overrides)


def trainer_for(model, tmp_path, callback, max_steps, lr=1e-2, checkpointing=False, logging_steps=1, data=None):
    fields = TrainingArguments.__dataclass_fields__
    ckpt = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=max_steps, per_device_train_batch_size=2, learning_rate=lr,
        logging_steps=logging_steps, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
        lr_scheduler_type="constant", remove_unused_columns=False, **{ckpt: checkpointing},
    )
    trainer = Trainer(model=model, args=args, train_dataset=data or Blocks())
    callback.add_to(trainer)
    return trainer


def test_warmup_moves_only_the_indexer_and_replay_is_logged(tmp_path):
    model = tiny_glm()
    indexer = set(indexer_parameter_names(model))
    assert indexer and all(".indexer." in n for n in indexer)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = trainer_for(model, tmp_path, HyScaleCallback(dense_warmup_steps=2), max_steps=2, checkpointing=True)
    trainer.train()
    for name, param in model.named_parameters():
        assert (not torch.equal(param.detach(), before[name])) == (name in indexer), name
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["hyscale_stage"] for e in logged] == [1.0, 1.0]
    assert all(e["indexer_loss"] > 0 for e in logged)
    # Dense warm-up runs no top-k; the counters are there and consistent.
    assert all(e["replay_indexer_recompute"] == 0 for e in logged)


def test_sparse_stage_with_checkpointing_replays_the_selection(tmp_path):
    model = tiny_glm()
    trainer = trainer_for(model, tmp_path, HyScaleCallback(dense_warmup_steps=0), max_steps=2, checkpointing=True)
    trainer.train()
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["hyscale_stage"] for e in logged] == [2.0, 2.0]
    for entry in logged:
        # 2 full indexer layers + 1 IndexShare layer per forward; recompute replays, never reruns.
        assert entry["replay_indexer_forward"] == 2 and entry["replay_indexer_recompute"] == 0
        assert entry["replay_shared_forward"] == 1 and entry["replay_replayed_selections"] == 3
        assert entry["indexer_loss"] > 0 and 0.0 < entry["topk_recall"] <= 1.0 + 1e-6


def test_loss_terms_reach_their_own_parameters():
    """Warm-up backward: only indexer gradients. Sparse, KL off: no indexer gradient from the LM loss."""
    model = tiny_glm()
    indexer = set(indexer_parameter_names(model))
    config = hyscale_hf.patched_config(model)
    batch = Blocks()[0]
    ids = batch["input_ids"][None]
    model.train()
    config.dense_warmup = True
    model(input_ids=ids, labels=ids).loss.backward()
    for name, p in model.named_parameters():
        if name in indexer:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    model.zero_grad(set_to_none=True)
    config.dense_warmup, config.indexer_loss_coef = False, 0.0
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is None or not p.grad.any() for n, p in model.named_parameters() if n in indexer)
    assert any(p.grad is not None and p.grad.any() for n, p in model.named_parameters() if n not in indexer)


def test_recall_rises_during_warmup(tmp_path):
    # Random tokens give the random-init model content-based attention that takes the indexer many
    # batches to generalise; a small dataset seen several times shows the warm-up working in seconds.
    model = tiny_glm()
    config = hyscale_hf.patched_config(model)
    config.dense_warmup = True  # recall of the dense model's attention, before and after
    data = Blocks(n=4, seed=7)
    sample = {"input_ids": data.ids[:2]}
    model.eval()
    before = hyscale_hf.measure_topk_recall(model, sample)
    trainer = trainer_for(model, tmp_path, HyScaleCallback(dense_warmup_steps=16), max_steps=16, logging_steps=4,
                          data=data)
    trainer.train()
    model.eval()
    config.dense_warmup = True
    after = hyscale_hf.measure_topk_recall(model, sample)
    assert after > before + 0.05, (before, after)
    kl = [e["indexer_loss"] for e in trainer.state.log_history if "loss" in e]
    assert kl[-1] < kl[0]


def test_lora_with_trainable_indexer(tmp_path):
    peft = pytest.importorskip("peft")
    model = tiny_glm()
    to_save = indexer_modules_to_save(model)
    assert to_save == ["model.layers.0.self_attn.indexer", "model.layers.2.self_attn.indexer"]  # layer 1 is shared
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_a_proj", "q_b_proj", "o_proj"],
                           modules_to_save=to_save)
    model = peft.get_peft_model(model, lora)
    assert hyscale_hf.is_patched(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("lora_" in n for n in trainable)
    assert {n for n in trainable if "lora_" not in n} == {
        n for n in indexer_parameter_names(model) if ".modules_to_save." in n
    }
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def changed():
        return {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}

    trainer = trainer_for(model, tmp_path, HyScaleCallback(dense_warmup_steps=2), max_steps=2)
    trainer.train()
    warm = changed()
    assert warm and all(".modules_to_save." in n and ".indexer." in n for n in warm)
    trainer = trainer_for(model, tmp_path, HyScaleCallback(dense_warmup_steps=0), max_steps=2)
    trainer.train()
    sparse = changed()
    assert any("lora_" in n for n in sparse)
    assert all(n in trainable for n in sparse)  # base weights and the frozen indexer originals never move
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable


def test_peft_without_indexer_in_modules_to_save_refuses_warmup(tmp_path):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_glm(), peft.LoraConfig(r=4, target_modules=["q_a_proj"], lora_dropout=0.0))
    trainer = trainer_for(model, tmp_path, HyScaleCallback(dense_warmup_steps=1), max_steps=1)
    with pytest.raises(ValueError, match="modules_to_save"):
        trainer.train()
