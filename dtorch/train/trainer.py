"""`dtorch.Trainer`: where a user's run lives.

    trainer = dtorch.Trainer(model=lambda: GPT(cfg), data=dataset, loss=dtorch.losses.next_token,
                             optimizer=dtorch.optim.AdamW(lr=3e-4), global_batch=16, seq_len=128,
                             checkpoint_dir="runs/a", plan="auto")
    trainer.fit(steps=200)

One process per rank (launched by `dtorch run` / `dtorch train` / torchrun, or alone). The
trainer (1) joins the process group, (2) chooses the plan ("auto" = detect the cluster, profile the
model, search; or a Plan / a path / a dict of fixed fields searched around), (3) applies it with
`dtorch.parallel.parallelize`, (4) restores the newest good checkpoint (resharded if the world or
the plan changed), (5) runs steps whose data is a pure function of the global step, and
(6) checkpoints every `checkpoint_every` steps, never torn.

Resuming is automatic: the same command picks up from `checkpoint_dir`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtorch.errors import ConfigError
from dtorch.plan.plan import Plan
from dtorch.train import hooks
from dtorch.train.losses import next_token
from dtorch.train.optim import AdamW, WarmupCosine
from dtorch.train.state import ModelState, OptimizerState, TrainState

log = logging.getLogger("dtorch.train")


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
      lr_schedule: a schedule spec with `build(optimizer, total_steps)`; default warm-up + cosine.
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
      trace_comms: record every collective of every rank to <log_dir>/comms-rank<r>.jsonl, with a
        per-step summary and CommDebugMode's per-module counts (default $DTORCH_TRACE_COMMS=1).
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
    ):
        if int(global_batch) < 1:
            raise ConfigError("global_batch", global_batch, "use a positive number of samples per step")
        if int(seq_len) < 1:
            raise ConfigError("seq_len", seq_len, "use a positive sequence length")
        if int(checkpoint_every) < 1:
            raise ConfigError("checkpoint_every", checkpoint_every, "use a positive number of steps")
        self.init_from = Path(init_from) if init_from is not None else None
        self.hf_config: dict | None = None
        self.model_factory = self._model_factory(model)
        self.data = data
        self._check_vocab(data)
        self.loss_fn = loss
        self.collate = collate
        self.optimizer_spec = optimizer or AdamW()
        self.lr_spec = lr_schedule or WarmupCosine()
        self.global_batch = int(global_batch)
        from dtorch.train.data import is_token_data

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
        # set up in _setup()
        self.plan: Plan | None = None
        self._profile = None
        self._profiled_flops: float | None = None
        self._cluster_name: str | None = None
        self.parallel = None
        self.step = 0

    # ---- setup -------------------------------------------------------------------------------
    def _model_factory(self, model: Any) -> Any:
        """The model factory, and the checks of `init_from` that need no process group: the
        directory's architecture is known and every tensor's shape matches the model."""
        if self.init_from is None:
            if model is None:
                raise ConfigError("model", None, "pass a model (a factory or a module), or init_from=<HF directory>")
            return model
        from dtorch.checkpoint.hf_weights import HFWeights, model_shapes, read_config

        weights = HFWeights(self.init_from)  # ConfigError: not a model directory, unknown architecture
        if model is None:
            if weights.seed:
                raise ConfigError("model", None, f"{self.init_from} is a seed checkpoint: pass the model it was "
                                  "written from")
            from dtorch.models import build_from_config

            config = weights.config
            model = lambda: build_from_config(config)  # noqa: E731 - a factory, called on meta
        if not weights.seed:
            self.hf_config = read_config(self.init_from)
        from dtorch.parallel.hf import adapt
        from dtorch.parallel.parallelize import meta_model

        skeleton = adapt(model) if isinstance(model, nn.Module) else meta_model(model)
        weights.check(model_shapes(skeleton))  # ConfigError naming the tensor
        return model

    def _check_vocab(self, data: Any) -> None:
        """A dataset's token ids must fit the model's embedding (checked before any process group)."""
        vocab = getattr(data, "vocab_size", None)
        if vocab is None:
            return
        from dtorch.parallel.parallelize import meta_model

        model = self.model_factory  # a module is looked at as it is (no copy of real weights)
        model = model if isinstance(model, nn.Module) else meta_model(model)
        emb = [m for m in model.modules() if isinstance(m, nn.Embedding)]
        if emb and int(vocab) > emb[0].num_embeddings:
            raise ConfigError("tokenizer", f"vocabulary of {vocab} tokens",
                              f"the model's embedding has {emb[0].num_embeddings} rows; use a tokenizer with at "
                              "most that many tokens or a model with a larger vocab_size")

    def _join(self) -> tuple[int, int, torch.device]:
        """Join the default process group when launched with several ranks; pick the device."""
        from dtorch.integrations.env import export_rank_env

        # One process per rank started by a scheduler (srun -n N): rank variables from its own.
        by_scheduler = export_rank_env() is not None or getattr(self, "_scheduler_ranks", False)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        cuda = torch.cuda.is_available()
        if cuda:
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local_rank)
            device = torch.device("cuda", local_rank)
        else:
            device = torch.device("cpu")
            local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            if local > 1 and "OMP_NUM_THREADS" not in os.environ:
                # ranks of one CPU node share its cores: a rank's share of threads, not all of them
                # each (oversubscribed threads measured 2-20x slower); the planner prices this share
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
        if world > 1 and not dist.is_initialized():
            if os.environ.get("DTORCH_RUN_DIR") or by_scheduler:
                # under `dtorch run` or a scheduler: a store that listens on MASTER_ADDR only
                # (torch's listens on every interface)
                from dtorch.process_group import init_process_group

                hooks.phase_begin("pg_init")  # timed into the recovery record under `dtorch run`
                init_process_group("nccl" if cuda else "gloo")
            else:
                dist.init_process_group("nccl" if cuda else "gloo")
        rank = dist.get_rank() if dist.is_initialized() else 0
        return rank, world, device

    def _dataset(self):
        if self.data is None:
            from dtorch.train.data import default_corpus

            return default_corpus(self.seq_len)
        return self.data

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
            from dtorch.train.data import batch_for

            dataset = self._dataset()
            self._sample_batch = batch_for(dataset, list(range(min(2, len(dataset)))), self.collate)
        return self._sample_batch

    def _agreed_plan(self) -> Plan:
        """Rank 0 chooses the plan and every rank receives it: the search reads measurements (the
        capability cache, the probe's calibration, runtime feedback) that two ranks could see
        differently, and ranks that apply different plans deadlock. A ConfigError on rank 0 is raised
        on every rank. Under `dtorch run`, a restart of the job at a world size it already ran at
        keeps the plan agreed then (`_job_plan`)."""
        if self.world == 1 or not dist.is_initialized():
            doc = self._plan_doc()
        else:
            doc = {}
            if self.rank == 0:
                try:
                    doc = self._plan_doc()
                except ConfigError as e:
                    value = e.value if isinstance(e.value, (int, float, str, bool, type(None))) else repr(e.value)
                    doc = {"error": [e.field, value, e.fix]}
            payload = json.dumps(doc).encode() if self.rank == 0 else b""
            size = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
            dist.broadcast(size, 0)
            buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=self.device)
            if self.rank == 0:
                buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
            dist.broadcast(buf, 0)
            doc = json.loads(bytes(buf.cpu().tolist()).decode())
        if "error" in doc:
            fld, value, fix = doc["error"]
            raise ConfigError(fld, value, fix)
        self._cluster_name = doc["cluster"]
        # the profile's figure, from rank 0: every rank reports MFU on the same denominator
        self._profiled_flops = doc.get("flops_per_token")
        if doc.get("profiled") and self._profile is None:
            # as rank 0 did for this start's search (its memory is part of every rank's baseline,
            # which the out-of-memory budget is measured against); a reused plan profiles nowhere
            from dtorch.model import profile_module

            self._profile = profile_module(self.model_factory, self.seq_len, sample=self._sample(),
                                           loss=self.loss_fn)
        return Plan.from_dict(doc["plan"])

    def _plan_doc(self) -> dict[str, Any]:
        """The plan for this world (as `_choose_plan` makes it, or as this job agreed earlier),
        with what the other ranks need to know about how it was made."""
        cached = self._job_plan()
        if cached is not None:
            return cached
        plan = self._choose_plan(self.world, self.rank)
        doc = {"plan": plan.to_dict(), "cluster": self._cluster_name,
               "flops_per_token": self._profile.flops_per_token if self._profile is not None else None}
        if path := self._job_plan_path():
            self._write_job_plan(path, doc)
        return {**doc, "profiled": self._profile is not None}

    @staticmethod
    def _write_job_plan(path: Path, doc: dict[str, Any]) -> None:
        try:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, path)
        except OSError:
            pass  # a cache only: the next start searches again

    def _job_plan_path(self) -> Path | None:
        """Under `dtorch run` (DTORCH_RUN_DIR: the job's private run directory), where the plan
        agreed for this world size and request is kept for the job's later starts."""
        run_dir = os.environ.get("DTORCH_RUN_DIR")
        if not run_dir:
            return None
        req = self.plan_request.to_dict() if isinstance(self.plan_request, Plan) else self.plan_request
        key = json.dumps([str(type(self.plan_request)), req, self.global_batch, self.seq_len, self.cluster_spec],
                         sort_keys=True, default=str)
        return Path(run_dir) / f"plan-world{self.world}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"

    def _job_plan(self) -> dict[str, Any] | None:
        """The plan this job agreed on at this world size in an earlier start, or None.

        A worker restarted after a failure meets the same model, batch, request and machines: the
        search would spend its time (a profile and a search: ~0.3 s of a recovery) to find what the
        job runs already, and a plan that moved (the calibration learns while the job runs) would
        also make the in-memory snapshot unusable. Not reused after an out-of-memory error at this
        world size: that start must re-plan under the memory it found."""
        path = self._job_plan_path()
        if path is None or not path.is_file():
            return None
        from dtorch.monitor import oom

        if oom.memory_budget(self.log_dir, self.world)[0] is not None:
            return None
        try:
            doc = json.loads(path.read_text())
            plan = Plan.from_dict(doc["plan"])
            plan.validate(world_size=self.world)
        except (OSError, ValueError, KeyError, TypeError, ConfigError):
            return None  # unreadable or no longer valid: choose again
        return doc if plan.global_batch == self.global_batch else None

    def _choose_plan(self, world: int, rank: int) -> Plan:
        """The plan for this world: given, loaded, or searched (fixed fields kept)."""
        req = self.plan_request
        if isinstance(req, Plan):
            plan = dataclasses.replace(req)
        elif isinstance(req, (str, os.PathLike)) and req != "auto":
            plan = Plan.load(req)
        else:
            fixed = dict(req) if isinstance(req, dict) else {}
            from dtorch.monitor import oom

            # an earlier start ran out of memory: plan under the memory it found, with every plan
            # family's estimate corrected by what was measured, not the plan that failed
            replan = oom.Replan.load(self.log_dir, world)
            plan = self._checkpointed_plan(world) if not fixed else None
            if plan is not None and replan is not None and plan.describe() in replan.failed:
                plan = None
            plan = plan or self._search(world, fixed, replan=replan)
            if replan is not None and rank == 0:  # a notice, not progress: printed without the console line too
                print(f"dtorch: re-planned after {len(replan.records)} out-of-memory error(s), {replan.describe()}: "
                      f"{plan.describe()}", file=sys.stderr, flush=True)
        if plan.global_batch is None:
            # A hand-written plan may leave micro-batching open: fill it from the global batch.
            local, rem = divmod(self.global_batch, plan.dp)
            if plan.local_batch() != local and not rem and local % plan.microbatch_size == 0:
                plan.num_microbatches = local // plan.microbatch_size
            plan.global_batch = self.global_batch
        plan.seq_len = plan.seq_len or self.seq_len
        plan.validate(world_size=world)
        if plan.global_batch != self.global_batch:
            raise ConfigError("global_batch", self.global_batch,
                              f"the plan is for global_batch={plan.global_batch}; make them agree")
        return plan

    def search_result(self, world: int, fixed: dict | None = None):
        """The planner's whole answer for this run at `world` ranks (`dtorch.plan.search.SearchResult`:
        the ranked plans, each family's best, what was not offered and why), asked exactly as `fit`
        asks it with `plan="auto"` or a dict of fixed fields; needs no process group."""
        if fixed is None:
            fixed = dict(self.plan_request) if isinstance(self.plan_request, dict) else {}
        return self._search(world, fixed, whole=True)

    def _search(self, world: int, fixed: dict, replan=None, whole: bool = False):
        from dtorch.cluster import load_cluster, local_cluster
        from dtorch.model import profile_module
        from dtorch.plan.search import search

        profile = profile_module(self.model_factory, self.seq_len, sample=self._sample(), loss=self.loss_fn)
        self._profile = profile
        workload = (profile.hidden, profile.num_heads, profile.seq_len)
        cluster = (load_cluster(self.cluster_spec, workload=workload) if self.cluster_spec
                   else local_cluster(world, workload=workload))
        if replan is not None:  # after an OOM: the memory the planner may plan with, per device
            groups = [dataclasses.replace(g, device=dataclasses.replace(
                g.device, memory_bytes=min(g.device.memory_bytes, replan.budget))) for g in cluster.groups]
            cluster = dataclasses.replace(cluster, groups=groups)
        self._cluster_name = cluster.name
        if cluster.world_size != world:
            raise ConfigError("cluster", self.cluster_spec,
                              f"it has {cluster.world_size} devices but {world} processes were launched")
        result = search(profile, cluster, global_batch=self.global_batch, seq_len=self.seq_len,
                        fixed=fixed or None, top_k=3, steps=getattr(self, "_fit_steps", None),  # (compile amortised)
                        memory_correction=replan.correct if replan else None, suggest=replan is None,
                        constants=self._cost_constants())
        if whole:
            return result
        if result.best is None and replan is not None:
            raise ConfigError("plan", "auto", replan.nothing_fits(result.closest))
        if result.best is None:
            raise ConfigError("plan", "auto", "no plan fits this model on this machine: "
                              + "; ".join(result.suggestions or ["use a smaller model or more devices"]))
        plan, estimate = result.best
        plan.predicted = estimate.to_dict()
        return plan

    def _cost_constants(self):
        """The cost model's constants with what this run decides beside the plan: whether it clips
        gradients (the optimizer tiers' overlap) and whether its AdamW is torch's fused kernel."""
        from dtorch.plan.cost import DEFAULT_CONSTANTS, with_constants

        clip = bool(self.max_grad_norm)
        fused = getattr(self.optimizer_spec, "fused", None) is True
        if (clip, fused) == (DEFAULT_CONSTANTS.grad_clipping, DEFAULT_CONSTANTS.cpu_adam_fused):
            return DEFAULT_CONSTANTS
        return with_constants(grad_clipping=clip, cpu_adam_fused=fused)

    def _checkpointed_plan(self, world: int) -> Plan | None:
        """The plan of the newest checkpoint when it was made for this world size and batch: an
        "auto" run that resumes on the same machines keeps its plan, so the continuation is
        bit-identical even if the planner's calibration moved in between."""
        if self.ckpt is None:
            return None
        for info in self.ckpt.list():
            if info.manifest_ok and info.plan:
                old = Plan.from_dict(info.plan)
                if old.world_size == world and old.global_batch == self.global_batch:
                    return old
                return None
        return None

    def _setup(self, total_steps: int) -> None:
        from dtorch.monitor.metrics import MetricsLogger
        from dtorch.parallel import parallelize

        self.rank, self.world, self.device = self._join()
        self._fit_steps = total_steps  # the run's length: the search amortises one-off compile seconds over it
        self.ckpt = None
        if self.checkpoint_dir is not None:
            from dtorch.checkpoint import CheckpointManager

            self.ckpt = CheckpointManager(self.checkpoint_dir, keep_last=self.keep_last)
        with hooks.phase("replan"):
            self.plan = self._agreed_plan()
        self.metrics = MetricsLogger(self.log_dir, rank=self.rank, total_steps=total_steps, console=self.console)
        pred = self.plan.predicted or {}
        self.metrics.event("plan", plan=self.plan.describe(), family=self.plan.family(),
                           predicted_step_time_s=pred.get("step_time_s"),
                           predicted_memory_bytes_per_rank=pred.get("memory_bytes_per_rank"),
                           predicted_memory_breakdown=pred.get("memory_breakdown"))
        if self.rank == 0 and self.console:
            extra = ""
            if pred:
                extra = (f" (predicted {pred.get('step_time_s', float('nan')) * 1e3:.0f} ms/step, "
                         f"{pred.get('memory_bytes_per_rank', 0) / 2**20:,.0f} MiB/rank)")
            print(f"dtorch: plan {self.plan.family()}: {self.plan.describe()}{extra}", flush=True)

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

    def _build_optimizers(self) -> list[torch.optim.Optimizer]:
        """The spec's optimizer per model part, in device memory or in the offload tier. The NVMe
        directory is checked on every rank first and a bad one fails all ranks alike."""
        from dtorch.train import offload as tiers

        parts = self.parallel.model_parts
        self.offload = tiers.OptimizerOffload.resolve(self.offload_request, self.plan.offload, self.offload_dir)
        if self.offload is None:
            return [self.optimizer_spec.build(p.parameters()) for p in parts]
        if self.plan.offload == "params":
            raise ConfigError("offload", self.offload_request, "the plan already offloads parameters, gradients and "
                              "optimizer state (offload=params, FSDP CPU offload); use one of the two")
        if self.offload.tier == "nvme":
            error = None
            try:
                need = sum(tiers.bytes_needed(self.optimizer_spec, p.parameters(), self.offload) for p in parts)
                local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
                tiers.check_directory(self.offload.directory, need, self.offload.budget_bytes,
                                      others_bytes=need * (local - 1))
            except ConfigError as e:
                error = (e.field, e.value if isinstance(e.value, (int, str, type(None))) else repr(e.value), e.fix)
            errors = [error]
            if dist.is_initialized():
                errors = [None] * dist.get_world_size()
                dist.all_gather_object(errors, error)
            first = next((e for e in errors if e is not None), None)
            if first is not None:
                raise ConfigError(*first)
            if self.async_checkpoint and self.ckpt is not None:
                # an async save copies every tensor into host memory first: the state the NVMe tier
                # keeps out of memory would come back at each checkpoint
                self.async_checkpoint = False
                log.info("NVMe optimizer tier: checkpoints are written synchronously, straight from its files")
        opts = [tiers.build(self.optimizer_spec, p.parameters(), self.offload, tag=f"r{self.rank}p{i}")
                for i, p in enumerate(parts)]
        from dtorch.plan.strategies.memory import step_overlaps_backward

        tier = "optimizer" if self.offload.tier == "host" else "optimizer_nvme"
        overlap = self.offload.overlap is not False and step_overlaps_backward(
            self.plan, bool(self.max_grad_norm), tier)
        if overlap:  # the CPU step of each block runs while the backward of the earlier ones does
            for o in opts:
                o.overlap_backward(self.plan.num_microbatches)
        mem = [o.memory() for o in opts]
        self.metrics.event("offload", tier=self.offload.tier, directory=self.offload.directory, overlap=overlap,
                           host_bytes=sum(m["host_bytes"] for m in mem), disk_bytes=sum(m["disk_bytes"] for m in mem),
                           buffer_bytes=sum(m["buffer_bytes"] for m in mem))
        return opts

    def checkpoint_state(self) -> dict[str, Any]:
        """Everything a resumed run needs; tensors reshard on load (DCP)."""
        from dtorch.checkpoint.state import RNGState

        return {
            "model": ModelState(self.parallel),
            "optim": OptimizerState(self.parallel, self.optimizers),
            "lr": _SchedulersState(self.schedulers),
            "train": self.train_state,
            "rng": RNGState(),
        }

    def _restore(self) -> int | None:
        if self.ckpt is None:
            return None
        t = time.perf_counter()
        with hooks.phase("load"):
            step = self.ckpt.load_latest(self.checkpoint_state())
        if step is None:
            return None
        self.step = self.train_state.step
        info = self.ckpt.loaded
        old = Plan.from_dict(info.plan) if info and info.plan else None
        changed = old is not None and (old.world_size != self.plan.world_size or old.mesh_shape != self.plan.mesh_shape)
        self.metrics.event("resume", step=self.step, seconds=time.perf_counter() - t,
                           from_plan=old.describe() if old else None, resharded=changed)
        if self.rank == 0 and self.console:
            how = f", resharded from {old.family()} at world size {old.world_size}" if changed else ""
            print(f"dtorch: resumed from step {self.step}{how}", flush=True)
        return self.step

    def _save(self, final: bool = False) -> None:
        if self.ckpt is None:
            return
        with hooks.phase("checkpoint"):
            res = self.ckpt.save(self.step, self.checkpoint_state(), async_=self.async_checkpoint and not final,
                                 plan=self.plan, extra={"tokens_seen": self.train_state.tokens_seen})
            if final:
                self.ckpt.wait()
        self.metrics.event("checkpoint", step=self.step, stall_s=res.stall_s, async_=res.async_)

    # ---- the loop -------------------------------------------------------------------------------
    def fit(self, steps: int) -> FitResult:
        """Train until the global step reaches `steps` (a resumed run does only what is left)."""
        if int(steps) < 1:
            raise ConfigError("steps", steps, "train for at least one step")
        steps = int(steps)
        t_start = time.perf_counter()
        from dtorch.integrations.env import detect, export_rank_env
        from dtorch.integrations.status import Reporter, last_fault
        from dtorch.train.preempt import EXIT_PREEMPTED, Preemption

        # status.json in the run directory (and the scheduler's job comment): see docs/schedulers.md
        self._scheduler_ranks = export_rank_env() is not None
        self.status = Reporter(self.log_dir, rank=int(os.environ.get("RANK", "0")))
        alloc = detect()
        self.status.report("planning", total_steps=steps, allocation=alloc.describe() if alloc else None)
        try:
            self._setup(steps)
            resumed = self._restore()
        except Exception as e:
            self.status.report("failed", why=f"{type(e).__name__}: {e}"[:300])
            raise
        hooks.phase_begin("prepare")  # what the loop needs before its first step (ends at `started`)
        preemption = Preemption(self.world, self.device)
        from dtorch.monitor.metrics import StepMetrics, measured_gemm_peak, peak_memory_bytes
        from dtorch.parallel.compile import compile_enabled
        from dtorch.train.data import batch_for

        tokens_per_step = self.global_batch * self.seq_len
        # uneven work (plan.dp_shares): each data-parallel rank's slice of the global batch, in samples
        sample_shares = ([self.plan.microbatch_size * n for n in self.plan.dp_shares]
                         if self.parallel.uneven else None)
        # MFU denominator: the spec-sheet peak on GPUs; on CPU the GEMM peak measured now, with all
        # ranks measuring at once (they share the cores).
        peak = self._device_peak() or measured_gemm_peak(self.device, cache_dir=os.environ.get("DTORCH_RUN_DIR") or None)
        flops_per_token = self._flops_per_token()
        result = FitResult(0, self.step, resumed, plan=self.plan)
        step_times: list[float] = []
        samples_log = None
        if os.environ.get("DTORCH_RECORD_SAMPLES") and self.log_dir is not None:
            # Audit trail of the data order: which sample indices each rank consumed at each step.
            samples_log = open(self.log_dir / f"samples-rank{self.rank}.jsonl", "a", buffering=1)  # noqa: SIM115
        loaded_step = self.step
        hooks.started(self)  # under `dtorch run`: may restore an in-memory snapshot newer than the checkpoint
        if self.step != loaded_step:
            result.resumed_from = self.step
        if result.resumed_from is not None:
            restored = self.ckpt.loaded if self.ckpt is not None else None
            self.status.report("recovering", from_step=result.resumed_from, total_steps=steps,
                               source="checkpoint" if restored is not None and restored.step == self.step else "snapshot",
                               after=last_fault(os.environ.get("DTORCH_RUN_DIR")),
                               epoch=int(os.environ.get("DTORCH_EPOCH", "0")))
        reported_commit = self.ckpt.last_committed if self.ckpt is not None else None
        watch = None
        pending_shares = None  # the straggler response's shares, applied at the next checkpoint
        stragglers = 0  # flags raised: a run with any does not feed the calibration
        dp_of_rank = None
        if self.rebalance and self.world > 1:
            dp_of_rank = [None] * self.world
            dist.all_gather_object(dp_of_rank, self.parallel.dp_rank)
        if self.world > 1 and self.straggler_every:
            from dtorch.monitor.straggler import StragglerWatch

            watch = StragglerWatch(self.parallel.model_parts, self.world, every=self.straggler_every,
                                   structure=getattr(self.parallel, "structure", None))
        from dtorch.monitor.live import RunMonitor

        mon = RunMonitor.start(self.monitor_config, rank=self.rank, world=self.world, device=self.device,
                               metrics=self.metrics, plan=self.plan, mesh=self.parallel.mesh,
                               tokens_per_step=tokens_per_step, flops_per_token=flops_per_token,
                               peak_flops=peak, console=self.console, model_parts=self.parallel.model_parts,
                               trace_dir=self.log_dir, first_step=self.step + 1,
                               structure=getattr(self.parallel, "structure", None))
        from dtorch.monitor import oom

        mem_base = oom._status("VmRSS") or 0
        cap = oom.MemoryCap(self.rank, mem_base)
        if cap.limit is not None:  # a test's memory cap counts from here (other peaks stay untouched)
            oom.reset_peak()
        phase = "data"
        try:
            while self.step < steps:
                phase = "data"
                t0 = time.perf_counter()
                hooks.before_step(self.step + 1)
                if self.ckpt is not None:
                    self.ckpt.raise_if_failed()  # a failed async save stops the run at the next step
                idx = self.sampler.local_indices(self.step, self.parallel.dp_rank, self.parallel.dp_size,
                                                 shares=sample_shares)
                if samples_log is not None:
                    samples_log.write(json.dumps({"step": self.step + 1, "dp_rank": self.parallel.dp_rank,
                                                  "indices": idx}) + "\n")
                inputs, labels = batch_for(self.dataset, idx, self.collate)
                t_data = time.perf_counter()
                comm0 = mon.comm_snapshot() if mon is not None else None
                phase = "forward_backward"
                with hooks.phase("forward_backward"), (mon.trace_modules() if mon is not None else _nothing()):
                    loss = self.parallel.forward_backward(inputs, labels)
                cap.check(self.step + 1)
                t_fb = time.perf_counter()
                comm1 = mon.comm_snapshot() if mon is not None else None
                gnorm = (self.parallel.clip_grad_norm_(self.max_grad_norm) if self.max_grad_norm
                         else torch.zeros(()))
                t_opt = time.perf_counter()
                phase = "optimizer"
                with hooks.phase("optimizer"):
                    for o in self.optimizers:
                        o.step()
                        o.zero_grad(set_to_none=True)
                    # a MoE with auxiliary-loss-free balancing moves its expert biases toward even load
                    self.parallel.update_expert_bias()
                    lr = self.schedulers[0].get_last_lr()[0]
                    for s in self.schedulers:
                        s.step()
                t_end = time.perf_counter()
                self.step += 1
                self.train_state.step = self.step
                self.train_state.tokens_seen += tokens_per_step
                dt = time.perf_counter() - t0
                loss_f = float(loss)
                result.losses[self.step] = loss_f
                step_times.append(dt)
                result.step_times.append(dt)
                result.steps_run += 1
                if result.steps_run == 2 and compile_enabled(self.plan):
                    result.compile_s = self._report_compile(step_times)
                tps = tokens_per_step / dt
                self.metrics.log(StepMetrics(
                    step=self.step, loss=loss_f, grad_norm=float(gnorm), lr=lr, step_time_s=dt,
                    tokens_per_s=tps, mfu=tps * flops_per_token / (peak * self.world),
                    peak_memory_bytes=peak_memory_bytes(self.device), world_size=self.world,
                    epoch=int(os.environ.get("DTORCH_EPOCH", "0"))))
                hooks.after_step(self.step, loss_f)
                if mon is not None:
                    mon.step(self.step, step_s=dt, data_s=t_data - t0, fb_s=t_fb - t_data, opt_s=t_end - t_opt,
                             comm_before=comm0, comm_after_fb=comm1)
                report = watch.step_done(self.step) if watch is not None else None
                if report is not None and report.new:
                    ratio = [round(x, 3) for x in report.ratio]
                    self.metrics.event("straggler", step=self.step, ranks=report.new, ratio=ratio)
                    stragglers += 1
                    if self.rank == 0:
                        print(report.warning(), file=sys.stderr, flush=True)
                        hooks.notice("straggler", step=self.step, ranks=report.new, ratio=ratio)
                    if dp_of_rank is not None:
                        pending_shares = self._plan_rebalance(report, dp_of_rank)
                if pending_shares is not None and self.step % self.checkpoint_every == 0 and self.step < steps:
                    # at the checkpoint, before it is written: it records the plan the run goes on with
                    sample_shares = self._apply_rebalance(pending_shares)
                    pending_shares = None
                if result.steps_run == 1 and self.ckpt is not None and self.async_checkpoint:
                    # Allocate the async save's CPU buffers now, between steps, not inside the first
                    # save's stall. Not before the first step: reading an optimizer's state dict
                    # before it has state runs a zero-lr step that shifts Adam's step count.
                    self.ckpt.warm_up(self.checkpoint_state())
                if self.step % self.checkpoint_every == 0 and self.step < steps:
                    phase = "checkpoint"
                    self._save()
                    cap.check(self.step)  # a test's cap: the save's staging copy is memory too
                committed = self.ckpt.last_committed if self.ckpt is not None else None
                if committed != reported_commit:  # at commit, not when an async save starts
                    reported_commit = committed
                    self.status.report("checkpointed", checkpoint_step=committed, step=self.step, total_steps=steps)
                else:
                    self.status.report("running", step=self.step, total_steps=steps, tokens_per_s=round(tps, 1))
                if self.step < steps and preemption.requested():
                    # a scheduler's warning: checkpoint now, within its grace period, and stop to be requeued
                    self._save(final=True)
                    self.status.report("preempted", step=self.step, signal=preemption.signal, total_steps=steps,
                                       checkpoint_step=self.step if self.ckpt is not None else None)
                    raise SystemExit(EXIT_PREEMPTED)
            if result.steps_run == 1 and compile_enabled(self.plan):  # no steady step to subtract
                result.compile_s = self._report_compile(step_times)
            if self.ckpt is not None and (resumed is None or resumed < steps):
                phase = "checkpoint"
                self._save(final=True)
            self._feedback(step_times, stragglers)
            self.status.report("finished", step=self.step, checkpoint_step=self.step if self.ckpt else None,
                               total_steps=steps)
        except BaseException as e:
            if oom.is_oom(e):
                self._name_oom(e, phase, mem_base, cap)
            if isinstance(e, Exception):
                self.status.report("failed", step=self.step, why=f"{type(e).__name__}: {e}"[:300])
            raise
        finally:
            preemption.close()
            if mon is not None:
                mon.close()
            if watch is not None:
                watch.close()
            if self.ckpt is not None:
                self.ckpt.wait(raise_on_error=False)
            if samples_log is not None:
                samples_log.close()
            self.metrics.close()
        result.final_step = self.step
        result.wall_s = time.perf_counter() - t_start
        return result

    def _plan_rebalance(self, report, dp_of_rank: list[int]) -> list[int] | None:
        """The shares the straggler report's measured speeds call for (same on every rank: the
        report is gathered), or None; logged as a `rebalance` event with `applied_at` to come."""
        from dtorch.train.rebalance import rebalanced_shares

        if self.plan.pp > 1 or self.plan.ep > 1:
            self.metrics.event("rebalance", step=self.step, skipped="pipeline and expert-parallel plans keep their "
                               "shares while running; restart with a plan that sets dp_shares")
            return None
        shares = rebalanced_shares(self.plan.dp_shares, self.plan.num_microbatches, report.ratio, dp_of_rank,
                                   self.parallel.dp_size)
        if shares is not None:
            self.metrics.event("rebalance", step=self.step, planned=shares, current=self.plan.dp_shares,
                               ratio=[round(x, 3) for x in report.ratio])
        return shares

    def _apply_rebalance(self, shares: list[int]) -> list[int] | None:
        """Cut the global batch by `shares` from the next step on; returns the sampler's shares."""
        old = self.plan.dp_shares
        try:
            self.parallel.set_dp_shares(shares)
        except ConfigError as e:
            self.metrics.event("rebalance", step=self.step, skipped=str(e))
            return [self.plan.microbatch_size * n for n in old] if self.parallel.uneven else None
        self.plan = self.parallel.plan
        self.metrics.event("rebalance", step=self.step, applied=shares, previous=old)
        if self.rank == 0 and self.console:
            print(f"dtorch: rebalanced at step {self.step} by measured speed: data-parallel shares "
                  f"{'/'.join(map(str, shares))} micro-batches (were {'/'.join(map(str, old)) if old else 'even'})",
                  flush=True)
        return [self.plan.microbatch_size * n for n in shares] if self.parallel.uneven else None

    def _name_oom(self, exc: BaseException, phase: str, mem_base: int, cap) -> None:
        """Write the OOM's record (rank, phase, stage, memory vs estimate; see dtorch.monitor.oom)."""
        from dtorch.monitor import oom

        stages = [0]
        if self.plan.pp > 1 and self.parallel is not None and self.parallel.mesh is not None:
            from dtorch.parallel.pipeline import stage_ids

            stages = list(stage_ids(self.plan, self.parallel.mesh["pp"].get_local_rank()))
        try:
            step = self.step if phase == "checkpoint" else self.step + 1  # a save is of the step done
            rec = oom.describe(exc, rank=self.rank, phase=phase, step=step, stages=stages, plan=self.plan,
                               device=self.device, base_bytes=mem_base, cap=cap)
            oom.record(rec, self.log_dir)
            self.metrics.event("oom", **rec)
            print(oom.message(rec), file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - naming the OOM must never hide it
            log.exception("could not record the out-of-memory error")

    def _report_compile(self, step_times: list[float]) -> float:
        """The `compile` event: what torch.compile cost this run at its first step (compile.py)."""
        from dtorch.parallel.compile import first_step_cost

        cost = first_step_cost(step_times)
        self.metrics.event("compile", **cost)
        if self.rank == 0 and self.console:
            steady = cost["steady_step_s"]
            print(f"dtorch: torch.compile took {cost['seconds']:.1f} s at the first step"
                  + (f" (then {steady * 1e3:.0f} ms/step)" if steady is not None else ""), flush=True)
        return cost["seconds"]

    def _feedback(self, step_times: list[float], stragglers: int = 0) -> None:
        """Compare the measured step time and peak memory with the plan's prediction, log the gap,
        and (rank 0, a clean run only: `feedback.unclean_reasons`) refine the calibration in the
        job's own directory, ``<log_dir>/calibration.json``; the shared one is left to `dtorch probe`."""
        if not (self.plan.predicted and self._cluster_name) or len(step_times) < 6:
            return
        from dtorch.monitor import feedback
        from dtorch.monitor.metrics import peak_memory_bytes

        peak = torch.tensor([peak_memory_bytes(self.device)], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        if self.rank != 0:
            return
        measured = sorted(step_times[3:])[len(step_times[3:]) // 2]  # median after warm-up
        gap = feedback.record(self.plan, measured, int(peak.item()), self._cluster_name,
                              save=self.log_dir is not None,
                              path=self.log_dir / "calibration.json" if self.log_dir is not None else None,
                              unclean=feedback.unclean_reasons(stragglers))
        self.metrics.event("feedback", **{k: v for k, v in gap.items() if not isinstance(v, dict)})
        if self.console and "skipped" not in gap:
            where = (f"written to {gap['path']}" if gap.get("path")
                     else gap.get("not_written", "not written (no log directory)"))
            print(f"dtorch: measured {measured * 1e3:.0f} ms/step vs predicted "
                  f"{self.plan.predicted['step_time_s'] * 1e3:.0f} ms; feedback {where}", flush=True)

    def _device_peak(self) -> float | None:
        if self.device.type != "cuda":
            return None
        from dtorch.cluster import local_cluster

        return local_cluster(self.world).slowest_group().device.peak(self.plan.param_dtype)

    def _flops_per_token(self) -> float:
        """Training FLOPs per token: the profile's when the plan was searched, else 6 x parameters."""
        if self._profile is not None:
            return self._profile.flops_per_token
        if self._profiled_flops is not None:
            return float(self._profiled_flops)
        return 6.0 * sum(p.numel() for p in self._meta_params())

    def _meta_params(self):
        from dtorch.parallel.parallelize import meta_model

        return meta_model(self.model_factory).parameters()

    # ---- after training ---------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's weights as plain CPU tensors on rank 0 (None elsewhere). Collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full: dict[str, torch.Tensor] = {}
        if dist.is_initialized():
            # torch keeps a cpu-offloaded full state dict on rank 0 only: under PP every rank's stage
            # is needed, so there each rank gathers its own and copies it to the CPU itself
            opts = StateDictOptions(full_state_dict=True, cpu_offload=self.plan.pp == 1)
            for part in self.parallel.model_parts:
                full.update({k: v.detach().cpu() for k, v in get_model_state_dict(part, options=opts).items()})
            if self.plan.pp > 1:  # each pipeline rank holds other blocks: gather them on rank 0
                gathered: list[Any] = [None] * dist.get_world_size()
                dist.all_gather_object(gathered, full if self.rank != 0 else {})
                for g in gathered:
                    full.update(g or {})
        else:
            for part in self.parallel.model_parts:
                full.update({k: v.detach().cpu() for k, v in part.state_dict().items()})
        from dtorch.parallel.materialize import clean_name

        return {clean_name(k): v for k, v in full.items()} if self.rank == 0 else None


_nothing = contextlib.nullcontext


class _SchedulersState:
    """LR schedulers of all model parts (identical schedules); saved once."""

    def __init__(self, schedulers: list):
        self.schedulers = schedulers

    def state_dict(self) -> dict[str, Any]:
        sd = self.schedulers[0].state_dict()
        return {k: v for k, v in sd.items() if k != "lr_lambdas"}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for s in self.schedulers:
            cur = s.state_dict()
            cur.update({k: v for k, v in sd.items() if k in cur})
            s.load_state_dict(cur)
