"""The runtime: the training loop (`Trainer`), data, losses, optimizer specs and checkpointable state."""

from __future__ import annotations

import importlib

_LAZY = {"Trainer": "dtorch.train.trainer", "FitResult": "dtorch.train.trainer"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dtorch.train' has no attribute {name!r}")


__all__ = list(_LAZY)
