"""What `Trainer.fit` does around its steps, one concern per object.

`fit` is a short loop: each step it calls every callback's `before_step`, runs the step (data,
forward and backward inside every callback's `around_forward`, optimizer), then every callback's
`after_step` with the step's `StepRecord`. `on_start` runs once the trainer is set up and resumed,
`on_end` after the last step, `on_error` when the loop fails, `close` (in reverse order) always.
The trainer builds its list in `Trainer._callbacks`; the order is the order of the hooks' effects
(the compile event before the step's metrics line, the snapshot before the step is reported done,
the rebalance before the checkpoint that records it, ...). An eval loop is one more callback.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtorch.errors import ConfigError
from dtorch.plan.plan import Plan
from dtorch.train import hooks

Trainer = Any
"""A `dtorch.train.trainer.Trainer` (not imported: the trainer imports this module)."""


@dataclass
class FitResult:
    """What `fit` did on this rank."""

    steps_run: int
    """Optimizer steps executed by this call (excluding those restored from a checkpoint)."""
    final_step: int
    resumed_from: int | None
    losses: dict[int, float] = field(default_factory=dict)
    """Per-step global mean loss, keyed by the 1-based step number."""
    plan: Plan | None = None
    wall_s: float = 0.0
    step_times: list[float] = field(default_factory=list)
    """Wall-clock seconds of each step this call ran, in order."""
    compile_s: float | None = None
    """With plan.compile: seconds the first step took beyond a steady step (torch.compile's tracing
    and code generation), as in the `compile` event; None otherwise."""
    eval_losses: dict[int, float] = field(default_factory=dict)
    """Evaluation loss by the step it was measured after (`Evaluate`)."""


@dataclass
class FitRun:
    """One call of `fit`: what the loop and its callbacks share."""

    steps: int
    """The global step to reach."""
    result: FitResult
    tokens_per_step: int
    flops_per_token: float
    """Model FLOPs per token (6N + attention, no recompute): MFU's numerator per token."""
    peak_flops: float
    """One rank's peak FLOP/s in the compute dtype: MFU's denominator per rank (`dtorch.cluster.peak`)."""
    sample_shares: list[int] | None
    """Uneven work (plan.dp_shares): each data-parallel rank's slice of the global batch, in samples."""
    phase: str = "data"
    """Where the step is (data, forward_backward, optimizer, checkpoint): an OOM names it."""
    stragglers: int = 0
    """Flags raised: a run with any does not feed the calibration."""


@dataclass
class StepRecord:
    """One step as it runs: filled in by the loop (times are `time.perf_counter()` readings)."""

    step: int
    """The step being run (1-based: the step count once it is done)."""
    t0: float
    indices: list[int] = field(default_factory=list)
    t_data: float = 0.0
    t_fb: float = 0.0
    t_opt: float = 0.0
    t_end: float = 0.0
    loss: float = 0.0
    grad_norm: float = 0.0
    lr: float = 0.0
    comm0: Any = None
    comm1: Any = None

    @property
    def dt(self) -> float:
        return self.t_end - self.t0


class Callback:
    """A concern of the training loop. Every hook is optional; all run on every rank, in the order
    of the trainer's list (collectives inside them are therefore matched)."""

    def on_start(self, tr: Trainer, run: FitRun) -> None:
        """Once: the trainer is set up and resumed, before the first step."""

    def before_step(self, tr: Trainer, run: FitRun, step: int) -> None:
        """At the start of step `step` (1-based), before its data is read."""

    def before_forward(self, tr: Trainer, run: FitRun, rec: StepRecord) -> None:
        """After the step's data is read, before its `forward_backward` phase is marked (what watches
        the phases, a chaos drill's fault included, has not seen the forward yet)."""

    def around_forward(self, tr: Trainer, run: FitRun, rec: StepRecord) -> contextlib.AbstractContextManager:
        """A context around the step's forward and backward."""
        return contextlib.nullcontext()

    def after_step(self, tr: Trainer, run: FitRun, rec: StepRecord) -> None:
        """After the optimizer step (`tr.step` is `rec.step`)."""

    def on_end(self, tr: Trainer, run: FitRun) -> None:
        """After the last step of a loop that did not fail."""

    def on_error(self, tr: Trainer, run: FitRun, exc: BaseException) -> None:
        """The loop failed with `exc` (re-raised after every callback's `on_error`)."""

    def close(self, tr: Trainer, run: FitRun) -> None:
        """Always, last, in reverse order."""


