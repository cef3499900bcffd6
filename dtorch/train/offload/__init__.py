"""Memory tiers for the optimizer: its state and fp32 master weights in host memory or on a local
disk, the step on the CPU (docs/memory-tiers.md)."""

from dtorch.train.offload.config import OFFLOAD_VALUES, OptimizerOffload, check_directory
from dtorch.train.offload.optimizer import OffloadedOptimizer, build, bytes_needed

__all__ = ["OFFLOAD_VALUES", "OffloadedOptimizer", "OptimizerOffload", "build", "bytes_needed", "check_directory"]
