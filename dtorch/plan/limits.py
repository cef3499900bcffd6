"""What the executor of this DTorch version can run: the planner ranks only such plans.

The limits themselves are declared by each strategy (`Strategy.limits` in
`dtorch.plan.strategies`); this module is their one entry point for the planner, and
`dtorch.parallel.check` enforces the same list before any process group exists.
"""

from __future__ import annotations

from dtorch.plan.strategies import check_executable, limits, unsupported  # noqa: F401
from dtorch.plan.strategies.precision import unsupported_dtype  # noqa: F401
