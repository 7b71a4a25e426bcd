"""scripts/finetune_long.py --tiny --cp_size 2 under accelerate on 2 CPU processes (gloo), against one process.

Each sequence of the context-parallel run is split over the two processes (hyscale_hf.enable_context_parallel);
both runs read the same blocks in the same order, so the logged per-step LM and indexer losses (dense
pre-training, dense warm-up, sparse) must agree (fp32, 2e-3 relative; summation order aside they are the
same computation). ~20 s on a 2-core machine.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.distributed.test_fsdp2_cpu import ROOT, TIMEOUT_S, _env, _run

SCRIPT = ROOT / "scripts" / "finetune_long.py"
CP_CONFIG = ROOT / "scripts" / "accelerate" / "cp2_cpu_gloo.yaml"


def _log(out) -> list[dict]:
    return [e for e in json.loads((out / "log_history.json").read_text()) if "loss" in e]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_finetune_long_tiny_with_cp_size_2_matches_one_process(tmp_path):
    single, cp = tmp_path / "single", tmp_path / "cp2"
    common = ["--tiny", "--no_progress"]
    _run([sys.executable, str(SCRIPT), *common, "--output_dir", str(single)], _env(False), TIMEOUT_S)
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CP_CONFIG), "--num_processes", "2"]
    _run([*launch, str(SCRIPT), *common, "--cp_size", "2", "--output_dir", str(cp)], _env(False), TIMEOUT_S)

    one, two = _log(single), _log(cp)
    assert [e["step"] for e in one] == [e["step"] for e in two] and len(one) >= 4
    assert [e["hyscale_stage"] for e in one] == [e["hyscale_stage"] for e in two] == sorted(e["hyscale_stage"] for e in one)
    assert {e["hyscale_stage"] for e in one} == {0, 1, 2}  # dense pre-training, warm-up and sparse steps all ran
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-3), a["step"]
        assert b["indexer_loss"] == pytest.approx(a["indexer_loss"], rel=2e-3), a["step"]


def test_cp_size_must_divide_the_processes_and_the_length(tmp_path):
    from hyscale_hf.recipes.args import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--tiny", "--cp_size", "3", "--output_dir", str(tmp_path)])  # 256 tokens: not a multiple of 6
    with pytest.raises(SystemExit):
        parse_args(["--tiny", "--cp_size", "0", "--output_dir", str(tmp_path)])
    assert parse_args(["--tiny", "--cp_size", "2", "--output_dir", str(tmp_path)]).cp_size == 2
