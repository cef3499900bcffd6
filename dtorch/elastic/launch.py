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
- Every detection, rendezvous and worker start goes to `<run_dir>/events.jsonl`; each recovery is
  summarised there (and printed) with its phases timed (`dtorch.elastic.events.recoveries`).
"""

from __future__ import annotations

import importlib
import logging
import os
import secrets
import signal
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from dtorch import trust
from dtorch.elastic import chaos, events, heartbeat, preemption
from dtorch.elastic import store as rdzv_store
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
# What the forkserver imports once, so that a worker (re)start is a fork instead of a torch import.
# torch._dynamo alone is ~4 s: it is imported lazily by the first optimizer a worker builds.
FORKSERVER_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.distributed.checkpoint",
                      "torch.distributed.tensor", "torch.distributed.fsdp", "dtorch.elastic.bootstrap"]
# What `dtorch train` adds to it: DTorch's trainer and what it imports on the way to its first step
# (~0.1-0.3 s of every worker start on a small, loaded machine). Import-time state of these modules
# is inherited by every fork, so they keep none that a worker must not share (checked: module
# constants, registries and caches only; threads start in `worker.setup`). Never the target
# module itself: runpy warns when the module it is to run as __main__ is imported already.
TRAINER_PRELOAD = ("dtorch.train.trainer", "dtorch.train.data", "dtorch.train.sampler",
                   "dtorch.parallel.parallelize", "dtorch.checkpoint.manager", "dtorch.checkpoint.snapshot",
                   "dtorch.monitor.live", "dtorch.monitor.straggler", "dtorch.elastic.worker", "dtorch.models",
                   "dtorch.model.profiler", "dtorch.integrations.status", "dtorch.integrations.env")


@dataclass
class LaunchSpec:
    """Everything `dtorch run` needs besides the script. Field names follow torchrun's flags."""

    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: int = 1
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str = "127.0.0.1:0"
    """host:port of the rendezvous store. Port 0 = pick a free one (single node only)."""
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
        host, port = split_endpoint(self.rdzv_endpoint)
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


