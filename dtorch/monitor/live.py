"""What the trainer holds while it runs: the per-rank collector, the communication timer and, on
rank 0, the live server. The trainer calls `RunMonitor.start(...)` once, `comm_snapshot()` around
forward/backward, `step(...)` after every step and `close()` at the end; nothing else.

Settings (Trainer arguments, or the environment for launched jobs):
  metrics_every   DTORCH_METRICS_EVERY     per-rank aggregation every N steps (default 10; 0 = off)
  monitor_port    DTORCH_MONITOR_PORT      serve /metrics and the page on rank 0 (0 = a free port);
                                           unset = no server
  monitor_host    DTORCH_MONITOR_HOST      default 127.0.0.1; another address needs allow_remote
                                           (DTORCH_MONITOR_ALLOW_REMOTE=1) and a token
  monitor_token   DTORCH_MONITOR_TOKEN     required on every request when set
  trace_comms     DTORCH_TRACE_COMMS=1     record every collective per rank (<log_dir>/comms-rank<r>.jsonl,
                                           see dtorch.monitor.comms); slows steps, for debugging
                  DTORCH_PROFILE_COMMS=1   profile the second metrics window with torch's profiler, an
                                           independent measure of communication time to check the
                                           metrics against (<log_dir>/comm-profile-rank<r>.json,
                                           see dtorch.monitor.commprofile)
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtorch.env import RuntimeEnv, current
from dtorch.errors import ConfigError
from dtorch.monitor.ranks import RankCollector, ranks_record

log = logging.getLogger("dtorch.monitor")


@dataclass
class MonitorConfig:
    metrics_every: int = 10
    port: int | None = None
    host: str = "127.0.0.1"
    token: str | None = None
    allow_remote: bool = False
    trace_comms: bool = False

    @classmethod
    def resolve(cls, metrics_every: int | None = None, port: int | None = None, host: str | None = None,
                token: str | None = None, allow_remote: bool | None = None,
                trace_comms: bool | None = None, env: RuntimeEnv | None = None) -> MonitorConfig:
        """Arguments win over the environment (`env`, default this process's); see the module
        docstring for the names."""
        env = env or current()
        every = metrics_every if metrics_every is not None else env.metrics_every
        every = 10 if every is None else every
        if every < 0:
            raise ConfigError("metrics_every", every, "aggregate every N >= 1 steps, or 0 for never")
        port = port if port is not None else env.monitor_port
        if port is not None and not 0 <= port <= 65535:
            raise ConfigError("monitor_port", port, "use a TCP port 0..65535 (0 = any free port)")
        remote = allow_remote if allow_remote is not None else env.monitor_allow_remote
        return cls(metrics_every=every, port=port, host=host or env.monitor_host or "127.0.0.1",
                   token=token or env.monitor_token, allow_remote=remote,
                   trace_comms=trace_comms if trace_comms is not None else env.trace_comms)


class RunMonitor:
    def __init__(self, cfg: MonitorConfig, *, rank: int, world: int, device, metrics, plan, mesh,
                 tokens_per_step: int, flops_per_token: float, peak_flops: float, console: bool = True,
                 model_parts: tuple = (), trace_dir=None, first_step: int = 1, structure=None):
        from dtorch.monitor.comms import CommTimer

        self.cfg, self.rank, self.metrics, self.plan, self.console = cfg, rank, metrics, plan, console
        self.comm = CommTimer(mesh).install() if cfg.metrics_every or cfg.trace_comms else None
        if cfg.trace_comms:
            from dtorch.monitor.comms import trace_path

            if trace_dir is None:
                raise ConfigError("trace_comms", True, "tracing writes <log_dir>/comms-rank<r>.jsonl: give a log_dir "
                                  "or checkpoint_dir")
            Path(trace_dir).mkdir(parents=True, exist_ok=True)
            if getattr(plan, "compile", False) and rank == 0 and console:
                print("dtorch: trace_comms with compile: per-module DTensor collective counts are not recorded "
                      "(torch.compile cannot run under CommDebugMode)", file=sys.stderr, flush=True)
            self.comm.trace_to(trace_path(trace_dir, rank))
            self.comm.begin_step(first_step)
        self.collector = RankCollector(rank=rank, world=world, device=device, every=cfg.metrics_every or 1,
                                       tokens_per_step=tokens_per_step, flops_per_token=flops_per_token,
                                       peak_flops=peak_flops, comm=self.comm) if cfg.metrics_every else None
        self.profile = None
        if self.collector is not None and current().profile_comms and trace_dir is not None:
            from dtorch.monitor.commprofile import CommProfile

            every = cfg.metrics_every
            self.profile = CommProfile(rank=rank, first=every + 1, last=2 * every, out_dir=trace_dir)
        self.server = None
        self.state = None
        self._named: set[int] = set()
        self._streak: dict[int, int] = {}
        self._windows = 0
        self.block_s = 0.0
        self._block_prev = 0.0
        self._t_block = 0.0
        self._handles: list = []
        if self.collector is not None and model_parts:
            from dtorch.model.structure import blocks_of

            # the blocks as the executor found them, whatever the model names them
            for block in blocks_of(model_parts, structure):
                self._handles.append(block.register_forward_pre_hook(self._pre))
                self._handles.append(block.register_forward_hook(self._post))
        if rank == 0 and cfg.port is not None:
            from dtorch.eventlog import events_path
            from dtorch.monitor.server import MonitorServer, MonitorState

            self.state = MonitorState(events_path())
            # what this run logged before the server started (the plan) or before a restart (the steps)
            self.state.replay(getattr(metrics, "path", None))
            self.server = MonitorServer(self.state, host=cfg.host, port=cfg.port, token=cfg.token,
                                        allow_remote=cfg.allow_remote)
            metrics.sinks.append(self.state.feed)
            self.server.write_info(getattr(metrics, "log_dir", None))
            if console:
                print(f"dtorch: monitor at {self.server.url} (Prometheus: {self.server.url}metrics)", flush=True)

    def _pre(self, module, args) -> None:
        self._t_block = time.perf_counter()

    def _post(self, module, args, out) -> None:
        self.block_s += time.perf_counter() - self._t_block

    @classmethod
    def start(cls, cfg: MonitorConfig, **kw) -> RunMonitor | None:
        if not cfg.metrics_every and cfg.port is None and not cfg.trace_comms:
            return None
        return cls(cfg, **kw)

    def trace_modules(self):
        """Around forward/backward: PyTorch's CommDebugMode when tracing (DTensor collectives per
        module), else nothing."""
        if not self.cfg.trace_comms or getattr(self.plan, "compile", False):
            # CommDebugMode is a TorchDispatchMode, under which torch.compile cannot run (measured:
            # "found no compiled frames"); see the warning in __init__
            return contextlib.nullcontext()
        from torch.distributed.tensor.debug import CommDebugMode

        self._debug_mode = CommDebugMode()
        return self._debug_mode

    def _module_counts(self) -> dict[str, Any]:
        mode = getattr(self, "_debug_mode", None)
        if mode is None:
            return {}
        out = {}
        for fqn, d in mode.comm_module_counts.items():
            counts = {f"{phase}:{getattr(op, '__name__', str(op))}": n for phase in ("forward", "backward")
                      for op, n in (d.get(phase) or {}).items() if n}
            if counts:
                out[fqn] = counts
        return out

    def comm_snapshot(self) -> dict[str, float] | None:
        return self.comm.snapshot() if self.comm is not None else None

    def step(self, step: int, *, step_s: float, data_s: float, fb_s: float, opt_s: float,
             comm_before: dict[str, float] | None, comm_after_fb: dict[str, float] | None) -> dict | None:
        """Record one step; every N steps gather all ranks (collective) and, on rank 0, write the
        ``ranks`` record. Returns that record on rank 0 when one was made."""
        if self.collector is None:
            if self.comm is not None:  # tracing only
                self.comm.end_step(self._module_counts())
                self.comm.begin_step(step + 1)
            return None
        now = self.comm.snapshot() if self.comm is not None else None
        c_fb = c_all = None
        if comm_before is not None and now is not None:
            c_fb = {a: comm_after_fb[a] - comm_before[a] for a in comm_before}
            c_all = {a: now[a] - comm_before[a] for a in comm_before}
        fwd, self._block_prev = self.block_s - self._block_prev, self.block_s
        self.collector.step(step_s=step_s, data_s=data_s, fb_s=fb_s, opt_s=opt_s, comm_fb=c_fb, comm_all=c_all,
                            fwd_blocks_s=fwd)
        if self.profile is not None:
            self.profile.stop_if_due(step)
        rows = self.collector.maybe_gather(step)
        if self.profile is not None:
            self.profile.start_if_due(step)
        if self.comm is not None and self.cfg.trace_comms:
            self.comm.end_step(self._module_counts())
            self.comm.begin_step(step + 1)
        if rows is None:
            return None
        rec = ranks_record(rows, step, self.plan.predicted if self.plan is not None else None)
        self.metrics.event("ranks", **rec)
        if len(rows) > 1:
            self.metrics.note = f"slowest r{rec['slowest_rank']} {rec['slowest_ratio']:.2f}x"
        # named after two windows in a row, never on the first (it carries one-time work): a load
        # spike on a shared host is not a straggler
        self._windows += 1
        self._streak = {r: self._streak.get(r, 0) + 1 for r in rec["stragglers"]} if self._windows > 1 else {}
        for r in (r for r, n in self._streak.items() if n >= 2):
            if r not in self._named:
                self._named.add(r)
                self.metrics.event("slow_rank", step=step, ranks=[r], ratio=rec["ranks"][r]["own_ratio"],
                                   source="per-rank view")
                if self.console:
                    print(f"dtorch: rank {r} is the slowest: its own work per step (data, compute, optimizer; "
                          f"waits excluded) is {rec['ranks'][r]['own_ratio']:.2f}x the fastest rank's",
                          file=sys.stderr, flush=True)
        for r in rec["throttling"]:
            if ("throttle", r) not in self._named:
                self._named.add(("throttle", r))  # type: ignore[arg-type]
                self.metrics.event("gpu_throttle", step=step, rank=r, reasons=rec["ranks"][r]["gpu_throttle"])
        return rec

    def close(self) -> None:
        if self.profile is not None:
            self.profile.close()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self.comm is not None:
            self.comm.uninstall()
        if self.server is not None:
            self.server.close()
