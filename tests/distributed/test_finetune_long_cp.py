"""scripts/finetune_long.py --tiny --cp_size 2 under accelerate on 2 CPU processes (gloo), against one process.

Each sequence of the context-parallel run is split over the two processes (hyscale_hf.enable_context_parallel),
under plain DDP and under FSDP2; the runs read the same blocks in the same order, so the logged per-step
LM and indexer losses (dense pre-training, dense warm-up, sparse) must agree (fp32, 2e-3 relative;
summation order aside they are the same computation). ~40 s on a 2-core machine.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.distributed.test_fsdp2_cpu import CPU_CONFIG as FSDP_CONFIG
from tests.distributed.test_fsdp2_cpu import ROOT, TIMEOUT_S, _env, _run

SCRIPT = ROOT / "scripts" / "finetune_long.py"
CP_CONFIG = ROOT / "scripts" / "accelerate" / "cp2_cpu_gloo.yaml"


def _log(out) -> list[dict]:
    return [e for e in json.loads((out / "log_history.json").read_text()) if "loss" in e]


COMMON = ["--tiny", "--no_progress"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp") / "single"
    _run([sys.executable, str(SCRIPT), *COMMON, "--output_dir", str(out)], _env(False), TIMEOUT_S)
    return _log(out)


def _assert_same_steps(one: list[dict], two: list[dict]) -> None:
    assert [e["step"] for e in one] == [e["step"] for e in two] and len(one) >= 4
    assert [e["hyscale_stage"] for e in one] == [e["hyscale_stage"] for e in two] == sorted(e["hyscale_stage"] for e in one)
    assert {e["hyscale_stage"] for e in one} == {0, 1, 2}  # dense pre-training, warm-up and sparse steps all ran
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-3), a["step"]
        assert b["indexer_loss"] == pytest.approx(a["indexer_loss"], rel=2e-3), a["step"]


@pytest.mark.slow  # two accelerate launches and a one-process run: ~40 s on 2 cores together with the next
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_finetune_long_tiny_with_cp_size_2_matches_one_process(single, tmp_path):
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CP_CONFIG), "--num_processes", "2"]
    _run([*launch, str(SCRIPT), *COMMON, "--cp_size", "2", "--output_dir", str(tmp_path)], _env(False), TIMEOUT_S)
    _assert_same_steps(single, _log(tmp_path))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_finetune_long_tiny_under_fsdp2_with_cp_size_2_matches_one_process(single, tmp_path):
    """FSDP2 shards the model over both processes while context parallelism splits each sequence over them."""
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(FSDP_CONFIG)]
    _run([*launch, str(SCRIPT), *COMMON, "--cp_size", "2", "--output_dir", str(tmp_path)], _env(True), TIMEOUT_S)
    _assert_same_steps(single, _log(tmp_path))


def test_cp_size_must_divide_the_processes_and_the_length(tmp_path):
    from hyscale_hf.recipes.args import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--tiny", "--cp_size", "3", "--output_dir", str(tmp_path)])  # 256 tokens: not a multiple of 6
    with pytest.raises(SystemExit):
        parse_args(["--tiny", "--cp_size", "0", "--output_dir", str(tmp_path)])
    assert parse_args(["--tiny", "--cp_size", "2", "--output_dir", str(tmp_path)]).cp_size == 2
