"""The job's state, told to whoever asks: a status file in the run directory (always), the Slurm
job comment (inside a Slurm job), the Kubernetes termination message (inside a pod), and the
pod's annotations and events where the pod's service account is permitted (`k8s_api.PodStatus`).

    r = Reporter(run_dir, rank)          # rank 0 writes; other ranks' calls are no-ops
    r.report("planning")
    r.report("running", step=120, tokens_per_s=5.1e3)      # rate-limited outside the file
    r.report("checkpointed", step=200)
    r.report("preempted", step=214, checkpoint_step=214, signal="SIGUSR1")
    r.report("failed", why="...")

States: planning, recovering (resumed from a checkpoint or an in-memory snapshot: `from_step`,
`source`), running, checkpointed (the checkpoint of `checkpoint_step` has committed: reported at
the first step after an asynchronous save's commit, never when it starts),
preempted (a checkpoint was written on a scheduler's signal and the job stops to be requeued),
finished, failed. `dtorch status RUN_DIR` prints the file. Standard library only (the trainer
imports it).

Both files are private and never written through a planted link, and a full disk never fails the
job through them: `dtorch.eventlog.replace_small`/`append_line` give up the directory's reserve to
write the last states (`failed` with its cause), and drop a record rather than raise.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from dtorch.integrations.env import slurm_job_id

STATUS_FILE = "status.json"
HISTORY_FILE = "status-history.jsonl"
STATES = ("planning", "recovering", "running", "checkpointed", "preempted", "finished", "failed")
TERMINATION_LOG = "/dev/termination-log"


def write(run_dir: str | os.PathLike, state: str, *, append_history: bool = True, **fields: Any) -> dict:
    """Replace `<run_dir>/status.json` atomically; append it to status-history.jsonl when asked
    (the reporter does so at changes of state, not at every step). A full disk drops the record
    (with one warning); a planted link in place of the history raises ConfigError."""
    from dtorch import eventlog

    assert state in STATES, state
    d = Path(run_dir)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    doc = {"state": state, "t": round(time.time(), 3), **{k: v for k, v in fields.items() if v is not None}}
    line = (json.dumps(doc) + "\n").encode()
    eventlog.replace_small(d / STATUS_FILE, line)
    if append_history:
        eventlog.append_line(d / HISTORY_FILE, line, "status_history")
    return doc


_TMP_RE = re.compile(r"^\.status\.json\.(?:tmp-)?(\d+)(?:-[0-9a-f]+|\.tmp)$")


def remove_stale_temps(run_dir: str | os.PathLike) -> list[str]:
    """Remove temp files of status.json left by processes that are gone (killed between the write
    and the rename; older versions also left them on a full disk); returns their names."""
    out = []
    try:
        names = os.listdir(run_dir)
    except OSError:
        return out
    for name in names:
        m = _TMP_RE.match(name)
        if m is None:
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # its writer is alive: it renames or removes it itself
        except ProcessLookupError:
            pass
        except OSError:
            continue
        try:
            os.unlink(os.path.join(run_dir, name))
            out.append(name)
        except OSError:
            pass
    return out


def read(run_dir: str | os.PathLike) -> dict | None:
    try:
        return json.loads((Path(run_dir) / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None


def history(run_dir: str | os.PathLike) -> list[dict]:
    try:
        lines = (Path(run_dir) / HISTORY_FILE).read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line torn by a kill mid-write
    return out


def last_fault(agent_run_dir: str | os.PathLike | None) -> str | None:
    """What the elastic agent last detected (`dtorch run`'s events.jsonl): "exit of rank 1
    (SIGKILL)", "hang of rank 0", "node_lost"; None when nothing was detected."""
    if not agent_run_dir:
        return None
    last = None
    try:
        with open(Path(agent_run_dir) / "events.jsonl") as f:
            for line in f:
                if '"detected"' in line:
                    try:
                        last = json.loads(line)
                    except ValueError:
                        continue
    except OSError:
        return None
    if last is None:
        return None
    ranks = last.get("ranks") or []
    what = f"{last.get('cause', 'failure')}" + (f" of rank {', '.join(map(str, ranks))}" if ranks else "")
    return what + (f" (epoch {last['epoch']})" if last.get("epoch") is not None else "")


def one_line(doc: dict) -> str:
    """`running step 120/300, 5.1k tok/s` - short enough for a Slurm comment or a pod message."""
    s = doc.get("state", "?")
    parts = [s]
    if doc.get("step") is not None:
        parts.append(f"step {doc['step']}" + (f"/{doc['total_steps']}" if doc.get("total_steps") else ""))
    if doc.get("tokens_per_s"):
        parts.append(f"{doc['tokens_per_s'] / 1e3:.1f}k tok/s")
    if doc.get("checkpoint_step") is not None:
        parts.append(f"checkpoint at step {doc['checkpoint_step']}")
    if doc.get("from_step") is not None:
        parts.append(f"resumed from step {doc['from_step']}" + (f" after {doc['after']}" if doc.get("after") else ""))
    if doc.get("signal"):
        parts.append(f"on {doc['signal']}")
    if doc.get("why"):
        parts.append(str(doc["why"]))
    return ", ".join(parts)


LIVE_STATES = ("planning", "recovering", "running", "checkpointed")
STALE_S = 300.0
"""A live state not rewritten for this long (the reporter rewrites it every second while steps
run) is reported as possibly lost when its process cannot be checked (another host)."""


def liveness(doc: dict, now: float | None = None) -> str | None:
    """Why a job whose last state is a live one is not running any more (None: it may be). The
    reporter stamps its pid and host: on the same host a pid that is gone settles it (a SIGKILL
    or a crash leaves no last word); elsewhere a status older than STALE_S says it may be."""
    if doc.get("state") not in LIVE_STATES:
        return None
    pid, host = doc.get("pid"), doc.get("host")
    if isinstance(pid, int) and host == socket.gethostname():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return f"its rank-0 process (pid {pid}) is gone: killed or crashed without reporting"
        except PermissionError:
            pass  # alive, another user's
        return None
    age = (time.time() if now is None else now) - float(doc.get("t", 0))
    if age > STALE_S:
        return f"no update for {age:.0f} s" + (f" (its process runs on {host})" if host else "") + \
            ": hung, or stopped without reporting"
    return None


def format_status(doc: dict | None, run_dir: str | os.PathLike) -> str:
    if doc is None:
        return f"{run_dir}: no status yet (no {STATUS_FILE})"
    age = time.time() - float(doc.get("t", time.time()))
    lost = liveness(doc)
    if lost is not None:
        lines = [f"{run_dir}: not running: {lost}; it last reported {one_line(doc)} ({age:.0f} s ago)"]
    else:
        lines = [f"{run_dir}: {one_line(doc)} ({age:.0f} s ago)"]
    for k, v in doc.items():
        if k not in ("state", "t"):
            lines.append(f"  {k}: {v}")
    return "\n".join(lines)


class Reporter:
    """Writes the status of rank 0 to the run directory and to the scheduler it runs under.

    The file is written at every change of state and at most every `file_interval` seconds
    otherwise; the Slurm comment (a `scontrol update`, run in the background) at every change of
    state and at most every `interval` seconds otherwise."""

    def __init__(self, run_dir: str | os.PathLike | None, rank: int = 0, interval: float = 30.0,
                 file_interval: float = 1.0):
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.enabled = rank == 0 and self.run_dir is not None
        self.interval = interval
        self._last_state: str | None = None
        self._last_sent = 0.0
        self._last_write = -1e9
        self.file_interval = file_interval
        self._proc: subprocess.Popen | None = None
        self.host = socket.gethostname()
        self.slurm_job = slurm_job_id()
        self._scontrol = shutil.which("scontrol") if self.slurm_job else None
        self.pod = None
        if self.enabled:
            from dtorch import eventlog
            from dtorch.integrations.k8s_api import PodStatus

            self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)  # type: ignore[union-attr]
            remove_stale_temps(self.run_dir)  # type: ignore[arg-type]
            eventlog.reserve(self.run_dir)  # type: ignore[arg-type]  # the last states outlive a full disk

            self.pod = PodStatus.from_env()  # None outside a pod; rate-limits itself

    def report(self, state: str, **fields: Any) -> None:
        if not self.enabled:
            return
        changed = state != self._last_state
        now = time.monotonic()
        if not changed and now - self._last_write < self.file_interval:
            return  # same state again within a second: a file per step is too much on a shared FS
        self._last_write = now
        # pid and host: `dtorch status` can tell a live job from one killed without a last word
        doc = write(self.run_dir, state, append_history=changed, **{"pid": os.getpid(), "host": self.host,
                                                                     **fields})  # type: ignore[arg-type]
        now = time.monotonic()
        self._last_state = state
        if self.pod is not None:
            self.pod.report(doc, "dtorch: " + one_line(doc), final=state in ("preempted", "failed", "finished"))
        if changed or now - self._last_sent >= self.interval or state in ("preempted", "failed", "finished"):
            self._last_sent = now
            self._to_scheduler(doc, final=state in ("preempted", "failed", "finished"))

    def _to_scheduler(self, doc: dict, final: bool) -> None:
        line = "dtorch: " + one_line(doc)
        if self._scontrol:
            if self._proc is not None and self._proc.poll() is None and not final:
                return  # the previous update is still running: skip this one
            cmd = [self._scontrol, "update", f"JobId={self.slurm_job}", f"Comment={line[:250]}"]
            try:
                self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                if final:
                    self._proc.wait(timeout=10)
            except (OSError, subprocess.SubprocessError):
                self._scontrol = None
        if final and os.path.exists(TERMINATION_LOG) and os.access(TERMINATION_LOG, os.W_OK):
            try:  # Kubernetes shows it as the container's termination message
                with open(TERMINATION_LOG, "w") as f:
                    f.write(line[:4000])
            except OSError:
                pass
