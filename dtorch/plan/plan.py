"""The Plan: a small, versioned, human-editable document that says how a model is spread.

A Plan is data, like a `PartitionSpec`: the planner writes it, a person can read, diff and edit
it, and the executor (`dtorch.parallel`) interprets it. It is pure (no torch.distributed here).

Mesh axes, outermost first: ``pp, dp_replicate, dp_shard, cp, tp``. TP is innermost so that it
lands on the fastest links (ranks of one node are contiguous), then CP, FSDP, replicate, PP.

Batch arithmetic (torchtitan/Megatron convention):
``global_batch = dp_replicate * dp_shard * microbatch_size * num_microbatches``.
With ``pp > 1`` the micro-batches flow through the pipeline schedule; with ``pp == 1`` they are
gradient-accumulation steps. CP and TP ranks see the same samples.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtorch.docio import read_document
from dtorch.errors import ConfigError, choices
from dtorch.plan import strategies
from dtorch.plan.strategies import AC_POLICIES, DTYPES, MESH_AXES, OFFLOAD_POLICIES, SCHEDULES

PLAN_VERSION = 1
__all__ = ["Plan", "PLAN_VERSION", "MESH_AXES", "SCHEDULES", "AC_POLICIES", "OFFLOAD_POLICIES", "DTYPES"]


@dataclass
@strategies.declare_fields  # + the fields strategies declare themselves (compile: strategies/compile.py)
class Plan:
    """How to run one model on one cluster. Every field has a default that means "off"."""

    dp_replicate: int = 1
    """Replicated data-parallel degree (DDP, or the outer axis of HSDP)."""
    dp_shard: int = 1
    """Sharded data-parallel degree (FSDP2 / ZeRO-3 over this axis)."""
    cp: int = 1
    """Context-parallel degree: the sequence is split over this axis inside attention."""
    tp: int = 1
    """Tensor-parallel degree (Megatron-style column/row split of linear layers)."""
    pp: int = 1
    """Pipeline-parallel degree (number of pipeline ranks)."""
    ep: int = 1
    """Expert-parallel degree: routed experts sharded over ep of the dp_replicate*dp_shard*cp ranks
    (borrowed, not extra ranks: the world size does not change). 1 for dense models."""
    sp: bool = False
    """Sequence parallelism on the TP axis (norms and dropout sharded on sequence); needs tp > 1."""
    microbatch_size: int = 1
    """Samples per micro-batch on one data-parallel rank."""
    num_microbatches: int = 1
    """Micro-batches per step per data-parallel rank (pipeline micro-batches or accumulation steps)."""
    schedule: str = "1f1b"
    """Pipeline schedule, one of SCHEDULES; ignored when pp == 1."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (>1 only for interleaved/zero-bubble schedules)."""
    layer_partition: list[int] | None = None
    """Blocks per pipeline stage (pp * virtual_stages entries); None means as even as possible."""
    ac: str = "none"
    """Activation checkpointing: none | selective | full."""
    offload: str = "none"
    """none | optimizer (optimizer states + fp32 masters in host memory, the step on the CPU) |
    optimizer_nvme (the states in files on a local disk; `dtorch train --offload-dir`) | params
    (FSDP CPU offload of params+grads+optimizer). docs/memory-tiers.md."""
    reshard_after_forward: bool = True
    """FSDP: free gathered parameters after forward (ZeRO-3) or keep them until backward (ZeRO-2-like)."""
    param_dtype: str = "float32"
    """Compute dtype of parameters (mixed precision); master weights stay float32."""
    reduce_dtype: str = "float32"
    """Dtype of gradient reductions."""
    model: str | None = None
    """The model this plan was made for (a preset or spec string), informational."""
    cluster: str | None = None
    """The cluster this plan was made for (a preset/shorthand or file), informational."""
    seq_len: int | None = None
    global_batch: int | None = None
    predicted: dict[str, Any] | None = None
    """The planner's estimate: step_time_s, tokens_per_s, mfu, memory_bytes_per_rank, breakdowns."""
    version: int = field(default=PLAN_VERSION)

    # ---- derived -----------------------------------------------------------------------------
    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def mesh_shape(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in MESH_AXES}

    def local_batch(self) -> int:
        """Samples one data-parallel rank processes per optimizer step."""
        return self.microbatch_size * self.num_microbatches

    def family(self) -> str:
        """A short name of the strategy family, e.g. 'FSDP', 'FSDPxTP', 'TPxPP', 'DDP', 'single'."""
        return strategies.family(self)

    def describe(self) -> str:
        """One line: degrees, micro-batching and policies."""
        return strategies.describe(self)

    # ---- validation --------------------------------------------------------------------------
    def validate(self, world_size: int | None = None) -> Plan:
        """Check internal consistency, every strategy's rules over the plan alone (model fit:
        `dtorch.plan.search.check`; both loop over `dtorch.plan.strategies`). Returns self."""
        if self.version != PLAN_VERSION:
            raise ConfigError("version", self.version, f"this DTorch reads plan version {PLAN_VERSION}")
        strategies.validate(self, world_size)
        return self

    # ---- serialisation -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for f in strategies.DECLARED:  # (a field added since, at its "off" default: not written)
            if f.omit_default and d[f.name] == f.default:
                del d[f.name]
        return {"version": d.pop("version"), **d}

    def to_json(self, indent: int = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        if not isinstance(d, dict):
            raise ConfigError("plan", type(d).__name__, "a plan is a JSON/YAML mapping of field: value")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError("plan", unknown[0], f"unknown plan field; {choices(sorted(known))}")
        return cls(**d).validate()

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        data = read_document(path, "plan", "plan file")
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        p = Path(path)
        if p.suffix in (".yaml", ".yml"):
            import yaml

            p.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))
        else:
            p.write_text(self.to_json() + "\n")

