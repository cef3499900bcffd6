#!/usr/bin/env bash
# Create .venv (if missing) and install DTorch with its dev extras, torch pinned by constraints.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.dtorch-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  .venv/bin/python -m pip install -q -c constraints.txt -e '.[dev]'
  touch "$stamp"
fi
