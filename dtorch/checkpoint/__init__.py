"""Never-torn checkpoints on DCP: verified load with fallback, async save, retention, export.

See `dtorch.checkpoint.manager` for the layout and the commit protocol.
"""

from dtorch.checkpoint.manager import (
    CheckpointError,
    CheckpointInfo,
    CheckpointManager,
    CheckpointWarning,
    SaveResult,
    VerifyReport,
)
from dtorch.checkpoint.state import ModelState, RNGState

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointWarning",
    "ModelState",
    "RNGState",
    "SaveResult",
    "VerifyReport",
]
