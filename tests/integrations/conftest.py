"""A real Slurm cluster for the scheduler tests, started once per session by
`scripts/slurm_local.sh` (munged, slurmctld and two slurmd from Debian's slurm-wlm and munge,
installed with apt when missing and this runs as root). Where it cannot be installed or started,
the Slurm tests skip with the reason, and the session's summary says how many ran."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_state = {"reason": None, "ran": 0, "skipped": 0, "failed": 0}


@pytest.fixture(scope="session")
def slurm():
    """SLURM_CONF of the local cluster (the environment of the test process gets it too)."""
    if _state["reason"] is not None:
        pytest.skip(_state["reason"])
    script = ROOT / "scripts" / "slurm_local.sh"
    try:
        out = subprocess.run(["bash", str(script), "start"], capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        _state["reason"] = "slurm unavailable: scripts/slurm_local.sh start timed out"
        pytest.skip(_state["reason"])
    if out.returncode != 0:
        lines = (out.stdout + out.stderr).strip().splitlines()
        _state["reason"] = lines[-1] if lines else f"scripts/slurm_local.sh exited {out.returncode}"
        pytest.skip(_state["reason"])
    conf = os.path.join(os.environ.get("DTORCH_SLURM_DIR", "/tmp/dtorch-slurm"), "slurm.conf")
    os.environ["SLURM_CONF"] = conf
    return conf


def pytest_runtest_logreport(report):
    if "tests/integrations/test_slurm" not in report.nodeid.replace(os.sep, "/"):
        return
    if report.when == "call":
        _state["ran" if report.passed else "failed"] += 1
    elif report.when == "setup" and report.skipped:
        _state["skipped"] += 1
    elif report.when == "setup" and report.failed:
        _state["failed"] += 1


def pytest_terminal_summary(terminalreporter):
    s = _state
    if s["ran"] + s["skipped"] + s["failed"] == 0:
        return
    line = f"slurm tests: {s['ran']} ran, {s['failed']} failed, {s['skipped']} skipped"
    if s["reason"]:
        line += f" ({s['reason']})"
    terminalreporter.write_line(line)
