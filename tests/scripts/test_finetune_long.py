"""scripts/finetune_long.py end to end at --tiny settings (offline, CPU), and its pieces."""

from __future__ import annotations

import configparser
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hyscale_hf
from hyscale_hf.recipes.data import byte_tokenizer, pack, stdlib_documents
from hyscale_hf.recipes.passkey import PasskeyBuilder

ROOT = Path(__file__).resolve().parents[2]


SCRIPT = ROOT / "scripts" / "finetune_long.py"


def script_env() -> dict[str, str]:
    """Offline, CPU, this tree's hyscale_hf (not another checkout's editable install), and one
    thread: a one-thread CPU run is bitwise reproducible (parallel reductions are not)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "",
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return env


def run_script(tmp_path, *args, expect: int = 0, progress: bool = False) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(SCRIPT), "--tiny", *([] if progress else ["--no_progress"]), *args]
    proc = subprocess.run(cmd, cwd=tmp_path, env=script_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_tiny_run_end_to_end(tmp_path):
    out = tmp_path / "run"
    proc = run_script(tmp_path, "--output_dir", str(out))
    assert "passkey" in proc.stdout and "top-k recall" in proc.stdout

    results = json.loads((out / "results.json").read_text())
    assert results["max_steps"] == 6 and results["dense_pretrain_steps"] == 1 and results["dense_warmup_steps"] == 2
    assert 0.0 < results["topk_recall_held_out"] <= 1.0
    assert set(results["passkey_per_depth"]) == {"0.0", "1.0"}
    assert 0.0 <= results["passkey_accuracy"] <= 1.0
    assert results["reload_max_abs_logit_diff"] == 0.0  # saved checkpoint, reloaded and patched, gives the same logits
    assert (out / "loss_curve.png").stat().st_size > 10_000
    # the four held-out evaluations, each also in its own file, on the same tokens
    states = ["dense", "sparse_fresh_indexer", "sparse_after_warmup", "sparse_after_training"]
    assert list(results["evaluation"]) == states
    for state in states:
        assert json.loads((out / f"evaluation_{state}.json").read_text()) == results["evaluation"][state]
        assert results["evaluation"][state]["tokens"] == results["held_out_tokens"]
    assert results["evaluation"]["dense"]["topk_recall"] is None  # the dense model keeps every key
    assert results["evaluation_ratios"]["perplexity_ratio_sparse_after_training"] > 0
    assert (out / "evaluation.png").stat().st_size > 10_000
    stats = results["selection_stats"]
    assert stats["indexer_forward"] > 0 and stats["indexer_recompute"] == 0 and stats["replayed_selections"] > 0

    history = [e for e in json.loads((out / "log_history.json").read_text()) if "loss" in e]
    assert [e["hyscale_stage"] for e in history] == [0.0, 1.0, 1.0, 2.0, 2.0, 2.0]
    assert all(e["indexer_loss"] > 0 for e in history)
    # The final loss is the last step's (logged every step here), the mean is over all six.
    assert (results["train_loss_last_logged"], results["train_loss_last_logged_step"]) == (history[-1]["loss"], 6)
    assert results["train_loss_mean_logged_steps"] == sum(e["loss"] for e in history) / 6
    assert f"{history[-1]['loss']:.4f} at the last logged step (6)" in proc.stdout

    # The checkpoint loads in a fresh process state: from_pretrained + patch_model with the saved config.
    from transformers import AutoModelForCausalLM

    config = hyscale_hf.HyScaleConfig(**json.loads((out / "hyscale_config.json").read_text()))
    assert not config.dense_warmup and config.topk == 32
    model = hyscale_hf.patch_model(AutoModelForCausalLM.from_pretrained(str(out)).eval(), config)
    ids = torch.tensor([byte_tokenizer()("def f(x):\n    return x\n" * 8)["input_ids"]])
    with torch.no_grad():
        first, second = model(input_ids=ids).logits, model(input_ids=ids).logits
    assert torch.isfinite(first).all() and torch.equal(first, second)


@pytest.mark.slow  # three runs, one of them refused after the model is loaded: ~40 s on 2 cores
def test_local_dense_model_with_lora(tmp_path):
    """--model: a local Llama checkpoint (the patch adds the indexer), LoRA adapters + a fully trained indexer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = byte_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         pad_token_id=tok.pad_token_id, bos_token_id=None, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    tok.save_pretrained(tmp_path / "llama")
    out = tmp_path / "run"
    run_script(tmp_path, "--model", str(tmp_path / "llama"), "--topk", "32", "--index_n_heads", "2",
               "--index_head_dim", "8", "--lora_r", "4", "--lm_loss_chunk", "100", "--output_dir", str(out))
    _check_lora_run(out)
    assert json.loads((out / "adapter_config.json").read_text())["lora_alpha"] == 8  # default: 2 x rank

    # The LoRA options reach PEFT's config; unknown target modules are refused by name.
    custom = tmp_path / "custom"
    run_script(tmp_path, "--model", str(tmp_path / "llama"), "--topk", "32", "--index_n_heads", "2", "--index_head_dim",
               "8", "--lora_r", "4", "--lora_alpha", "16", "--lora_dropout", "0.1", "--lora_target_modules",
               "q_proj,v_proj", "--output_dir", str(custom))
    saved = json.loads((custom / "adapter_config.json").read_text())
    assert (saved["lora_alpha"], saved["lora_dropout"], sorted(saved["target_modules"])) == (16, 0.1, ["q_proj", "v_proj"])
    proc = run_script(tmp_path, "--model", str(tmp_path / "llama"), "--lora_r", "4", "--lora_target_modules", "qkv",
                      "--output_dir", str(tmp_path / "bad"), expect=1)
    assert "--lora_target_modules ['qkv']" in proc.stderr and "q_proj" in proc.stderr


