"""Heartbeats that find hung ranks, and the diagnosis printed when one is found.

Worker side. The training loop calls `mark(step=..., phase=...)` (directly, or through
`dtorch.elastic.worker.beat` / `phase`). That only updates a small in-memory record: the step, the
phase and `progress_t`, the wall time of the last call *from the training loop*. A writer thread
publishes the record to `<run_dir>/hb/rank<R>.json` every `interval` seconds (tmp file + rename,
so a reader never sees half a record), together with `written_t`.

Why both: a SIGSTOPped process stops all its threads, so `written_t` stops moving; a busy loop or a
collective that never returns leaves the thread running, so `written_t` moves but `progress_t`
does not. The monitor judges `progress_t` only, which catches all three.

Agent side. `HangWatch.check()` (called from the agent's monitor loop) returns the local ranks
whose progress is older than the timeout. Then `dump_and_kill()` asks every local rank for its
Python stacks (SIGUSR1 -> faulthandler, installed by the worker bootstrap; a stopped rank is sent
SIGCONT so that it can answer) and, from the writer thread, the flight recorder
(`torch._C._distributed_c10d._dump_fr_trace`, gloo and NCCL); then SIGKILLs them so the elastic
agent restarts the group. `diagnose()` builds the one line that names the stuck rank: the rank
that is furthest behind (lowest step, then oldest progress), its phase, and what the others wait in.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from typing import Any

from dtorch.env import current

HB_DIR = "hb"
DUMP_DIR = "dumps"
NCCL_DUMP_DIR = "nccl"
"""Under an epoch's dump directory: where the NCCL watchdog writes its flight-recorder pickles on a
collective timeout (`TORCH_FR_DUMP_TEMP_FILE`, see `dtorch.elastic.worker.nccl_flight_recorder`)."""

_lock = threading.Lock()
_state: dict[str, Any] = {"step": -1, "phase": "start", "progress_t": time.time(), "beats": 0,
                          "steps_done": 0, "committed_step": None}
_writer: _Writer | None = None


def mark(step: int | None = None, phase: str | None = None, committed_step: int | None = None,
         step_done: bool = False) -> None:
    """Record progress of the training loop (cheap: no I/O). Call at least once per step;
    `step_done=True` once a step has finished (the strict timeout applies from the first one)."""
    with _lock:
        # a new step is published at once (one small file write per step), so a rank stopped or
        # killed mid-step is reported at its real last step, not the writer thread's last one
        publish = step is not None and int(step) != _state["step"]
        if step_done:
            _state["steps_done"] += 1
            _state["step_done_t"] = time.time()
        if step is not None:
            _state["step"] = int(step)
        if phase is not None:
            _state["phase"] = phase
        if committed_step is not None:
            _state["committed_step"] = int(committed_step)
        _state["progress_t"] = time.time()
        _state["beats"] += 1
    if publish:
        try:
            flush()
        except OSError:  # a full disk must not stop training; the writer thread retries
            pass


def snapshot() -> dict[str, Any]:
    """A copy of this process's heartbeat record."""
    with _lock:
        return dict(_state)


def flush() -> None:
    """Publish the record now (before a deliberate stop, so the monitor sees where it happened)."""
    if _writer is not None:
        _writer.write_once()


def hb_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, HB_DIR, f"rank{rank}.json")


