"""`dtorch submit` sizes the request from the plan; bad input is one line and exit code 2."""

import json
import os
import signal
import subprocess
import sys

import pytest

from dtorch.integrations import status
from dtorch.integrations.slurm import parse_slurm_time, slurm_time


def _cli(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    # these requests are for GPU clusters elsewhere: not fitted to the suite's local Slurm (its
    # fixture exports SLURM_CONF for the Slurm tests), whose CPU nodes would refuse them
    env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "dtorch.cli", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def test_70b_by_deadline_prints_plan_request_and_script():
    out = _cli("submit", "slurm", "--model", "llama3-70b", "--device-type", "h100", "--tokens", "1T",
               "--deadline", "30d")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    m = next(line for line in text.splitlines() if line.startswith("recommended: "))
    nodes = int(m.split()[1])
    assert f"request: {nodes} nodes x 8 x H100" in text
    for line in (f"#SBATCH --nodes={nodes}", "#SBATCH --ntasks-per-node=8", "#SBATCH --gres=gpu:8",
                 "#SBATCH --exclusive", "#SBATCH --signal=USR1@120", "#SBATCH --requeue"):
        assert line in text
    assert "--constraint" not in text  # a site's feature names are its own: only when asked
    assert "time limit: the predicted" in text and "+ 15% + 10 min" in text
    assert "srun --kill-on-bad-exit=1" in text and "scontrol requeue" in text
    # the chosen size meets the deadline and the next smaller planned one does not
    rows = [r.split() for r in text.splitlines() if r.strip() and r.split()[0].isdigit()]
    days = {int(r[0]): float(r[r.index("days") - 1]) for r in rows if "days" in r}
    assert days[nodes] <= 30 and all(d > 30 for n, d in days.items() if n < nodes)


@pytest.mark.parametrize("args,field", [
    (["slurm", "--device-type", "h999", "--nodes", "2", "--steps", "5"], "device-type='h999'"),
    (["slurm", "--device-type", "h100", "--tokens", "1T", "--deadline", "1h", "--max-nodes", "64"], "deadline"),
    (["slurm", "--device-type", "h100", "--nodes", "2", "--steps", "5", "--checkpoint-dir", "/nonexistent/x/ckpt"],
     "checkpoint-dir"),
    (["k8s", "--device-type", "h100", "--nodes", "2", "--steps", "5"], "pvc"),
    (["k8s", "--device-type", "h100", "--nodes", "2", "--steps", "5", "--pvc", "c", "--kind", "pytorchjob"], "kind"),
])
def test_bad_input_is_one_line_exit_2(args, field):
    out = _cli("submit", args[0], "--model", "llama3-8b", *args[1:])
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dtorch submit: error: ") and field in lines[0], out.stderr


def test_a_plan_file_fixes_the_nodes_and_is_what_the_job_runs(tmp_path):
    plan = tmp_path / "plan.json"
    out = _cli("plan", "--model", "llama3-8b", "--cluster", "h100:2x8", "--global-batch", "1024", "--out", str(plan))
    assert out.returncode == 0, out.stderr
    out = _cli("submit", "slurm", "--model", "llama3-8b", "--device-type", "h100", "--plan", str(plan), "--steps", "9")
    assert out.returncode == 0, out.stderr
    assert "#SBATCH --nodes=2" in out.stdout and f"--plan {plan}" in out.stdout
    out = _cli("submit", "slurm", "--model", "llama3-8b", "--device-type", "h100", "--plan", str(plan),
               "--nodes", "3", "--steps", "9")
    assert out.returncode == 2 and "world size 16" in out.stderr


def test_slurm_times_round_trip():
    assert slurm_time(90) == "00:02:00" and slurm_time(86400 * 2 + 3600) == "2-01:00:00"
    assert parse_slurm_time("2-01:00:00") == 2 * 86400 + 3600 and parse_slurm_time("30") == 1800
    assert parse_slurm_time("UNLIMITED") is None and parse_slurm_time("1-12") == 86400 + 12 * 3600


def test_status_file_history_and_cli(tmp_path):
    r = status.Reporter(tmp_path, rank=0)
    r.report("planning", total_steps=10)
    r.report("running", step=3, total_steps=10, tokens_per_s=5100.0)
    r.report("running", step=4, total_steps=10, tokens_per_s=5200.0)
    assert status.read(tmp_path)["step"] == 3  # same state within a second: not rewritten
    r.report("preempted", step=4, checkpoint_step=4, signal="SIGTERM", total_steps=10)
    status.Reporter(tmp_path, rank=1).report("failed", why="never written by rank 1")
    doc = status.read(tmp_path)
    assert doc["state"] == "preempted" and doc["checkpoint_step"] == 4
    assert [h["state"] for h in status.history(tmp_path)] == ["planning", "running", "preempted"]
    assert status.one_line(doc) == "preempted, step 4/10, checkpoint at step 4, on SIGTERM"
    out = _cli("status", str(tmp_path))
    assert out.returncode == 0 and "preempted, step 4/10" in out.stdout
    assert json.loads(_cli("status", str(tmp_path), "--json").stdout)["state"] == "preempted"
    assert _cli("status", str(tmp_path / "nope")).returncode == 2


def test_status_of_a_job_killed_without_a_word_is_not_running(tmp_path):
    import socket
    import subprocess
    import time

    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no longer runs, as a SIGKILLed rank 0 leaves it
    status.write(tmp_path, "running", step=7, total_steps=10, pid=gone.pid, host=socket.gethostname())
    out = _cli("status", str(tmp_path))
    assert out.returncode == 0 and "not running" in out.stdout and f"pid {gone.pid}" in out.stdout, out.stdout
    assert "running, step 7/10" in out.stdout  # what it last said, kept
    # alive: this process
    status.write(tmp_path, "running", step=8, pid=os.getpid(), host=socket.gethostname())
    assert "not running" not in status.format_status(status.read(tmp_path), tmp_path)
    # another host: only the age can tell
    doc = {"state": "running", "t": time.time() - 3600, "step": 9, "pid": 1, "host": "elsewhere"}
    assert "no update for 3600 s" in status.format_status(doc, tmp_path)
    assert status.liveness({**doc, "t": time.time()}) is None
    assert status.liveness({**doc, "state": "finished"}) is None  # a final state is the truth
    r = status.Reporter(tmp_path, rank=0)
    r.report("running", step=1)
    assert status.read(tmp_path)["pid"] == os.getpid()


def test_preemption_flag_set_by_signal_single_process(monkeypatch):
    from dtorch.train.preempt import Preemption

    monkeypatch.delenv("DTORCH_RUN_DIR", raising=False)
    before = signal.getsignal(signal.SIGUSR1)
    p = Preemption(world=1)
    try:
        assert not p.requested()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert p.requested() and p.signal == "SIGUSR1"
    finally:
        p.close()
    assert signal.getsignal(signal.SIGUSR1) is before  # the previous handler is back


def test_deadline_sizing_skips_only_sizes_whose_planner_bound_already_misses():
    """The bound that spares the 32-node search (issue 15: < 2 s) is a true floor of what the
    search finds there, and the chosen size is the one the full search of every size would choose."""
    import dataclasses

    from dtorch.cluster.load import preset_group
    from dtorch.cluster.spec import Cluster
    from dtorch.integrations.request import size_for_deadline
    from dtorch.plan.profiles import get_profile
    from dtorch.plan.recommend import step_time_floor
    from dtorch.plan.search import search

    group = preset_group("h100")
    profile = get_profile("llama3-70b", 4096)
    rec = size_for_deadline(profile, group, tokens=1e12, deadline_s=30 * 86400, global_batch=1024,
                            max_nodes=2048, dtype="bfloat16")
    skipped = [o for o in rec.options if o.estimate is None and "not searched" in o.note]
    assert [o.nodes for o in skipped] == [32] and rec.chosen.nodes == 64
    cl = Cluster([dataclasses.replace(group, num_nodes=32)])
    best = search(profile, cl, global_batch=1024, top_k=1, dtype="bfloat16", suggest=False).best[1]
    floor = step_time_floor(profile, cl, global_batch=1024, dtype="bfloat16")
    assert floor <= best.step_time_s
    small = get_profile("llama3-8b", 4096)
    for nodes in (1, 2, 4):  # and on other sizes, no plan the search finds beats it
        c = Cluster([dataclasses.replace(group, num_nodes=nodes)])
        r = search(small, c, global_batch=256, top_k=1, dtype="bfloat16", suggest=False)
        assert step_time_floor(small, c, global_batch=256, dtype="bfloat16") <= min(
            e.step_time_s for _, e in r.best_by_family.values())
    assert 1e12 / (1024 * 4096 / best.step_time_s) > 30 * 86400  # the full search agrees: 32 misses


SBATCH_FLAGS = ["--name", "--account", "--qos", "--partition", "--constraint", "--gres-name", "--checkpoint-dir"]


@pytest.mark.parametrize("flag", SBATCH_FLAGS)
def test_a_newline_in_an_sbatch_value_is_refused_and_nothing_runs(tmp_path, flag):
    """With stand-ins for Slurm's commands (sbatch runs the script at once, srun does nothing), a
    newline in a value that goes into an #SBATCH line would run the rest as a command of the batch
    script: it must be refused in one line naming the value, exit 2, and nothing may run."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, body in (("sbatch", 'cd "$(dirname "$2")" && bash "$2" >/dev/null 2>&1; echo 42'),
                       ("srun", "exit 0"), ("scontrol", "exit 0"), ("sinfo", "exit 1")):
        (stubs / name).write_text(f"#!/bin/sh\n{body}\n")
        (stubs / name).chmod(0o755)
    value = "x\ntouch pwned #"
    if flag == "--checkpoint-dir":
        value = f"{tmp_path}/{value}"
    out = subprocess.run([sys.executable, "-m", "dtorch.cli", "submit", "slurm", "--model",
                          "gpt:layers=1,hidden=32,heads=2,vocab=256,seq=32", "--device-type", "h100", "--nodes", "1",
                          "--steps", "5", "--global-batch", "8", "--seq-len", "32", "--checkpoint-dir",
                          str(tmp_path / "ck"), "--out", str(tmp_path / "job.sbatch"), "--now", flag, value],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}"})
    assert not (tmp_path / "pwned").exists(), "the injected command ran"
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    field = flag[2:]
    assert len(lines) == 1 and f"{field}={value!r}" in lines[0] and "control character" in lines[0], out.stderr


def test_slurm_values_with_spaces_and_unicode_still_write_the_script():
    from dtorch.integrations.slurm import check_sbatch_value

    for ok in ("gpu", "team a", "h100&ib", "équipe"):
        check_sbatch_value("account", ok)
    for bad in ("a\rb", "a\tb", "a\x00b", "a\u2028b"):
        with pytest.raises(Exception, match="control character"):
            check_sbatch_value("account", bad)


@pytest.mark.parametrize("kw,bad", [
    ({"name": "My_Job"}, "name='My_Job'"),
    ({"name": "a" * 60}, "name="),
    ({"name": "job\nx"}, "name="),
    ({"namespace": "-team"}, "namespace='-team'"),
    ({"pvc": "ckpt/../x"}, "pvc="),
    ({"queue": "team a"}, "queue='team a'"),
    ({"image": "GHCR.io/Me/Dtorch:1"}, "image="),
    ({"image": "ghcr.io/me/dtorch:1 --privileged"}, "image="),
    ({"image": "ghcr.io/me/dtorch@sha256:abc"}, "image="),
])
def test_kubernetes_names_and_images_are_checked_against_their_formats(kw, bad):
    from dtorch.errors import ConfigError
    from dtorch.integrations.k8s import check_names

    good = {"name": "dtorch-llama3-8b", "namespace": "team-a", "pvc": "ckpt.v1", "queue": "team_a.gpu",
            "runtime": "torch-distributed", "image": "registry.example.com:5000/team/dtorch:1.2-rc_1", "nodes": 4}
    check_names(**good)
    check_names(**{**good, "image": "localhost/dtorch@sha256:" + "a" * 64})
    check_names(**{**good, "image": "dtorch"})
    with pytest.raises(ConfigError) as e:
        check_names(**{**good, **kw})
    assert bad in str(e.value) and "\n" not in str(e.value)


def test_a_bad_image_ends_dtorch_submit_k8s_in_one_line():
    out = _cli("submit", "k8s", "--model", "llama3-8b", "--device-type", "h100", "--nodes", "2", "--steps", "5",
               "--pvc", "ckpt", "--image", "ghcr.io/me/dtorch:1\nx: y")
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "image='ghcr.io/me/dtorch:1\\nx: y'" in lines[0], out.stderr
