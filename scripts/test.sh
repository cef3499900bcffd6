#!/usr/bin/env bash
# The test command: set up (idempotent), then run the tests.
#
#   bash scripts/test.sh            the whole suite, the long drills included (CI runs exactly this)
#   bash scripts/test.sh --quick    the change-test cycle: -m "not slow", the single-process tests
#                                   (no process groups, no launched jobs, no drills); ~3 min on 2 cores
#   bash scripts/test.sh --drills   only the long failure drills (-m drill: elastic resize and chaos,
#                                   straggler, OOM re-plan, Slurm preemption), which the whole suite runs too
#
# Other arguments go to pytest (a file, -k EXPR, -x, ...). Exit code 5 (no tests) is a failure of the
# suite's wiring, not a pass, so it is reported and turned into 1.
set -uo pipefail
cd "$(dirname "$0")/.."
select=()
case "${1:-}" in
  --quick) select=(-m "not slow"); shift ;;
  --drills) select=(-m drill); shift ;;
esac
bash scripts/setup.sh || exit 1
.venv/bin/python -m pytest -q --durations=15 "${select[@]}" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: the suite is miswired" >&2
  exit 1
fi
exit "$rc"
