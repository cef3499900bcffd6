#!/usr/bin/env bash
# One-GPU checks of the planner against the machine (under 8 minutes on one H100/H200):
# step time, MFU and peak memory of the planner's 1-GPU plans for a ~1B and a ~8B Llama beside the
# prediction, and the CUDA path of every one-GPU option. Results: benchmarks/results/gpu_check.{json,md}.
# Needs a CUDA build of torch (pip install torch, not the CPU wheel that constraints.txt pins).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
exec timeout 480 "$PY" -m benchmarks.gpu_check
