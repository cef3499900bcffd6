"""`dtorch run`: an elastic, fault-tolerant launcher on torch.distributed.elastic's agent.

This is torchrun's machinery (`LocalElasticAgent` + dynamic rendezvous), configured and extended:

- Known defects worked around (see shared/reference/RELIABILITY.md):
  * restarts reading a stale master address from the agent's shared TCPStore (pytorch#135712):
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, workers get a fresh store per round;
  * workers orphaned by a SIGKILLed agent: every worker starts through `dtorch.elastic.bootstrap`,
    which sets PR_SET_PDEATHSIG (and the heartbeat thread exits when the agent pid disappears);
  * slow scale-down (~41 s by default): last_call_timeout=1 s, keep-alive every 1 s with 5 misses
    (a dead node leaves the rendezvous after ~5 s instead of 15 s), join_timeout=120 s;
  * a node lost between rendezvous and worker start, which left the others blocked in
    process-group init (30 min): the agent watches the round's keep-alives, and rejoins when it
    was itself dropped from the round;
  * ~10 s of Python + torch imports per worker (re)start: workers fork from a forkserver that
    imported torch once (`start_method="forkserver"`, default).
- Control plane bound to loopback by default: `--rdzv-endpoint 127.0.0.1:0` and, when the endpoint
  is loopback, workers' MASTER_ADDR is 127.0.0.1 too. torch's TCPStore listens on all interfaces
  whatever host it is given, so the rendezvous store is built here on a socket bound to the
  endpoint's address only (`dtorch.elastic.store`); workers should create their process group
  with `dtorch.elastic.worker.init_process_group` for the same reason. Multi-node runs must name a
  reachable endpoint explicitly. The rendezvous state is signed with the job's key and verified
  before torch unpickles it (`dtorch.elastic.store.SignedBackend`); the workers' store is not
  authenticated: keep multi-node endpoints on a private network.
- Errors no restart can fix (`dtorch.elastic.bootstrap.is_fatal`) stop the job at once: the agent
  prints the worker's one line and `launch` returns 2.
- In-memory snapshots (`dtorch.checkpoint.snapshot`): the agent owns a private /dev/shm directory
  for them (DTORCH_SNAPSHOT_DIR), removed when the job ends.
- Hang detection: the agent's monitor loop also reads the workers' heartbeats
  (`dtorch.elastic.heartbeat`); a rank without progress for `--heartbeat-timeout` seconds gets its
  stacks and flight recorder dumped, ONE line names it, and the local group is SIGKILLed so the
  agent restarts it (counts as a restart, like a crash).
- Membership epoch: the rendezvous round, given to workers as DTORCH_EPOCH.
- Growing back waits for a checkpoint boundary: a waiting node is admitted (the agent restarts its
  workers into a bigger group) once every local rank has reported a newer committed checkpoint
  (`worker.checkpoint_committed`) or after `grow_wait` seconds; scripts that never report commit
  are not held back.
- The agent itself, its detectors (exit, hang, node loss, straggler) and the one place that
  records and acts on their detections: `dtorch.elastic.agent`; what it reads of torch's private
  elastic state: `dtorch.elastic.torch_compat`.
- Every detection, rendezvous and worker start goes to `<run_dir>/events.jsonl`; each recovery is
  summarised there (and printed) with its phases timed (`dtorch.elastic.events.recoveries`).
"""

from __future__ import annotations

import importlib
import logging
import os
import secrets
import stat
import sys
import tempfile
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

from dtorch import trust
from dtorch.elastic import chaos, events, heartbeat, preemption
from dtorch.elastic import store as rdzv_store
from dtorch.env import current, environ, export, restore
from dtorch.errors import ConfigError

log = logging.getLogger("dtorch.elastic")

# Rendezvous settings that make recovery fast; any of them can be overridden with --rdzv-conf.
FAST_RDZV_CONF: dict[str, Any] = {
    "last_call_timeout": 1,  # seconds to wait for more nodes once min is reached (default 30)
    "join_timeout": 120,  # seconds a rendezvous may take in all (default 600)
    "keep_alive_interval": 1,  # agent keep-alive period (default 5)
    # Missed keep-alives before a node is dropped (default 3, i.e. 15 s). 3 x 1 s evicted live but
    # CPU-starved agents on a loaded machine, splitting the job in two: 5 s is the compromise.
    "keep_alive_max_attempt": 5,
}