def dump_dir(run_dir: str, epoch: int) -> str:
    return os.path.join(run_dir, DUMP_DIR, f"epoch{epoch}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class _Writer(threading.Thread):
    """Publishes the record every `interval` s; answers dump requests; exits if the agent is gone."""

    def __init__(self, run_dir: str, rank: int, epoch: int, interval: float, agent_pid: int | None):
        super().__init__(name="dtorch-heartbeat", daemon=True)
        self.run_dir, self.rank, self.epoch = run_dir, rank, epoch
        self.interval, self.agent_pid = interval, agent_pid
        self.path = hb_path(run_dir, rank)
        self._dumped = False
        self._write_lock = threading.Lock()
        os.makedirs(os.path.dirname(self.path), exist_ok=True)

    def write_once(self) -> None:
        with self._write_lock:  # the loop's thread (new step) and the writer thread both publish
            rec = snapshot()
            rec.update(rank=self.rank, epoch=self.epoch, pid=os.getpid(), written_t=time.time(),
                       local_rank=current().local_rank or 0)
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(rec, f)
            os.replace(tmp, self.path)

    def run(self) -> None:
        while True:
            try:
                self.write_once()
                self._maybe_dump()
            except Exception:  # a full disk must not kill training; the monitor will see stale beats
                pass
            if self.agent_pid is not None and not _alive(self.agent_pid):
                # Our agent died (PR_SET_PDEATHSIG covers Linux; this covers the rest): do not linger.
                os._exit(70)
            time.sleep(self.interval)

    def _maybe_dump(self) -> None:
        d = dump_dir(self.run_dir, self.epoch)
        if self._dumped or not os.path.exists(os.path.join(d, "REQUEST")):
            return
        self._dumped = True
        write_dumps(d, self.rank)


def write_dumps(directory: str, rank: int) -> None:
    """Write this process's Python stacks (all threads) and flight-recorder entries into `directory`.

    Runs on the heartbeat thread, so it works while the main thread is blocked in a collective
    (which releases the GIL) or busy in Python.
    """
    os.makedirs(directory, exist_ok=True)
    frames = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate()}
    with open(os.path.join(directory, f"rank{rank}.py-stacks.txt"), "w") as f:
        for ident, frame in frames.items():
            f.write(f"--- thread {names.get(ident, ident)} ---\n")
            f.write("".join(traceback.format_stack(frame)))
    fr = flight_recorder()
    if fr is not None:
        with open(os.path.join(directory, f"rank{rank}.flight-recorder.json"), "w") as f:
            json.dump(fr, f, default=str)


def flight_recorder() -> dict[str, Any] | None:
    """This process's flight-recorder entries (collectives issued, their state), or None if torch or
    the recorder is not in use. Enabled by TORCH_FR_BUFFER_SIZE (the launcher sets it)."""
    if "torch.distributed" not in sys.modules:
        return None
    try:
        import pickle

        import torch._C._distributed_c10d as c10d

        data = pickle.loads(c10d._dump_fr_trace(True, False, False))
    except Exception:
        return None
    raw = data.get("entries", [])
    entries = [{k: e.get(k) for k in ("record_id", "pg_id", "process_group", "collective_seq_id", "profiling_name",
                                      "state", "input_sizes", "time_created_ns", "retired", "is_p2p")} for e in raw]
    max_seq: dict[str, int] = {}
    for e in raw:
        if not e.get("is_p2p"):
            key = str(e.get("process_group", (e.get("pg_id"),))[0])
            max_seq[key] = max(max_seq.get(key, 0), int(e.get("collective_seq_id") or 0))
    return {"entries": entries[-32:], "max_seq_by_pg": max_seq}


def start(run_dir: str, rank: int, epoch: int, interval: float, agent_pid: int | None) -> None:
    """Start the writer thread of this process (idempotent)."""
    global _writer
    if _writer is not None:
        return
    with _lock:
        _state["progress_t"] = time.time()
    _writer = _Writer(run_dir, rank, epoch, interval, agent_pid)
    _writer.write_once()
    _writer.start()


# ---------------------------------------------------------------------------- agent side


