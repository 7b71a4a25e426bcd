"""scripts/compile_sm90.py under this machine's Triton: the tiled indexer KL kernels compile for sm_90
without a GPU (a compiler failure there is what the tool exists to catch before a GPU call), and the
report names each kernel's registers."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_tiled_kl_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a real compile, not the interpreter
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_sm90.py"), "tiled_kl"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("ok", "FAIL"))]
    assert len(lines) == 12 and all(line.startswith("ok") for line in lines), proc.stdout
    for line in lines:
        assert re.search(r"\d+ registers, \d+ B spilled", line), line


def test_loops_lists_each_kernels_loop_sizes():
    """--loops prints, under each compiled kernel, its loops' instruction counts from the sm_90 SASS (the
    final selection has several loops inside its per-row loop, which is the largest)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_sm90.py"), "hytopk_finalize", "--loops"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    loops = [line for line in proc.stdout.splitlines() if "instructions per loop iteration" in line]
    assert len(loops) == 2, proc.stdout
    for line in loops:
        sizes = [int(n) for n in re.findall(r"\d+", line.split(":", 1)[1])]
        assert len(sizes) >= 3 and min(sizes) > 0 and max(sizes) == sizes[-1], line
