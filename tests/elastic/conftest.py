"""Shared helpers for the elastic tests: launching `dtorch run` on the toy worker, and the check
that no process of a test survives it (scan /proc for the test's marker in command lines)."""

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
TOY = os.path.join(HERE, "toy_worker.py")
CLI = [sys.executable, "-m", "dtorch.cli", "run"]


def pids_with(marker: str) -> list[int]:
    """Live pids (other than ours) whose command line or initial environment contains `marker`.
    Workers forked from the agent's forkserver carry the forkserver's command line, but its
    environment, which has DTORCH_TEST_MARKER (see `dtorch_run`)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue  # already dead, waiting to be reaped
            found = False
            for name in ("cmdline", "environ"):
                with open(f"/proc/{d}/{name}", "rb") as f:
                    found = found or marker.encode() in f.read()
            if found:
                out.append(int(d))
        except (OSError, IndexError):
            continue
    return out


@pytest.fixture
def marker():
    """A unique string put on every command line of the test; after the test no process may carry it."""
    m = f"dtorchtest-{uuid.uuid4().hex[:10]}"
    yield m
    deadline = time.time() + 10
    left = pids_with(m)
    while left and time.time() < deadline:
        time.sleep(0.2)
        left = pids_with(m)
    for p in left:  # clean up before failing, so one failure does not poison the next tests
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"processes left running after the test: {left}"


def dtorch_run(out: str, marker: str, *flags: str, steps: int = 12, nproc: int = 4, step_sleep: float = 0.0,
               pace_file: str = "", timeout: float = 150, wait: bool = True):
    """Run (or start, with wait=False) `dtorch run` on the toy worker writing into `out`; with
    `pace_file`, `step_sleep` paces the steps only while that file exists (see toy_worker.py)."""
    os.makedirs(out, exist_ok=True)
    pace = ["--pace-file", pace_file] if pace_file else []
    cmd = [*CLI, "--nproc-per-node", str(nproc), "--run-dir", os.path.join(out, "run"), *flags,
           TOY, "--out", out, "--steps", str(steps), "--step-sleep", str(step_sleep), *pace, "--marker", marker]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "DTORCH_TEST_MARKER": marker}
    if not wait:
        # output to a file, not a pipe: nobody reads a pipe while the test waits, and a full pipe
        # would block the agent
        log_path = os.path.join(out, f"agent-{time.time_ns()}.log")
        with open(log_path, "w") as log:
            p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        p.log_path = log_path
        return p
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(name="dtorch_run")
def _dtorch_run_fixture():
    """`dtorch_run(out, marker, *flags, ...)`: see `dtorch_run` in this file."""
    return dtorch_run


@pytest.fixture(name="pids_with")
def _pids_with_fixture():
    return pids_with


@pytest.fixture(scope="session")
def baseline(tmp_path_factory):
    """Final weights of an uninterrupted 4-worker run of the toy (12 steps), shared by the tests."""
    import torch

    out = str(tmp_path_factory.mktemp("baseline"))
    m = f"dtorchtest-{uuid.uuid4().hex[:10]}"
    r = dtorch_run(out, m)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not pids_with(m)
    return torch.load(os.path.join(out, "final.pt"), weights_only=True)
