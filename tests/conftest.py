"""Suite-wide settings: tests never read or write the user's planner calibration, and torch runs
one thread per process."""

import os
import tempfile

# Set at import so that subprocesses started by any test inherit them too.
os.environ.setdefault("DTORCH_CALIBRATION_DIR", tempfile.mkdtemp(prefix="dtorch-test-calibration-"))
# The suite runs three sessions side by side on a 2-core machine (scripts/test.sh): with torch's
# default of one thread per core, each process's threads spin-wait for each other on the busy cores
# (5 steps of llama-tiny: 1.4-4 s instead of 0.14 s; `pytest -m "not slow" tests/model` on a loaded
# machine: 59-111 s and 20-31 CPU-s, against 47-50 s and 12 CPU-s with one thread). A test that
# measures with more threads sets them itself (test_mfu).
os.environ.setdefault("OMP_NUM_THREADS", "1")
