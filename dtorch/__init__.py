"""DTorch: say what you want to train; DTorch plans how, applies the plan with PyTorch's own
distributed stack, and keeps the run alive.

Heavy pieces (torch.distributed, the trainer) are imported on first use so that the planner and
the CLI start fast.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "Plan": "dtorch.plan.plan",
    "ConfigError": "dtorch.errors",
    "Cluster": "dtorch.cluster.spec",
    "parallelize": "dtorch.parallel",
    "Trainer": "dtorch.train",
    "losses": "dtorch.train.losses",
    "optim": "dtorch.train.optim",
    "models": "dtorch.models",
}


def __getattr__(name: str):
    if name in _LAZY:
        mod = importlib.import_module(_LAZY[name])
        value = mod if _LAZY[name].endswith("." + name) else getattr(mod, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dtorch' has no attribute {name!r}")


__all__ = list(_LAZY)
