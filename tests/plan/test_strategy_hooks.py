"""A strategy is one unit (issue 29): the cost model and the search reach every strategy through
registry hooks, so a strategy's term added to the registry shows in the estimate and the lower
bound without editing cost.py or search.py, and those modules name no strategy they loop over.
About 2 s."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dtorch.cluster.load import parse_shorthand
from dtorch.plan import cost, strategies
from dtorch.plan.cost import DEFAULT_CONSTANTS, estimate, step_counts
from dtorch.plan.plan import Plan
from dtorch.plan.profiles import get_profile
from dtorch.plan.search import _bound, _Mesh, _meshes, precisions
from dtorch.plan.strategies import REGISTRY
from dtorch.plan.strategies.base import StepTerm, Strategy

ROOT = Path(__file__).resolve().parents[2]


class _Toy(Strategy):
    """A strategy that only adds seconds: once per step at the pipeline's pace, and to the bound."""

    name = "toy"

    def pace_terms(self, step, t_mb):
        return (StepTerm("toy", 0.25 * t_mb),)

    def bound_pace(self, step, t, n):
        return 1.5


@pytest.fixture(scope="module")
def case():
    return get_profile("llama3-8b", 2048), parse_shorthand("h100:1x8")


def test_a_per_step_term_reaches_the_estimate_through_the_registry(case, monkeypatch):
    prof, cl = case
    plan = Plan(pp=2, dp_shard=4, num_microbatches=4, schedule="1f1b")
    before = estimate(plan, prof, cl)
    assert before.time_breakdown["bubble"] > 0 and before.time_breakdown["pp_p2p"] > 0  # (the pipeline's)
    monkeypatch.setattr(cost, "PACED", (*cost.PACED, _Toy()))
    after = estimate(plan, prof, cl)
    toy = after.time_breakdown["toy"]
    # a quarter of the slowest stage's micro-batch: the bubble is (pp-1)/v = 1 of them under 1F1B
    assert toy == pytest.approx(0.25 * before.time_breakdown["bubble"], rel=1e-12)
    assert after.step_time_s == pytest.approx(before.step_time_s + toy, rel=1e-12)
    assert after.tokens_per_s < before.tokens_per_s


def test_the_step_counts_fields_come_from_the_strategies_that_fill_them(case, monkeypatch):
    prof, _ = case
    plan = Plan(tp=2, dp_shard=4, sp=True)
    counts = step_counts(plan, prof)
    assert counts.tp_small_per_microbatch > 0 and counts.tp_small_per_step > 0
    assert step_counts(Plan(dp_shard=8), prof).tp_small_per_microbatch == 0.0
    monkeypatch.setattr(cost, "COUNTING", ())  # nothing fills them: the defaults
    bare = step_counts(plan, prof)
    assert (bare.tp_small_per_microbatch, bare.tp_small_per_step) == (0.0, 0.0)
    assert bare.ops_per_microbatch == counts.ops_per_microbatch


def test_the_lower_bound_adds_a_strategy_s_bound_terms(case, monkeypatch):
    prof, cl = case
    group = cl.slowest_group()
    precs, _ = precisions(group, {})
    mesh = _Mesh(2, 1, 4, 1, 1)
    before = _bound(mesh, 1, prof, group, 64, precs, DEFAULT_CONSTANTS)
    monkeypatch.setattr(strategies, "PACE_BOUNDED", (*strategies.PACE_BOUNDED, _Toy()))
    assert _bound(mesh, 1, prof, group, 64, precs, DEFAULT_CONSTANTS) == pytest.approx(before + 1.5, rel=1e-12)


def test_the_search_picks_mesh_degrees_innermost_first(case):
    prof, cl = case
    assert [s.axis for s in strategies.DEGREED] == ["tp", "cp", "pp"]
    meshes = _meshes(prof, cl, 64, {})
    assert all(m.pp * m.dp_replicate * m.dp_shard * m.cp * m.tp == 8 for m in meshes)
    assert len({tuple(m.degrees.values()) for m in meshes}) == len(meshes)
    # tp varies slowest: every tp=1 mesh comes before the first tp=2 one
    tps = [m.tp for m in meshes]
    assert tps == sorted(tps)
    fixed = _meshes(prof, cl, 64, {"tp": 2, "pp": 2})
    assert fixed and all(m.tp == 2 and m.pp == 2 for m in fixed)


def _strategy_names(path: Path) -> set[str]:
    """Strategy singletons (REGISTRY members' names) a module imports."""
    singletons = {name for name in dir(strategies) if any(getattr(strategies, name) is s for s in REGISTRY)}
    tree = ast.parse(path.read_text())
    return {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
            and (node.module or "").startswith("dtorch.plan.strategies") for a in node.names} & singletons


def test_the_loops_name_no_strategy():
    assert _strategy_names(ROOT / "dtorch/plan/cost.py") == set()
    for mod in ("parallel/parallelize.py", "parallel/halves.py", "parallel/dryrun.py"):
        assert _strategy_names(ROOT / "dtorch" / mod) == set(), mod
    # the search's walk inside a mesh names what it orders (search.py says why); nothing else
    assert _strategy_names(ROOT / "dtorch/plan/search.py") <= {"EXPERT", "MEMORY", "PIPELINE", "PRECISION", "TENSOR",
                                                                       "ZERO"}