def read_beats(run_dir: str, epoch: int | None = None) -> dict[int, dict[str, Any]]:
    """Every rank's last published record in `run_dir` (only those of `epoch` when given)."""
    d = os.path.join(run_dir, HB_DIR)
    out: dict[int, dict[str, Any]] = {}
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return out
    for n in names:
        if not (n.startswith("rank") and n.endswith(".json")):
            continue
        try:
            fd = os.open(os.path.join(d, n), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            with os.fdopen(fd) as f:
                if os.fstat(fd).st_uid != os.geteuid():
                    continue  # not written by one of our workers
                rec = json.load(f)
            rank = int(rec["rank"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if n != f"rank{rank}.json":
            continue
        if epoch is None or rec.get("epoch") == epoch:
            out[rank] = rec
    return out


def read_local_beats(run_dir: str, epoch: int, pids: dict[int, int]) -> dict[int, dict[str, Any]]:
    """The records of this agent's workers (`pids`: global rank -> pid) only: a record whose pid
    is not the worker's was not written by it (planted, or left by an earlier group) and is ignored."""
    return {r: b for r, b in read_beats(run_dir, epoch).items() if r in pids and b.get("pid") == pids[r]}


def proc_state(pid: int) -> str | None:
    """Linux process state letter (R, S, D, T stopped, Z zombie, ...) or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def sample_states(pids: dict[int, int], samples: int = 5, every: float = 0.02) -> dict[int, str | None]:
    """Each rank's process state, sampled a few times: T (stopped) if ever seen stopped, R if
    running in most samples (a busy loop), else the last state seen. One look could catch a
    waiting rank in a brief R."""
    seen: dict[int, list[str | None]] = {r: [] for r in pids}
    for i in range(samples):
        for r, p in pids.items():
            seen[r].append(proc_state(p))
        if i + 1 < samples:
            time.sleep(every)
    out: dict[int, str | None] = {}
    for r, xs in seen.items():
        if any(x in ("T", "t") for x in xs):
            out[r] = next(x for x in xs if x in ("T", "t"))
        elif sum(x == "R" for x in xs) * 2 > len(xs):
            out[r] = "R"
        else:
            out[r] = next((x for x in reversed(xs) if x not in (None, "R")), xs[-1])
    return out


@dataclass
class Hang:
    """Local ranks found hung, with how long each has made no progress (seconds)."""

    ranks: dict[int, float]
    epoch: int
    limit: float | None = None
    """The limit a running rank was judged against (seconds): the timeout stretched to the job's
    own pace and the machine's load (a stopped rank is judged against the timeout itself)."""


def load_factor() -> float:
    """How much slower than alone a CPU-bound process runs here now: the 1-minute load average
    per CPU, at least 1 (at most 10: a hang must still be found on a machine that is swamped)."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return 1.0
    return min(10.0, max(1.0, load / (os.cpu_count() or 1)))


def _stopped(pid: int) -> bool:
    return proc_state(pid) in ("T", "t")


class HangWatch:
    """Judges the local workers of one epoch: tells a hung rank from a slow one.

    Until every local rank has finished a step in this epoch the group is starting (imports,
    process-group init, loading, compiling, peers on slower nodes): then only `startup_timeout`
    applies, counted from the group's start. Afterwards each rank must make progress within
    `timeout` seconds.

    A rank that is stopped (SIGSTOP, a tracer: process state T) cannot be slow: it is judged
    against those limits as they are. A rank that runs may only be slow: its limit is stretched
    to the job's own pace, `slow_factor` times the longest recent step of this group (steps
    finished since it started, as the workers report them), and by the machine's load
    (`load_factor`, CPUs over-subscribed by other programs). A busy loop or a collective that never
    returns is still found, later on a slow or loaded machine. Each group (`reset`, after a
    restart or a resize) starts a fresh window: its own start time and step history, nothing of
    the group before. A script that never beats is never judged."""

    def __init__(self, run_dir: str, timeout: float, startup_timeout: float, period: float = 0.25,
                 slow_factor: float = 3.0, load: Any = load_factor, stopped: Any = _stopped, window: int = 20):
        self.run_dir, self.timeout, self.startup_timeout, self.period = run_dir, timeout, startup_timeout, period
        self.slow_factor, self.load, self.stopped = slow_factor, load, stopped
        self.epoch = -1
        self.local: dict[int, int] = {}
        self.t_start = time.time()
        self._next = 0.0
        self._done: dict[int, tuple[int, float]] = {}
        self.step_s: deque[float] = deque(maxlen=window)
        """Seconds per step of this group's recent steps (every local rank's), as reported."""

    def reset(self, epoch: int, local: dict[int, int]) -> None:
        """New worker group: `local` maps global rank -> pid. A fresh detection window."""
        self.epoch, self.local, self.t_start, self._next = epoch, dict(local), time.time(), 0.0
        self._done = {}
        self.step_s.clear()

    def _observe(self, beats: dict[int, dict[str, Any]]) -> None:
        """Record the step times the ranks reported since the last look (a rank that finished n
        steps between two looks: n steps of their mean)."""
        for rank, b in beats.items():
            n, t = int(b.get("steps_done", 0)), b.get("step_done_t")
            if not n or t is None:
                continue
            prev = self._done.get(rank)
            if prev is not None and n > prev[0]:
                per = (float(t) - prev[1]) / (n - prev[0])
                self.step_s.extend([per] * min(n - prev[0], self.step_s.maxlen or 1))
            if prev is None or n > prev[0]:
                self._done[rank] = (n, float(t))

    def check(self) -> Hang | None:
        now = time.time()
        if self.timeout <= 0 or now < self._next:
            return None
        self._next = now + self.period
        beats = read_local_beats(self.run_dir, self.epoch, self.local)
        if not any(b.get("beats", 0) > 0 for b in beats.values()):
            return None
        self._observe(beats)
        steady = all(beats.get(r, {}).get("steps_done", 0) > 0 for r in self.local)
        base = self.timeout if steady else self.startup_timeout
        # a running rank: the job's own pace and the machine's load stretch the limit
        pace = max(base, self.slow_factor * max(self.step_s, default=0.0)) if steady else base
        limit = pace * self.load()
        stuck = {}
        for rank, pid in self.local.items():
            b = beats.get(rank, {})
            if steady:
                age = now - b["progress_t"]
            elif b.get("steps_done", 0) > 0:
                continue  # done its first step: waits for the others
            else:
                age = now - self.t_start
            if age > limit or (age > base and self.stopped(pid)):
                stuck[rank] = age
        return Hang(stuck, self.epoch, limit) if stuck else None


def dump_and_kill(run_dir: str, epoch: int, pids: dict[int, int], states: dict[int, str | None],
                  wait: float = 2.0) -> str:
    """Collect stacks + flight recorder from every local rank, then SIGKILL them all; returns the
    dump directory.

    SIGUSR1 makes faulthandler (installed by the worker bootstrap) write the C-level view of all
    threads to `rank<R>.faulthandler.txt`; the REQUEST file makes the heartbeat thread write the
    Python stacks and the flight recorder. A stopped rank can only answer once continued, and a
    continued rank would make progress: so the running ranks are killed first, then the stopped
    ones get SIGCONT (their pending SIGUSR1 dumps the stack where they stopped) and die too.
    """
    d = dump_dir(run_dir, epoch)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "REQUEST"), "w") as f:
        f.write(str(time.time()))
    stopped = {r: p for r, p in pids.items() if states.get(r) in ("T", "t")}
    running = {r: p for r, p in pids.items() if r not in stopped}
    _signal(pids, signal.SIGUSR1)
    deadline = time.time() + wait
    want = {f"rank{r}.py-stacks.txt" for r in running}
    while time.time() < deadline and not want <= set(os.listdir(d)):
        time.sleep(0.05)
    kill_all(running)
    if stopped:
        _signal(stopped, signal.SIGCONT)
        time.sleep(0.3)  # faulthandler writes from the signal handler at once; give it the CPU
        kill_all(stopped)
    return d


def _signal(pids: dict[int, int], sig: signal.Signals) -> None:
    for pid in pids.values():
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def kill_all(pids: dict[int, int]) -> None:
    """SIGKILL the given workers, and SIGCONT them: a stopped process is only reaped once continued
    on some kernels."""
    _signal(pids, signal.SIGKILL)
    _signal(pids, signal.SIGCONT)


def _fr(dump: str | None, rank: int) -> dict[str, Any]:
    if not dump:
        return {}
    try:
        with open(os.path.join(dump, f"rank{rank}.flight-recorder.json")) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}


def collectives_behind(dump: str | None, ranks: list[int]) -> dict[int, int]:
    """For each rank, in how many process groups it has issued fewer collectives than the most
    advanced rank of that group (flight recorder). The ranks the others wait for are behind."""
    seqs = {r: _fr(dump, r).get("max_seq_by_pg", {}) for r in ranks}
    top: dict[str, int] = {}
    for m in seqs.values():
        for pg, n in m.items():
            top[pg] = max(top.get(pg, 0), n)
    return {r: sum(1 for pg, n in m.items() if n < top[pg]) for r, m in seqs.items()}


def _last_collective(dump: str, rank: int) -> str | None:
    entries = _fr(dump, rank).get("entries", [])
    if not entries:
        return None
    e = entries[-1]
    # gloo marks entries "scheduled" and retires them lazily: only the sequence number is reliable.
    return f"{e.get('profiling_name')} #{e.get('collective_seq_id')}"


COLLECTIVE_WORDS = ("allreduce", "all_reduce", "reduce_scatter", "allgather", "all_gather", "barrier",
                    "broadcast", "collective", "alltoall", "send", "recv", "wait")


def _in_collective(phase: str | None) -> bool:
    return any(w in (phase or "").lower() for w in COLLECTIVE_WORDS)


def diagnose(hang: Hang, beats: dict[int, dict[str, Any]], pids: dict[int, int],
             states: dict[int, str | None], dump: str | None) -> tuple[str, dict[str, Any]]:
    """The one-line diagnosis and its fields.

    Ranks in a collective wait for someone; the culprit is the rank that is not where the others
    are. Among all ranks that published a beat in this epoch it is, in order of evidence: a stopped
    process (state T), a rank that issued fewer collectives than its peers (flight recorder), a
    rank that did not answer the dump request, a rank outside a collective phase, a rank burning
    CPU (state R) while the others sleep, then the lowest step and the oldest progress. `beats`
    and `states` are snapshots taken when the hang was found (before the dump disturbed anything)."""
    now = time.time()
    candidates = beats or {r: {"step": -1, "phase": "?", "progress_t": now - a} for r, a in hang.ranks.items()}
    answered = set()
    if dump and os.path.isdir(dump):
        answered = {int(n[4:].split(".")[0]) for n in os.listdir(dump) if n.endswith(".py-stacks.txt")}

    behind = collectives_behind(dump, list(candidates))

    def suspicion(r: int) -> tuple:
        b = candidates[r]
        return (states.get(r) not in ("T", "t"), -behind.get(r, 0), bool(dump) and r in answered,
                _in_collective(b.get("phase")), states.get(r) != "R", b.get("step", -1), b.get("progress_t", now))

    culprit = min(candidates, key=suspicion)
    b = candidates[culprit]
    st = states.get(culprit)
    what = {"T": "stopped (SIGSTOP)", "t": "stopped by a tracer", "D": "in uninterruptible sleep",
            "R": "running (busy?)", "S": "sleeping (blocked?)", None: "not on this node or gone"}.get(st, st)
    others: dict[str, list[int]] = {}
    for r, ob in sorted(beats.items()):
        if r != culprit:
            others.setdefault(f"'{ob.get('phase')}' at step {ob.get('step')}", []).append(r)
    coll = _last_collective(dump, culprit) if dump else None
    line = (f"dtorch: HANG: rank {culprit} (pid {b.get('pid', pids.get(culprit))}, {what}) made no progress "
            f"for {now - b.get('progress_t', now):.1f} s at step {b.get('step')} in phase '{b.get('phase')}'")
    if coll:
        line += f", last collective issued {coll}"
    divergence = None
    if dump:
        from dtorch.monitor.flight import describe, find_divergence_in

        # DTorch's dumps of this hang, then what the NCCL watchdog wrote on its own timeout
        divergence = find_divergence_in(dump, os.path.join(dump, NCCL_DUMP_DIR))
        if divergence is not None:
            line += f"; {describe(divergence)}"
    if others:
        line += "; " + "; ".join(f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))} in {k}"
                                 for k, rs in others.items())
    if dump:
        line += f"; stacks: {dump}"
    fields = {"rank": culprit, "step": b.get("step"), "phase": b.get("phase"), "state": st,
              "no_progress_s": now - b.get("progress_t", now), "collective": coll, "dump": dump,
              "fault_t": b.get("progress_t"), "divergence": divergence}
    return line, fields
