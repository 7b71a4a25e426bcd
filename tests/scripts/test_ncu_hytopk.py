"""scripts/ncu_hytopk.py: it exists for Nsight Compute on a GPU, so without CUDA it says so and stops
before building any input (a CPU run would otherwise time nothing and look like a profile)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_refuses_without_cuda_naming_the_reason():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "ncu_hytopk.py"), "--seqlen", "64"], cwd=ROOT,
                          env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert "no CUDA device" in proc.stderr, proc.stderr[-2000:]
