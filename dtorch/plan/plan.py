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

PLAN_VERSION = 1
MESH_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
AC_POLICIES = ("none", "selective", "full")
OFFLOAD_POLICIES = ("none", "optimizer", "params")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass
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
    """none | optimizer (optimizer states on CPU) | params (FSDP CPU offload of params+grads+optimizer)."""
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
        parts = []
        if self.dp_replicate > 1 and self.dp_shard > 1:
            parts.append("HSDP")
        elif self.dp_shard > 1:
            parts.append("FSDP")
        elif self.dp_replicate > 1:
            parts.append("DDP")
        if self.cp > 1:
            parts.append("CP")
        if self.tp > 1:
            parts.append("TP+SP" if self.sp else "TP")
        if self.pp > 1:
            parts.append("PP")
        return "x".join(parts) or "single"

    def describe(self) -> str:
        """One line: degrees, micro-batching and policies."""
        deg = " ".join(f"{a}={getattr(self, a)}" for a in MESH_AXES if getattr(self, a) > 1) or "single device"
        extra = f"mb={self.microbatch_size}x{self.num_microbatches}"
        if self.pp > 1:
            extra += f" {self.schedule}" + (f"(v={self.virtual_stages})" if self.virtual_stages > 1 else "")
        if self.sp:
            extra += " sp"
        if self.ac != "none":
            extra += f" ac={self.ac}"
        if self.offload != "none":
            extra += f" offload={self.offload}"
        if self.dp_shard > 1 and not self.reshard_after_forward:
            extra += " no-reshard"
        if self.layer_partition is not None:
            extra += " stages=" + _runs(self.layer_partition)
        short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
        if (self.param_dtype, self.reduce_dtype) != ("float32", "float32"):
            extra += f" {short[self.param_dtype]}" + (f"/reduce-{short[self.reduce_dtype]}"
                                                       if self.reduce_dtype != "float32" else "")
        return f"{deg} {extra}"

    # ---- validation --------------------------------------------------------------------------
    def validate(self, world_size: int | None = None) -> Plan:
        """Check internal consistency (not model fit: see `dtorch.plan.check`). Returns self."""
        for axis in (*MESH_AXES, "microbatch_size", "num_microbatches", "virtual_stages"):
            v = getattr(self, axis)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(axis, v, "must be a positive integer")
        if self.version != PLAN_VERSION:
            raise ConfigError("version", self.version, f"this DTorch reads plan version {PLAN_VERSION}")
        if self.schedule not in SCHEDULES:
            raise ConfigError("schedule", self.schedule, choices(SCHEDULES))
        if self.ac not in AC_POLICIES:
            raise ConfigError("ac", self.ac, choices(AC_POLICIES))
        if self.offload not in OFFLOAD_POLICIES:
            raise ConfigError("offload", self.offload, choices(OFFLOAD_POLICIES))
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ConfigError(name, getattr(self, name), choices(DTYPES))
        if self.sp and self.tp == 1:
            raise ConfigError("sp", self.sp, "sequence parallelism needs tp > 1; set sp=false or raise tp")
        if self.pp == 1 and self.virtual_stages != 1:
            raise ConfigError("virtual_stages", self.virtual_stages, "virtual stages need pp > 1; set 1")
        if self.virtual_stages > 1 and self.schedule in ("gpipe", "1f1b"):
            raise ConfigError(
                "virtual_stages", self.virtual_stages,
                f"schedule {self.schedule} runs one stage per rank; use schedule=interleaved_1f1b or virtual_stages=1",
            )
        if self.pp > 1 and self.num_microbatches < self.pp and self.schedule != "gpipe":
            raise ConfigError(
                "num_microbatches", self.num_microbatches,
                f"schedule {self.schedule} with pp={self.pp} needs at least {self.pp} micro-batches; "
                f"use num_microbatches >= {self.pp} or schedule=gpipe",
            )
        if self.layer_partition is not None:
            if len(self.layer_partition) != self.num_stages or any(n < 1 for n in self.layer_partition):
                raise ConfigError(
                    "layer_partition", self.layer_partition,
                    f"give {self.num_stages} positive block counts (pp * virtual_stages), or null for even",
                )
        if world_size is not None and self.world_size != world_size:
            raise ConfigError(
                "degrees", self.mesh_shape,
                f"pp*dp_replicate*dp_shard*cp*tp = {self.world_size} but the world size is {world_size}",
            )
        if self.global_batch is not None and self.global_batch != self.dp * self.local_batch():
            raise ConfigError(
                "global_batch", self.global_batch,
                f"dp({self.dp}) * microbatch_size({self.microbatch_size}) * num_microbatches"
                f"({self.num_microbatches}) = {self.dp * self.local_batch()}; make them agree",
            )
        return self

    # ---- serialisation -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
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


def _runs(sizes: list[int]) -> str:
    """``[1, 2, 2, 2, 1]`` -> ``1/2x3/1``: a partition as runs of equal stage sizes."""
    out: list[str] = []
    i = 0
    while i < len(sizes):
        j = i
        while j < len(sizes) and sizes[j] == sizes[i]:
            j += 1
        out.append(str(sizes[i]) + (f"x{j - i}" if j - i > 1 else ""))
        i = j
    return "/".join(out)