START_METHODS = ("forkserver", "spawn")


@dataclass
class LaunchSpec:
    """Everything `dtorch run` needs besides the script. Field names follow torchrun's flags."""

    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: int = 1
    rdzv_backend: str = "c10d"
    """"c10d" (elastic: nodes join and leave, ranks given at each rendezvous) or "static"
    (torchrun's `--node-rank`/`--master-addr`/`--master-port`: a fixed set of nodes, each with the
    rank it is given; see `StaticRendezvous`). Any other name goes to torch's registry."""
    rdzv_endpoint: str = "127.0.0.1:0"
    """host:port of the rendezvous store. Port 0 = pick a free one (single node only). For the
    static rendezvous: node 0's address and port (torchrun's master_addr:master_port)."""
    node_rank: int | None = None
    """This node's rank, static rendezvous only (torchrun's `--node-rank`; default 0)."""
    rdzv_id: str | None = None
    """Job id shared by all nodes. Default: a fresh id on one node; "none" (torchrun's) on many."""
    rdzv_conf: dict[str, Any] = field(default_factory=dict)
    max_restarts: int = 3
    monitor_interval: float = 0.1
    """Seconds between two checks of the workers by the agent."""
    heartbeat_timeout: float = 30.0
    """Seconds without progress after which a rank is declared hung; 0 disables the check."""
    startup_timeout: float | None = None
    """Seconds a rank may take to its first beat once others beat (default 10x heartbeat_timeout)."""
    chaos: str = ""
    """Fault-injection spec, see `dtorch.elastic.chaos`."""
    run_dir: str | None = None
    """Where heartbeats, dumps, chaos marks and events.jsonl go. Default: a fresh private
    $TMPDIR/dtorch-<rdzv_id>-<random>. An existing one must be ours and writable by nobody else.
    Share it between nodes (or not) as you like: each agent only judges its own workers."""
    local_addr: str | None = None
    shutdown_timeout: int = 5
    """Seconds between SIGTERM and SIGKILL when the agent stops its workers (torchrun: 30)."""
    grow_wait: float = 300.0
    """Longest time a waiting node is held back for a checkpoint boundary (seconds)."""
    snapshot_every: int = 1
    """Steps between in-memory snapshots of DTorch's trainer (0 = off): a worker failure then
    costs at most this many steps, not the steps since the last durable checkpoint."""
    preload: tuple[str, ...] = ()
    """Modules the forkserver imports besides torch (`TRAINER_PRELOAD` for `dtorch train`)."""
    start_method: str = "forkserver"
    """How workers start: "forkserver" forks them from a server that imported torch once (fast
    restarts); "spawn" runs a fresh interpreter per worker, as torchrun does for scripts."""
    log_dir: str | None = None
    """torchrun's `--log-dir`: the base directory of the workers' log files (a job directory named
    after `rdzv_id` is made in it). Default: `<run_dir>/logs`."""
    redirects: str = "0"
    """torchrun's `--redirects`: which std streams of which local ranks go to a log file only
    (0 none, 1 stdout, 2 stderr, 3 both; "3" for every rank or "0:1,1:2" per local rank)."""
    tee: str = "0"
    """torchrun's `--tee`: the same syntax, streams written to the log file and to the console."""
    local_ranks_filter: str = ""
    """torchrun's `--local-ranks-filter`: "0,1" shows only those local ranks' output on the console."""

    def __post_init__(self) -> None:
        if self.start_method not in START_METHODS:
            raise ConfigError("start_method", self.start_method, "use one of {forkserver, spawn}")
        if not (1 <= self.min_nodes <= self.max_nodes):
            raise ConfigError("nnodes", f"{self.min_nodes}:{self.max_nodes}", "use N or MIN:MAX with 1 <= MIN <= MAX")
        if self.nproc_per_node < 1:
            raise ConfigError("nproc_per_node", self.nproc_per_node, "use a positive number of workers per node")
        if self.snapshot_every < 0:
            raise ConfigError("snapshot_every", self.snapshot_every, "use steps >= 1, or 0 for no snapshots")
        if self.max_restarts < 0:
            raise ConfigError("max_restarts", self.max_restarts, "use 0 or more")
        if self.heartbeat_timeout < 0:
            raise ConfigError("heartbeat_timeout", self.heartbeat_timeout, "use seconds > 0, or 0 to disable")
        for name in ("redirects", "tee"):
            std_streams(name, getattr(self, name))
        ranks_filter(self.local_ranks_filter)
        host, port = split_endpoint(self.rdzv_endpoint)
        if self.rdzv_backend == "static":
            self._check_static(port)
        elif self.node_rank is not None:
            raise ConfigError("node_rank", self.node_rank,
                              f"the {self.rdzv_backend} rendezvous ranks the nodes itself; --node-rank belongs to "
                              "the static rendezvous (drop --rdzv-backend and --rdzv-endpoint, or drop --node-rank)")
        if self.rdzv_backend == "c10d" and port == 0 and self.max_nodes > 1:
            raise ConfigError("rdzv_endpoint", self.rdzv_endpoint,
                              "several nodes need a fixed port every node can reach, e.g. --rdzv-endpoint HOST:29400")
        if self.local_addr is None and trust.is_loopback(host):
            self.local_addr = "127.0.0.1"  # keep MASTER_ADDR off the network when the job is local
        if self.rdzv_id is None:
            self.rdzv_id = f"dtorch-{uuid.uuid4().hex[:12]}" if self.max_nodes == 1 else "none"
        if self.run_dir is None:  # unpredictable: nobody can plant it before us
            self.run_dir = os.path.join(tempfile.gettempdir(), f"dtorch-{self.rdzv_id}-{secrets.token_hex(8)}")
        if self.startup_timeout is None:
            self.startup_timeout = 10 * self.heartbeat_timeout
        chaos.parse(self.chaos)  # fail now, not in every worker

    def _check_static(self, port: int) -> None:
        if self.min_nodes != self.max_nodes:
            raise ConfigError("nnodes", f"{self.min_nodes}:{self.max_nodes}",
                              "a static rendezvous (--node-rank/--master-addr) has a fixed number of nodes: use "
                              "--nnodes N, or the c10d rendezvous (--rdzv-endpoint HOST:PORT) to be elastic")
        if "rank" in self.rdzv_conf:  # torchrun overrides it with --node-rank: one source, not two
            raise ConfigError("rdzv_conf", f"rank={self.rdzv_conf['rank']}", "give this node's rank as --node-rank")
        if self.node_rank is None:
            self.node_rank = 0
        if not 0 <= self.node_rank < self.max_nodes:
            raise ConfigError("node_rank", self.node_rank, f"use 0 <= --node-rank < --nnodes ({self.max_nodes})")
        if port == 0 and self.max_nodes > 1:
            raise ConfigError("master_port", port, "the nodes of a static rendezvous need a fixed port, e.g. "
                              "--master-port 29500")
        if self.max_nodes > 1 and self.max_restarts > 0:
            # each agent restarts only its own workers into a new round that the other nodes never
            # join (torchrun's static rendezvous has the same limit): the job would hang, not recover
            raise ConfigError("max_restarts", self.max_restarts,
                              "a static rendezvous of several nodes cannot restart one node's workers into the "
                              "others' group: use --max-restarts 0, or the c10d rendezvous (--rdzv-endpoint "
                              "HOST:PORT, no --node-rank) to recover from failures")


