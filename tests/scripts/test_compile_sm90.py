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


def test_loops_in_sass_counts_bodies_and_forward_skips():
    """A loop's body runs from its back branch's target to the branch; a forward branch inside it skips
    the instructions between, and one leaving the loop is not counted."""
    from tests.support.scripts import load_script

    sass = "\n".join(f"        /*{a:04x}*/                   {text} ;" for a, text in [
        (0x00, "MOV R1, R2"), (0x10, "@P0 BRA 0x40"), (0x20, "IADD3 R1, R1, 1, RZ"), (0x30, "BRA 0x60"),
        (0x40, "IADD3 R1, R1, 2, RZ"), (0x50, "@P1 BRA 0x90"), (0x60, "ISETP.NE P2, R1, RZ"),
        (0x70, "@P2 BRA 0x00"), (0x80, "EXIT"), (0x90, "BRA 0x60"),
    ])  # fmt: skip
    assert load_script("compile_sm90").loops_in_sass(sass) == [(8, [2, 2]), (4, [])]
