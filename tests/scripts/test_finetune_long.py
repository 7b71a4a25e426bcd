"""scripts/finetune_long.py end to end at --tiny settings (offline, CPU), and its pieces."""

from __future__ import annotations

import configparser
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import hyscale_hf
from hyscale_hf.recipes.data import byte_tokenizer, pack, stdlib_documents
from hyscale_hf.recipes.passkey import PasskeyBuilder

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_run_end_to_end(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "finetune_long.py"), "--tiny", "--no_progress", "--output_dir", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "passkey" in proc.stdout and "top-k recall" in proc.stdout

    results = json.loads((out / "results.json").read_text())
    assert results["max_steps"] == 6 and results["dense_pretrain_steps"] == 1 and results["dense_warmup_steps"] == 2
    assert 0.0 < results["topk_recall_held_out"] <= 1.0
    assert set(results["passkey_per_depth"]) == {"0.0", "1.0"}
    assert 0.0 <= results["passkey_accuracy"] <= 1.0
    assert results["reload_max_abs_logit_diff"] == 0.0  # saved checkpoint, reloaded and patched, gives the same logits
    assert (out / "loss_curve.png").stat().st_size > 10_000
    stats = results["selection_stats"]
    assert stats["indexer_forward"] > 0 and stats["indexer_recompute"] == 0 and stats["replayed_selections"] > 0

    history = [e for e in json.loads((out / "log_history.json").read_text()) if "loss" in e]
    assert [e["hyscale_stage"] for e in history] == [0.0, 1.0, 1.0, 2.0, 2.0, 2.0]
    assert all(e["indexer_loss"] > 0 for e in history)

    # The checkpoint loads in a fresh process state: from_pretrained + patch_model with the saved config.
    from transformers import AutoModelForCausalLM

    config = hyscale_hf.HyScaleConfig(**json.loads((out / "hyscale_config.json").read_text()))
    assert not config.dense_warmup and config.topk == 32
    model = hyscale_hf.patch_model(AutoModelForCausalLM.from_pretrained(str(out)).eval(), config)
    ids = torch.tensor([byte_tokenizer()("def f(x):\n    return x\n" * 8)["input_ids"]])
    with torch.no_grad():
        first, second = model(input_ids=ids).logits, model(input_ids=ids).logits
    assert torch.isfinite(first).all() and torch.equal(first, second)


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