def _check_lora_run(out):
    results = json.loads((out / "results.json").read_text())
    assert results["dense_pretrain_steps"] == 0 and results["topk"] == 32
    assert json.loads((out / "hyscale_config.json").read_text())["lm_loss_chunk"] == 100
    assert 0.0 < results["topk_recall_held_out"] <= 1.0
    saved = json.loads((out / "adapter_config.json").read_text())
    assert sorted(saved["modules_to_save"]) == ["model.layers.0.self_attn.indexer", "model.layers.1.self_attn.indexer"]
    assert not any("indexer" in t for t in saved["target_modules"])
    history = [e for e in json.loads((out / "log_history.json").read_text()) if "loss" in e]
    assert [e["hyscale_stage"] for e in history] == [1.0, 1.0, 2.0, 2.0, 2.0, 2.0]


def test_eval_fraction_evaluates_during_training(tmp_path):
    out = tmp_path / "run"
    run_script(tmp_path, "--output_dir", str(out), "--eval_fraction", "0.25", "--eval_steps", "3")
    evals = [e for e in json.loads((out / "log_history.json").read_text()) if "eval_loss" in e]
    assert [e["step"] for e in evals] == [3, 6]
    results = json.loads((out / "results.json").read_text())
    assert (results["eval_loss_last"], results["eval_loss_last_step"]) == (evals[-1]["eval_loss"], 6)


def test_model_is_saved_before_evaluation(tmp_path, monkeypatch):
    """An evaluation that fails costs nothing: the trained model and its config are already written."""
    from hyscale_hf.recipes import evaluate, finetune_long

    real = evaluate.stage_evaluation

    def failing_evaluation(args, name, *rest):  # the evaluations before and during training still run
        if name == "sparse_after_training":
            raise RuntimeError("evaluation failed")
        return real(args, name, *rest)

    monkeypatch.setattr(evaluate, "stage_evaluation", failing_evaluation)
    out = tmp_path / "run"
    try:
        finetune_long.run(["--tiny", "--no_progress", "--output_dir", str(out)])
    except RuntimeError as e:
        assert str(e) == "evaluation failed"
    else:
        raise AssertionError("the patched evaluation did not run")
    assert (out / "model.safetensors").is_file() and (out / "log_history.json").is_file()
    assert json.loads((out / "hyscale_config.json").read_text())["topk"] == 32


def test_main_exit_status(monkeypatch):
    """The console script's exit status: 0 after a run, 128 + signal after an interruption (never the
    results dict, which sys.exit would print to stderr with status 1)."""
    from hyscale_hf.recipes import finetune_long

    monkeypatch.setattr(finetune_long, "run", lambda argv=None: {"passkey_accuracy": 0.0})
    assert finetune_long.main([]) == 0
    monkeypatch.setattr(finetune_long, "run", lambda argv=None: {"interrupted_by": 15, "step": 3})
    assert finetune_long.main([]) == 143


def test_console_script_entry_point():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    line = cfg["options.entry_points"]["console_scripts"].strip()
    name, target = (part.strip() for part in line.split("="))
    assert name == "hyscale-finetune-long"
    module, func = target.split(":")
    assert callable(getattr(importlib.import_module(module), func))


def test_packing_and_passkey_prompts():
    tok = byte_tokenizer()
    assert len(tok) == 259
    docs = stdlib_documents(20_000, seed=1)
    assert sum(map(len, docs)) >= 20_000 and all(len(d) >= 4000 for d in docs)
    blocks = pack(docs, tok, 512)
    assert len(blocks) >= 30 and all(len(b) == 512 for b in blocks["input_ids"][:5])
    assert blocks["input_ids"][0] == blocks["labels"][0]

    builder = PasskeyBuilder(tok, 600)
    shallow, deep = builder.sample(0.0, "12345"), builder.sample(1.0, "12345")
    assert len(shallow.input_ids) == len(deep.input_ids) <= 600
    text = tok.decode(deep.input_ids)
    assert text.endswith("The pass key is 12345") and text.index("pass key is 12345.") > 400
    assert tok.decode(shallow.input_ids[-shallow.answer_len :]) == " 12345"
    assert tok.decode(shallow.input_ids).index("pass key is 12345.") < 250
