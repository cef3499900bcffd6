"""The executor: apply a Plan to a plain model with PyTorch's own distributed stack.

`parallelize(model_or_factory, plan, loss_fn=...) -> ParallelModel` (see model.py for the contract),
`check_plan` (reject impossible plans before any process group exists), `annotate` (tensor-parallel
roles for layers the executor cannot name), `verify` (dry run at full scale on a fake process group).
"""

from __future__ import annotations

import importlib

# Bound eagerly: the submodule of the same name, once imported directly
# (`from dtorch.parallel.parallelize import meta_model`), would otherwise shadow the function.
from dtorch.parallel.parallelize import parallelize

_LAZY = {
    "ParallelModel": "dtorch.parallel.model",
    "check_plan": "dtorch.parallel.check",
    "model_dims": "dtorch.parallel.check",
    "annotate": "dtorch.parallel.tp",
    "verify": "dtorch.parallel.dryrun",
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dtorch.parallel' has no attribute {name!r}")


__all__ = ["parallelize", *_LAZY]
