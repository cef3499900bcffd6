"""The run's event log file: one JSON object per line in `<run_dir>/events.jsonl`.

The floor of the package (imports no room): the launcher and the workers (`dtorch.elastic.events`,
which adds phase timing and recovery records on top) write it, the monitor and the OOM record
(`dtorch.monitor`) read and append to it. Lines are appended with one `write` on a file opened with
O_APPEND, so records from many processes on one host never interleave (POSIX guarantees this for
regular files; lines are far below a page).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

EVENTS_FILE = "events.jsonl"


def events_path(run_dir: str | None = None) -> str | None:
    """Path of the event log in `run_dir` (default: `$DTORCH_RUN_DIR`), or None when not under `dtorch run`."""
    run_dir = run_dir or os.environ.get("DTORCH_RUN_DIR")
    return os.path.join(run_dir, EVENTS_FILE) if run_dir else None


def log(kind: str, path: str | None = None, **fields: Any) -> dict[str, Any] | None:
    """Append one event `{"kind": kind, "t": now, "pid": ..., **fields}`; returns it (None if no log).

    Workers fill `rank` and `epoch` from their environment when the caller does not.
    """
    path = path or events_path()
    if path is None:
        return None
    rec: dict[str, Any] = {"kind": kind, "t": time.time(), "pid": os.getpid()}
    if "RANK" in os.environ and "rank" not in fields:
        rec["rank"] = int(os.environ["RANK"])
    if "DTORCH_EPOCH" in os.environ and "epoch" not in fields:
        rec["epoch"] = int(os.environ["DTORCH_EPOCH"])
    rec.update(fields)
    line = (json.dumps(rec, default=str) + "\n").encode()
    # never through a symlink: a link planted in the run directory must not redirect our appends
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
    return rec


def read(path: str) -> list[dict[str, Any]]:
    """All events of a log, in file order; a torn last line (writer killed mid-write) is skipped."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    except FileNotFoundError:
        pass
    return out
