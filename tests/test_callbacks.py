"""HyScaleCallback on a tiny DSA model (tests/toy_dsa.py) under the real Transformers Trainer."""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

import hyscale_hf
from hyscale_hf import HyScaleCallback, indexer_modules_to_save, indexer_parameter_names
from hyscale_hf.state import patch_state
from tests.toy_dsa import tiny_toy_model

SEQ = 48


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, seq: int = SEQ, vocab: int = 64, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StageRecorder(TrainerCallback):
    """Per optimizer step: the stage and the trainable parameter names the step ran with."""

    def __init__(self) -> None:
        self.steps = []

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        self.steps.append((patch_state(model).config.dense_warmup, trainable))


def make_trainer(model, tmp_path, callbacks, max_steps=6, lr=1e-2, logging_steps=1):
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=max_steps,
        per_device_train_batch_size=2,
        learning_rate=lr,
        logging_steps=logging_steps,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        lr_scheduler_type="constant",
    )
    return Trainer(model=model, args=args, train_dataset=RandomTokens(), callbacks=callbacks)


def patched_toy(**overrides):
    model = tiny_toy_model()
    return hyscale_hf.patch_model(model, backend="torch", **overrides)


def test_stage_switch_freezes_then_unfreezes(tmp_path):
    model = patched_toy()
    everything = {n for n, _ in model.named_parameters()}
    indexer = set(indexer_parameter_names(model))
    assert indexer and indexer < everything
    recorder = StageRecorder()
    trainer = make_trainer(model, tmp_path, [HyScaleCallback(dense_warmup_steps=3), recorder], max_steps=6)
    trainer.train()
    assert [dense for dense, _ in recorder.steps] == [True] * 3 + [False] * 3
    for dense, trainable in recorder.steps:
        assert trainable == (indexer if dense else everything)
    assert not patch_state(model).config.dense_warmup
    assert all(p.requires_grad for p in model.parameters())

    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["step"] for e in logged] == list(range(1, 7))
    assert [e["hyscale_stage"] for e in logged] == [1.0] * 3 + [2.0] * 3  # warm-up, then sparse
    for entry in logged:  # values reach log_history although on_log runs after it is written
        assert entry["indexer_loss"] > 0 and 0.0 <= entry["topk_recall"] <= 1.0 + 1e-6


def test_dense_pretrain_stage_comes_first(tmp_path):
    model = patched_toy()
    everything = {n for n, _ in model.named_parameters()}
    indexer = set(indexer_parameter_names(model))
    recorder = StageRecorder()
    callback = HyScaleCallback(dense_warmup_steps=2, dense_pretrain_steps=2)
    trainer = make_trainer(model, tmp_path, [callback, recorder], max_steps=6)
    trainer.train()
    assert [dense for dense, _ in recorder.steps] == [True] * 4 + [False] * 2
    assert [t == everything for _, t in recorder.steps] == [True, True, False, False, True, True]
    assert all(t == indexer for _, t in recorder.steps[2:4])
    logged = [e["hyscale_stage"] for e in trainer.state.log_history if "loss" in e]
    assert logged == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]


def test_warmup_trains_only_the_indexer(tmp_path):
    model = patched_toy()
    indexer = set(indexer_parameter_names(model))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    make_trainer(model, tmp_path, [HyScaleCallback(dense_warmup_steps=4)], max_steps=4).train()
    for name, param in model.named_parameters():
        changed = not torch.equal(param.detach(), before[name])
        assert changed == (name in indexer), name


def test_sparse_stage_trains_everything(tmp_path):
    model = patched_toy()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    make_trainer(model, tmp_path, [HyScaleCallback(dense_warmup_steps=0)], max_steps=2).train()
    assert all(not torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())


def test_indexer_loss_coef_override_and_loss_only_in_indexer(tmp_path):
    model = patched_toy()
    trainer = make_trainer(model, tmp_path, [HyScaleCallback(indexer_loss_coef=0.0)], max_steps=1)
    trainer.train()
    assert patch_state(model).config.indexer_loss_coef == 0.0
    # With the KL term off, the LM loss alone must leave the indexer without gradient.
    model.zero_grad(set_to_none=True)
    batch = RandomTokens()[0]
    model.train()
    model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss.backward()
    for name, param in model.named_parameters():
        if name in set(indexer_parameter_names(model)):
            assert param.grad is None or not param.grad.any(), name
        else:
            assert param.grad is not None, name


def test_add_to_runs_before_reporting_callbacks(tmp_path):
    model = patched_toy()
    trainer = make_trainer(model, tmp_path, None, max_steps=2)
    callback = HyScaleCallback(dense_warmup_steps=1).add_to(trainer)
    assert trainer.callback_handler.callbacks[0] is callback
    assert callback.add_to(trainer) is callback  # a second call moves it, never duplicates it
    assert sum(c is callback for c in trainer.callback_handler.callbacks) == 1
    seen = []

    class Reporter(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if "loss" in logs:
                seen.append(dict(logs))

    trainer.add_callback(Reporter())
    trainer.train()
    assert len(seen) == 2 and all("indexer_loss" in logs for logs in seen)


def test_recall_rises_during_warmup(tmp_path):
    model = tiny_toy_model()
    with torch.no_grad():  # peaked attention, so top-6 of ~24 visible keys can hold most of its mass
        for layer in model.layers:
            layer.self_attn.q_proj.weight.mul_(40)
    hyscale_hf.patch_model(model, backend="torch", topk=6, dense_warmup=True)  # recall of the dense model
    batch = {"input_ids": RandomTokens(n=4, seed=1).ids}
    model.eval()
    before = hyscale_hf.measure_topk_recall(model, batch)
    trainer = make_trainer(model, tmp_path, [HyScaleCallback(dense_warmup_steps=30)], max_steps=30, logging_steps=10)
    trainer.train()
    model.eval()
    patch_state(model).config.dense_warmup = True
    after = hyscale_hf.measure_topk_recall(model, batch)
    assert after > before + 0.03, (before, after)
    logged = [e["indexer_loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(logged) == 3 and logged[-1] < logged[0]


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="dense_warmup_steps"):
        HyScaleCallback(dense_warmup_steps=-1)
    with pytest.raises(ValueError, match="recall_queries"):
        HyScaleCallback(recall_queries=-2)
    unpatched = tiny_toy_model()
    with pytest.raises(ValueError, match="patched"):
        make_trainer(unpatched, tmp_path, [HyScaleCallback()], max_steps=1).train()
    with pytest.raises(ValueError, match="no submodule named"):
        indexer_modules_to_save(torch.nn.Linear(2, 2))
