"""Where a run's plan comes from: the sources in one order, and the plan with the one it came from.

The order, first match wins (`PlanResolver.doc`):

1. job cache: under `dtorch run`, the plan this job agreed at this world size and request in an
   earlier start (`<run_dir>/plan-world<N>-<key>.json`); not after an out-of-memory error there;
2. request: the user's whole plan (a `Plan`, a path); a dict of fixed fields bounds the search;
3. checkpoint: an "auto" run resuming on the same world and batch keeps its checkpoint's plan;
4. OOM re-plan: after an out-of-memory error, the search under the memory that was found;
5. search: the planner's best for this model on this machine;
6. rebalance: while running, the straggler response re-cuts `dp_shares` (`PlanResolver.rebalanced`).

Rank 0 resolves and every rank receives the result (`agree`): the search reads measurements that
two ranks could see differently, and ranks that apply different plans deadlock.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dtorch.errors import ConfigError
from dtorch.plan.plan import Plan

SOURCES = ("job_cache", "request", "checkpoint", "oom_replan", "search", "rebalance")
"""The sources of a plan, in the order they are asked."""


@dataclass(frozen=True)
class Resolved:
    """The plan a run goes on with, where it came from (one of `SOURCES`), and what every rank
    needs to know about how it was made."""

    plan: Plan
    source: str
    cluster_name: str | None = None
    flops_per_token: float | None = None
    """The profile's figure, from rank 0: every rank reports MFU on the same denominator."""


@dataclass(frozen=True)
class PlanRequest:
    """What the user asked for, and what a plan must agree with."""

    plan: Any
    """"auto" | Plan | path to a plan JSON/YAML | dict of fixed fields."""
    global_batch: int
    seq_len: int
    cluster: str | None = None
    log_dir: Path | None = None
    run_dir: str | None = None
    """The job's run directory under `dtorch run` (the job cache), from `RuntimeEnv.run_dir`."""
    grad_clipping: bool = True
    fused_adam: bool = False


