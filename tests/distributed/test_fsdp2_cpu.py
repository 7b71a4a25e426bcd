"""accelerate FSDP2 on 2 CPU processes (gloo) with tiny patched models, against one process.

``fsdp2_tiny_train.py`` runs twice on the same data and initial weights: under ``accelerate launch
--config_file scripts/accelerate/fsdp2_cpu_gloo.yaml`` (2 processes, FSDP2) and as one plain process
(no sharding). Each run trains, in turn: (1) a Llama with an added indexer, all parameters, decoder
layers wrapped by ``hyscale_hf.wrap_layers_for_replay``; (2) LoRA adapters plus the indexers (PEFT
``modules_to_save``) under Transformers' gradient checkpointing, which ``patch_model`` rewires for
replay; (3) a tiny GLM-5 (glm_moe_dsa: its own indexer, IndexShare, MoE) wrapped for replay. The
per-step LM and indexer losses must agree (fp32), the indexer must never rerun in a checkpoint
recompute, and the checkpoints written under FSDP2 must load back into one process and patch again
with the trained indexers (same logits as the distributed model).

accelerate 1.15 enables FSDP only on GPUs; ``cpu_fsdp_shim/sitecustomize.py`` lets it run its FSDP2
path on CPU processes (see its docstring). ~35-60 s on a 2-core machine, depending on its load.
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
from hyscale_hf.state import patch_state
from tests.distributed.fsdp2_tiny_train import LENGTH, PATCH, PHASES, eval_tokens, tiny_llama

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "fsdp2_tiny_train.py"
CPU_CONFIG = ROOT / "scripts" / "accelerate" / "fsdp2_cpu_gloo.yaml"
GPU_CONFIG = ROOT / "scripts" / "accelerate" / "fsdp2_2gpu.yaml"
STEPS = 6
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


def _phases() -> list[str]:
    glm5 = "glm_moe_dsa" in hyscale_hf.supported_model_types()  # absent from older Transformers
    return ["full", "lora"] + (["glm5"] if glm5 else [])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(one-process output dir, FSDP2 output dir); each holds one folder per phase."""
    base = tmp_path_factory.mktemp("fsdp2")
    single, fsdp = base / "single", base / "fsdp2"
    args = ["--steps", str(STEPS), "--phases", ",".join(_phases()), "--save"]
    _run([sys.executable, str(SCRIPT), "--out", str(single), *args], _env(False), TIMEOUT_S)
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_CONFIG)]
    _run([*launch, str(SCRIPT), "--out", str(fsdp), *args], _env(True), TIMEOUT_S)
    return single, fsdp


def _result(path: Path) -> dict:
    return json.loads((path / "result.json").read_text())


# phase -> (decoder layer class, full indexer layers, IndexShare shared layers, minimum LM-loss drop)
EXPECT = {
    "full": ("LlamaDecoderLayer", 2, 0, 0.3),
    "lora": ("LlamaDecoderLayer", 2, 0, 0.01),  # LoRA starts at the base model (lora_B = 0) and moves slowly
    "glm5": ("GlmMoeDsaDecoderLayer", 2, 1, 0.3),
}


def _phase(phase: str) -> str:
    if phase not in _phases():
        pytest.skip(f"phase {phase} needs a model family the installed Transformers lacks")
    return phase


@pytest.mark.slow
@pytest.mark.parametrize("phase", EXPECT)
def test_fsdp2_losses_match_one_process(runs, phase):
    one, two = (_result(p / _phase(phase)) for p in runs)
    layer_class, full, shared, drop = EXPECT[phase]
    assert one["world"] == 1 and one["distributed_type"] == "DistributedType.NO"
    assert two["world"] == 2 and two["distributed_type"] == "DistributedType.FSDP"
    assert two["sharded_layers"] == [layer_class] * (full + shared), "each decoder layer: its own FSDP2 unit"
    for key in ("lm_losses", "indexer_losses"):
        assert len(one[key]) == len(two[key]) == STEPS
        torch.testing.assert_close(torch.tensor(two[key]), torch.tensor(one[key]), rtol=1e-5, atol=1e-5,
                                   msg=lambda m, key=key: f"{key} differ between FSDP2 and one process: {m}")
    # The runs really train (the model memorises its two alternating batches; the indexer fits attention).
    assert one["lm_losses"][-1] < one["lm_losses"][0] - drop
    assert one["indexer_losses"][-1] < 0.75 * one["indexer_losses"][0]
    if phase == "lora":
        trainable = two["trainable"]
        assert any(".indexer.modules_to_save." in n for n in trainable) and any(".lora_A." in n for n in trainable)
        assert not any(".indexer.original_module." in n or n.endswith("q_proj.base_layer.weight") for n in trainable)


@pytest.mark.slow
@pytest.mark.parametrize("phase", EXPECT)
def test_fsdp2_replays_selection(runs, phase):
    _, full, shared, _ = EXPECT[_phase(phase)]
    tile = PHASES[phase][1].get("tile_tokens")
    tiles = 1 if tile is None else -(-LENGTH // tile)  # a tiled layer selects tile by tile
    for path in runs:
        result = _result(path / phase)
        stats = result["selection_stats"]  # summed over processes
        world = result["world"]
        assert stats["indexer_forward"] == world * STEPS * full * tiles
        assert stats["shared_forward"] == world * STEPS * shared * tiles
        assert stats["indexer_recompute"] == 0, "the indexer reran in a checkpoint recompute"
        assert stats["shared_recompute"] == 0
        assert stats["replayed_selections"] == stats["indexer_forward"] + stats["shared_forward"]


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=eval_tokens()).logits


def _reload(checkpoint: Path, dense: bool = True):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    hyscale_hf.patch_model(model, backend="torch")  # dense: indexer settings and weights from the checkpoint
    config = patch_state(model).config
    if dense:
        assert (config.topk, config.index_n_heads, config.index_head_dim) == (
            PATCH["topk"], PATCH["index_n_heads"], PATCH["index_head_dim"])
    return _logits(model)


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["full", "glm5"])
def test_fsdp2_full_checkpoint_loads_into_one_process(runs, phase):
    fsdp = runs[1] / _phase(phase)
    expected = torch.load(fsdp / "logits.pt")
    torch.testing.assert_close(_reload(fsdp / "final", dense=phase == "full"), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_fsdp2_sharded_checkpoint_merges_and_loads(runs, tmp_path):
    from accelerate.utils import merge_fsdp_weights

    fsdp = runs[1] / "full"
    shards = fsdp / "state" / "pytorch_model_fsdp_0"
    assert sorted(p.name for p in shards.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    merge_fsdp_weights(str(shards), str(tmp_path))
    shutil.copy(fsdp / "state" / "config.json", tmp_path / "config.json")
    expected = torch.load(fsdp / "logits.pt")
    torch.testing.assert_close(_reload(tmp_path), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_fsdp2_lora_adapter_loads_into_one_process(runs):
    """The adapter saved under FSDP2 (LoRA + the trained indexers) on a freshly patched base model."""
    from peft import PeftModel

    fsdp = runs[1]
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
