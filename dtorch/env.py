"""The process environment, read in one place.

`RuntimeEnv` is every variable DTorch reads, typed: what torchrun sets (RANK, WORLD_SIZE, ...),
what `dtorch run` hands its workers (DTORCH_RUN_DIR, DTORCH_EPOCH, the snapshot settings, ...) and
the operator's switches (DTORCH_CACHE, DTORCH_KEY_FILE, ...). An entry point reads it once with
`current()` and passes it down; code with no caller to hand it one calls `current()` itself.
`current()` parses again only when one of these variables changed (a test's monkeypatch, the agent
exporting DTORCH_EPOCH), so it is cheap to call.

Scheduler variables (SLURM_*, PET_*, SKYPILOT_*, Kubernetes' POD_*) are parsed by
`dtorch.integrations.env`, from the mapping `environ()` returns. Nothing else in `dtorch/` touches
`os.environ`: a process that starts children changes their environment through `export` and
`restore`, or builds it with `child_environ`.

A value that cannot be parsed is a `ConfigError` naming the variable and the fix.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from dtorch.errors import ConfigError


def _number(kind: type, name: str, raw: str | None, default: Any) -> Any:
    """`raw` as `kind` (int or float), `default` when unset or empty; ConfigError naming `name`."""
    if raw in (None, ""):
        return default
    try:
        return kind(raw)
    except ValueError:
        raise ConfigError(name, raw, "use a whole number" if kind is int else "use a number") from None


def _int(name: str, raw: str | None, default: int | None) -> int | None:
    return _number(int, name, raw, default)


def _float(name: str, raw: str | None, default: float | None) -> float | None:
    return _number(float, name, raw, default)


def _str(raw: str | None) -> str | None:
    return raw or None


def _flag(raw: str | None, default: bool) -> bool:
    """"1" on, "0" off; unset or empty: the default."""
    return default if raw in (None, "") else raw != "0"


def _var(name: str, parse: Callable[[str, str | None], Any], doc: str) -> Any:
    return field(metadata={"var": name, "parse": parse, "doc": doc})


@dataclass(frozen=True)
class RuntimeEnv:
    """Every environment variable DTorch reads, parsed. None means unset."""

    # torchrun's contract (unset outside a launched worker)
    rank: int | None = _var("RANK", lambda n, r: _int(n, r, None), "this process's global rank")
    world_size: int | None = _var("WORLD_SIZE", lambda n, r: _int(n, r, None), "processes in the job")
    local_rank: int | None = _var("LOCAL_RANK", lambda n, r: _int(n, r, None), "rank on this node")
    local_world_size: int | None = _var("LOCAL_WORLD_SIZE", lambda n, r: _int(n, r, None), "processes on this node")
    group_rank: int = _var("GROUP_RANK", lambda n, r: _int(n, r, 0), "this node's rank")
    master_addr: str | None = _var("MASTER_ADDR", lambda n, r: _str(r), "rendezvous host")
    master_port: int | None = _var("MASTER_PORT", lambda n, r: _int(n, r, None), "rendezvous port")
    restart_count: int = _var("TORCHELASTIC_RESTART_COUNT", lambda n, r: _int(n, r, 0), "torchelastic's restarts")
    run_id: str = _var("TORCHELASTIC_RUN_ID", lambda n, r: r or "local", "torchelastic's run id")
    omp_num_threads: int | None = _var("OMP_NUM_THREADS", lambda n, r: _int(n, r, None), "threads per process")
    flight_recorder_size: str | None = _var("TORCH_FR_BUFFER_SIZE", lambda n, r: _str(r),
                                            "torch's flight recorder entries")
    nccl_trace_size: str | None = _var("TORCH_NCCL_TRACE_BUFFER_SIZE", lambda n, r: _str(r),
                                       "torch's older name for the flight recorder's entries")

    # what `dtorch run` hands its workers
    run_dir: str | None = _var("DTORCH_RUN_DIR", lambda n, r: _str(r), "the launch's run directory")
    epoch: int | None = _var("DTORCH_EPOCH", lambda n, r: _int(n, r, None), "membership epoch")
    agent_pid: int | None = _var("DTORCH_AGENT_PID", lambda n, r: _int(n, r, None), "the node agent's pid")
    heartbeat_interval: float = _var("DTORCH_HEARTBEAT_INTERVAL", lambda n, r: _float(n, r, 0.5),
                                     "seconds between heartbeats")
    collective_timeout: float = _var("DTORCH_COLLECTIVE_TIMEOUT", lambda n, r: _float(n, r, 120.0),
                                     "seconds before a collective counts as hung")
    snapshot_dir: str | None = _var("DTORCH_SNAPSHOT_DIR", lambda n, r: _str(r), "in-memory snapshot directory")
    snapshot_every: int = _var("DTORCH_SNAPSHOT_EVERY", lambda n, r: _int(n, r, 1), "steps between snapshots")
    snapshot_background: bool = _var("DTORCH_SNAPSHOT_BACKGROUND", lambda n, r: _flag(r, True),
                                     "copy snapshots off the training thread")
    snapshot_peer: bool = _var("DTORCH_SNAPSHOT_PEER", lambda n, r: _flag(r, True),
                               "replicate snapshots to the next node")
    snapshot_root: str | None = _var("DTORCH_SNAPSHOT_ROOT", lambda n, r: _str(r), "where snapshot dirs are made")
    chaos: str = _var("DTORCH_CHAOS", lambda n, r: r or "", "a chaos drill's fault list")
    preempt_marker: str | None = _var("DTORCH_PREEMPT_MARKER", lambda n, r: _str(r), "file a SIGTERM leaves")
    record_samples: bool = _var("DTORCH_RECORD_SAMPLES", lambda n, r: bool(r), "record each step's sample ids")
    master_port_override: int | None = _var("DTORCH_MASTER_PORT", lambda n, r: _int(n, r, None),
                                            "rendezvous port for scheduler launches")

    # keys and trust
    key: str | None = _var("DTORCH_KEY", lambda n, r: _str(r), "the job's HMAC key")
    key_file: str | None = _var("DTORCH_KEY_FILE", lambda n, r: _str(r), "file holding the HMAC key")
    trust: tuple[Path, ...] = _var("DTORCH_TRUST", lambda n, r: tuple(
        Path(p).resolve() for p in (r or "").split(os.pathsep) if p), "directories trusted as they are")
    config_home: str | None = _var("XDG_CONFIG_HOME", lambda n, r: _str(r), "where the key file lives")

    # monitoring
    metrics_every: int | None = _var("DTORCH_METRICS_EVERY", lambda n, r: _int(n, r, None),
                                     "per-rank aggregation every N steps")
    monitor_port: int | None = _var("DTORCH_MONITOR_PORT", lambda n, r: _int(n, r, None), "live server port")
    monitor_host: str | None = _var("DTORCH_MONITOR_HOST", lambda n, r: _str(r), "live server address")
    monitor_token: str | None = _var("DTORCH_MONITOR_TOKEN", lambda n, r: _str(r), "live server token")
    monitor_allow_remote: bool = _var("DTORCH_MONITOR_ALLOW_REMOTE", lambda n, r: r == "1",
                                      "serve on a non-loopback address")
    trace_comms: bool = _var("DTORCH_TRACE_COMMS", lambda n, r: r == "1", "record every collective")
    profile_comms: bool = _var("DTORCH_PROFILE_COMMS", lambda n, r: r == "1", "profile one metrics window")
    progress: str = _var("DTORCH_PROGRESS", lambda n, r: r or "", "progress bar on/off")
    memory_cap: str | None = _var("DTORCH_TEST_MEMORY_CAP", lambda n, r: _str(r), "test-only OOM cap")

    # caches and calibration
    cache_dir: str | None = _var("DTORCH_CACHE", lambda n, r: _str(r), "dataset and tokenizer cache")
    published_dir: str | None = _var("DTORCH_PUBLISHED_DIR", lambda n, r: _str(r), "published tables")
    calibration_dir: str | None = _var("DTORCH_CALIBRATION_DIR", lambda n, r: _str(r), "calibration store")
    no_calibration: bool = _var("DTORCH_NO_CALIBRATION", lambda n, r: bool(r), "ignore stored calibration")
    capability_cache: str | None = _var("DTORCH_CAPABILITY_CACHE", lambda n, r: _str(r), "capability cache")
    cxx: str | None = _var("CXX", lambda n, r: _str(r), "C++ compiler for torch.compile")

    @classmethod
    def parse(cls, environ: Mapping[str, str]) -> RuntimeEnv:
        return cls(**{f.name: f.metadata["parse"](f.metadata["var"], environ.get(f.metadata["var"]))
                      for f in fields(cls)})

    @property
    def launched(self) -> bool:
        """Started by torchrun (or `dtorch run`): RANK is set."""
        return self.rank is not None


VARIABLES: tuple[str, ...] = tuple(f.metadata["var"] for f in fields(RuntimeEnv))
"""The names `RuntimeEnv` reads."""

_cache: tuple[tuple[str | None, ...], RuntimeEnv] | None = None


def current() -> RuntimeEnv:
    """This process's `RuntimeEnv`; parsed again only when one of its variables changed."""
    global _cache
    raw = tuple(os.environ.get(v) for v in VARIABLES)
    if _cache is None or _cache[0] != raw:
        _cache = (raw, RuntimeEnv.parse(os.environ))
    return _cache[1]


def environ() -> dict[str, str]:
    """A copy of the whole environment: for the scheduler parsers and for a child's environment."""
    return dict(os.environ)


def child_environ(extra: Mapping[str, str] | None = None, drop: Iterable[str] = ()) -> dict[str, str]:
    """The environment for a child process: this one's, with `extra` set and `drop` removed."""
    env = dict(os.environ)
    for k in drop:
        env.pop(k, None)
    env.update(extra or {})
    return env


def export(values: Mapping[str, str | None]) -> dict[str, str | None]:
    """Set (None: remove) variables in this process's environment, for itself and the children it
    starts; returns the previous values, for `restore`."""
    saved = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    return saved


def restore(saved: Mapping[str, str | None]) -> None:
    """Undo an `export`."""
    export(saved)
