"""The run's event log file: one JSON object per line in `<run_dir>/events.jsonl`, and the small
records beside it that must outlive a full disk.

The floor of the package (imports no room): the launcher and the workers (`dtorch.elastic.events`,
which adds phase timing and recovery records on top) write it, the monitor and the OOM record
(`dtorch.monitor`) read and append to it. Lines are appended with one `write` on a file opened with
O_APPEND, so records from many processes on one host never interleave (POSIX guarantees this for
regular files; lines are far below a page).

Small records (events, metrics lines, the status file) are written with `append_line` and
`replace_small`: private files never written through a planted link (`dtorch.trust`), and when
the filesystem is full (another writer filled it) the directory's reserve (`reserve`: bytes set
aside by the first writer) is given up so that the job's last records (its status, the cause of
its end) are still written; if even that fails the record is dropped with one warning, never
raised: a job must end on the error that stopped it, not on its log.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from typing import Any

from dtorch import env, trust

EVENTS_FILE = "events.jsonl"
RESERVE_FILE = ".dtorch-reserve"
RESERVE_BYTES = 64 << 10
"""Bytes set aside per directory: thousands of small records after the disk filled up."""
_FULL = (errno.ENOSPC, errno.EDQUOT)
_reserved: set[str] = set()
_warned: set[str] = set()
_log = logging.getLogger("dtorch.eventlog")


def events_path(run_dir: str | None = None) -> str | None:
    """Path of the event log in `run_dir` (default: `$DTORCH_RUN_DIR`), or None when not under `dtorch run`."""
    run_dir = run_dir or env.current().run_dir
    return os.path.join(run_dir, EVENTS_FILE) if run_dir else None


def log(kind: str, path: str | None = None, **fields: Any) -> dict[str, Any] | None:
    """Append one event `{"kind": kind, "t": now, "pid": ..., **fields}`; returns it (None if no log).

    Workers fill `rank` and `epoch` from their environment when the caller does not. A full disk
    drops the record (after the reserve) with a warning; a planted link raises ConfigError.
    """
    path = path or events_path()
    if path is None:
        return None
    rec: dict[str, Any] = {"kind": kind, "t": time.time(), "pid": os.getpid()}
    e = env.current()
    if e.rank is not None and "rank" not in fields:
        rec["rank"] = e.rank
    if e.epoch is not None and "epoch" not in fields:
        rec["epoch"] = e.epoch
    rec.update(fields)
    append_line(path, (json.dumps(rec, default=str) + "\n").encode(), "events")
    return rec


def reserve(directory: str | os.PathLike) -> None:
    """Set aside RESERVE_BYTES in `directory` (a private file, allocated now) unless it is there
    already; `append_line`/`replace_small` give it up when the disk is full. Best effort."""
    path = os.path.join(directory, RESERVE_FILE)
    _reserved.add(os.fspath(directory))
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        return  # set aside by another process already, or not possible: nothing to do
    try:
        os.posix_fallocate(fd, 0, RESERVE_BYTES)
    except OSError:
        try:  # a filesystem without fallocate: real zeros take the blocks too
            os.write(fd, bytes(RESERVE_BYTES))
        except OSError:
            os.unlink(path)  # no room even for the reserve
    finally:
        os.close(fd)


def release(directory: str | os.PathLike) -> bool:
    """Give up `directory`'s reserve (the disk is full); True when there was one."""
    try:
        os.unlink(os.path.join(directory, RESERVE_FILE))
        return True
    except OSError:
        return False


def _dropped(path: str | os.PathLike, e: OSError) -> bool:
    key = os.fspath(path)
    if key not in _warned:
        _warned.add(key)
        _log.warning("dtorch: could not write %s (%s); going on without it", key, e.strerror or e)
    return False


def append_line(path: str | os.PathLike, line: bytes, field: str, fd: int | None = None) -> bool:
    """Append `line` to `path` with one O_APPEND write (or to the open `fd` of it, from
    `trust.open_append`). On a full disk the directory's reserve is given up and the write tried
    again; returns False when the line could not be written."""
    directory = os.path.dirname(os.fspath(path)) or "."
    if directory not in _reserved:
        reserve(directory)
    own = fd is None
    try:
        if own:
            fd = trust.open_append(path, field)
    except OSError as e:
        if e.errno not in _FULL or not release(directory):
            return _dropped(path, e)
        try:
            fd = trust.open_append(path, field)
        except OSError as e2:
            return _dropped(path, e2)
    assert fd is not None
    try:
        view = memoryview(line)
        retried = False
        while view:
            try:
                view = view[os.write(fd, view):]
            except OSError as e:
                if e.errno not in _FULL or retried or not release(directory):
                    return _dropped(path, e)
                retried = True
        return True
    finally:
        if own:
            os.close(fd)


def replace_small(path: str | os.PathLike, data: bytes) -> bool:
    """Replace the small file `path` atomically (`trust.replace_file`, not fsynced: a status, not a
    checkpoint). On a full disk the directory's reserve is given up and the write tried again;
    returns False when the old content had to stay (no temp file is left behind either way)."""
    directory = os.path.dirname(os.fspath(path)) or "."
    if directory not in _reserved:
        reserve(directory)
    try:
        trust.replace_file(path, data, durable=False)
        return True
    except OSError as e:
        if e.errno not in _FULL or not release(directory):
            return _dropped(path, e)
    try:
        trust.replace_file(path, data, durable=False)
        return True
    except OSError as e:
        return _dropped(path, e)


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
