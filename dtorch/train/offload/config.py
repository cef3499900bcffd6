"""What a user asks of the memory tiers, and the checks that run before training starts.

    Trainer(..., offload="optimizer")                       # host tier: states + fp32 masters in RAM
    Trainer(..., offload=OptimizerOffload("nvme", directory="/nvme/tmp", budget_bytes=200 * 2**30))

The plan's `offload=optimizer` selects the host tier too, its `offload=optimizer_nvme` the NVMe tier
in `offload_dir` (the planner chooses them where nothing cheaper fits; see docs/memory-tiers.md).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtorch.errors import ConfigError

TIERS = ("host", "nvme")
OFFLOAD_VALUES = ("none", "optimizer", "optimizer_nvme")
"""What `Trainer(offload=...)` accepts as a string: none, the host tier, the NVMe tier."""


@dataclass(frozen=True)
class OptimizerOffload:
    """Optimizer state (and fp32 master weights) kept off the device; the step runs on the CPU."""

    tier: str = "host"
    """host: host memory (pinned on CUDA) | nvme: files on a local disk, read back block by block."""
    directory: str | None = None
    """nvme: an existing, writable directory on a local disk (a private sub-directory is made in it)."""
    budget_bytes: int | None = None
    """nvme: the most bytes this rank may write there (None: the free space is the budget)."""
    params_on_disk: bool = False
    """nvme: the fp32 master weights live in the files too (12 instead of 8 bytes/parameter on disk
    for AdamW, and 4 bytes/parameter less in host memory)."""
    block_bytes: int = 64 * 2**20
    """Bytes of state per block: the unit read, stepped and written back (whole parameters: a
    parameter larger than this is a block of its own)."""
    buffers: int = 3
    """Block buffers in host memory (one being read ahead, one stepped, one written back): the
    host memory the NVMe tier holds is buffers x the largest block."""
    overlap: bool | None = None
    """Step each block on a worker thread during the backward, as its gradients land (None: wherever
    the run allows it, `dtorch.plan.strategies.memory.step_overlaps_backward`: no gradient clipping,
    one rank or FSDP; False: after the backward, always)."""
    fused: bool | None = None
    """The CPU kernel: None = the optimizer spec's own choice when the model lives on the CPU (so a
    CPU run is bit-identical to the in-memory one), torch's fused CPU kernel when it lives on an
    accelerator; True/False forces it."""

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise ConfigError("offload.tier", self.tier, f"use one of {', '.join(TIERS)}")
        if self.tier == "nvme" and not self.directory:
            raise ConfigError("offload.directory", self.directory,
                              "the NVMe tier needs a directory on a local disk, e.g. "
                              "OptimizerOffload('nvme', directory='/local/nvme/tmp')")
        if self.budget_bytes is not None and int(self.budget_bytes) < 1:
            raise ConfigError("offload.budget_bytes", self.budget_bytes, "give a positive number of bytes or None")
        if int(self.buffers) < 2:
            raise ConfigError("offload.buffers", self.buffers, "use at least 2 block buffers (read ahead + step)")
        if int(self.block_bytes) < 1:
            raise ConfigError("offload.block_bytes", self.block_bytes, "use a positive number of bytes")

    @classmethod
    def resolve(cls, value: Any, plan_offload: str = "none", directory: str | os.PathLike | None = None
                ) -> OptimizerOffload | None:
        """The tier of a run: `value` (Trainer's `offload=`: None, a string of OFFLOAD_VALUES, or an
        OptimizerOffload) wins; else the plan's `offload=optimizer` means the host tier and its
        `offload=optimizer_nvme` the NVMe tier in `directory`."""
        if isinstance(value, OptimizerOffload):
            return value
        if directory is not None and value in ("none", "optimizer"):
            # nothing silently ignored: only the NVMe tier writes to a directory
            raise ConfigError("offload_dir", str(directory),
                              f"offload={value} keeps no files on disk; use offload=optimizer_nvme for the NVMe "
                              "tier, or drop the directory")
        if value is None:
            if plan_offload == "optimizer_nvme":
                if directory is None:
                    raise ConfigError("offload_dir", None,
                                      "the plan says offload=optimizer_nvme: give a directory on a local disk, "
                                      "`dtorch train --offload-dir DIR` or Trainer(offload_dir=...)")
                return cls("nvme", directory=str(directory))
            return cls("host") if plan_offload == "optimizer" else None
        if value == "none":
            return None
        if value == "optimizer":
            return cls("host")
        if value == "optimizer_nvme":
            if directory is None:
                raise ConfigError("offload_dir", None,
                                  "offload=optimizer_nvme keeps the optimizer state in files: give a directory on a "
                                  "local disk, `dtorch train --offload-dir DIR` or Trainer(offload_dir=...)")
            return cls("nvme", directory=str(directory))
        raise ConfigError("offload", value, f"use one of {', '.join(OFFLOAD_VALUES)} or an OptimizerOffload")


def check_directory(directory: str | os.PathLike, need_bytes: int, budget_bytes: int | None = None,
                    others_bytes: int = 0) -> Path:
    """The NVMe tier's directory, checked before training starts: it exists, is a directory this
    process may write, and has room for `need_bytes` (this rank's files) plus `others_bytes` (the
    other ranks of this node writing there too) within the budget. One ConfigError otherwise."""
    path = Path(directory).expanduser()
    fld = "offload.directory"
    if not path.exists():
        raise ConfigError(fld, str(path), f"it does not exist; create it (the optimizer state needs "
                          f"{need_bytes:,} bytes there) or point the NVMe tier at a local disk")
    if not path.is_dir():
        raise ConfigError(fld, str(path), "it is not a directory; give a directory on a local disk")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(fld, str(path), f"it is not writable by this user; the optimizer state needs "
                          f"{need_bytes:,} bytes there: choose a directory you own")
    if budget_bytes is not None and need_bytes > budget_bytes:
        raise ConfigError("offload.budget_bytes", budget_bytes,
                          f"the optimizer state of this rank needs {need_bytes:,} bytes in {path}; "
                          "raise the budget, add ranks (FSDP shards the state) or use the host tier")
    free = shutil.disk_usage(path).free
    total = need_bytes + others_bytes
    if total > free:
        raise ConfigError(fld, str(path), f"it has {free:,} bytes free but the optimizer state needs "
                          f"{total:,} bytes there; free space or choose a larger disk")
    return path
