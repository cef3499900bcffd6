#!/usr/bin/env bash
# The test command: set up (idempotent), then run the whole suite. Exit code 5 (no tests) is a failure
# of the suite's wiring, not a pass, so it is reported and turned into 1.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
.venv/bin/python -m pytest -q --durations=15 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: the suite is miswired" >&2
  exit 1
fi
exit "$rc"
