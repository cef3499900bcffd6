"""DTorch's elastic agent: torch's `LocalElasticAgent` plus detectors, an event log and grow gating.

Importing this module imports torch.distributed.elastic (~1 s): `dtorch.elastic.launch` imports
it when a job starts, not when the CLI starts.

How the agent watches its workers. Every `monitor_interval` torch's loop calls
`_monitor_workers`; there each detector looks once and may return a `Detection`:

- `ExitDetector`: a worker exited (torch reports the group FAILED). The cause is the rank that
  died of a signal or exited on its own, not the peers torch stopped; a worker that logged a
  `fatal` event (an error no restart can fix) makes it a stop, not a restart.
- `HangDetector`: a rank's heartbeat shows no progress for `--heartbeat-timeout` seconds
  (`dtorch.elastic.heartbeat.HangWatch`); its stacks and flight recorder are dumped first.
- `NodeLossDetector`: a node of this round stopped its rendezvous keep-alive, or this node was
  dropped from the round (torch's agent only looks for nodes joining).
- `StragglerDetector`: the trainer's straggler watch (`dtorch.monitor.straggler`) named a slow
  rank; the workers report it through the hook seam into the event log, and the agent records it.

`DTorchAgent._act` is the one place a detection is recorded (one event in `events.jsonl`, one line
on stderr) and acted on: `restart` kills the local workers so torch restarts the group (counts
as a restart), `stop` ends the job without retries, `report` only records. Every read of torch's
private elastic state goes through `dtorch.elastic.torch_compat`.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from dtorch.elastic import events, heartbeat, preemption
from dtorch.elastic import store as rdzv_store
from dtorch.elastic import torch_compat as tc
from dtorch.env import export

ACTIONS = ("restart", "stop", "report")
_EVENT_KIND = {"restart": "detected", "stop": "stopped", "report": "observed"}


@dataclass
class Detection:
    """What a detector found. `action`: "restart" (kill the local workers; torch restarts the
    group), "stop" (end the job now, no retries) or "report" (record only)."""

    cause: str
    """"exit", "hang", "node_lost", "fatal", "repeated" (an error back at the same step after a
    restart) or "straggler"."""
    action: str
    line: str | None = None
    """The one line printed on stderr (None: someone printed it already)."""
    ranks: list[int] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    fault_t: float | None = None
    """When the fault happened (seconds since the epoch), where known."""
    detect_t: float = field(default_factory=time.time)
    fields: dict[str, Any] = field(default_factory=dict)
    """More for the event record (exit codes, the hang diagnosis, the fatal message, ...)."""

    def __post_init__(self) -> None:
        assert self.action in ACTIONS, self.action


class ExitDetector:
    """Worker exits, from torch's FAILED result (see the module docstring)."""

    def __init__(self, agent: DTorchAgent):
        self.agent = agent
        self.last_error: tuple[Any, ...] | None = None
        """(exception, message, step) of the error that caused the last restart, if one did."""
        self.cause: str | None = None
        """The last failure's cause in one line: the first failing worker's exception (with the
        step and where its full traceback is) or its exit code or signal."""

    def check(self, result: Any, t_check: float) -> Detection:
        a = self.agent
        fatal = self._fatal_event()
        if fatal is not None:
            message = str(fatal.get("message") or fatal.get("error"))
            return Detection("fatal", "stop", line=None, ranks=[fatal.get("rank")], detect_t=t_check,
                             fields={"rank": fatal.get("rank"), "message": message})
        codes = self._exit_codes(result)
        # Ranks the agent itself SIGTERMed while stopping the group are victims, not causes;
        # so are ranks that raised because a peer vanished, when some rank died of a signal.
        ranks = [r for r, c in codes.items() if c != -signal.SIGTERM] or sorted(codes)
        if any(codes[r] < 0 for r in ranks):
            ranks = [r for r in ranks if codes[r] < 0]
        why = {r: (signal.Signals(-codes[r]).name if codes[r] < 0 else f"exit code {codes[r]}") for r in ranks}
        error = self._first_error(ranks)
        if error is not None:
            r = error["rank"]
            err = f"{error['error']}: {error['message']}" if error.get("message") else str(error["error"])
            step = error.get("step")
            where = f"at step {step}" if isinstance(step, int) and step >= 0 else "before the first step"
            log = error.get("log") or os.path.join(a.run_dir, events.EVENTS_FILE)
            self.cause = f"rank {r} raised {err} ({where}); full traceback: {log}"
            why[r] = f"{why.get(r, 'exit code 1')}: {err}"
            sig = (error["error"], error.get("message"), error.get("step"))
            repeated = sig == self.last_error and not error.get("symptom")
            self.last_error = sig
            if repeated:
                # the same exception at the same step as the failure the last restart was for: a
                # deterministic error, which every further restart would meet again
                message = (f"rank {r} raised the same error {where} after a restart, so no restart can fix it: "
                           f"{err}; full traceback: {log}")
                return Detection("repeated", "stop", line=None, ranks=[r], detect_t=t_check,
                                 fields={"rank": r, "message": message, "exit_code": 1, "exitcodes": codes,
                                         "step": error.get("step")})
        else:
            self.last_error = None
            self.cause = ", ".join(f"rank {r} ({s})" for r, s in why.items()) + \
                f"; events: {os.path.join(a.run_dir, events.EVENTS_FILE)}"
        line = (f"dtorch: worker failure in epoch {a.epoch}: " + ", ".join(f"rank {r} ({s})" for r, s in why.items())
                + f"; {len(codes) - len(ranks)} other local ranks stopped; {tc.remaining_restarts(a)} restarts left")
        return Detection("exit", "restart", line=line, ranks=ranks, fault_t=self._fault_time(ranks),
                         detect_t=t_check, fields={"exitcodes": codes, "cause_line": self.cause,
                                                   **({"error": error} if error else {})})

    def _first_error(self, ranks: list[int]) -> dict[str, Any] | None:
        """The first `worker_error` (an exception a worker died of) of this epoch among `ranks`,
        the ranks that failed on their own; an error that only follows a peer's loss (`symptom`)
        counts when no other rank raised one."""
        a = self.agent
        evs = [e for e in events.read(a.events_path)
               if e["kind"] == "worker_error" and e.get("epoch") == a.epoch and e.get("rank") in ranks]
        if not evs:
            return None
        return min(evs, key=lambda e: (bool(e.get("symptom")), e["t"], e.get("rank", 0)))

    def _fatal_event(self) -> dict[str, Any] | None:
        """The first `fatal` event of this epoch: a worker met an error no restart can fix."""
        a = self.agent
        evs = [e for e in events.read(a.events_path) if e["kind"] == "fatal" and e.get("epoch") == a.epoch]
        return min(evs, key=lambda e: (e["t"], e.get("rank", 0))) if evs else None

    def _fault_time(self, ranks: list[int]) -> float | None:
        """When the fault happened: the chaos mark if one fired, else the last progress seen."""
        a = self.agent
        faults = [e["t"] for e in events.read(a.events_path)
                  if e["kind"] == "fault" and e.get("epoch") == a.epoch and e.get("rank") in ranks]
        if faults:
            return min(faults)
        beats = heartbeat.read_beats(a.run_dir, a.epoch)
        ts = [beats[r]["progress_t"] for r in ranks if r in beats]
        return min(ts) if ts else None

    def _exit_codes(self, result: Any) -> dict[int, int]:
        """Exit codes of every local worker that has exited. torch reports one failure per group
        for forked workers (the first it saw), which need not be the root cause."""
        codes = {r: f.exitcode for r, f in result.failures.items()}
        exited = tc.local_exit_codes(self.agent)
        for w in self.agent.get_worker_group().workers:
            code = exited.get(w.local_rank)
            if code is not None and code != 0:
                codes.setdefault(w.global_rank, code)
        return dict(sorted(codes.items()))


