"""What DTorch writes in a run or checkpoint directory holds against a hostile or full disk: a LATEST
of any kind is moved aside at commit (never a failed save), every file is private and never written
through a planted link, status and events survive a full disk, "checkpointed" is reported at commit
only, and `ckpt export` falls back to the newest good checkpoint as training does. Real files; the
full disks are real small filesystems (tmpfs, mounted as root)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
import subprocess
import sys

import pytest
import torch

from dtorch import eventlog
from dtorch.checkpoint import CheckpointError, CheckpointManager, CheckpointWarning
from dtorch.checkpoint import files as F
from dtorch.cli import main as cli_main
from dtorch.errors import ConfigError
from dtorch.integrations import status

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

TINY = "gpt:layers=1,hidden=32,heads=2,vocab=256,seq=64"


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 8, generator=g)}, "meta": {"step": seed}}


def _mode(p) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


@contextlib.contextmanager
def small_fs(path, size_kb: int):
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k,mode=0700", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def _fill(directory) -> None:
    """Take every free byte of the filesystem (a real full disk, as another writer would)."""
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        while True:
            os.write(fd, bytes(4096))
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)


# ---- LATEST of any kind -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["directory", "fifo", "symlink_to_dir", "dangling_symlink"])
@pytest.mark.parametrize("async_", [False, True])
def test_latest_of_any_kind_is_moved_aside_at_commit_with_a_warning(tmp_path, kind, async_):
    root = tmp_path / "run"
    mgr = CheckpointManager(root, keep_last=2)
    mgr.save(1, _state(1))
    latest = root / F.LATEST
    latest.unlink()
    (tmp_path / "elsewhere").mkdir()
    {"directory": lambda: latest.mkdir(), "fifo": lambda: os.mkfifo(latest),
     "symlink_to_dir": lambda: latest.symlink_to(tmp_path / "elsewhere"),
     "dangling_symlink": lambda: latest.symlink_to(tmp_path / "nowhere")}[kind]()
    with pytest.warns(CheckpointWarning, match="not a regular file; moved aside"):
        res = mgr.save(2, _state(2), async_=async_)
        mgr.wait()  # raises if the save did not commit
    assert res.committed
    assert stat.S_ISREG(os.lstat(latest).st_mode) and latest.read_text() == "step-00000002\n"
    assert len(list(root.glob("LATEST.aside-*"))) == 1
    assert list((tmp_path / "elsewhere").iterdir()) == []  # never written through the link
    mgr.save(3, _state(3))  # the saves after it go on, retention too
    assert [i.step for i in mgr.list()] == [3, 2]
    mgr.close()


# ---- private files, planted links ---------------------------------------------------------------------
def test_checkpoint_directories_and_files_are_private(tmp_path):
    root = tmp_path / "new" / "ckpt"
    mgr = CheckpointManager(root)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2), async_=True)
    mgr.close()
    assert _mode(root) == 0o700
    for step in ("step-00000001", "step-00000002"):
        d = root / step
        assert _mode(d) == 0o700
        names = sorted(p.name for p in d.iterdir())
        assert {"manifest.json", ".metadata", "rank-00000.pt"} <= set(names)
        assert {n: _mode(d / n) for n in names} == dict.fromkeys(names, 0o600)
    assert _mode(root / F.LATEST) == 0o600
    assert F.read_latest(root) == "step-00000002"


def test_logs_in_the_checkpoint_directory_refuse_planted_links_and_are_private(tmp_path):
    from dtorch.monitor.metrics import MetricsLogger

    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(ConfigError, match="metrics.*symlink"):
        MetricsLogger(d, console=False)
    (d / status.HISTORY_FILE).symlink_to(victim)
    with pytest.raises(ConfigError, match="status_history.*symlink"):
        status.write(d, "running", step=1)
    (d / eventlog.EVENTS_FILE).symlink_to(victim)
    with pytest.raises(ConfigError, match="events.*symlink"):
        eventlog.log("fault", path=str(d / eventlog.EVENTS_FILE))
    os.link(victim, d / "hard.jsonl")  # a hard link to a file of ours elsewhere: refused too
    with pytest.raises(ConfigError, match="hard links"):
        eventlog.log("fault", path=str(d / "hard.jsonl"))
    assert victim.read_text() == "precious\n"

    fresh = tmp_path / "fresh"
    (fresh).mkdir()
    (fresh / status.STATUS_FILE).symlink_to(victim)
    status.write(fresh, "running", step=1)  # replaced: the link itself, never its target
    assert victim.read_text() == "precious\n" and status.read(fresh)["state"] == "running"
    m = MetricsLogger(fresh, console=False)
    m.event("plan", plan="dp")
    m.close()
    eventlog.log("fault", path=str(fresh / eventlog.EVENTS_FILE))
    for name in ("metrics.jsonl", status.STATUS_FILE, status.HISTORY_FILE, eventlog.EVENTS_FILE):
        assert _mode(fresh / name) == 0o600, name


def test_a_log_of_another_user_is_refused_unless_its_directory_is_trusted(tmp_path, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("changing a file's owner needs root")
    d = tmp_path / "shared"
    d.mkdir()
    (d / status.HISTORY_FILE).write_text("")
    os.chown(d / status.HISTORY_FILE, 65534, 65534)
    with pytest.raises(ConfigError, match="owned by uid 65534.*DTORCH_TRUST="):
        status.write(d, "running", step=1)
    monkeypatch.setenv("DTORCH_TRUST", str(d))
    status.write(d, "running", step=1)
    assert [h["state"] for h in status.history(d)] == ["running"]


# ---- a full disk ------------------------------------------------------------------------------------------
def test_status_and_events_survive_a_full_disk_and_leave_no_temp_files(tmp_path):
    with small_fs(tmp_path / "fs", 512) as fs:
        run = fs / "run"
        r = status.Reporter(run)
        r.report("running", step=3)
        eventlog.log("fault", path=str(run / eventlog.EVENTS_FILE), step=3)
        _fill(fs)
        r.report("failed", step=4, why="CheckpointError: not enough space")  # no exception
        assert status.read(run)["state"] == "failed"
        assert [h["state"] for h in status.history(run)] == ["running", "failed"]
        eventlog.log("fatal", path=str(run / eventlog.EVENTS_FILE), message="the cause")
        assert [e["kind"] for e in eventlog.read(str(run / eventlog.EVENTS_FILE))] == ["fault", "fatal"]
        assert not [p.name for p in run.iterdir() if ".tmp" in p.name]
        # a temp file left by a writer killed mid-replace is cleaned by the next reporter
        (run / ".status.json.999999999.tmp").write_text("{}")
        status.Reporter(run)
        assert not [p.name for p in run.iterdir() if ".tmp" in p.name]


@pytest.mark.slow
def test_disk_filled_during_an_async_save_ends_on_the_full_cause_and_status_never_claims_it(tmp_path):
    from dtorch.models import build_model
    from dtorch.plan.plan import Plan
    from dtorch.train import Trainer, hooks

    with small_fs(tmp_path / "fs", 3072) as fs:
        ckpt = fs / "ckpt"
        saves = []

        def fill_at_second_save(phase: str) -> None:
            if phase == "begin":
                saves.append(phase)
                if len(saves) == 2:  # after its space check: another writer fills the disk during the write
                    _fill(fs)

        def started(trainer) -> None:
            trainer.ckpt.fault_hook = fill_at_second_save

        hooks.register(on_started=started)
        try:
            trainer = Trainer(model=lambda: build_model(TINY), global_batch=4, seq_len=16, checkpoint_dir=ckpt,
                              checkpoint_every=2, plan=Plan(), console=False)
            with pytest.raises(CheckpointError) as e:
                trainer.fit(steps=8)
        finally:
            hooks.clear()
        msg = str(e.value)
        assert "No space left" in msg and "needs about" in msg and "last good checkpoint" in msg, msg
        assert "step-00000002" in msg.split("last good checkpoint")[1], msg
        hist = status.history(ckpt)
        claimed = [h for h in hist if h["state"] == "checkpointed"]
        assert [h["checkpoint_step"] for h in claimed] == [2]  # step 4 never committed: never claimed
        committed_at = F.read_manifest(ckpt / "step-00000002").created_unix
        assert claimed[0]["t"] >= committed_at - 1e-3  # reported at the commit, not at the save's start
        assert hist[-1]["state"] == "failed" and "needs about" in hist[-1]["why"]
        assert status.read(ckpt)["state"] == "failed"
        assert not [p.name for p in ckpt.iterdir() if ".tmp" in p.name and not p.name.startswith("step-")]


# ---- export falls back like training -------------------------------------------------------------------
def test_export_without_step_uses_the_newest_good_checkpoint(tmp_path, capsys):
    from safetensors import safe_open

    root = tmp_path / "run"
    mgr = CheckpointManager(root)
    for s in (1, 2, 3):
        mgr.save(s, _state(s))
    mgr.close()
    (root / "step-00000003" / "__0_0.distcp").write_bytes(b"torn")
    out = tmp_path / "out.safetensors"
    with pytest.warns(CheckpointWarning, match="step-00000003 is damaged"):
        assert cli_main(["ckpt", "export", str(root), str(out)]) == 0
    with safe_open(str(out), framework="pt") as f:
        assert f.metadata()["dtorch.step"] == "2"
        assert torch.equal(f.get_tensor("model.w"), _state(2)["model"]["w"])
    assert cli_main(["ckpt", "export", str(root), str(out), "--step", "3"]) == 2  # asked for: no fallback
    assert "damaged" in capsys.readouterr().err


# ---- where a restored job resumed from -------------------------------------------------------------------
@pytest.mark.slow
def test_restore_from_a_snapshot_reports_where_it_resumed(tmp_path):
    """A real worker SIGKILLed in step 10 (one worker under the agent): the snapshot of step 9 is newer
    than the checkpoint of step 4 (joined by the save of step 8, which may have committed too), and
    the job's summary, its status and the agent's line say so."""
    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "dtorch.cli", "train", "--nproc", "1", "--model", TINY,
                        "--seq-len", "16", "--global-batch", "4", "--steps", "12", "--checkpoint-every", "4",
                        "--sample-tokens", "0", "--no-progress", "--checkpoint-dir", str(ckpt), "--run-dir", str(run),
                        "--chaos", "kill:rank=0:step=10:phase=forward_backward"],
                       env={**os.environ, "OMP_NUM_THREADS": "1", "DTORCH_NO_CALIBRATION": "1"},
                       capture_output=True, text=True, timeout=240)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert re.search(r"restored the in-memory snapshot of step 9 \(newer than the durable checkpoint of step [48]\)",
                     out), out[-3000:]
    summary = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("dtorch: {"))[len("dtorch: "):])
    assert summary["resumed_from"] == 9 and summary["steps_run"] == 3
    recovering = [h for h in status.history(ckpt) if h["state"] == "recovering"]
    assert [(h["from_step"], h["source"]) for h in recovering] == [(9, "snapshot")]
