"""scripts/bench_fsdp2.py runs end to end at a tiny size under FSDP2 on 2 CPU processes (gloo).

The GPU run (2 H200s against 1) uses the same code; here the point is that the script runs, shards,
replays the selection and writes what the comparison table reads. ~15 s on a 2-core machine.
"""

from __future__ import annotations

import json
import math
import sys

import pytest

import hyscale_hf
from tests.distributed.test_fsdp2_cpu import CPU_CONFIG, ROOT, TIMEOUT_S, _env, _run
from tests.support.scripts import load_script

SCRIPT = ROOT / "scripts" / "bench_fsdp2.py"


def test_bench_fsdp2_tiny_two_processes(tmp_path):
    if "glm_moe_dsa" not in hyscale_hf.supported_model_types():
        pytest.skip("glm_moe_dsa is not patchable with the installed Transformers")
    out = tmp_path / "two.json"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_CONFIG)]
    steps, layers = 3, 2
    _run([*launch, str(SCRIPT), "--tiny", "--steps", str(steps), "--warmup", "1", "--layers", str(layers),
          "--indexer_loss_coef", "1.0", "--out", str(out)], _env(True), TIMEOUT_S)
    result = json.loads(out.read_text())
    assert result["processes"] == 2 and result["distributed_type"] == "DistributedType.FSDP"
    assert [row["step"] for row in result["steps"]] == list(range(steps))
    assert all(math.isfinite(row["lm_loss"]) and row["indexer_loss"] > 0 for row in result["steps"])
    assert result["median_step_seconds"] > 0 and len(result["peak_gib_per_process"]) == 2
    stats = result["selection_stats"]  # summed over processes: one sequence per process and step
    assert stats["indexer_forward"] == 2 * steps * layers and stats["indexer_recompute"] == 0

    bench = load_script("bench_fsdp2")
    table = bench.compare([str(out), str(out)])
    assert "two.json" in table and "0.00e+00" in table