class HangDetector:
    """Ranks without progress (heartbeats), diagnosed with their stacks and flight recorder."""

    def __init__(self, agent: DTorchAgent, watch: heartbeat.HangWatch):
        self.agent, self.watch = agent, watch

    def check(self) -> Detection | None:
        hang = self.watch.check()
        if hang is None:
            return None
        a = self.agent
        t_detect = time.time()
        states = heartbeat.sample_states(a.local_pids)
        beats = heartbeat.read_beats(a.run_dir, hang.epoch)
        # the dump needs the ranks alive, and kills them once it has what it can get
        dump = heartbeat.dump_and_kill(a.run_dir, hang.epoch, a.local_pids, states)
        line, fields = heartbeat.diagnose(hang, beats, a.local_pids, states, dump)
        culprit = fields.pop("rank")
        return Detection("hang", "restart", line=line, ranks=[culprit], detect_t=t_detect,
                         fields={"diagnosis": line, "limit_s": hang.limit, **fields})


class NodeLossDetector:
    """Nodes of this round whose agent stopped its rendezvous keep-alive (a dead or cut-off node):
    still listed with an expired keep-alive, or already removed from the round by a surviving
    agent's keep-alive; or this node dropped from its own round. A node lost before its workers
    connected would leave ours blocked in process-group init until that times out (30 min).
    At most one store read a second."""

    def __init__(self, agent: DTorchAgent, period: float = 1.0):
        self.agent, self.period = agent, period
        self._next = 0.0
        self.round_nodes: set[str] = set()
        self.round_t = 0.0

    def new_round(self, state: Any) -> None:
        """After a rendezvous: remember who is in the round."""
        self.round_nodes = {str(n) for n in state.participants} if state is not None else set()
        self.round_t = time.time()

    def lost(self) -> dict[str, float]:
        """node -> last sign of life (seconds since the epoch)."""
        now = time.time()
        if now < self._next or not self.round_nodes:
            return {}
        self._next = now + self.period
        a = self.agent
        state = a.rendezvous_state()
        me = tc.this_node(a.get_worker_group().spec.rdzv_handler)
        if state is None or me is None:
            return {}
        if state.round > a.epoch or (state.round == a.epoch and state.complete
                                     and me not in {str(n) for n in state.participants}):
            # Our round is over without us (we were dropped: a stalled keep-alive, or the others
            # moved on). Our workers belong to a group that no longer exists: restart and rejoin.
            return {me: self.round_t}
        expiry = tc.keep_alive_expiry(a.get_worker_group().spec.rdzv_handler)
        if state.round != a.epoch or not state.complete or expiry is None:
            return {}
        expire = datetime.now(timezone.utc) - expiry
        hb = state.last_heartbeats
        # Our own keep-alive counts only through the others: this agent is alive (it is running this),
        # and a keep-alive thread starved on a loaded host is not a lost node. If the others removed
        # us for it, the branch above restarts us into their new round.
        lost = {str(n): hb[n].timestamp() for n in state.participants
                if n in hb and hb[n] < expire and str(n) != me}
        present = {str(n) for n in state.participants}
        for name in self.round_nodes - present:
            lost[name] = self.round_t  # removed as dead by another agent: last seen at the rendezvous
        return lost

    def check(self) -> Detection | None:
        lost = self.lost()
        if not lost:
            return None
        a = self.agent
        me = tc.this_node(a.get_worker_group().spec.rdzv_handler)
        what = (f"this node ({me}) was dropped from round {a.epoch} of the rendezvous" if me in lost else
                f"node(s) {', '.join(sorted(lost))} stopped their rendezvous keep-alive in epoch {a.epoch}")
        # the fault: somewhat after the node's last keep-alive (within one keep-alive interval)
        return Detection("node_lost", "restart", line=f"dtorch: {what}; restarting the local workers into a new round",
                         nodes=sorted(lost), fault_t=min(lost.values()))


