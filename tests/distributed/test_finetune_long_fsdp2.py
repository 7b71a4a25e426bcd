"""scripts/finetune_long.py --tiny under accelerate FSDP2 on 2 CPU processes (gloo), against one process.

The FSDP2 run takes one packed block per process and step, the one-process run two (``--batch_size
2``), from the same shuffled order, so each optimizer step sees the same global batch: the logged
LM and indexer losses (dense pre-training, dense warm-up with only the indexer trainable, sparse)
must agree, and the checkpoint saved under FSDP2 must load into one process, patch again and give the
one-process run's logits.
~30 s on a 2-core machine.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

import hyscale_hf
from tests.distributed.test_fsdp2_cpu import CPU_CONFIG, ROOT, TIMEOUT_S, _env, _run

SCRIPT = ROOT / "scripts" / "finetune_long.py"


def _log(out) -> list[dict]:
    history = json.loads((out / "log_history.json").read_text())
    return [entry for entry in history if "loss" in entry]


@pytest.mark.slow  # an FSDP2 launch and a one-process run: ~30 s on 2 cores
@pytest.mark.skipif(not SCRIPT.exists(), reason="scripts/finetune_long.py is not on this branch")
def test_finetune_long_tiny_under_fsdp2_matches_one_process(tmp_path):
    single, fsdp = tmp_path / "single", tmp_path / "fsdp2"
    common = ["--tiny", "--no_progress"]
    _run([sys.executable, str(SCRIPT), *common, "--batch_size", "2", "--output_dir", str(single)], _env(False), TIMEOUT_S)
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_CONFIG)]
    _run([*launch, str(SCRIPT), *common, "--batch_size", "1", "--output_dir", str(fsdp)], _env(True), TIMEOUT_S)

    one, two = _log(single), _log(fsdp)
    assert [e["step"] for e in one] == [e["step"] for e in two] and len(one) >= 4
    assert [e["hyscale_stage"] for e in one] == [e["hyscale_stage"] for e in two]
    assert {0.0, 1.0, 2.0} <= {e["hyscale_stage"] for e in one}, "the tiny run passes through all three stages"
    for key in ("loss", "indexer_loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor([e[key] for e in two]), torch.tensor([e[key] for e in one]),
                                   rtol=1e-4, atol=1e-6, msg=lambda m, key=key: f"{key}: FSDP2 vs one process: {m}")
    for entry in two:
        assert entry["replay_indexer_recompute"] == 0
        assert (entry["replay_indexer_forward"] > 0) == (entry["hyscale_stage"] == 2.0)  # selection: sparse stage only

    # The chunked LM loss (the head's logits a chunk at a time) under FSDP2 gives the same training.
    chunked = tmp_path / "fsdp2_chunked_loss"
    _run([*launch, str(SCRIPT), *common, "--batch_size", "1", "--lm_loss_chunk", "64", "--output_dir", str(chunked)],
         _env(True), TIMEOUT_S)
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor([e[key] for e in _log(chunked)]), torch.tensor([e[key] for e in two]),
                                   rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: lm_loss_chunk vs not: {m}")

    results = json.loads((fsdp / "results.json").read_text())
    assert results["train_tokens"] == json.loads((single / "results.json").read_text())["train_tokens"]
    # The checkpoint saved under FSDP2 loads into one process and patches again (with the saved
    # HyScaleConfig), giving the logits of the one-process run's checkpoint.
    ids = torch.randint(3, 200, (1, 64), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_reloaded_logits(fsdp, ids), _reloaded_logits(single, ids), rtol=1e-4, atol=1e-4)


def _reloaded_logits(out, ids) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    assert (out / "model.safetensors").exists(), f"no weights saved in {out}"
    model = AutoModelForCausalLM.from_pretrained(out)
    config = hyscale_hf.HyScaleConfig(**json.loads((out / "hyscale_config.json").read_text()))
    hyscale_hf.patch_model(model, config.replace(backend="torch"))
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits
