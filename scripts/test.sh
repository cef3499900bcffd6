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
# The whole suite (no arguments) runs as three pytest sessions side by side, which together select
# every test exactly once:
#   timed   the multi-process tests of the rooms whose tests time things (elastic/, monitor/,
#           integrations/, probe/ and the trainer's straggler test: hang, straggler and keep-alive
#           detection, time bounds) and the docs' long commands (a probe, a two-node launch) at
#           normal priority;
#   multi   the other multi-process tests (tests/parallel, plan, train, checkpoint, model: losses,
#           bytes and files, whatever the timing) at nice 10;
#   single  the single-process tests and the `beside` ones (-m "not slow or beside": a slow test
#           whose outcome does not depend on timing, such as the doc-command runner) at nice 10.
# A multi-process test leaves a core idle much of the time (an agent importing torch, a job's
# single-threaded start, waits for a rendezvous, a kill or a timeout); the sessions beside it fill
# it, at a lower priority (nice 10 reaches the test processes and what they start in their own
# session; a job a test starts in a new session is its own scheduling group where the kernel groups
# by session, /proc/sys/kernel/sched_autogroup_enabled: the timed tests' bounds allow for it). The output of the
# other two follows the first's; the exit code is a failure if any failed. DTORCH_TEST_SERIAL=1
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
# the rooms (and files) of the timed session; the multi session is the rest of -m "slow and not beside"
# (and the docs' long commands: a 4-rank probe, a launch as two nodes, the benchmark runner)
timed=(tests/elastic tests/monitor tests/integrations tests/probe tests/train/test_straggler.py
       tests/test_doc_commands.py::test_the_long_commands_run_as_written)
not_timed=()
for p in "${timed[@]}"; do
  case "$p" in *::*) not_timed+=(--deselect "$p") ;; *) not_timed+=(--ignore "$p") ;; esac
done
logs=$(mktemp -d "${TMPDIR:-/tmp}/dtorch-tests.XXXXXX")
nice -n 10 .venv/bin/python -m pytest -q --durations=15 -m "slow and not beside" "${not_timed[@]}" \
  >"$logs/multi" 2>&1 &
multi=$!
nice -n 10 .venv/bin/python -m pytest -q --durations=15 -m "not slow or beside" >"$logs/single" 2>&1 &
single=$!
trap 'kill "$multi" "$single" 2>/dev/null; exit 130' INT TERM
.venv/bin/python -m pytest -q --durations=15 -m "slow and not beside" "${timed[@]}"
timed_rc=$?
wait "$multi"
multi_rc=$?
wait "$single"
single_rc=$?
trap - INT TERM
echo
echo "=== the other multi-process tests (-m \"slow and not beside\", not in ${timed[*]}), run beside ==="
cat "$logs/multi"
echo
echo "=== the single-process tests (-m \"not slow or beside\"), run beside ==="
cat "$logs/single"
rm -rf "$logs"
checked "$timed_rc" "-m \"slow and not beside\" ${timed[*]}"
timed_rc=$?
checked "$multi_rc" "-m \"slow and not beside\" (the rest)"
multi_rc=$?
checked "$single_rc" "-m \"not slow or beside\""
single_rc=$?
echo "whole suite: $(( $(date +%s) - start )) s (timed multi-process tests: exit $timed_rc;" \
     "other multi-process tests: exit $multi_rc; single-process tests: exit $single_rc)"
[ "$timed_rc" -eq 0 ] && [ "$multi_rc" -eq 0 ] && [ "$single_rc" -eq 0 ]