class StragglerDetector:
    """Slow ranks named by the trainer's straggler watch (`dtorch.monitor.straggler.StragglerWatch`),
    which the workers report as `straggler` events (`dtorch.elastic.worker`); the trainer has
    printed its line already. Reads only what the log gained since the last look, once a second."""

    def __init__(self, agent: DTorchAgent, period: float = 1.0):
        self.agent, self.period = agent, period
        self._next = 0.0
        self._offset = 0
        self._pending: list[dict[str, Any]] = []

    def _read_new(self) -> None:
        try:
            with open(self.agent.events_path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except OSError:
            return
        end = chunk.rfind(b"\n") + 1  # a line still being written is read next time
        self._offset += end
        for line in chunk[:end].splitlines():
            if b'"straggler"' in line:
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                if e.get("kind") == "straggler":
                    self._pending.append(e)

    def check(self, force: bool = False) -> Detection | None:
        now = time.time()
        if not self._pending and (now >= self._next or force):
            self._next = now + self.period
            self._read_new()
        if not self._pending:
            return None
        e = self._pending.pop(0)
        return Detection("straggler", "report", line=None, ranks=list(e.get("ranks", [])), fault_t=e["t"],
                         fields={"step": e.get("step"), "ratio": e.get("ratio"), "reported_epoch": e.get("epoch")})


class DTorchAgent(LocalElasticAgent):
    """LocalElasticAgent + membership epoch, detectors, event log, grow gating (module docstring)."""

    def __init__(self, *args: Any, dspec: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.dspec = dspec
        self.run_dir: str = dspec.run_dir
        self.events_path = os.path.join(self.run_dir, events.EVENTS_FILE)
        self.epoch = -1
        self.local_pids: dict[int, int] = {}
        self.watch = heartbeat.HangWatch(self.run_dir, dspec.heartbeat_timeout, dspec.startup_timeout or 0)
        self.exits = ExitDetector(self)
        self.node_loss = NodeLossDetector(self)
        self.stragglers = StragglerDetector(self)
        self.watching = [HangDetector(self, self.watch), self.node_loss, self.stragglers]
        """The detectors asked while the workers are healthy, in this order (first finding wins)."""
        self.detections = 0  # restarts this agent asked for; each should end in a reported recovery
        self.recoveries_reported = 0
        self.recovery_pending = False
        self._next_recovery_check = 0.0
        self.fatal: str | None = None
        """The one-line message of an error a restart cannot fix (see bootstrap.is_fatal), or of
        one that came back at the same step after a restart."""
        self.fatal_code = 2
        self.cause: str | None = None
        """The cause of the last restart in one line (the job's last line if it fails)."""
        """The job's exit code when `fatal` is set: 2 for bad input, 1 for a repeated error."""
        self._grow_since: float | None = None
        self._saw_commits = False
        self._grow_base: int | None = None
        self._grew = False

    # -- membership
    def _round(self) -> int:
        r = tc.rendezvous_round(self.get_worker_group().spec.rdzv_handler)
        if r is not None:
            return r
        # another rendezvous backend: fall back to this agent's count
        return self.get_worker_group().spec.max_restarts - tc.remaining_restarts(self)

    def rendezvous_state(self) -> Any:
        """The rendezvous state as stored (read-only; None if unavailable or not authenticated)."""
        backend = tc.rendezvous_backend(self.get_worker_group().spec.rdzv_handler)
        if not isinstance(backend, rdzv_store.SignedBackend):
            return None  # another backend: its values are not authenticated, so not read here
        try:
            return rdzv_store.read_state(backend)
        except Exception:  # a store hiccup: nothing to conclude
            return None

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
        self.node_loss.new_round(self.rendezvous_state())
        events.log("rendezvous", self.events_path, start=t0, end=time.time(), epoch=self.epoch,
                   world_size=worker_group.workers[0].world_size if worker_group.workers else None,
                   nodes=worker_group.group_world_size, node_rank=worker_group.group_rank)

    def _start_workers(self, worker_group: Any) -> dict[int, Any]:
        export({"DTORCH_EPOCH": str(self.epoch)})  # for workers started as new processes
        if callable(worker_group.spec.entrypoint):
            # forked workers inherit the forkserver's environment: pass what changes per start
            worker_group.spec.args = ({**worker_group.spec.args[0], "DTORCH_EPOCH": str(self.epoch)},
                                      *worker_group.spec.args[1:])
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

    # -- detection: the detectors look, `_act` records and acts
    def _monitor_workers(self, worker_group: Any) -> Any:
        t_check = time.time()
        # For a failed group this call also stops the surviving workers, so the failure was seen
        # at t_check, not on return.
        result = super()._monitor_workers(worker_group)
        found = None
        if result.state == WorkerState.FAILED:
            found = self.exits.check(result, t_check)
        elif result.state == WorkerState.HEALTHY:
            for detector in self.watching:
                found = detector.check()
                if found is not None:
                    break
        if found is not None:
            result = self._act(found, result)
        if result.state == WorkerState.HEALTHY:
            self._maybe_report_recovery()
        return result

    def _act(self, d: Detection, result: Any) -> Any:
        """Record `d` (one event, one line) and act on it; returns what torch's loop should see."""
        fields: dict[str, Any] = {"cause": d.cause, "epoch": self.epoch, "detect_t": d.detect_t, **d.fields}
        if d.action != "stop":
            fields["ranks"] = d.ranks
        if d.nodes:
            fields["nodes"] = d.nodes
        if d.fault_t is not None:
            fields["fault_t"] = d.fault_t
        events.log(_EVENT_KIND[d.action], self.events_path, **fields)
        if d.line:
            print(d.line, file=sys.stderr, flush=True)
        if d.action == "report":
            return result
        if d.action == "stop":
            tc.forbid_restarts(self)  # torch's loop then stops the group and returns the failure
            self.fatal = str(d.fields.get("message"))
            self.fatal_code = int(d.fields.get("exit_code", 2))
            return result
        self.detections += 1
        self.recovery_pending = True
        self.cause = d.fields.get("cause_line") or (d.line or d.cause).removeprefix("dtorch: ")
        heartbeat.kill_all(self.local_pids)  # already gone after an exit or a hang dump: harmless
        return result if result.state == WorkerState.FAILED else RunResult(state=WorkerState.UNHEALTHY)

    def drain_reports(self) -> None:
        """When the job ends: record what the report-only detectors have not looked at yet (a
        straggler named in the last second of the run)."""
        while (found := self.stragglers.check(force=True)) is not None:
            self._act(found, RunResult(state=WorkerState.SUCCEEDED))

    def _maybe_report_recovery(self, force: bool = False) -> None:
        now = time.time()
        if not self.recovery_pending or (now < self._next_recovery_check and not force):
            return
        self._next_recovery_check = now + 1.0
        if self.get_worker_group().group_rank != 0:
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


class QuietFatal(logging.Filter):
    """Drops torch's multi-line report of a worker that exited for a fatal error: the worker
    logged the cause as one `fatal` event (or the agent stopped the job for an error that came
    back after a restart), and the agent prints that line instead."""

    def __init__(self, events_path: str, agent: DTorchAgent | None = None):
        super().__init__()
        self.events_path = events_path
        self.agent = agent
        self.since = time.time()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        if self.agent is not None and self.agent.fatal is not None:
            return False
        return not any(e["kind"] == "fatal" and e["t"] >= self.since for e in events.read(self.events_path))


class GatedRendezvous:
    """The rendezvous handler, except that `num_nodes_waiting` goes through the agent's grow gate."""

    def __init__(self, handler: Any):
        self._handler = handler
        self.gate = None

    def num_nodes_waiting(self) -> int:
        n = self._handler.num_nodes_waiting()
        return self.gate(n) if self.gate is not None else n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handler, name)