class CompileReport(Callback):
    """The `compile` event: what torch.compile cost this run at its first step."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def after_step(self, tr: Trainer, run: FitRun, rec: StepRecord) -> None:
        if self.enabled and run.result.steps_run == 2:
            run.result.compile_s = self.report(tr, run.result.step_times)

    def on_end(self, tr: Trainer, run: FitRun) -> None:
        if self.enabled and run.result.steps_run == 1:  # no steady step to subtract
            run.result.compile_s = self.report(tr, run.result.step_times)

    @staticmethod
    def report(tr: Trainer, step_times: list[float]) -> float:
        from dtorch.parallel.compile import first_step_cost

        cost = first_step_cost(step_times)
        tr.metrics.event("compile", **cost)
        if tr.rank == 0 and tr.console:
            steady = cost["steady_step_s"]
            print(f"dtorch: torch.compile took {cost['seconds']:.1f} s at the first step"
                  + (f" (then {steady * 1e3:.0f} ms/step)" if steady is not None else ""), flush=True)
        return cost["seconds"]


class MetricsSink(Callback):
    """Each step's line of metrics.jsonl (+ TensorBoard, the console)."""

    def after_step(self, tr: Trainer, run: FitRun, rec: StepRecord) -> None:
        from dtorch.cluster.peak import mfu
        from dtorch.monitor.metrics import StepMetrics, peak_memory_bytes

        tps = run.tokens_per_step / rec.dt
        tr.metrics.log(StepMetrics(
            step=rec.step, loss=rec.loss, grad_norm=rec.grad_norm, lr=rec.lr, step_time_s=rec.dt,
            tokens_per_s=tps, mfu=mfu(tps, run.flops_per_token, run.peak_flops, tr.world),
            peak_memory_bytes=peak_memory_bytes(tr.device), world_size=tr.world, epoch=tr.env.epoch or 0))

    def close(self, tr: Trainer, run: FitRun) -> None:
        tr.metrics.close()


def require_extra(package: str, field: str, value: Any) -> None:
    """ConfigError naming the extra that installs `package` when it is not importable (a sink asked
    for and missing: one line, exit 2 from the CLI)."""
    import importlib.util

    if importlib.util.find_spec(package) is None:
        raise ConfigError(field, value, f"{package} is not installed: pip install 'dtorch-os[{package}]'")


class Sink(Callback):
    """A metrics sink outside DTorch, on rank 0 only: once `open`ed it gets every record
    metrics.jsonl gets and writes the scalars people chart (`STEP_SCALARS` each step, `EVAL_SCALARS`
    at each evaluation) at their global step. Subclasses implement `open`, `write` and `finish`."""

    STEP_SCALARS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
                    "tokens_per_s": "train/tokens_per_s", "mfu": "train/mfu", "step_time_s": "train/step_time_s",
                    "peak_memory_bytes": "memory/peak_bytes"}
    """Step record key -> tag. MFU as a ratio (0..1), the one definition (`dtorch.cluster.peak`)."""
    EVAL_SCALARS = {"loss": "eval/loss", "perplexity": "eval/perplexity"}

    def __init__(self) -> None:
        self.opened = False
        self.failed = False

    def open(self, tr: Trainer, run: FitRun) -> None:
        raise NotImplementedError

    def write(self, step: int, scalars: dict[str, float]) -> None:
        raise NotImplementedError

    def finish(self, failed: bool) -> None:
        raise NotImplementedError

    def on_start(self, tr: Trainer, run: FitRun) -> None:
        if tr.rank != 0:
            return
        self.open(tr, run)
        self.opened = True
        tr.metrics.sinks.append(self.feed)

    def feed(self, record: dict[str, Any]) -> None:
        """One record of metrics.jsonl (a step's metrics or an event)."""
        import math

        if "event" not in record and "step" in record:
            keys = self.STEP_SCALARS
        elif record.get("event") == "eval":
            keys = self.EVAL_SCALARS
        else:
            return
        values = {tag: float(record[k]) for k, tag in keys.items() if isinstance(record.get(k), (int, float))}
        # an infinite perplexity (a diverged run) is no point on a chart
        self.write(int(record["step"]), {k: v for k, v in values.items() if math.isfinite(v)})

    def on_error(self, tr: Trainer, run: FitRun, exc: BaseException) -> None:
        self.failed = True

    def close(self, tr: Trainer, run: FitRun) -> None:
        if self.opened:
            if self.feed in tr.metrics.sinks:
                tr.metrics.sinks.remove(self.feed)
            self.opened = False
            self.finish(self.failed)