def std_streams(name: str, text: str) -> Any:
    """torchrun's `--redirects`/`--tee` value as torch's `Std` (or a map local rank -> `Std`)."""
    from torch.distributed.elastic.multiprocessing import Std

    try:
        return Std.from_str(text)
    except ValueError:
        raise ConfigError(name, text, "use 0 (none), 1 (stdout), 2 (stderr) or 3 (both), for every local "
                          "rank or per rank as LOCAL_RANK:N,..., e.g. 3 or 0:3,1:2") from None


def ranks_filter(text: str) -> set[int] | None:
    """torchrun's `--local-ranks-filter` ("0,1") as a set of local ranks; None for no filter."""
    if not text:
        return None
    try:
        return {int(r) for r in text.split(",")}
    except ValueError:
        raise ConfigError("local_ranks_filter", text, "use comma-separated local ranks, e.g. 0,1") from None


class StaticRendezvous:
    """torchrun's static rendezvous: `nnodes` nodes, each with the rank it was given; node 0
    serves the store at the endpoint (master_addr:master_port), bound to that address only
    (`dtorch.process_group.tcp_store`, unlike torch's static handler, whose store listens on every
    interface). Each round (the first start, and every restart on a single node) publishes a fresh
    port on node 0 for the workers' own store (MASTER_ADDR is the endpoint's host), as the c10d
    rendezvous does with TORCH_DISABLE_SHARE_RDZV_TCP_STORE."""

    def __init__(self, endpoint: str, node_rank: int, nnodes: int, run_id: str, timeout_s: float = 600.0):
        self.host, self.port = split_endpoint(endpoint)
        self.rank, self.world_size, self.run_id = node_rank, nnodes, run_id
        self.timeout_s = timeout_s
        self._store: Any = None
        self._round = 0

    use_agent_store = False  # the workers build their own store (`dtorch.elastic.worker`)

    def get_backend(self) -> str:
        return "static"

    def next_rendezvous(self) -> Any:
        from datetime import timedelta

        from torch.distributed import PrefixStore
        from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousStoreInfo

        from dtorch.process_group import tcp_store

        if self._store is None:
            self._store = tcp_store(self.host, self.port, self.rank == 0, timedelta(seconds=self.timeout_s),
                                    multi_tenant=True)
        store = PrefixStore(f"dtorch-static/{self.run_id}/{self._round}", self._store)
        self._round += 1
        info = RendezvousStoreInfo.build(self.rank, store, local_addr=self.host if self.rank == 0 else None)
        return RendezvousInfo(store, self.rank, self.world_size, info)

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self.run_id

    def shutdown(self) -> bool:
        return True



