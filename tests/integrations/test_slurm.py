"""Real Slurm jobs (local cluster from conftest's `slurm` fixture): a 2-task job trains and
checkpoints; SIGUSR1 makes it checkpoint and requeue; the requeued job resumes with per-step
losses bit-identical to an uninterrupted run; the job comment and status file show the states."""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

MODEL = "gpt:layers=2,hidden=32,heads=2,vocab=256,seq=32"
STEPS = 36  # USR1 after step 12; the requeued job finishes the rest


def _submit(ckpt: Path, extra=()) -> str:
    cmd = [sys.executable, "-m", "dtorch.cli", "submit", "slurm", "--model", MODEL, "--device-type", "cpu",
           "--nodes", "2", "--steps", str(STEPS), "--global-batch", "4", "--seq-len", "32",
           "--checkpoint-dir", str(ckpt), "--time", "10min", "--grace", "10", "--cpus-per-task", "1",
           "--mem", "1G", "--partition", "debug", "--train-arg=--checkpoint-every=10",
           "--train-arg=--sample-tokens=0", "--train-arg=--no-progress", "--train-arg=--warmup=2", "--now", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    m = re.search(r"submitted Slurm job (\d+); ([A-Z_]+)", out.stdout)  # the id and the state squeue gives
    assert m, out.stdout
    return m.group(1)


def _job(jid: str) -> dict:
    out = subprocess.run(["scontrol", "show", "job", jid], capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def _comment(jid: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", jid], capture_output=True, text=True).stdout
    m = re.search(r"Comment=(.*)$", out, re.M)
    return m.group(1).strip() if m else ""


def _wait(pred, timeout: float, what: str, poll: float = 0.5):
    t0 = time.time()
    while time.time() - t0 < timeout:
        v = pred()
        if v:
            return v
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _done(jid: str) -> bool:
    return _job(jid).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")


def _losses(ckpt: Path) -> dict[int, float]:
    """Per-step loss of rank 0; a step logged twice (before and after a requeue) keeps the last."""
    out = {}
    for line in (ckpt / "metrics.jsonl").read_text().splitlines():
        d = json.loads(line)
        if "step" in d and "loss" in d and "event" not in d:
            out[d["step"]] = d["loss"]
    return out


@pytest.mark.drill
def test_preempted_job_checkpoints_requeues_and_resumes_bit_identical(slurm, tmp_path, capsys):
    ref, pre = tmp_path / "uninterrupted", tmp_path / "preempted"
    # both at once: each takes one CPU of each of the two nodes
    jid_ref, jid = _submit(ref), _submit(pre)

    def past_step(n: int):
        # metrics.jsonl gets a line per step (the status file at most one a second)
        try:
            return len(_losses(pre)) >= n
        except (OSError, ValueError):  # not there yet, or a line half written
            return False

    _wait(lambda: past_step(12), 240, "the job to pass step 12", poll=0.05)
    subprocess.run(["scancel", "--signal=USR1", jid], check=True)
    # the job comment follows the run while it trains (updated at each change of state)
    assert re.match(rf"dtorch: (running|checkpointed|preempted), step \d+/{STEPS}", _comment(jid)), _comment(jid)
    planning = json.loads((pre / "status-history.jsonl").read_text().splitlines()[0])
    assert planning["state"] == "planning" and planning["allocation"].startswith(f"slurm job {jid}: 2 nodes (n1, n2)")
    # the ranks agree on a step, checkpoint it, exit 75; the batch script requeues the job
    _wait(lambda: _job(jid).get("Restarts", "0") != "0", 120, "the job to be requeued")
    first = [h for h in map(json.loads, (pre / "status-history.jsonl").read_text().splitlines())]
    preempted = [h for h in first if h["state"] == "preempted"]
    assert preempted and preempted[0]["signal"] == "SIGUSR1", first
    stop = preempted[0]["checkpoint_step"]
    assert 12 <= stop < STEPS
    assert (pre / f"step-{stop:08d}").is_dir()
    # Slurm holds a requeued job for cred_expire seconds; release it early to keep the test short, but
    # not within the second its old credential was revoked: slurmd compares credential times in whole
    # seconds, and a launch in that second is killed as "Job credential revoked" (seen once in CI)
    time.sleep(1.5)
    subprocess.run(["scontrol", "update", f"JobId={jid}", "StartTime=now"], capture_output=True)
    _wait(lambda: _done(jid_ref), 240, f"job {jid_ref} to finish")
    assert _job(jid_ref)["JobState"] == "COMPLETED", _job(jid_ref)
    assert _comment(jid_ref).startswith(f"dtorch: finished, step {STEPS}/{STEPS}")
    ref_losses = _losses(ref)
    assert sorted(ref_losses) == list(range(1, STEPS + 1))
    _wait(lambda: _done(jid), 240, f"requeued job {jid} to finish")
    info = _job(jid)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", info
    assert _comment(jid).startswith(f"dtorch: finished, step {STEPS}/{STEPS}")
    hist = [json.loads(x) for x in (pre / "status-history.jsonl").read_text().splitlines()]
    states = [h["state"] for h in hist]
    assert states.index("preempted") < states.index("recovering") < states.index("finished")
    assert [h for h in hist if h["state"] == "recovering"][0]["from_step"] == stop
    log = "\n".join(p.read_text() for p in pre.glob("slurm-*.out"))
    assert "requeueing job" in log
    got = _losses(pre)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got == ref_losses  # bit-identical floats, steps before and after the requeue
    # dtorch status prints what the job reported last (the CLI's main in this process: no new interpreter)
    from dtorch.cli import main

    capsys.readouterr()
    code, out = main(["status", str(pre)]), capsys.readouterr().out
    assert code == 0 and f"finished, step {STEPS}/{STEPS}" in out
    assert "preempted" in out or "recovering" in out


def test_unknown_partition_is_one_line_exit_2(slurm, tmp_path):
    cmd = [sys.executable, "-m", "dtorch.cli", "submit", "slurm", "--model", MODEL, "--device-type", "cpu",
           "--nodes", "2", "--steps", "5", "--global-batch", "4", "--seq-len", "32", "--partition", "nosuch",
           "--checkpoint-dir", str(tmp_path / "x")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "partition='nosuch'" in lines[0] and "debug" in lines[0], out.stderr


@pytest.mark.parametrize("extra,limit", [
    (["--nodes", "2", "--cpus-per-task", "8"], "cpus-per-task=8: 1 task(s) per node x 8 CPUs = 8, but partition "
                                               "debug's nodes have 2"),
    (["--nodes", "3"], "nodes=3: partition debug has 2 node(s)"),
    (["--nodes", "2", "--mem", "16G"], "mem='16384M': partition debug's nodes have 2000 MB"),
])
def test_a_request_no_node_can_hold_is_refused_before_sbatch(slurm, tmp_path, extra, limit):
    cmd = [sys.executable, "-m", "dtorch.cli", "submit", "slurm", "--model", MODEL, "--device-type", "cpu",
           "--steps", "5", "--global-batch", "4", "--seq-len", "32", "--checkpoint-dir", str(tmp_path / "x"),
           "--now", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and limit in lines[0], out.stderr
    assert "submitted" not in out.stdout and not (tmp_path / "x").exists()


def test_preset_defaults_are_fitted_to_the_partition(slurm, tmp_path):
    out = subprocess.run([sys.executable, "-m", "dtorch.cli", "submit", "slurm", "--model", MODEL, "--device-type",
                          "cpu", "--nodes", "2", "--steps", "5", "--global-batch", "4", "--seq-len", "32",
                          "--checkpoint-dir", str(tmp_path / "x")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "#SBATCH --cpus-per-task=2" in out.stdout and "#SBATCH --mem=2000M" in out.stdout
    assert "2 CPUs per task: partition debug's nodes have 2 CPUs" in out.stdout
    assert "--exclusive" not in out.stdout and "--constraint" not in out.stdout  # a CPU job, no feature asked
    assert "#SBATCH --time=01:00:00" in out.stdout  # the default partition's MaxTime


def test_time_limit_is_capped_at_the_partition_and_the_job_requeues_itself(slurm, tmp_path):
    out = subprocess.run([sys.executable, "-m", "dtorch.cli", "submit", "slurm", "--model", MODEL, "--device-type",
                          "cpu", "--nodes", "2", "--steps", "5", "--global-batch", "4", "--seq-len", "32",
                          "--partition", "debug", "--time", "3h", "--checkpoint-dir", str(tmp_path / "x")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "#SBATCH --time=01:00:00" in out.stdout  # the local partition's MaxTime is 60 min
    assert "capped at the partition's 1.0 h" in out.stdout and "requeues itself" in out.stdout
