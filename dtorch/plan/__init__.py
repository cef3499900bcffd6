"""The planner: pure functions from (ModelProfile, Cluster) to a ranked, explained Plan.

    from dtorch.plan import search, estimate, check, explain
    result = search(profile, cluster, global_batch=512, fixed={"tp": 8})
    print(explain(result))

Submodules: `plan` (the Plan document), `strategies` (the strategy registry: every parallelism's
fields, rules, limits, search candidates and time terms, one file each), `cost` (the analytic cost
model), `comm` (collective times), `search` (the plan search and `check`), `explain`, `recommend`
(cluster sizing), `calibration` (published runs), `profiles` (model profiles without torch).
Nothing here imports torch or torch.distributed.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "Plan": "dtorch.plan.plan",
    "estimate": "dtorch.plan.cost",
    "Estimate": "dtorch.plan.cost",
    "CostConstants": "dtorch.plan.cost",
    "search": "dtorch.plan.search",
    "check": "dtorch.plan.search",
    "parse_fix": "dtorch.plan.search",
    "SearchResult": "dtorch.plan.search",
    "explain": "dtorch.plan.explain",
    "recommend": "dtorch.plan.recommend",
    "get_profile": "dtorch.plan.profiles",
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dtorch.plan' has no attribute {name!r}")


__all__ = list(_LAZY)
