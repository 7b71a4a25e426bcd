"""scripts/bench_cp.py on 2 CPU processes (gloo) at toy dims: both phases run on every rank and rank 0
writes the figures (the GPU runs use the same code under torchrun)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_cp_tiny_on_two_processes(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "scripts" / "bench_cp.py"), "--tiny", "--reps", "1", "--warmup", "0", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "bench_cp.json").read_text())
    assert result["world"] == 2 and result["tokens"] == 2 * result["tokens_per_rank"]
    for base, cp in result["ranks"]:
        assert base["phase"] == "baseline" and cp["phase"] == "context_parallel"
        assert base["step_ms"] > 0 and cp["step_ms"] > 0 and 0 < cp["collective_share"] < 1
        assert cp["per_gpu_throughput_vs_baseline"] > 0
    assert (tmp_path / "bench_cp.png").stat().st_size > 0
    assert "per-GPU throughput" in proc.stdout