class PlanResolver:
    """The plan for a world of ranks from the sources in `SOURCES` order. Holds the model's profile
    and the cluster's name once a search (or `agree`) made them."""

    def __init__(self, request: PlanRequest, model_factory: Any, loss_fn: Callable, sample: Callable[[], Any]):
        self.request = request
        self.model_factory = model_factory
        self.loss_fn = loss_fn
        self.sample = sample
        self.profile: Any = None
        self.cluster_name: str | None = None
        self.fit_steps: int | None = None
        """The run's length: the search amortises one-off compile seconds over it."""

    # ---- all ranks --------------------------------------------------------------------------------
    def agree(self, world: int, rank: int, device: torch.device, ckpt: Any) -> Resolved:
        """Rank 0 resolves the plan and every rank receives it. A ConfigError on rank 0 is raised on
        every rank."""
        if world == 1 or not dist.is_initialized():
            doc = self.doc(world, rank, ckpt)
        else:
            doc = {}
            if rank == 0:
                try:
                    doc = self.doc(world, rank, ckpt)
                except ConfigError as e:
                    value = e.value if isinstance(e.value, (int, float, str, bool, type(None))) else repr(e.value)
                    doc = {"error": [e.field, value, e.fix]}
            doc = _broadcast_doc(doc, rank, device)
        if "error" in doc:
            fld, value, fix = doc["error"]
            raise ConfigError(fld, value, fix)
        self.cluster_name = doc["cluster"]
        if doc.get("profiled") and self.profile is None:
            # as rank 0 did for this start's search (its memory is part of every rank's baseline,
            # which the out-of-memory budget is measured against); a reused plan profiles nowhere
            self.profile = self._profile()
        return Resolved(Plan.from_dict(doc["plan"]), doc.get("source", "search"), doc["cluster"],
                        doc.get("flops_per_token"))

    # ---- rank 0 -----------------------------------------------------------------------------------
    def doc(self, world: int, rank: int, ckpt: Any) -> dict[str, Any]:
        """The plan for this world (the job's cached one, else `choose`), with what the other ranks
        need to know about how it was made and its source."""
        cached = self._job_plan(world)
        if cached is not None:
            return {**cached, "source": "job_cache"}
        plan, source = self.choose(world, rank, ckpt)
        doc = {"plan": plan.to_dict(), "cluster": self.cluster_name,
               "flops_per_token": self.profile.flops_per_token if self.profile is not None else None}
        if path := self._job_plan_path(world):
            _write_job_plan(path, doc)
        return {**doc, "profiled": self.profile is not None, "source": source}

    def choose(self, world: int, rank: int, ckpt: Any) -> tuple[Plan, str]:
        """The plan for this world and its source: given, loaded, kept from the checkpoint, or
        searched (fixed fields kept)."""
        req, source = self.request.plan, "request"
        if isinstance(req, Plan):
            plan = dataclasses.replace(req)
        elif isinstance(req, (str, os.PathLike)) and req != "auto":
            plan = Plan.load(req)
        else:
            plan, source = self._auto(world, rank, ckpt, dict(req) if isinstance(req, dict) else {})
        gb = self.request.global_batch
        if plan.global_batch is None:
            # A hand-written plan may leave micro-batching open: fill it from the global batch.
            local, rem = divmod(gb, plan.dp)
            if plan.local_batch() != local and not rem and local % plan.microbatch_size == 0:
                plan.num_microbatches = local // plan.microbatch_size
            plan.global_batch = gb
        plan.seq_len = plan.seq_len or self.request.seq_len
        plan.validate(world_size=world)
        if plan.global_batch != gb:
            raise ConfigError("global_batch", gb, f"the plan is for global_batch={plan.global_batch}; make them agree")
        return plan, source

    def _auto(self, world: int, rank: int, ckpt: Any, fixed: dict) -> tuple[Plan, str]:
        """"auto" or fixed fields: the checkpoint's plan, else the search (under an OOM re-plan's budget)."""
        from dtorch.monitor import oom

        # an earlier start ran out of memory: plan under the memory it found, with every plan
        # family's estimate corrected by what was measured, not the plan that failed
        replan = oom.Replan.load(self.request.log_dir, world)
        plan = self.checkpointed(world, ckpt) if not fixed else None
        if plan is not None and replan is not None and plan.describe() in replan.failed:
            plan = None
        if plan is not None:
            return plan, "checkpoint"
        plan = self.search(world, fixed, replan=replan)
        if replan is not None and rank == 0:  # a notice, not progress: printed without the console line too
            print(f"dtorch: re-planned after {len(replan.records)} out-of-memory error(s), {replan.describe()}: "
                  f"{plan.describe()}", file=sys.stderr, flush=True)
        return plan, "oom_replan" if replan is not None else "search"

    def checkpointed(self, world: int, ckpt: Any) -> Plan | None:
        """The plan of the newest checkpoint when it was made for this world size and batch: an
        "auto" run that resumes on the same machines keeps its plan, so the continuation is
        bit-identical even if the planner's calibration moved in between."""
        if ckpt is None:
            return None
        for info in ckpt.list():
            if info.manifest_ok and info.plan:
                old = Plan.from_dict(info.plan)
                if old.world_size == world and old.global_batch == self.request.global_batch:
                    return old
                return None
        return None

    def search(self, world: int, fixed: dict, replan: Any = None, whole: bool = False) -> Any:
        """The planner's best plan for `world` ranks (`whole`: its whole `SearchResult`)."""
        from dtorch.cluster import load_cluster, local_cluster
        from dtorch.plan.profiles import gpu_attention_differs
        from dtorch.plan.search import search

        req = self.request
        profile = self.profile = self._profile()
        workload = (profile.hidden, profile.num_heads, profile.seq_len)
        cluster = (load_cluster(req.cluster, workload=workload) if req.cluster
                   else local_cluster(world, workload=workload))
        if replan is not None:  # after an OOM: the memory the planner may plan with, per device
            groups = [dataclasses.replace(g, device=dataclasses.replace(
                g.device, memory_bytes=min(g.device.memory_bytes, replan.budget))) for g in cluster.groups]
            cluster = dataclasses.replace(cluster, groups=groups)
        if gpu_attention_differs(profile, cluster.groups):
            profile = self.profile = self._profile(fused_attention=True)  # attention as the GPU runs it
        self.cluster_name = cluster.name
        if cluster.world_size != world:
            raise ConfigError("cluster", req.cluster,
                              f"it has {cluster.world_size} devices but {world} processes were launched")
        result = search(profile, cluster, global_batch=req.global_batch, seq_len=req.seq_len,
                        fixed=fixed or None, top_k=3, steps=self.fit_steps,  # (compile amortised)
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

    # ---- while running ----------------------------------------------------------------------------
    @staticmethod
    def rebalanced(parallel: Any, shares: list[int]) -> Resolved:
        """The running plan with its data-parallel shares re-cut to `shares` (applied to `parallel`
        from the next step on); ConfigError when the executor refuses them."""
        parallel.set_dp_shares(shares)
        return Resolved(parallel.plan, "rebalance")

    # ---- helpers ----------------------------------------------------------------------------------
    def _profile(self, fused_attention: bool = False) -> Any:
        from dtorch.model import profile_module

        return profile_module(self.model_factory, self.request.seq_len, sample=self.sample(), loss=self.loss_fn,
                              fused_attention=fused_attention)

    def _cost_constants(self) -> Any:
        """The cost model's constants with what this run decides beside the plan: whether it clips
        gradients (the optimizer tiers' overlap) and whether its AdamW is torch's fused kernel."""
        from dtorch.plan.cost import DEFAULT_CONSTANTS, with_constants

        clip, fused = self.request.grad_clipping, self.request.fused_adam
        if (clip, fused) == (DEFAULT_CONSTANTS.grad_clipping, DEFAULT_CONSTANTS.cpu_adam_fused):
            return DEFAULT_CONSTANTS
        return with_constants(grad_clipping=clip, cpu_adam_fused=fused)

    def _job_plan_path(self, world: int) -> Path | None:
        """Under `dtorch run` (the job's private run directory), where the plan agreed for this
        world size and request is kept for the job's later starts."""
        req = self.request
        if not req.run_dir:
            return None
        plan = req.plan.to_dict() if isinstance(req.plan, Plan) else req.plan
        key = json.dumps([str(type(req.plan)), plan, req.global_batch, req.seq_len, req.cluster],
                         sort_keys=True, default=str)
        return Path(req.run_dir) / f"plan-world{world}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"

    def _job_plan(self, world: int) -> dict[str, Any] | None:
        """The plan this job agreed on at this world size in an earlier start, or None.

        A worker restarted after a failure meets the same model, batch, request and machines: the
        search would spend its time (a profile and a search: ~0.3 s of a recovery) to find what the
        job runs already, and a plan that moved (the calibration learns while the job runs) would
        also make the in-memory snapshot unusable. Not reused after an out-of-memory error at this
        world size: that start must re-plan under the memory it found."""
        path = self._job_plan_path(world)
        if path is None or not path.is_file():
            return None
        from dtorch.monitor import oom

        if oom.memory_budget(self.request.log_dir, world)[0] is not None:
            return None
        try:
            doc = json.loads(path.read_text())
            plan = Plan.from_dict(doc["plan"])
            plan.validate(world_size=world)
        except (OSError, ValueError, KeyError, TypeError, ConfigError):
            return None  # unreadable or no longer valid: choose again
        return doc if plan.global_batch == self.request.global_batch else None


def _write_job_plan(path: Path, doc: dict[str, Any]) -> None:
    try:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)
    except OSError:
        pass  # a cache only: the next start searches again


def _broadcast_doc(doc: dict[str, Any], rank: int, device: torch.device) -> dict[str, Any]:
    """Rank 0's `doc` on every rank (as JSON bytes over the default process group)."""
    payload = json.dumps(doc).encode() if rank == 0 else b""
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(size, 0)
    buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if rank == 0:
        buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dist.broadcast(buf, 0)
    return json.loads(bytes(buf.cpu().tolist()).decode())
