"""scripts/run_transformers_model_tests.py: its plugin patches each model right after construction
(inside from_pretrained too, before loading), and the sdist mode builds a runnable harness tree."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import run_transformers_model_tests as runner  # noqa: E402

_CHECK = textwrap.dedent("""
    import torch
    import _transformers_tests_plugin as plugin
    plugin._install()
    import hyscale_hf
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    assert hyscale_hf.is_patched(model) and not hyscale_hf.is_patched(model.model)  # once, at the top
    assert sum(".indexer." in n for n in model.state_dict()) == 2 * 7
    sd = {k: v + 1 for k, v in model.state_dict().items()}
    loaded = LlamaForCausalLM.from_pretrained(None, config=config, state_dict=sd)
    assert hyscale_hf.is_patched(loaded)
    assert all(torch.equal(v, sd[k]) for k, v in loaded.state_dict().items())  # indexers loaded too
    print("OK")
""")


def test_the_plugin_patches_after_construction_and_inside_from_pretrained():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "scripts")]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_sdist_mode_builds_a_harness_tree(tmp_path):
    sdist = tmp_path / "sdist" / "tests"
    sdist.mkdir(parents=True)
    (sdist / "test_modeling_common.py").write_text("class ModelTesterMixin:\n    pass\n\ndef ids_tensor(*a):\n    pass\n")
    stand_ins = runner._harness_tree(sdist, ["llama", "glm_moe_dsa"], tmp_path / "work")
    tree = tmp_path / "work" / "tests"
    assert set(stand_ins) == {"generation/test_utils.py", "exporters/test_export.py", "test_training_mixin.py"}
    assert "TrainingTesterMixin" in (tree / "test_training_mixin.py").read_text()
    text = (tree / "models" / "glm_moe_dsa" / "test_modeling_glm_moe_dsa.py").read_text()
    assert "GlmMoeDsaForCausalLM" in text and "test_all_params_have_gradient = False" in text
    compile((tree / "models" / "llama" / "test_modeling_llama.py").read_text(), "llama", "exec")


def test_a_folder_without_the_harness_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        runner.main([str(tmp_path)])