def _agent_class():
    """Built on first use: importing torch.distributed.elastic costs ~1 s."""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class DTorchAgent(LocalElasticAgent):
        """LocalElasticAgent + membership epoch, heartbeat hang detection, event log, grow gating."""

        def __init__(self, *args: Any, dspec: LaunchSpec, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.dspec = dspec
            self.run_dir: str = dspec.run_dir  # type: ignore[assignment]
            self.events_path = os.path.join(self.run_dir, events.EVENTS_FILE)
            self.epoch = -1
            self.watch = heartbeat.HangWatch(self.run_dir, dspec.heartbeat_timeout, dspec.startup_timeout or 0)
            self.local_pids: dict[int, int] = {}
            self.recoveries_reported = 0
            self.detections = 0  # failures this agent saw; each should end in a reported recovery
            self.recovery_pending = False
            self._next_recovery_check = 0.0
            self._grow_since: float | None = None
            self._saw_commits = False
            self._next_peer_check = 0.0
            self._round_nodes: set[str] = set()
            self._round_t = 0.0
            self._grow_base: int | None = None
            self._grew = False
            self.fatal: str | None = None
            """The one-line message of an error a restart cannot fix (see bootstrap.is_fatal)."""

        # -- membership
        def _round(self) -> int:
            holder = getattr(self._worker_group.spec.rdzv_handler, "_state_holder", None)
            try:
                return int(holder.state.round)  # type: ignore[union-attr]
            except AttributeError:  # another rendezvous backend: fall back to this agent's count
                return self._worker_group.spec.max_restarts - self._remaining_restarts

        def _rendezvous(self, worker_group: Any) -> None:
            t0 = time.time()
            if self._grew:
                # the group that just stopped was stopped to grow: name the checkpoint the grown
                # group resumes from (workers publish each commit the moment it happens)
                self._grew = False
                beats = heartbeat.read_local_beats(self.run_dir, self.epoch, self.local_pids)
                done = [b.get("committed_step") for b in beats.values() if b.get("committed_step") is not None]
                events.log("grow_checkpoint", self.events_path, epoch=self.epoch,
                           committed_step=min(done) if len(done) == len(self.local_pids) and done else None)
            if not self._saw_commits:  # did the group that just ended report checkpoints?
                self._saw_commits = any(b.get("committed_step") is not None
                                        for b in heartbeat.read_beats(self.run_dir, self.epoch).values())
            super()._rendezvous(worker_group)
            self.epoch = self._round()
            state = self._rdzv_state()
            self._round_nodes = {str(n) for n in state.participants} if state is not None else set()
            self._round_t = time.time()
            events.log("rendezvous", self.events_path, start=t0, end=time.time(), epoch=self.epoch,
                       world_size=worker_group.workers[0].world_size if worker_group.workers else None,
                       nodes=worker_group.group_world_size, node_rank=worker_group.group_rank)

        def _start_workers(self, worker_group: Any) -> dict[int, Any]:
            os.environ["DTORCH_EPOCH"] = str(self.epoch)  # for workers started as new processes
            if callable(worker_group.spec.entrypoint):
                # forked workers inherit the forkserver's environment: pass what changes per start
                worker_group.spec.args = ({"DTORCH_EPOCH": str(self.epoch)}, *worker_group.spec.args[1:])
            pids = super()._start_workers(worker_group)
            preemption.arm(self.run_dir)  # after torch registered its SIGTERM handler for this start
            self.local_pids = {worker_group.workers[lr].global_rank: pid for lr, pid in pids.items()}
            self.watch.reset(self.epoch, self.local_pids)
            events.log("workers_started", self.events_path, epoch=self.epoch, ranks=sorted(self.local_pids),
                       node_rank=worker_group.group_rank)
            return pids

        def _stop_workers(self, worker_group: Any) -> None:
            # SIGCONT first: a stopped worker cannot act on SIGTERM, and torch would wait for it.
            for pid in self.local_pids.values():
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            self._shutdown(timeout=self.dspec.shutdown_timeout)

        # -- detection
        def _monitor_workers(self, worker_group: Any) -> Any:
            t_check = time.time()
            # For a failed group this call also stops the surviving workers (torch waits for them:
            # ~1.8 s for forked workers here), so the failure was seen at t_check, not on return.
            result = super()._monitor_workers(worker_group)
            if result.state == WorkerState.FAILED:
                fatal = self._fatal_event()
                if fatal is not None:
                    self._on_fatal(fatal)
                    return result
                self._on_exit_failure(result, t_check)
            elif result.state == WorkerState.HEALTHY:
                hang = self.watch.check()
                if hang is not None:
                    self._on_hang(hang)
                    return RunResult(state=WorkerState.UNHEALTHY)
                lost = self._lost_nodes()
                if lost:
                    self._on_node_lost(lost)
                    return RunResult(state=WorkerState.UNHEALTHY)
                self._maybe_report_recovery()
            return result

        def _fatal_event(self) -> dict[str, Any] | None:
            """The first `fatal` event of this epoch: a worker met an error no restart can fix."""
            evs = [e for e in events.read(self.events_path) if e["kind"] == "fatal" and e.get("epoch") == self.epoch]
            return min(evs, key=lambda e: (e["t"], e.get("rank", 0))) if evs else None

        def _on_fatal(self, ev: dict[str, Any]) -> None:
            self._remaining_restarts = 0  # torch's loop then stops the group and returns the failure
            self.fatal = str(ev.get("message") or ev.get("error"))
            events.log("stopped", self.events_path, cause="fatal", rank=ev.get("rank"), epoch=self.epoch,
                       message=self.fatal)

        def _fault_time(self, ranks: list[int]) -> float | None:
            """When the fault happened: the chaos mark if one fired, else the last progress seen."""
            faults = [e["t"] for e in events.read(self.events_path)
                      if e["kind"] == "fault" and e.get("epoch") == self.epoch and e.get("rank") in ranks]
            if faults:
                return min(faults)
            beats = heartbeat.read_beats(self.run_dir, self.epoch)
            ts = [beats[r]["progress_t"] for r in ranks if r in beats]
            return min(ts) if ts else None

        def _exit_codes(self, result: Any) -> dict[int, int]:
            """Exit codes of every local worker that has exited. torch reports one failure per group
            for forked workers (the first it saw), which need not be the root cause."""
            codes = {r: f.exitcode for r, f in result.failures.items()}
            procs = getattr(getattr(self._pcontext, "_pc", None), "processes", None)
            if procs:
                for w in self._worker_group.workers:
                    code = procs[w.local_rank].exitcode
                    if code is not None and code != 0:
                        codes.setdefault(w.global_rank, code)
            return dict(sorted(codes.items()))

        def _on_exit_failure(self, result: Any, t_check: float) -> None:
            codes = self._exit_codes(result)
            # Ranks the agent itself SIGTERMed while stopping the group are victims, not causes;
            # so are ranks that raised because a peer vanished, when some rank died of a signal.
            ranks = [r for r, c in codes.items() if c != -signal.SIGTERM] or sorted(codes)
            if any(codes[r] < 0 for r in ranks):
                ranks = [r for r in ranks if codes[r] < 0]
            fault_t = self._fault_time(ranks)
            self.detections += 1
            self.recovery_pending = True
            events.log("detected", self.events_path, cause="exit", ranks=ranks, exitcodes=codes,
                       epoch=self.epoch, fault_t=fault_t, detect_t=t_check)
            why = {r: (signal.Signals(-codes[r]).name if codes[r] < 0 else f"exit code {codes[r]}") for r in ranks}
            print(f"dtorch: worker failure in epoch {self.epoch}: "
                  + ", ".join(f"rank {r} ({s})" for r, s in why.items())
                  + f"; {len(codes) - len(ranks)} other local ranks stopped; "
                  + f"{self._remaining_restarts} restarts left", file=sys.stderr, flush=True)

        def _rdzv_state(self) -> Any:
            """The rendezvous state as stored (read-only; None if unavailable)."""
            backend = self._worker_group.spec.rdzv_handler._state_holder._backend
            if not isinstance(backend, rdzv_store.SignedBackend):
                return None  # another backend: its values are not authenticated, so not read here
            try:
                return rdzv_store.read_state(backend)
            except Exception:  # a store hiccup: nothing to conclude
                return None

        def _lost_nodes(self) -> dict[str, float]:
            """Nodes of this round whose agent stopped its rendezvous keep-alive (a dead or cut-off
            node): still listed with an expired keep-alive, or already removed from the round by a
            surviving agent's keep-alive. torch's agent only looks for nodes joining; a node lost
            before its workers connected would leave ours blocked in process-group init until that
            times out (30 min). At most one store read a second. Returns node -> last sign of life
            (seconds since the epoch)."""
            now = time.time()
            if now < self._next_peer_check or not self._round_nodes:
                return {}
            self._next_peer_check = now + 1.0
            state = self._rdzv_state()
            if state is None:
                return {}
            me = str(self._worker_group.spec.rdzv_handler._this_node)
            if state.round > self.epoch or (state.round == self.epoch and state.complete
                                            and me not in {str(n) for n in state.participants}):
                # Our round is over without us (we were dropped: a stalled keep-alive, or the others
                # moved on). Our workers belong to a group that no longer exists: restart and rejoin.
                return {me: self._round_t}
            if state.round != self.epoch or not state.complete:
                return {}
            from datetime import datetime, timezone

            settings = self._worker_group.spec.rdzv_handler._settings
            expire = datetime.now(timezone.utc) - settings.keep_alive_interval * settings.keep_alive_max_attempt
            hb = state.last_heartbeats
            lost = {str(n): hb[n].timestamp() for n in state.participants if n in hb and hb[n] < expire}
            present = {str(n) for n in state.participants}
            for name in self._round_nodes - present:
                lost[name] = self._round_t  # removed as dead by another agent: last seen at the rendezvous
            return lost

        def _on_node_lost(self, lost: dict[str, float]) -> None:
            t_detect = time.time()
            heartbeat.kill_all(self.local_pids)
            self.detections += 1
            self.recovery_pending = True
            # the fault: somewhat after the node's last keep-alive (within one keep-alive interval)
            events.log("detected", self.events_path, cause="node_lost", ranks=[], nodes=sorted(lost),
                       epoch=self.epoch, detect_t=t_detect, fault_t=min(lost.values()))
            me = str(self._worker_group.spec.rdzv_handler._this_node)
            what = (f"this node ({me}) was dropped from round {self.epoch} of the rendezvous" if me in lost else
                    f"node(s) {', '.join(sorted(lost))} stopped their rendezvous keep-alive in epoch {self.epoch}")
            print(f"dtorch: {what}; restarting the local workers into a new round", file=sys.stderr, flush=True)

        def _on_hang(self, hang: heartbeat.Hang) -> None:
            t_detect = time.time()
            states = heartbeat.sample_states(self.local_pids)
            beats = heartbeat.read_beats(self.run_dir, hang.epoch)
            dump = heartbeat.dump_and_kill(self.run_dir, hang.epoch, self.local_pids, states)
            line, fields = heartbeat.diagnose(hang, beats, self.local_pids, states, dump)
            culprit = fields.pop("rank")
            self.detections += 1
            self.recovery_pending = True
            events.log("detected", self.events_path, cause="hang", ranks=[culprit], epoch=self.epoch,
                       detect_t=t_detect, diagnosis=line, **fields)
            print(line, file=sys.stderr, flush=True)

        def _maybe_report_recovery(self, force: bool = False) -> None:
            now = time.time()
            if not self.recovery_pending or (now < self._next_recovery_check and not force):
                return
            self._next_recovery_check = now + 1.0
            if self._worker_group.group_rank != 0:
                return  # one agent reports
            recs = events.recoveries(self.events_path)
            for r in recs[self.recoveries_reported:]:
                events.log("recovery", self.events_path, **r)
                print("dtorch: " + events.format_recovery(r), file=sys.stderr, flush=True)
            self.recoveries_reported = max(self.recoveries_reported, len(recs))
            self.recovery_pending = len(recs) < self.detections

        # -- growing at a checkpoint boundary
        def grow_gate(self, waiting: int) -> int:
            """How many waiting nodes to report to the agent loop now (0 = not yet).

            Once the workers have reported a committed checkpoint (in any epoch), a waiting node
            is admitted only after the next commit in this epoch, or after `grow_wait` seconds."""
            if waiting <= 0:
                self._grow_since = None
                return 0
            beats = heartbeat.read_local_beats(self.run_dir, self.epoch, self.local_pids)
            mine = [beats[r].get("committed_step") for r in self.local_pids if r in beats]
            self._saw_commits = self._saw_commits or any(c is not None for c in mine)
            now = time.time()
            if not self._saw_commits:
                return self._admit(waiting, None, "this job reports no checkpoints")
            base = min((c for c in mine if c is not None), default=None)
            if self._grow_since is None:
                self._grow_since, self._grow_base = now, base
                events.log("grow_waiting", self.events_path, epoch=self.epoch, waiting=waiting, committed_step=base)
            newer = (len(mine) == len(self.local_pids) and all(c is not None for c in mine)
                     and (self._grow_base is None or min(mine) > self._grow_base))  # type: ignore[type-var]
            if newer:
                return self._admit(waiting, min(mine), "checkpoint committed")  # type: ignore[type-var]
            if now - self._grow_since > self.dspec.grow_wait:
                return self._admit(waiting, base, f"no checkpoint within {self.dspec.grow_wait:.0f} s")
            return 0

        def _admit(self, waiting: int, step: int | None, why: str) -> int:
            events.log("grow", self.events_path, epoch=self.epoch, waiting=waiting, committed_step=step, why=why)
            self._grow_since = None
            self._grew = True
            return waiting

    return DTorchAgent


class _QuietFatal(logging.Filter):
    """Drops torch's multi-line report of a worker that exited for a fatal error: the worker
    logged the cause as one `fatal` event, and the agent prints that line instead."""

    def __init__(self, events_path: str):
        super().__init__()
        self.events_path = events_path
        self.since = time.time()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        return not any(e["kind"] == "fatal" and e["t"] >= self.since for e in events.read(self.events_path))


class _GatedRendezvous:
    """The rendezvous handler, except that `num_nodes_waiting` goes through the agent's grow gate."""

    def __init__(self, handler: Any):
        self._handler = handler
        self.gate = None

    def num_nodes_waiting(self) -> int:
        n = self._handler.num_nodes_waiting()
        return self.gate(n) if self.gate is not None else n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handler, name)


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
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry

    run_dir: str = spec.run_dir  # type: ignore[assignment]
    trust.private_dir(run_dir, "run_dir")  # 0700, ours, not a symlink
    for name in (events.EVENTS_FILE, heartbeat.HB_DIR, heartbeat.DUMP_DIR, "logs"):
        if os.path.islink(os.path.join(run_dir, name)):
            raise ConfigError("run_dir", run_dir, f"{name} in it is a symlink (planted?); remove it or use another --run-dir")
    preemption.clear(run_dir)
    # torch's log formatter imports torch._dynamo on the first exception it formats, and the agent
    # formats one on every worker failure: 2-5 s added to each first recovery here. Pay it now,
    # in the background, while the workers start.
    threading.Thread(target=importlib.import_module, args=("torch._dynamo",), daemon=True,
                     name="dtorch-preimport").start()
    snap_dir = None
    if spec.snapshot_every > 0:
        # RAM (/dev/shm) when there is one: snapshots outlive workers, not the machine
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else run_dir
        snap_dir = str(trust.private_dir(os.path.join(shm, f"dtorch-snap-{secrets.token_hex(8)}"), "snapshot_dir"))
    env = {
        "DTORCH_SNAPSHOT_DIR": snap_dir or "",
        "DTORCH_SNAPSHOT_EVERY": str(spec.snapshot_every),
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "DTORCH_RUN_DIR": run_dir,
        "DTORCH_AGENT_PID": str(os.getpid()),
        "DTORCH_CHAOS": spec.chaos,
        "DTORCH_HEARTBEAT_INTERVAL": str(max(0.05, min(0.5, spec.heartbeat_timeout / 10 or 0.5))),
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
    }
    # The flight recorder (gloo and NCCL) is what names the collective a hung rank is in.
    env.setdefault("TORCH_FR_BUFFER_SIZE", os.environ.get("TORCH_FR_BUFFER_SIZE", "2000"))
    saved = {k: os.environ.get(k) for k in [*env, "DTORCH_EPOCH"]}
    os.environ.update(env)

    conf = {**FAST_RDZV_CONF, **spec.rdzv_conf}
    params = RendezvousParameters(backend=spec.rdzv_backend, endpoint=spec.rdzv_endpoint, run_id=spec.rdzv_id,
                                  min_nodes=spec.min_nodes, max_nodes=spec.max_nodes,
                                  local_addr=spec.local_addr, **conf)
    entrypoint: Any
    if no_python:
        entrypoint, wargs = target, list(args)
    elif spec.start_method == "forkserver":
        import multiprocessing

        from dtorch.elastic.bootstrap import run_target

        multiprocessing.set_forkserver_preload([*FORKSERVER_PRELOAD, *spec.preload])
        entrypoint, wargs = run_target, [{}, target, list(args), module]
    else:
        entrypoint = sys.executable
        wargs = ["-u", "-m", "dtorch.elastic.bootstrap", *(["-m"] if module else []), target, *args]
    if spec.rdzv_backend == "c10d" and conf.get("store_type", "tcp") == "tcp":
        inner = rdzv_store.rendezvous_handler(params)  # listens on the endpoint's address only
    else:
        inner = rdzv_registry.get_rendezvous_handler(params)
    handler = _GatedRendezvous(inner)
    wspec = WorkerSpec(role="dtorch", local_world_size=spec.nproc_per_node, entrypoint=entrypoint,
                       args=tuple(wargs), rdzv_handler=handler, max_restarts=spec.max_restarts,  # type: ignore[arg-type]
                       monitor_interval=spec.monitor_interval, local_addr=spec.local_addr)
    agent = _agent_class()(spec=wspec, logs_specs=DefaultLogsSpecs(log_dir=os.path.join(run_dir, "logs")),
                           start_method="forkserver" if spec.start_method == "forkserver" else "spawn",
                           shutdown_timeout=spec.shutdown_timeout, dspec=spec)
    handler.gate = agent.grow_gate
    quiet = _QuietFatal(agent.events_path)
    torch_logs = [logging.getLogger(n) for n in ("torch.distributed.elastic.multiprocessing.api",
                                                 "torch.multiprocessing.spawn")]
    for lg in torch_logs:
        lg.addFilter(quiet)
    shutdown_rdzv = True
    try:
        result = agent.run()
        agent._maybe_report_recovery(force=True)
        if result is None:  # the rendezvous was closed by another node: nothing left to do here
            return 0
        if agent.fatal is not None:
            print(f"dtorch: error: {agent.fatal}", file=sys.stderr, flush=True)
            return 2
        if result.is_failed():
            ranks = ", ".join(f"rank {r} (exit {f.exitcode})" for r, f in sorted(result.failures.items()))
            print(f"dtorch: job failed after {spec.max_restarts} restarts: {ranks or 'unhealthy workers'}",
                  file=sys.stderr, flush=True)
            return 1
        return 0
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
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
