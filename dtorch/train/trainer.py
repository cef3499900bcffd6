"""`dtorch.Trainer`: where a user's run lives.

    trainer = dtorch.Trainer(model=lambda: GPT(cfg), data=dataset, loss=dtorch.losses.next_token,
                             optimizer=dtorch.optim.AdamW(lr=3e-4), global_batch=16, seq_len=128,
                             checkpoint_dir="runs/a", plan="auto")
    trainer.fit(steps=200)

One process per rank (launched by `dtorch run` / `dtorch train` / torchrun, or alone). The
trainer (1) joins the process group, (2) chooses the plan ("auto" = detect the cluster, profile the
model, search; or a Plan / a path / a dict of fixed fields searched around: `dtorch.train.resolve`),
(3) applies it with `dtorch.parallel.parallelize`, (4) restores the newest good state (a checkpoint,
resharded if the world or the plan changed, or under `dtorch run` an in-memory snapshot:
`dtorch.checkpoint.resume`), (5) runs steps whose data is a pure function of the global step, with
what happens around them in callbacks (`dtorch.train.callbacks`), and (6) checkpoints every
`checkpoint_every` steps, never torn.

Resuming is automatic: the same command picks up from `checkpoint_dir`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dtorch import env
from dtorch.errors import ConfigError
from dtorch.plan.plan import Plan
from dtorch.train import build, evaluate, hooks, recovery
from dtorch.train import callbacks as cb
from dtorch.train.callbacks import FitResult, FitRun, StepRecord
from dtorch.train.data import batch_for
from dtorch.train.losses import next_token
from dtorch.train.optim import AdamW, WarmupCosine
from dtorch.train.resolve import PlanRequest, PlanResolver, Resolved
from dtorch.train.state import ModelState, OptimizerState, TrainState

log = logging.getLogger("dtorch.train")

__all__ = ["FitResult", "Trainer"]


class Trainer:
    """Train `model` on `data` with a plan chosen for the machines this process runs on.

    Arguments (all keyword):
      model: a factory returning an nn.Module (called on the meta device; weights are initialised
        by `init_weights(seed)` when the module has it), or a module. May be None with `init_from`.
      init_from: a Hugging Face model directory (config.json + safetensors: Llama 3, Mistral,
        Qwen2, GPT-2) or a DTorch seed checkpoint: the initial weights, each rank reading only its
        slices (dtorch.checkpoint.hf_weights). Without `model`, the reference model is built from
        its config.json. A checkpoint in `checkpoint_dir` still wins (the run resumes).
      data: a map-style dataset whose items are a tensor, a tuple or a dict of tensors of any dtype
        and shape: a 1-D integer tensor of seq_len+1 tokens or (input, target) token pairs (language
        models), (x, y) or (x1, ..., xk, y) tuples, dicts whose "labels"/"label"/"target" key is the
        target and whose other keys are the model's keyword arguments (docs/models.md);
        None = the default byte-level corpus (no download).
      collate: `collate(list of items) -> batch` (default: stack every tensor along a new dim 0).
      loss: `loss(output, target) -> mean loss of a micro-batch`, called with the model's logits
        (`.logits` / a dict's "logits" / a tuple's first element, else the output) and the target;
        default: cross entropy over the last dimension (next-token or classification).
      optimizer: an optimizer spec with `build(params)` (dtorch.optim.AdamW, SGD).
      lr_schedule: a schedule spec with `build(optimizer, total_steps)`; default warm-up + cosine
        (dtorch.optim.WarmupCosine; also Constant, WarmupLinear, WSD).
      global_batch: samples per optimizer step over all data-parallel ranks.
      seq_len: tokens per sample of token data; ignored for any other data (a sample then counts
        as one token in throughput and in the planner's figures).
      checkpoint_dir: where checkpoints live; the run resumes from it automatically. None = none.
      checkpoint_every: steps between checkpoints (and one at the end of `fit`).
      plan: "auto" | Plan | path to a plan JSON/YAML | dict of fixed fields (e.g. {"tp": 2}).
      cluster: a cluster spec (preset, shorthand, file) for planning; default: this machine.
      seed: initial weights and data order.
      max_grad_norm: gradient clipping (None = off).
      log_dir: metrics.jsonl (+ TensorBoard); default: checkpoint_dir.
      async_checkpoint: write checkpoints in the background (the blocking stall is logged).
      keep_last: committed checkpoints to keep.
      straggler_every: every N steps all ranks compare their mean block-forward time; a rank at
        least 1.5x slower than the fastest (or suddenly slow against its own history) for two
        checks in a row is named once on the console and as a `straggler` event (0 = off).
      rebalance: the straggler response (docs/monitoring.md): when the straggler check names a
        persistently slow rank, re-cut the data-parallel shares (plan.dp_shares) by the measured
        speeds at the next checkpoint, logged as a `rebalance` event (pp=1 plans; off by default).
      metrics_every: every N steps all ranks gather their step-time terms, memory and GPU readings
        into a ``ranks`` record of metrics.jsonl (0 = off; default $DTORCH_METRICS_EVERY or 10).
      monitor_port / monitor_host / monitor_token: serve Prometheus /metrics and the live page on
        rank 0 (port 0 = a free one; default $DTORCH_MONITOR_PORT, unset = no server); see
        docs/monitoring.md.
      offload: where the optimizer state and fp32 master weights live (docs/memory-tiers.md):
        None = what the plan says (its offload=optimizer is the host tier, optimizer_nvme the
        NVMe tier in `offload_dir`), "none", "optimizer" (host memory, the step on the CPU),
        "optimizer_nvme" (files in `offload_dir`), or a
        dtorch.train.offload.OptimizerOffload for the budget, buffers and params_on_disk.
      offload_dir: the NVMe tier's directory on a local disk (checked before training starts).
      eval_data / eval_split / eval_every / eval_batches: the eval loop (dtorch.train.evaluate): a dataset
        like `data` or the fraction of `data` held out (never trained on; default 0.05); every N steps and at
        the end (0: at the end only; off unless one of the three is given); global batches per evaluation.
      trace_comms: record every collective of every rank to <log_dir>/comms-rank<r>.jsonl, with a
        per-step summary and CommDebugMode's per-module counts (default $DTORCH_TRACE_COMMS=1).
      sinks: metrics sinks beside metrics.jsonl, rank 0: dtorch.train.callbacks.TensorBoard(),
        WandB(project) (docs/monitoring.md).
    """

    def __init__(
        self,
        *,
        model: Callable[[], nn.Module] | nn.Module | None = None,
        data: Any = None,
        init_from: str | os.PathLike | None = None,
        loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = next_token,
        optimizer: Any = None,
        lr_schedule: Any = None,
        global_batch: int = 8,
        seq_len: int = 128,
        collate: Callable[[list], Any] | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        checkpoint_every: int = 50,
        plan: str | Plan | dict | os.PathLike = "auto",
        cluster: str | None = None,
        seed: int = 0,
        max_grad_norm: float | None = 1.0,
        log_dir: str | os.PathLike | None = None,
        async_checkpoint: bool = True,
        keep_last: int = 3,
        console: bool = True,
        straggler_every: int = 10,
        rebalance: bool = False,
        metrics_every: int | None = None,
        monitor_port: int | None = None,
        monitor_host: str | None = None,
        monitor_token: str | None = None,
        trace_comms: bool | None = None,
        offload: Any = None,
        offload_dir: str | os.PathLike | None = None,
        eval_data: Any = None, eval_every: int = 0,
        eval_split: float | None = None, eval_batches: int | None = None,
        sinks: Any = (),
    ):
        if int(global_batch) < 1:
            raise ConfigError("global_batch", global_batch, "use a positive number of samples per step")
        if int(seq_len) < 1:
            raise ConfigError("seq_len", seq_len, "use a positive sequence length")
        if int(checkpoint_every) < 1:
            raise ConfigError("checkpoint_every", checkpoint_every, "use a positive number of steps")
        self.init_from = Path(init_from) if init_from is not None else None
        self.model_factory, self.hf_config = build.model_factory(model, self.init_from)
        self.data = data
        build.check_vocab(self.model_factory, data, eval_data)
        self.eval_spec = evaluate.EvalSpec.resolve(eval_every, eval_data, eval_split, eval_batches)
        self.eval_data, self._datasets_cache = eval_data, None
        self.loss_fn = loss
        self.collate = collate
        self.optimizer_spec = optimizer or AdamW()
        self.lr_spec = lr_schedule or WarmupCosine()
        self.global_batch = int(global_batch)
        from dtorch.train.data import is_token_data  # noqa: I001

        # a sample of other data (images, features) is the planner's "token": seq_len is 1 for it
        self.seq_len = int(seq_len) if is_token_data(data, collate) else 1
        if self.hf_config is not None:  # a window the reference model would ignore: refused here, at start
            from dtorch.checkpoint.hf_weights import check_window

            check_window(self.hf_config, self.seq_len)
        self._sample_batch = None
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.checkpoint_every = int(checkpoint_every)
        self.plan_request = plan
        self.cluster_spec = cluster
        self.seed = int(seed)
        self.max_grad_norm = max_grad_norm
        self.log_dir = Path(log_dir) if log_dir is not None else self.checkpoint_dir
        if int(straggler_every) < 0:
            raise ConfigError("straggler_every", straggler_every, "check every N >= 1 steps, or 0 for never")
        self.straggler_every = int(straggler_every)
        self.rebalance = bool(rebalance)
        if self.rebalance and not self.straggler_every:
            raise ConfigError("rebalance", True, "the straggler response needs the straggler check; "
                              "set straggler_every >= 1 or rebalance=False")
        from dtorch.monitor.live import MonitorConfig

        self.monitor_config = MonitorConfig.resolve(metrics_every, monitor_port, monitor_host, monitor_token,
                                                    trace_comms=trace_comms)
        from dtorch.train.offload import OptimizerOffload

        OptimizerOffload.resolve(offload, directory=offload_dir)  # a bad value fails here, before any work
        self.offload_request, self.offload_dir = offload, offload_dir
        self.offload = None
        self.async_checkpoint = async_checkpoint
        self.keep_last = keep_last
        self.console = console
        self.sinks = list(sinks)
        # set up in _setup()
        self.plan: Plan | None = None
        self.env = env.current()  # the process's environment, read once (a scheduler's ranks: again in _join)
        self.resolver = PlanResolver(PlanRequest(
            plan, self.global_batch, self.seq_len, cluster, self.log_dir, self.env.run_dir, bool(max_grad_norm),
            getattr(self.optimizer_spec, "fused", None) is True), self.model_factory, loss, self._sample)
        self.plan_source: Resolved | None = None
        self.ckpt = None
        self.snapshots: cb.Snapshots | None = None
        self._scheduler_ranks = False
        self.parallel = None
        self.step = 0

    # ---- setup -------------------------------------------------------------------------------
    def _dataset(self):
        """The samples trained on: the data, less a held-out evaluation split when one is asked."""
        return self._datasets()[0]

    def _datasets(self) -> tuple[Any, Any]:
        """(training set, evaluation set or None), built once (`dtorch.train.evaluate.datasets`)."""
        self._datasets_cache = self._datasets_cache or evaluate.datasets(self)
        return self._datasets_cache

    def _microbatch_sample(self) -> tuple[torch.Tensor] | None:
        """One micro-batch of the run's model input on the meta device, for the executor's checks of
        what applies (the pipeline cut traces it); None when the input is not one tensor (pipeline and
        context parallelism refuse such input)."""
        inputs = self._sample()[0]
        if not isinstance(inputs, torch.Tensor):
            return None
        return (torch.empty((self.plan.microbatch_size, *inputs.shape[1:]), dtype=inputs.dtype, device="meta"),)

    def _sample(self) -> tuple[Any, Any]:
        """One real batch of the run's data (two samples, collated), which the profiler measures the
        model on (docs/models.md)."""
        if self._sample_batch is None:
            dataset = self._dataset()
            self._sample_batch = batch_for(dataset, list(range(min(2, len(dataset)))), self.collate)
        return self._sample_batch

    # ---- the plan (dtorch.train.resolve) ----------------------------------------------------------
    def search_result(self, world: int, fixed: dict | None = None):
        """The planner's whole answer for this run at `world` ranks (`dtorch.plan.search.SearchResult`:
        the ranked plans, each family's best, what was not offered and why), asked exactly as `fit`
        asks it with `plan="auto"` or a dict of fixed fields; needs no process group."""
        if fixed is None:
            fixed = dict(self.plan_request) if isinstance(self.plan_request, dict) else {}
        return self.resolver.search(world, fixed, whole=True)

    def _search(self, world: int, fixed: dict, replan=None, whole: bool = False):
        return self.resolver.search(world, fixed, replan=replan, whole=whole)

    def _choose_plan(self, world: int, rank: int) -> Plan:
        return self.resolver.choose(world, rank, self.ckpt)[0]

    def _plan_doc(self) -> dict[str, Any]:
        return self.resolver.doc(self.world, self.rank, self.ckpt)

    def _setup(self, total_steps: int) -> None:
        from dtorch.monitor.metrics import MetricsLogger
        from dtorch.parallel import parallelize

        self.rank, self.world, self.device = build.join(self.env, self._scheduler_ranks)
        self.resolver.fit_steps = total_steps
        self.ckpt = None
        if self.checkpoint_dir is not None:
            from dtorch.checkpoint import CheckpointManager

            self.ckpt = CheckpointManager(self.checkpoint_dir, keep_last=self.keep_last)
            self.ckpt.on_commit = hooks.committed  # the moment a save has committed, to the watchers
        with hooks.phase("replan"):
            self.plan_source = self.resolver.agree(self.world, self.rank, self.device, self.ckpt)
        self.plan = self.plan_source.plan
        self.metrics = MetricsLogger(self.log_dir, rank=self.rank, total_steps=total_steps, console=self.console)
        build.announce_plan(self)

        hooks.phase_begin("build")  # the model and its optimizers (ends at the next phase)
        weights = None
        if self.init_from is not None:
            from dtorch.checkpoint.hf_weights import HFWeights

            weights = HFWeights(self.init_from)
            if self.rank == 0 and self.checkpoint_dir is not None and self.hf_config is not None:
                from dtorch.checkpoint.hf_weights import save_run_config

                # for `dtorch ckpt export --hf`: the config, tokenizer and generation config
                save_run_config(self.checkpoint_dir, self.hf_config, self.init_from)
        self.parallel = parallelize(self.model_factory, self.plan, loss_fn=self.loss_fn,
                                    device=self.device, seed=self.seed, seq_len=self.seq_len, weights=weights,
                                    sample=self._microbatch_sample())
        st = self.parallel.startup
        self.metrics.event("startup", path=st["path"], bytes_read=st["bytes_read"],
                           peak_rss_bytes=st["peak_rss_bytes"], init_from=str(self.init_from or ""))
        # One optimizer per model part (pipeline chunks): the optimizer state dict then maps
        # cleanly onto each part's fully qualified names.
        self.optimizers = self._build_optimizers()
        self.schedulers = [self.lr_spec.build(o, total_steps) for o in self.optimizers]
        self.dataset = self._dataset()
        from dtorch.train.sampler import GlobalSampler

        self.sampler = GlobalSampler(len(self.dataset), self.global_batch, seed=self.seed)
        self.train_state = TrainState()
        self.snapshot_state = recovery.SnapshotState(self)
        self.resume_chooser = recovery.chooser(self)

    def _build_optimizers(self) -> list[torch.optim.Optimizer]:
        """The spec's optimizer per model part, in device memory or in the offload tier (`build.build_optimizers`)."""
        return build.build_optimizers(self)

    def checkpoint_state(self) -> dict[str, Any]:
        """Everything a resumed run needs; tensors reshard on load (DCP)."""
        from dtorch.checkpoint.state import RNGState

        return {
            "model": ModelState(self.parallel),
            "optim": OptimizerState(self.parallel, self.optimizers),
            "lr": build.SchedulersState(self.schedulers),
            "train": self.train_state,
            "rng": RNGState(),
        }

    def _save(self, final: bool = False) -> None:
        if self.ckpt is None:
            return
        if self.snapshots is not None:
            self.snapshots.wait()  # the last step's snapshot copy is complete before the save reads the state
        with hooks.phase("checkpoint"):
            res = self.ckpt.save(self.step, self.checkpoint_state(), async_=self.async_checkpoint and not final,
                                 plan=self.plan, extra=build.checkpoint_extra(self))
            if final:
                self.ckpt.wait()
        self.metrics.event("checkpoint", step=self.step, stall_s=res.stall_s, async_=res.async_)

    # ---- the loop -------------------------------------------------------------------------------
    def fit(self, steps: int) -> FitResult:
        """Train until the global step reaches `steps` (a resumed run does only what is left)."""
        if int(steps) < 1:
            raise ConfigError("steps", steps, "train for at least one step")
        steps, t_start = int(steps), time.perf_counter()
        build.check_fit(self, steps)  # a schedule or an evaluation set the run cannot hold: before any work
        from dtorch.integrations.env import detect, export_rank_env
        from dtorch.integrations.status import Reporter

        # status.json in the run directory (and the scheduler's job comment): see docs/schedulers.md
        self._scheduler_ranks = export_rank_env() is not None  # a scheduler's ranks: rank variables from its own
        self.env = env.current()
        self.status = Reporter(self.log_dir, rank=self.env.rank or 0)
        alloc = detect()
        self.status.report("planning", total_steps=steps, allocation=alloc.describe() if alloc else None)
        try:
            self._setup(steps)
            self.resumed = recovery.resume(self)
        except Exception as e:
            self.status.report("failed", why=f"{type(e).__name__}: {e}"[:300])
            raise
        hooks.phase_begin("prepare")  # what the loop needs before its first step (ends at `started`)
        run = self._fit_run(steps)
        callbacks = self.callbacks = self._callbacks()
        hooks.started(self)
        try:
            for c in callbacks:
                c.on_start(self, run)
            while self.step < steps:
                rec = self._train_step(run, callbacks)
                for c in callbacks:
                    c.after_step(self, run, rec)
            for c in callbacks:
                c.on_end(self, run)
        except BaseException as e:
            for c in callbacks:
                c.on_error(self, run, e)
            raise
        finally:
            for c in reversed(callbacks):
                c.close(self, run)
        run.result.final_step = self.step
        run.result.wall_s = time.perf_counter() - t_start
        return run.result

    def _fit_run(self, steps: int) -> FitRun:
        """What this call of `fit` shares with its callbacks."""
        peak = build.device_peak(self)  # MFU's denominator, the plan's (dtorch.cluster.peak)
        shares = [self.plan.microbatch_size * n for n in self.plan.dp_shares] if self.parallel.uneven else None
        return FitRun(steps, FitResult(0, self.step, self.resumed.step, plan=self.plan),
                      self.global_batch * self.seq_len, build.flops_per_token(self), peak, shares)

    def _callbacks(self) -> list[cb.Callback]:
        """The loop's callbacks, in the order their effects must happen (see `dtorch.train.callbacks`)."""
        from dtorch.parallel.compile import compile_enabled

        snaps = self.resume_chooser.snapshots
        self.snapshots = cb.Snapshots(snaps.snapshotter, snaps.every, self.snapshot_state) if snaps else None
        return [c for c in (
            cb.CompileReport(compile_enabled(self.plan)), cb.MetricsSink(),
            cb.SampleAudit() if self.env.record_samples and self.log_dir is not None else None,
            self.snapshots, cb.Seam(), cb.Monitor(), cb.Stragglers(),
            cb.Evaluate.of(self),
            cb.Checkpoints() if self.ckpt is not None else None, cb.OOMGuard(), cb.Feedback(), cb.Status(),
            cb.Preempted(), *self.sinks,
        ) if c is not None]

    def _train_step(self, run: FitRun, callbacks: list[cb.Callback]) -> StepRecord:
        """One optimizer step: this rank's slice of the global batch, forward and backward, clipping,
        the optimizers and schedules, with the callbacks' hooks around each (`cb.Callback`)."""
        rec = StepRecord(self.step + 1, time.perf_counter())
        run.phase = "data"
        for c in callbacks:
            c.before_step(self, run, rec.step)
        if self.ckpt is not None:
            self.ckpt.raise_if_failed()  # a failed async save stops the run at the next step
        rec.indices = self.sampler.local_indices(self.step, self.parallel.dp_rank, self.parallel.dp_size,
                                                 shares=run.sample_shares)
        inputs, labels = batch_for(self.dataset, rec.indices, self.collate)
        rec.t_data = time.perf_counter()
        run.phase = "forward_backward"
        for c in callbacks:  # before the phase mark: a fault injected there finds the last step complete
            c.before_forward(self, run, rec)
        with hooks.phase("forward_backward"), contextlib.ExitStack() as stack:
            for c in callbacks:
                stack.enter_context(c.around_forward(self, run, rec))
            loss = self.parallel.forward_backward(inputs, labels)
        rec.t_fb = time.perf_counter()
        gnorm = self.parallel.clip_grad_norm_(self.max_grad_norm) if self.max_grad_norm else torch.zeros(())
        rec.t_opt = time.perf_counter()
        run.phase = "optimizer"
        with hooks.phase("optimizer"):
            for o in self.optimizers:
                o.step()
                o.zero_grad(set_to_none=True)
            # a MoE with auxiliary-loss-free balancing moves its expert biases toward even load
            self.parallel.update_expert_bias()
            rec.lr = self.schedulers[0].get_last_lr()[0]
            for s in self.schedulers:
                s.step()
        self.step += 1
        self.train_state.step = self.step
        self.train_state.tokens_seen += run.tokens_per_step
        rec.t_end = time.perf_counter()
        rec.loss, rec.grad_norm = float(loss), float(gnorm)
        run.result.losses[self.step] = rec.loss
        run.result.step_times.append(rec.dt)
        run.result.steps_run += 1
        return rec

    # ---- after training ---------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's weights as plain CPU tensors on rank 0 (None elsewhere). Collective."""
        return build.full_state_dict(self)