class TensorBoard(Sink):
    """TensorBoard event files (`pip install 'dtorch-os[tensorboard]'`) in `log_dir`, default
    ``<log_dir of the run>/tb``: the scalars of `Sink`, and the plan as text."""

    def __init__(self, log_dir: str | None = None) -> None:
        require_extra("tensorboard", "tensorboard", log_dir or True)
        super().__init__()
        self.log_dir = log_dir
        self.writer: Any = None

    def open(self, tr: Trainer, run: FitRun) -> None:
        from torch.utils.tensorboard import SummaryWriter

        if self.log_dir is None and tr.log_dir is None:
            raise ConfigError("tensorboard", True, "TensorBoard writes to <checkpoint_dir>/tb: give a checkpoint_dir "
                              "or log_dir, or TensorBoard(log_dir=...)")
        self.writer = SummaryWriter(str(self.log_dir or tr.log_dir / "tb"))
        self.writer.add_text("plan", f"{tr.plan.family()}: {tr.plan.describe()}", tr.step)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)

    def finish(self, failed: bool) -> None:
        self.writer.close()


class WandB(Sink):
    """A Weights & Biases run (`pip install 'dtorch-os[wandb]'`) in `project`: the scalars of `Sink`
    and the run's plan and shape as its config. The wandb library reads its own settings
    (``WANDB_MODE=offline``, ``WANDB_DIR``, ``WANDB_API_KEY``, ``WANDB_ENTITY``). A run that resumes
    from its checkpoint continues the W&B run its first start made (the id is kept in
    ``<log_dir>/wandb-run-id``); a fresh start makes a new one.

    W&B drops a row whose ``_step`` is below the run's last one, and a resume re-runs the steps
    after its checkpoint. So the global step is a metric of its own, `STEP_METRIC`, declared the
    x-axis of every chart (``define_metric``, as Lightning and transformers do), and ``_step`` is
    a row counter that only grows across restarts: one row per global step written (an evaluation
    joins its step's row), the next row kept in ``<log_dir>/wandb-run-step`` (an offline run starts
    its ``_step`` at 0 again; online, W&B's own count wins when it is higher). The file is written
    once per `ROW_BLOCK` rows, ahead of them: a restart skips the rest of the block, never reuses a
    row. A re-run step is a second row with the same `STEP_METRIC`: both are kept."""

    STEP_METRIC = "train/step"
    ROW_BLOCK = 1000

    def __init__(self, project: str, *, name: str | None = None, entity: str | None = None) -> None:
        if not project or not isinstance(project, str):
            raise ConfigError("wandb", project, "give the Weights & Biases project to log to")
        require_extra("wandb", "wandb", project)
        super().__init__()
        self.project, self.name, self.entity = project, name, entity
        self.run: Any = None
        self.row = 0
        """The ``_step`` of the row being written."""
        self.reserved = 0
        """Rows below this are this run's to write (the value kept in `row_file`)."""
        self.last_step: int | None = None
        self.row_file: Path | None = None

    def _run_id(self, tr: Trainer) -> str | None:
        """This run's W&B id: the first start's when the trainer resumed, else a new one."""
        if tr.log_dir is None:
            return None
        import secrets

        from dtorch import trust

        path = tr.log_dir / "wandb-run-id"
        if tr.resumed.step is not None and path.is_file():
            kept = path.read_text().strip()
            if kept.isalnum():
                return kept
        run_id = secrets.token_hex(8)
        trust.replace_file(path, run_id.encode(), durable=False)
        return run_id

    def open(self, tr: Trainer, run: FitRun) -> None:
        import wandb

        config = {"plan": tr.plan.describe(), "family": tr.plan.family(), "world_size": tr.world,
                  "global_batch": tr.global_batch, "seq_len": tr.seq_len, "param_dtype": tr.plan.param_dtype,
                  "flops_per_token": run.flops_per_token, "mfu_peak_flops_per_rank": run.peak_flops}
        self.run = wandb.init(project=self.project, entity=self.entity, id=self._run_id(tr), resume="allow",
                              name=self.name or (tr.log_dir.name if tr.log_dir is not None else None),
                              config=config)
        self.run.define_metric(self.STEP_METRIC)
        self.run.define_metric("*", step_metric=self.STEP_METRIC)
        self.row_file = tr.log_dir / "wandb-run-step" if tr.log_dir is not None else None
        kept = 0
        if tr.resumed.step is not None and self.row_file is not None and self.row_file.is_file():
            text = self.row_file.read_text().strip()
            kept = int(text) if text.isdigit() else 0
        self.row, self.last_step = max(int(self.run.step), kept), None
        self.reserved = self.row

    def write(self, step: int, scalars: dict[str, float]) -> None:
        if step != self.last_step:
            if self.last_step is not None:
                self.row += 1
            self.last_step = step
            if self.row_file is not None and self.row >= self.reserved:
                # kept before the rows are sent: a kill after them never reuses their _step
                from dtorch import trust

                self.reserved = self.row + self.ROW_BLOCK
                trust.replace_file(self.row_file, str(self.reserved).encode(), durable=False)
        self.run.log({**scalars, self.STEP_METRIC: step}, step=self.row)

    def finish(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class SampleAudit(Callback):
    """DTORCH_RECORD_SAMPLES: which sample indices each rank consumed at each step."""

    def __init__(self) -> None:
        self.file: Any = None

    def on_start(self, tr: Trainer, run: FitRun) -> None:
        self.file = open(tr.log_dir / f"samples-rank{tr.rank}.jsonl", "a", buffering=1)  # noqa: SIM115

    def after_step(self, tr: Trainer, run: FitRun, rec: StepRecord) -> None:
        from dtorch.train.evaluate import Subset

        # indices of the data as given: with a held-out split the sampler counts the samples left to train on
        indices = [tr.dataset.indices[i] for i in rec.indices] if isinstance(tr.dataset, Subset) else rec.indices
        self.file.write(json.dumps({"step": rec.step, "dp_rank": tr.parallel.dp_rank, "indices": indices}) + "\n")

    def close(self, tr: Trainer, run: FitRun) -> None:
        if self.file is not None:
            self.file.close()


class Snapshots(Callback):
    """In-memory snapshots every `every` steps (`dtorch.checkpoint.snapshot`); the copy of one step
    runs beside the next step's data loading and is joined before its forward."""

    def __init__(self, snapshotter: Any, every: int, state: Any):
        self.snap, self.every, self.state = snapshotter, every, state

    def wait(self) -> None:
        self.snap.wait()

    def before_forward(self, tr: Trainer, run: FitRun, rec: StepRecord) -> None:
        self.snap.wait()  # a failure from the forward on finds the previous step's copy complete

    def after_step(self, tr: Trainer, run: FitRun, rec: StepRecord) -> None:
        if rec.step % self.every:
            return
        snap = self.snap
        before = len(snap.stall_s)
        snap.take(rec.step, self.state())
        n = len(snap.stall_s)
        if n > before and n % 10 == 1 and n > 1:  # the stall of the last 10 takes (their waits are in), for the benchmark
            recent = sorted(snap.stall_s[-11:-1])
            parts = {k: sorted(v[-10:])[len(v[-10:]) // 2] for k, v in snap.parts_s.items() if v}
            hooks.notice("snapshot_stall", step=rec.step, takes=n - 1, median_s=recent[len(recent) // 2],
                         max_s=recent[-1], parts_median_s=parts)


class Seam(Callback):
    """The one-way hook seam (`dtorch.train.hooks`): what watches the loop sees each step."""

    def before_step(self, tr: Trainer, run: FitRun, step: int) -> None:
        hooks.before_step(step)

    def after_step(self, tr: Trainer, run: FitRun, rec: StepRecord) -> None:
        hooks.after_step(rec.step, rec.loss)


class Monitor(Callback):
    """The run monitor (`dtorch.monitor.live`): per-rank aggregation, comms, the live server."""

    def __init__(self) -> None:
        self.mon: Any = None

    def on_start(self, tr: Trainer, run: FitRun) -> None:
        from dtorch.monitor.live import RunMonitor

        p = tr.parallel
        self.mon = RunMonitor.start(tr.monitor_config, rank=tr.rank, world=tr.world, device=tr.device,
                                    metrics=tr.metrics, plan=tr.plan, mesh=p.mesh,
                                    tokens_per_step=run.tokens_per_step, flops_per_token=run.flops_per_token,
                                    peak_flops=run.peak_flops, console=tr.console, model_parts=p.model_parts,
                                    trace_dir=tr.log_dir, first_step=tr.step + 1,
                                    structure=getattr(p, "structure", None))

    @contextlib.contextmanager
    def around_forward(self, tr: Trainer, run: FitRun, rec: StepRecord) -> Iterator[None]:
        if self.mon is None:
            yield
            return
        rec.comm0 = self.mon.comm_snapshot()
        with self.mon.trace_modules():
            yield
        rec.comm1 = self.mon.comm_snapshot()

    def after_step(self, tr: Trainer, run: FitRun, rec: StepRecord) -> None:
        if self.mon is not None:
            self.mon.step(rec.step, step_s=rec.dt, data_s=rec.t_data - rec.t0, fb_s=rec.t_fb - rec.t_data,
                          opt_s=rec.t_end - rec.t_opt, comm_before=rec.comm0, comm_after_fb=rec.comm1)

    def close(self, tr: Trainer, run: FitRun) -> None:
        if self.mon is not None:
            self.mon.close()


class Stragglers(Callback):
    """The straggler check (every `straggler_every` steps) and its response, the rebalance: new
    data-parallel shares by measured speed, applied at the next checkpoint (pp=1 plans)."""

    def __init__(self) -> None:
        self.watch: Any = None
        self.dp_of_rank: list[Any] | None = None
        self.pending: list[int] | None = None

    def on_start(self, tr: Trainer, run: FitRun) -> None:
        import torch.distributed as dist

        if tr.rebalance and tr.world > 1:
            self.dp_of_rank = [None] * tr.world
            dist.all_gather_object(self.dp_of_rank, tr.parallel.dp_rank)
        if tr.world > 1 and tr.straggler_every:
            from dtorch.monitor.straggler import StragglerWatch

            self.watch = StragglerWatch(tr.parallel.model_parts, tr.world, every=tr.straggler_every,
                                        structure=getattr(tr.parallel, "structure", None))

    def after_step(self, tr: Trainer, run: FitRun, rec: StepRecord) -> None:
        report = self.watch.step_done(tr.step) if self.watch is not None else None
        if report is not None and report.new:
            ratio = [round(x, 3) for x in report.ratio]
            tr.metrics.event("straggler", step=tr.step, ranks=report.new, ratio=ratio)
            run.stragglers += 1
            if tr.rank == 0:
                print(report.warning(), file=sys.stderr, flush=True)
                hooks.notice("straggler", step=tr.step, ranks=report.new, ratio=ratio)
            if self.dp_of_rank is not None:
                self.pending = self._planned(tr, report)
        if self.pending is not None and tr.step % tr.checkpoint_every == 0 and tr.step < run.steps:
            # at the checkpoint, before it is written: it records the plan the run goes on with
            run.sample_shares = self._apply(tr, self.pending)
            self.pending = None

    def _planned(self, tr: Trainer, report: Any) -> list[int] | None:
        """The shares the straggler report's measured speeds call for (same on every rank: the
        report is gathered), or None; logged as a `rebalance` event with `applied_at` to come."""
        from dtorch.train.rebalance import rebalanced_shares

        if tr.plan.pp > 1 or tr.plan.ep > 1:
            tr.metrics.event("rebalance", step=tr.step, skipped="pipeline and expert-parallel plans keep their "
                             "shares while running; restart with a plan that sets dp_shares")
            return None
        shares = rebalanced_shares(tr.plan.dp_shares, tr.plan.num_microbatches, report.ratio, self.dp_of_rank,
                                   tr.parallel.dp_size)
        if shares is not None:
            tr.metrics.event("rebalance", step=tr.step, planned=shares, current=tr.plan.dp_shares,
                             ratio=[round(x, 3) for x in report.ratio])
        return shares

    @staticmethod
    def _apply(tr: Trainer, shares: list[int]) -> list[int] | None:
        """Cut the global batch by `shares` from the next step on; returns the sampler's shares."""
        old = tr.plan.dp_shares
        try:
            tr.plan_source = tr.resolver.rebalanced(tr.parallel, shares)
        except ConfigError as e:
            tr.metrics.event("rebalance", step=tr.step, skipped=str(e))
            return [tr.plan.microbatch_size * n for n in old] if tr.parallel.uneven else None
        tr.plan = tr.plan_source.plan
        tr.metrics.event("rebalance", step=tr.step, applied=shares, previous=old)
        if tr.rank == 0 and tr.console:
            print(f"dtorch: rebalanced at step {tr.step} by measured speed: data-parallel shares "
                  f"{'/'.join(map(str, shares))} micro-batches (were {'/'.join(map(str, old)) if old else 'even'})",
                  flush=True)
        return [tr.plan.microbatch_size * n for n in shares] if tr.parallel.uneven else None

    def close(self, tr: Trainer, run: FitRun) -> None:
        if self.watch is not None:
            self.watch.close()


class Evaluate(Callback):
    """The eval loop: every `every` steps and at the end, the loss on the evaluation set under the
    run's plan (`dtorch.train.evaluate.eval_loss`: eval mode, no gradients, all-reduced as training's
    loss is), logged as an `eval` event with its perplexity. A plan that cannot evaluate fails at the
    start, saying why."""

    def __init__(self, every: int, eval_set: Any, batches: int):
        self.every, self.eval_set, self.batches = every, eval_set, batches
        self.last: int | None = None

    @classmethod
    def of(cls, tr: Trainer) -> Evaluate | None:
        """The trainer's eval loop, or None when it asked for none."""
        if tr.eval_spec is None:
            return None
        from dtorch.train.evaluate import eval_batches

        return cls(tr.eval_spec.every, tr._datasets()[1], eval_batches(tr))

    def on_start(self, tr: Trainer, run: FitRun) -> None:
        from dtorch.train.evaluate import can_evaluate

        why = can_evaluate(tr.parallel)
        if why is not None:
            raise ConfigError("eval_every", self.every, why)

    def after_step(self, tr: Trainer, run: FitRun, rec: StepRecord) -> None:
        if self.every and tr.step % self.every == 0 and tr.step < run.steps:
            self.evaluate(tr, run)

    def on_end(self, tr: Trainer, run: FitRun) -> None:
        if self.last != tr.step:
            self.evaluate(tr, run)

    def evaluate(self, tr: Trainer, run: FitRun) -> float:
        import math
        import time

        from dtorch.train.evaluate import eval_loss

        if tr.snapshots is not None:
            tr.snapshots.wait()  # the step's snapshot copy reads the weights the forward gathers
        phase, run.phase = run.phase, "eval"
        # the straggler check times training's block forwards: the evaluation's are not counted
        watch = next((c.watch for c in getattr(tr, "callbacks", ()) if isinstance(c, Stragglers) and c.watch), None)
        timed = (watch.seconds, watch.calls) if watch is not None else None
        t0 = time.perf_counter()
        loss = eval_loss(tr, self.eval_set, self.batches, phase=lambda: hooks.phase_begin("eval"))
        if watch is not None:
            watch.seconds, watch.calls = timed
        run.phase = phase
        ppl = math.exp(loss) if loss < 700 else math.inf
        self.last = tr.step
        run.result.eval_losses[tr.step] = loss
        tr.metrics.event("eval", step=tr.step, loss=loss, perplexity=ppl, batches=self.batches,
                         samples=self.batches * tr.global_batch, seconds=round(time.perf_counter() - t0, 4))
        if tr.rank == 0 and tr.console:
            print(f"dtorch: eval at step {tr.step}: loss {loss:.4f} perplexity {ppl:.2f} "
                  f"({self.batches * tr.global_batch} samples)", file=sys.stderr, flush=True)
        return loss


class Checkpoints(Callback):
    """Durable checkpoints every `checkpoint_every` steps and one at the end; the async save's
    buffers allocated after the first step."""

    def after_step(self, tr: Trainer, run: FitRun, rec: StepRecord) -> None:
        if run.result.steps_run == 1 and tr.async_checkpoint:
            # Allocate the async save's CPU buffers now, between steps, not inside the first
            # save's stall. Not before the first step: reading an optimizer's state dict
            # before it has state runs a zero-lr step that shifts Adam's step count.
            tr.ckpt.warm_up(tr.checkpoint_state())
        if tr.step % tr.checkpoint_every == 0 and tr.step < run.steps:
            run.phase = "checkpoint"
            tr._save()

    def on_end(self, tr: Trainer, run: FitRun) -> None:
        resumed = tr.resumed.checkpoint_step  # a snapshot's step is not durable: written again
        if resumed is None or resumed < run.steps:
            run.phase = "checkpoint"
            tr._save(final=True)

    def close(self, tr: Trainer, run: FitRun) -> None:
        tr.ckpt.wait(raise_on_error=False)


class OOMGuard(Callback):
    """A test's memory cap (DTORCH_TEST_MEMORY_CAP) checked after each forward and save, and the
    record of an out-of-memory error: rank, phase, stage, memory vs estimate (`dtorch.monitor.oom`)."""

    def __init__(self) -> None:
        self.base, self.cap = 0, None

    def on_start(self, tr: Trainer, run: FitRun) -> None:
        from dtorch.monitor import oom

        self.base = oom._status("VmRSS") or 0
        self.cap = oom.MemoryCap(tr.rank, self.base)
        if self.cap.limit is not None:  # a test's memory cap counts from here (other peaks stay untouched)
            oom.reset_peak()

    @contextlib.contextmanager
    def around_forward(self, tr: Trainer, run: FitRun, rec: StepRecord) -> Iterator[None]:
        yield
        self.cap.check(rec.step)

    def after_step(self, tr: Trainer, run: FitRun, rec: StepRecord) -> None:
        if run.phase == "checkpoint":
            self.cap.check(tr.step)  # a test's cap: the save's staging copy is memory too

    def on_error(self, tr: Trainer, run: FitRun, exc: BaseException) -> None:
        from dtorch.monitor import oom

        if not oom.is_oom(exc):
            return
        stages = [0]
        if tr.plan.pp > 1 and tr.parallel is not None and tr.parallel.mesh is not None:
            from dtorch.parallel.pipeline import stage_ids

            stages = list(stage_ids(tr.plan, tr.parallel.mesh["pp"].get_local_rank()))
        try:
            step = tr.step if run.phase == "checkpoint" else tr.step + 1  # a save is of the step done
            rec = oom.describe(exc, rank=tr.rank, phase=run.phase, step=step, stages=stages, plan=tr.plan,
                               device=tr.device, base_bytes=self.base, cap=self.cap)
            oom.record(rec, tr.log_dir)
            tr.metrics.event("oom", **rec)
            print(oom.message(rec), file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - naming the OOM must never hide it
            import logging

            logging.getLogger("dtorch.train").exception("could not record the out-of-memory error")


class Feedback(Callback):
    """At the end: the measured step time and peak memory against the plan's prediction."""

    def on_end(self, tr: Trainer, run: FitRun) -> None:
        self.feedback(tr, run.result.step_times, run.stragglers)

    @staticmethod
    def feedback(tr: Trainer, step_times: list[float], stragglers: int = 0) -> None:
        """Compare the measured step time and peak memory with the plan's prediction, log the gap,
        and (rank 0, a clean run only: `feedback.unclean_reasons`) refine the calibration in the
        job's own directory, ``<log_dir>/calibration.json``; the shared one is left to `dtorch probe`."""
        if not (tr.plan.predicted and tr.resolver.cluster_name) or len(step_times) < 6:
            return
        import torch
        import torch.distributed as dist

        from dtorch.monitor import feedback
        from dtorch.monitor.metrics import peak_memory_bytes

        peak = torch.tensor([peak_memory_bytes(tr.device)], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        if tr.rank != 0:
            return
        measured = sorted(step_times[3:])[len(step_times[3:]) // 2]  # median after warm-up
        gap = feedback.record(tr.plan, measured, int(peak.item()), tr.resolver.cluster_name,
                              save=tr.log_dir is not None,
                              path=tr.log_dir / "calibration.json" if tr.log_dir is not None else None,
                              unclean=feedback.unclean_reasons(stragglers))
        tr.metrics.event("feedback", **{k: v for k, v in gap.items() if not isinstance(v, dict)})
        if tr.console and "skipped" not in gap:
            where = (f"written to {gap['path']}" if gap.get("path")
                     else gap.get("not_written", "not written (no log directory)"))
            print(f"dtorch: measured {measured * 1e3:.0f} ms/step vs predicted "
                  f"{tr.plan.predicted['step_time_s'] * 1e3:.0f} ms; feedback {where}", flush=True)


class Status(Callback):
    """status.json in the run directory (and the scheduler's job comment): docs/schedulers.md."""

    def __init__(self) -> None:
        self.reported_commit: int | None = None

    def on_start(self, tr: Trainer, run: FitRun) -> None:
        from dtorch.integrations.status import last_fault

        self.reported_commit = tr.ckpt.last_committed if tr.ckpt is not None else None
        if run.result.resumed_from is not None:
            tr.status.report("recovering", from_step=run.result.resumed_from, total_steps=run.steps,
                             source=tr.resumed.source if tr.resumed.source != "peer" else "snapshot",
                             after=last_fault(tr.env.run_dir), epoch=tr.env.epoch or 0)

    def after_step(self, tr: Trainer, run: FitRun, rec: StepRecord) -> None:
        committed = tr.ckpt.last_committed if tr.ckpt is not None else None
        if committed != self.reported_commit:  # at commit, not when an async save starts
            self.reported_commit = committed
            tr.status.report("checkpointed", checkpoint_step=committed, step=tr.step, total_steps=run.steps)
        else:
            tr.status.report("running", step=tr.step, total_steps=run.steps,
                             tokens_per_s=round(run.tokens_per_step / rec.dt, 1))

    def on_end(self, tr: Trainer, run: FitRun) -> None:
        tr.status.report("finished", step=tr.step, checkpoint_step=tr.step if tr.ckpt else None,
                         total_steps=run.steps)

    def on_error(self, tr: Trainer, run: FitRun, exc: BaseException) -> None:
        if isinstance(exc, Exception):
            tr.status.report("failed", step=tr.step, why=f"{type(exc).__name__}: {exc}"[:300])


class Preempted(Callback):
    """A scheduler's warning signal: checkpoint now, within its grace period, and stop to be requeued."""

    def __init__(self) -> None:
        self.preemption: Any = None

    def on_start(self, tr: Trainer, run: FitRun) -> None:
        from dtorch.train.preempt import Preemption

        self.preemption = Preemption(tr.world, tr.device, tr.env)

    def after_step(self, tr: Trainer, run: FitRun, rec: StepRecord) -> None:
        from dtorch.train.preempt import EXIT_PREEMPTED

        if tr.step < run.steps and self.preemption.requested():
            tr._save(final=True)
            tr.status.report("preempted", step=tr.step, signal=self.preemption.signal, total_steps=run.steps,
                             checkpoint_step=tr.step if tr.ckpt is not None else None)
            raise SystemExit(EXIT_PREEMPTED)

    def close(self, tr: Trainer, run: FitRun) -> None:
        if self.preemption is not None:
            self.preemption.close()
