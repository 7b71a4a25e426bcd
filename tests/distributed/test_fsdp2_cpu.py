"""accelerate FSDP2 on 2 CPU processes (gloo) with a tiny patched Llama, against one process.

``fsdp2_tiny_train.py`` runs twice on the same data and initial weights: under ``accelerate launch
--config_file scripts/accelerate/fsdp2_cpu_gloo.yaml`` (2 processes, FSDP2) and as one plain process
(no sharding). Each run trains (1) all parameters with the decoder layers wrapped by
``hyscale_hf.wrap_layers_for_replay`` and (2) LoRA adapters plus the indexers (PEFT
``modules_to_save``) under Transformers' gradient checkpointing, which ``patch_model`` rewires for
replay. The per-step LM and indexer losses must agree (fp32), the indexer must never rerun in a
checkpoint recompute, and the checkpoints written under FSDP2 must load back into one process and
patch again with the trained indexers (same logits as the distributed model).

accelerate 1.15 enables FSDP only on GPUs; ``cpu_fsdp_shim/sitecustomize.py`` lets it run its FSDP2
path on CPU processes (see its docstring). The whole module takes ~45 s on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hyscale_hf
from tests.distributed.fsdp2_tiny_train import PATCH, eval_tokens, tiny_llama

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "fsdp2_tiny_train.py"
CPU_CONFIG = ROOT / "scripts" / "accelerate" / "fsdp2_cpu_gloo.yaml"
GPU_CONFIG = ROOT / "scripts" / "accelerate" / "fsdp2_2gpu.yaml"
STEPS, LAYERS = 6, 2
TIMEOUT_S = 240


def _run(cmd: list[str], env: dict[str, str], timeout: float) -> str:
    """Run ``cmd`` in its own process group; kill the whole group (launcher and workers) on timeout."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout} s: {' '.join(cmd)}\n{out[-4000:]}")
    if proc.returncode != 0:
        pytest.fail(f"exit code {proc.returncode}: {' '.join(cmd)}\n{out[-6000:]}")
    return out


def _env(distributed: bool) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", TRITON_INTERPRET="1")
    paths = [str(ROOT)] + ([str(HERE / "cpu_fsdp_shim")] if distributed else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p])
    if distributed:
        env["HYSCALE_CPU_FSDP"] = "1"
    return env


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(one-process output dir, FSDP2 output dir), both trained with replay and saved."""
    base = tmp_path_factory.mktemp("fsdp2")
    single, fsdp = base / "single", base / "fsdp2"
    args = ["--steps", str(STEPS), "--checkpointing", "wrap", "--lora", "--lora_checkpointing", "transformers",
            "--save"]
    _run([sys.executable, str(SCRIPT), "--out", str(single), *args], _env(False), TIMEOUT_S)
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_CONFIG)]
    _run([*launch, str(SCRIPT), "--out", str(fsdp), *args], _env(True), TIMEOUT_S)
    return single, fsdp


def _result(path: Path) -> dict:
    return json.loads((path / "result.json").read_text())


PHASES = {"full": "", "lora": "lora"}


@pytest.mark.parametrize("phase", PHASES)
def test_fsdp2_losses_match_one_process(runs, phase):
    one, two = (_result(p / PHASES[phase]) for p in runs)
    assert one["world"] == 1 and one["distributed_type"] == "DistributedType.NO"
    assert two["world"] == 2 and two["distributed_type"] == "DistributedType.FSDP"
    assert two["sharded_layers"] == ["FSDPLlamaDecoderLayer"] * LAYERS, "each decoder layer is its own FSDP2 unit"
    for key in ("lm_losses", "indexer_losses"):
        assert len(one[key]) == len(two[key]) == STEPS
        torch.testing.assert_close(torch.tensor(two[key]), torch.tensor(one[key]), rtol=1e-5, atol=1e-5,
                                   msg=lambda m, key=key: f"{key} differ between FSDP2 and one process: {m}")
    # The runs really train (the model memorises its two alternating batches; the indexer fits attention).
    assert one["lm_losses"][-1] < one["lm_losses"][0] - (0.3 if phase == "full" else 0.01)
    assert one["indexer_losses"][-1] < 0.5 * one["indexer_losses"][0]
    if phase == "lora":
        trainable = two["trainable"]
        assert any(".indexer.modules_to_save." in n for n in trainable) and any(".lora_A." in n for n in trainable)
        assert not any(".indexer.original_module." in n or n.endswith("q_proj.base_layer.weight") for n in trainable)


@pytest.mark.parametrize("phase", PHASES)
def test_fsdp2_replays_selection(runs, phase):
    for path in runs:
        result = _result(path / PHASES[phase])
        stats = result["selection_stats"]  # summed over processes
        runs_per_process = STEPS * LAYERS
        assert stats["indexer_forward"] == result["world"] * runs_per_process
        assert stats["indexer_recompute"] == 0, "the indexer reran in a checkpoint recompute"
        assert stats["replayed_selections"] == stats["indexer_forward"]


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=eval_tokens()).logits


def _reload(checkpoint: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    hyscale_hf.patch_model(model, backend="torch")  # indexer settings and weights from the checkpoint
    config = hyscale_hf.patching.patch_state(model).config
    assert (config.topk, config.index_n_heads, config.index_head_dim) == (
        PATCH["topk"], PATCH["index_n_heads"], PATCH["index_head_dim"])
    return _logits(model)


def test_fsdp2_full_checkpoint_loads_into_one_process(runs):
    _, fsdp = runs
    expected = torch.load(fsdp / "logits.pt")
    torch.testing.assert_close(_reload(fsdp / "final"), expected, rtol=1e-5, atol=1e-5)


def test_fsdp2_sharded_checkpoint_merges_and_loads(runs, tmp_path):
    from accelerate.utils import merge_fsdp_weights

    _, fsdp = runs
    shards = fsdp / "state" / "pytorch_model_fsdp_0"
    assert sorted(p.name for p in shards.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    merge_fsdp_weights(str(shards), str(tmp_path))
    shutil.copy(fsdp / "state" / "config.json", tmp_path / "config.json")
    expected = torch.load(fsdp / "logits.pt")
    torch.testing.assert_close(_reload(tmp_path), expected, rtol=1e-5, atol=1e-5)


def test_fsdp2_lora_adapter_loads_into_one_process(runs):
    """The adapter saved under FSDP2 (LoRA + the trained indexers) on a freshly patched base model."""
    from peft import PeftModel

    _, fsdp = runs
    base = hyscale_hf.patch_model(tiny_llama(), **PATCH)  # the indexers must exist to take their weights
    untrained = _logits(base)
    model = PeftModel.from_pretrained(base, fsdp / "lora" / "final")
    expected = torch.load(fsdp / "lora" / "logits.pt")
    assert not torch.allclose(untrained, expected, atol=1e-3), "training changed nothing?"
    torch.testing.assert_close(_logits(model), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", [CPU_CONFIG, GPU_CONFIG], ids=lambda p: p.name)
def test_accelerate_configs(path):
    """Both configs parse with accelerate's loader and keep the settings replay under FSDP2 needs."""
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(path))
    fsdp = config.fsdp_config
    assert config.distributed_type == "FSDP" and config.num_processes == 2
    assert fsdp["fsdp_version"] == 2
    assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert fsdp["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
    assert fsdp["fsdp_activation_checkpointing"] is False
    assert fsdp["fsdp_cpu_ram_efficient_loading"] is False
    assert config.mixed_precision == ("no" if path == CPU_CONFIG else "bf16")
