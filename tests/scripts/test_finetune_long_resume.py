"""finetune_long: Trainer checkpoints, resume in the right stage with the uninterrupted run's results,
the check of resumed weights, and SIGTERM (checkpoint, clean exit, resume), on the --tiny preset.

The runs use one CPU thread (``script_env``): a one-thread CPU run is bitwise reproducible, so a
resumed run must end on exactly the uninterrupted run's weights.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import hyscale_hf
from hyscale_hf.recipes.args import parse_args
from hyscale_hf.recipes.checkpoints import (
    ResumeMismatch,
    VerifyResumeCallback,
    mismatched_weights,
    reference_weights,
    resolve_resume,
    restore_weights,
    sparse_config_record,
)
from hyscale_hf.recipes.data import byte_tokenizer
from hyscale_hf.recipes.finetune_long import build_glm5_model
from tests.scripts.test_finetune_long import SCRIPT, run_script, script_env

# --tiny: step 1 dense pre-training, steps 2-3 dense warm-up, then sparse
TINY_STAGES = [0.0, 1.0, 1.0]


def _history(out) -> list[dict]:
    return [e for e in json.loads((out / "log_history.json").read_text()) if "loss" in e]


@pytest.mark.slow  # two tiny runs, ~30 s on 2 cores
def test_resume_gives_the_uninterrupted_run(tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    common = ["--save_steps", "2", "--save_total_limit", "3"]
    run_script(tmp_path, *common, "--output_dir", str(full))
    assert sorted(p.name for p in full.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    checkpoint = full / "checkpoint-2"  # after step 2, inside the warm-up
    config = json.loads((checkpoint / "hyscale_config.json").read_text())
    assert config["topk"] == 32 and not config["dense_warmup"]
    assert any(".indexer." in key for key in load_file(checkpoint / "model.safetensors"))
    assert json.loads((checkpoint / "recipe_args.json").read_text())["seq_len"] == 256

    proc = run_script(tmp_path, *common, "--resume_from_checkpoint", str(checkpoint), "--output_dir", str(resumed))
    assert f"resuming from {checkpoint}" in proc.stdout
    one, two = _history(full), _history(resumed)
    # The resumed run goes on in the warm-up (step 3), then sparse, with the same losses step by step.
    assert [(e["step"], e["hyscale_stage"]) for e in two] == [(e["step"], e["hyscale_stage"]) for e in one]
    assert [e["hyscale_stage"] for e in two] == TINY_STAGES + [2.0] * 3
    assert [e["loss"] for e in two] == [e["loss"] for e in one]
    assert [e["indexer_loss"] for e in two[2:]] == [e["indexer_loss"] for e in one[2:]]
    a, b = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    results = json.loads((resumed / "results.json").read_text())
    assert results["resumed_from"] == str(checkpoint) and results["reload_max_abs_logit_diff"] == 0.0

    # A resume must repeat the run's training arguments.
    args = parse_args(["--tiny", "--seq_len", "128", "--resume_from_checkpoint", str(checkpoint), "--output_dir",
                       str(tmp_path / "other")], on_gpu=False)
    args.world_size = 1
    with pytest.raises(SystemExit, match=r"--seq_len: checkpoint 256, now 128"):
        resolve_resume(args)


@pytest.mark.slow  # two tiny runs of 40 steps, ~35 s on 2 cores
def test_sigterm_checkpoints_and_the_run_resumes(tmp_path):
    out = tmp_path / "run"
    common = ["--tiny", "--max_steps", "40", "--output_dir", str(out)]
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *common, "--no_progress"], cwd=tmp_path, env=script_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    logged = 0
    for line in proc.stdout:
        logged += line.startswith("{'loss'")
        if logged == 3:
            proc.send_signal(signal.SIGTERM)
            break
    rest = proc.communicate(timeout=300)[0]
    assert proc.returncode == 128 + signal.SIGTERM, rest[-3000:]
    assert "Traceback" not in rest
    step = int(re.search(r"SIGTERM: stopped after step (\d+) of 40", rest).group(1))
    assert 3 <= step < 40
    checkpoint = out / f"checkpoint-{step}"
    for name in ("model.safetensors", "optimizer.pt", "trainer_state.json", "hyscale_config.json", "recipe_args.json"):
        assert (checkpoint / name).is_file(), name
    assert not (out / "results.json").exists()
    saved_log = json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]
    assert saved_log[-1]["step"] == step  # the interrupted step was logged before the checkpoint

    # The same command with a bare --resume_from_checkpoint (the newest in --output_dir), progress bars on.
    proc = run_script(tmp_path, *common[1:], "--resume_from_checkpoint", progress=True)
    history = _history(out)
    assert [e["step"] for e in history] == list(range(1, 41))  # a continuous loss curve: every step, once
    assert [e["hyscale_stage"] for e in history] == TINY_STAGES + [2.0] * 37
    assert json.loads((out / "results.json").read_text())["resumed_from"] == str(checkpoint)
    # packing, and the evaluation after training (the ones before the checkpoint are read back)
    for bar in ("pack", "sparse_after_training", "sparse_after_training: passkey"):
        assert re.search(rf"{bar}: 100%", proc.stderr), f"no {bar!r} progress bar"


def test_resumed_weights_are_checked_and_loaded_as_from_pretrained_does(tmp_path):
    """Transformers 5.24's Trainer resumes with load_state_dict(strict=False) on the checkpoint file,
    which misses GLM-5's fused expert weights (saved per expert): the check names them, and
    restore_weights loads them right."""
    args = argparse.Namespace(hidden_size=64, num_layers=2, topk=32, index_n_heads=2, index_head_dim=16, seq_len=256,
                              seed=0, torch_dtype=torch.float32)
    trained = hyscale_hf.patch_model(build_glm5_model(args, byte_tokenizer()))
    with torch.no_grad():  # stand-in for training: weights no fresh init has
        for p in trained.parameters():
            p.add_(0.01 * torch.randn_like(p))
    checkpoint = tmp_path / "checkpoint-3"
    trained.save_pretrained(checkpoint)
    (checkpoint / "hyscale_config.json").write_text(json.dumps(sparse_config_record(trained)))
    args.seed = 1
    fresh = hyscale_hf.patch_model(build_glm5_model(args, byte_tokenizer()))
    fresh.load_state_dict(load_file(checkpoint / "model.safetensors"), strict=False)  # the Trainer's resume

    reference = reference_weights(fresh, str(checkpoint))
    problems = mismatched_weights(fresh, reference)
    assert "model.layers.1.mlp.experts.gate_up_proj: differs from the checkpoint" in problems
    with pytest.raises(ResumeMismatch, match="refusing"):
        VerifyResumeCallback(str(checkpoint), reference).on_train_begin(None, None, None, model=fresh)

    restore_weights(fresh, reference)
    assert mismatched_weights(fresh, reference) == []
    expected = trained.state_dict()
    assert [k for k, v in fresh.state_dict().items() if not torch.equal(v, expected[k])] == []
    with torch.no_grad():  # any weight that drifts from the checkpoint is caught, not just the experts
        fresh.model.layers[0].self_attn.indexer.wk.weight[0, 0] += 1.0
    assert mismatched_weights(fresh, reference) == ["model.layers.0.self_attn.indexer.wk.weight: differs from the checkpoint"]
