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
#
# The whole suite (no arguments) runs as two pytest sessions side by side: the multi-process tests
# (-m "slow and not beside") and the single-process ones (-m "not slow or beside": `beside` marks a
# slow test whose outcome does not depend on timing, such as the doc-command runner, whose drills and
# probes are short 2-rank jobs of their own). The multi-process tests leave a core idle
# much of the time (an agent importing torch, a job's single-threaded start, waits for a rendezvous,
# a kill or a timeout); the single-process tests fill it, at a lower priority (nice 10) so that the
# drills' timings (hang detection, stragglers) see the machine as before. Each test still runs
# exactly once: the two selections together are the whole suite. The single-process session's
# output follows the other's; the exit code is a failure if either failed. DTORCH_TEST_SERIAL=1
# runs the whole suite as one session instead.
set -uo pipefail
cd "$(dirname "$0")/.."
select=()
whole=0
case "${1:-}" in
  --quick) select=(-m "not slow"); shift ;;
  --drills) select=(-m drill); shift ;;
  "") [ "${DTORCH_TEST_SERIAL:-0}" = 1 ] || whole=1 ;;
esac
bash scripts/setup.sh || exit 1

# pytest's exit code, with 5 (nothing collected) turned into 1
checked() {
  if [ "$1" -eq 5 ]; then
    echo "pytest collected no tests ($2): the suite is miswired" >&2
    return 1
  fi
  return "$1"
}

if [ "$whole" = 0 ]; then
  .venv/bin/python -m pytest -q --durations=15 "${select[@]}" "$@"
  checked $? "pytest $*"
  exit $?
fi

start=$(date +%s)
log=$(mktemp "${TMPDIR:-/tmp}/dtorch-tests-single.XXXXXX")
nice -n 10 .venv/bin/python -m pytest -q --durations=15 -m "not slow or beside" >"$log" 2>&1 &
single=$!
trap 'kill "$single" 2>/dev/null; exit 130' INT TERM
.venv/bin/python -m pytest -q --durations=15 -m "slow and not beside"
multi=$?
wait "$single"
single_rc=$?
trap - INT TERM
echo
echo "=== the single-process tests (-m \"not slow or beside\"), run beside the multi-process ones ==="
cat "$log"
rm -f "$log"
checked "$multi" "-m \"slow and not beside\""
multi=$?
checked "$single_rc" "-m \"not slow or beside\""
single_rc=$?
echo "whole suite: $(( $(date +%s) - start )) s (multi-process tests: exit $multi; single-process tests: exit $single_rc)"
[ "$multi" -eq 0 ] && [ "$single_rc" -eq 0 ]