SNAP_PREFIX = "dtorch-snap-"
"""Snapshot directories are named ``dtorch-snap-<agent pid>.<its start time>.<random>``: an agent
killed with SIGKILL cannot remove its own (RAM in /dev/shm), so the next agent on the node removes
those whose agent is gone."""


def _process_tag(pid: int) -> str | None:
    """``<pid>.<start time in clock ticks>`` (/proc), which names one process even after its pid is
    reused; None where there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f"{pid}.{f.read().rsplit(')', 1)[1].split()[19]}"
    except (OSError, IndexError):
        return None


def sweep_stale_snapshots(parent: str) -> list[str]:
    """Remove this user's snapshot directories under `parent` whose agent no longer runs (killed
    with SIGKILL, or its node rebooted the job away); returns the paths removed. A directory of a
    running agent, of another user, a symlink or a name not of this form is left alone."""
    import shutil

    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        parts = name[len(SNAP_PREFIX):].split(".") if name.startswith(SNAP_PREFIX) else []
        if len(parts) != 3 or not parts[0].isdigit():
            continue
        path = os.path.join(parent, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            continue
        if _process_tag(int(parts[0])) == f"{parts[0]}.{parts[1]}":
            continue  # its agent is alive
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed

def split_endpoint(endpoint: str) -> tuple[str, int]:
    """`host:port` -> (host, port); a missing port is 29400 (torchrun's default)."""
    host, sep, port = endpoint.rpartition(":")
    if not sep:
        return endpoint, 29400
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        raise ConfigError("rdzv_endpoint", endpoint, "use HOST:PORT, e.g. 127.0.0.1:29400") from None


def parse_nnodes(text: str) -> tuple[int, int]:
    """torchrun's `--nnodes`: "N" or "MIN:MAX"."""
    try:
        lo, _, hi = text.partition(":")
        return int(lo), int(hi or lo)
    except ValueError:
        raise ConfigError("nnodes", text, "use N or MIN:MAX, e.g. --nnodes 1:4") from None


def _prepare_run_dir(spec: LaunchSpec, run_dir: str) -> None:
    """The run directory private (0700, ours, not a symlink), no planted link in it, no stale
    preemption marker; and torch._dynamo imported in the background."""
    trust.private_dir(run_dir, "run_dir")
    for name in (events.EVENTS_FILE, heartbeat.HB_DIR, heartbeat.DUMP_DIR, *(() if spec.log_dir else ("logs",))):
        if os.path.islink(os.path.join(run_dir, name)):
            raise ConfigError("run_dir", run_dir, f"{name} in it is a symlink (planted?); remove it or use another --run-dir")
    preemption.clear(run_dir)
    # torch's log formatter imports torch._dynamo on the first exception it formats, and the agent
    # formats one on every worker failure: 2-5 s added to each first recovery here. Pay it now,
    # in the background, while the workers start.
    threading.Thread(target=importlib.import_module, args=("torch._dynamo",), daemon=True,
                     name="dtorch-preimport").start()


def _snapshot_dir(spec: LaunchSpec, run_dir: str) -> str | None:
    """A fresh private directory for the in-memory snapshots, or None when they are off."""
    if spec.snapshot_every <= 0:
        return None
    # RAM (/dev/shm) when there is one: snapshots outlive workers, not the machine
    # (DTORCH_SNAPSHOT_ROOT: another parent directory, e.g. for tests that kill agents)
    shm = current().snapshot_root or (
        "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else run_dir)
    sweep_stale_snapshots(shm)
    return str(trust.private_dir(os.path.join(shm, f"{SNAP_PREFIX}{_process_tag(os.getpid()) or 'nopid'}."
                                                   f"{secrets.token_hex(8)}"), "snapshot_dir"))


def _worker_env(spec: LaunchSpec, run_dir: str, snap_dir: str | None) -> dict[str, str]:
    """The variables the workers (and this agent) run with, see `dtorch.env.RuntimeEnv`."""
    env = {
        "DTORCH_SNAPSHOT_DIR": snap_dir or "",
        "DTORCH_SNAPSHOT_EVERY": str(spec.snapshot_every),
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "DTORCH_RUN_DIR": run_dir,
        "DTORCH_AGENT_PID": str(os.getpid()),
        "DTORCH_PREEMPT_MARKER": preemption.marker(run_dir, os.getpid()),  # read by dtorch.train.preempt
        "DTORCH_CHAOS": spec.chaos,
        "DTORCH_HEARTBEAT_INTERVAL": str(max(0.05, min(0.5, spec.heartbeat_timeout / 10 or 0.5))),
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
    }
    # The flight recorder (gloo and NCCL) is what names the collective a hung rank is in.
    env.setdefault("TORCH_FR_BUFFER_SIZE", current().flight_recorder_size or "2000")
    return env


def _entrypoint(spec: LaunchSpec, target: str, args: list[str], module: bool, no_python: bool,
                worker_env: dict[str, str]) -> tuple[Any, list]:
    """(what the agent starts per worker, its arguments): the executable itself, the forkserver's
    `run_target` (with `worker_env`: the forkserver may predate it), or a fresh interpreter running
    `dtorch.elastic.bootstrap`."""
    if no_python:
        return target, list(args)
    if spec.start_method == "forkserver":
        from dtorch.elastic.bootstrap import run_target, start_forkserver

        start_forkserver(spec.preload)  # already running when the command started it early
        return run_target, [dict(worker_env), target, list(args), module]
    return sys.executable, ["-u", "-m", "dtorch.elastic.bootstrap", *(["-m"] if module else []), target, *args]


def _rendezvous(spec: LaunchSpec) -> Any:
    """The rendezvous handler of `spec` (static, DTorch's TCP store, or torch's registry), gated."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry

    from dtorch.elastic.agent import GatedRendezvous

    conf = {**FAST_RDZV_CONF, **spec.rdzv_conf}
    params = RendezvousParameters(backend=spec.rdzv_backend, endpoint=spec.rdzv_endpoint, run_id=spec.rdzv_id,
                                  min_nodes=spec.min_nodes, max_nodes=spec.max_nodes,
                                  local_addr=spec.local_addr, **conf)
    if spec.rdzv_backend == "static":
        inner: Any = StaticRendezvous(spec.rdzv_endpoint, spec.node_rank or 0, spec.max_nodes, str(spec.rdzv_id),
                                      float(conf.get("timeout", 600)))
    elif spec.rdzv_backend == "c10d" and conf.get("store_type", "tcp") == "tcp":
        inner = rdzv_store.rendezvous_handler(params)  # listens on the endpoint's address only
    else:
        inner = rdzv_registry.get_rendezvous_handler(params)
    return GatedRendezvous(inner)


def _exit_code(agent: Any, result: Any, spec: LaunchSpec) -> int:
    """The job's exit code from the agent's result, with the one line that names a failure's cause."""
    if result is None:  # the rendezvous was closed by another node: nothing left to do here
        return 0
    if agent.fatal is not None:
        print(f"dtorch: error: {agent.fatal}", file=sys.stderr, flush=True)
        return agent.fatal_code
    if result.is_failed():
        ranks = ", ".join(f"rank {r} (exit {f.exitcode})" for r, f in sorted(result.failures.items()))
        # the last line names the cause: the first failing worker's exception and where its
        # traceback is (not only an exit code)
        cause = agent.cause or f"{ranks or 'unhealthy workers'}; events: {agent.events_path}"
        print(f"dtorch: job failed after {spec.max_restarts} restarts: {cause}", file=sys.stderr, flush=True)
        return 1
    return 0


def launch(spec: LaunchSpec, target: str, args: list[str], module: bool = False, no_python: bool = False) -> int:
    """Run `target` (a script path, a module with `module=True`, or an executable with `no_python`)
    on `spec.nproc_per_node` workers per node under the elastic agent. Returns the exit code:
    0 when every worker succeeded, 1 when the job failed after its restarts, 2 when a worker met an
    error no restart can fix (a `fatal` event: the agent prints its one line, no retries).

    Called from your own script with the forkserver start method, that script must guard its
    entry point with `if __name__ == "__main__":` (multiprocessing's forkserver imports the main
    module). Sets the DTORCH_* variables in this process's environment while it runs."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException

    from dtorch.elastic.agent import DTorchAgent, QuietFatal

    run_dir: str = spec.run_dir  # type: ignore[assignment]
    _prepare_run_dir(spec, run_dir)
    snap_dir = _snapshot_dir(spec, run_dir)
    # the agent exports DTORCH_EPOCH per start: restored with the rest when the job ends
    worker_env = _worker_env(spec, run_dir, snap_dir)
    saved = {"DTORCH_EPOCH": environ().get("DTORCH_EPOCH"), **export(worker_env)}
    entrypoint, wargs = _entrypoint(spec, target, args, module, no_python, worker_env)
    handler = _rendezvous(spec)
    wspec = WorkerSpec(role="dtorch", local_world_size=spec.nproc_per_node, entrypoint=entrypoint,
                       args=tuple(wargs), rdzv_handler=handler, max_restarts=spec.max_restarts,  # type: ignore[arg-type]
                       monitor_interval=spec.monitor_interval, local_addr=spec.local_addr)
    logs = DefaultLogsSpecs(log_dir=spec.log_dir or os.path.join(run_dir, "logs"),
                            redirects=std_streams("redirects", spec.redirects), tee=std_streams("tee", spec.tee),
                            local_ranks_filter=ranks_filter(spec.local_ranks_filter))
    agent = DTorchAgent(spec=wspec, logs_specs=logs,
                        start_method="forkserver" if spec.start_method == "forkserver" else "spawn",
                        shutdown_timeout=spec.shutdown_timeout, dspec=spec)
    handler.gate = agent.grow_gate
    quiet = QuietFatal(agent.events_path, agent)
    torch_logs = [logging.getLogger(n) for n in ("torch.distributed.elastic.multiprocessing.api",
                                                 "torch.multiprocessing.spawn")]
    for lg in torch_logs:
        lg.addFilter(quiet)
    shutdown_rdzv = True
    try:
        result = agent.run()
        agent.drain_reports()
        agent._maybe_report_recovery(force=True)
        return _exit_code(agent, result, spec)
    except SignalException as e:
        shutdown_rdzv = False  # closing the rendezvous would stop the other nodes from carrying on
        return 128 + int(e.sigval)
    finally:
        for lg in torch_logs:
            lg.removeFilter(quiet)
        if snap_dir:
            import shutil

            shutil.rmtree(snap_dir, ignore_errors=True)  # the agent owns the snapshots: gone with the job
        if shutdown_rdzv:
            handler.shutdown()
        restore(saved)
