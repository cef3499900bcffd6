"""Expert parallelism with context parallelism is planned, priced and ranked like any other product.

The executor runs it loss-equivalent to one process, the MoE's sequence-wise balance loss included
(`tests/parallel/test_ep_cp_loss.py`), so the search offers EP x CP families, `--fix ep=..,cp=..`
plans them, and the ep ranks' replica rule counts a replica's dp_shard x cp ranks as the
executor's expert mesh does. Planner only: about 12 s in all (six searches).
"""

from __future__ import annotations

import itertools

import pytest

from dtorch.cli import main
from dtorch.cluster.load import parse_shorthand
from dtorch.plan.explain import explain
from dtorch.plan.plan import Plan
from dtorch.plan.profiles import get_profile
from dtorch.plan.search import search
from dtorch.plan.strategies.expert import EXPERT

MODEL, CLUSTER, SEQ, BATCH = "moe-tiny", "cpu:1x4", 128, 16


def _search(**fixed):
    return search(get_profile(MODEL, SEQ), parse_shorthand(CLUSTER), global_batch=BATCH, fixed=fixed or None)


def _plans(result) -> list[Plan]:
    return [p for p, _ in result.ranked] + [p for p, _ in result.best_by_family.values()]


@pytest.mark.parametrize("fixed", [{"ep": 2, "cp": 2}, {"ep": 4, "cp": 4}, {"ep": 2, "cp": 2, "dp_shard": 2},
                                   {"ep": 2, "cp": 2, "pp": 1, "dp_replicate": 2}])
def test_fixing_ep_with_cp_plans_and_prices_it(fixed):
    result = _search(**fixed)
    assert result.ranked
    for plan, est in result.ranked:
        assert all(getattr(plan, k) == v for k, v in fixed.items()), plan
        assert est.step_time_s > 0 and est.fits
        assert est.time_breakdown["ep"] > 0 and est.time_breakdown["cp"] > 0  # both exchanges priced
    # (ZeRO-2 x EP under a pipeline stays a limit of its own, for every cp)
    assert not any("balance loss" in why or "context parallelism" in why for why in result.rejected.values())


def test_ep_with_cp_prices_the_cp_share_of_the_tokens():
    """The all-to-alls move only a rank's own chunk of each sequence: a cp=2 rank with micro-batches of
    4 sequences (cp=4: 8) routes as many tokens as a dp_shard=4 rank with 2 whole sequences: the same
    ep exchange."""
    from dtorch.plan.cost import estimate

    prof, cluster = get_profile(MODEL, SEQ), parse_shorthand(CLUSTER)

    def ep_time(**fields):
        plan = Plan(ep=2, seq_len=SEQ, global_batch=BATCH, **fields)
        return estimate(plan, prof, cluster).time_breakdown["ep"]

    fsdp = ep_time(dp_shard=4, microbatch_size=2, num_microbatches=2)
    assert ep_time(dp_shard=2, cp=2, microbatch_size=4, num_microbatches=2) == pytest.approx(fsdp, rel=1e-6)
    assert ep_time(cp=4, microbatch_size=8, num_microbatches=2) == pytest.approx(fsdp, rel=1e-6)


def test_dtorch_plan_fix_ep_cp_plans(capsys):
    args = ["plan", "--model", MODEL, "--cluster", CLUSTER, "--seq-len", str(SEQ), "--global-batch", str(BATCH)]
    assert main([*args, "--fix", "ep=2,cp=2"]) == 0
    out = capsys.readouterr()
    assert "ep=2" in out.out and "cp=2" in out.out and "error" not in out.err


def test_the_search_ranks_ep_with_cp_beside_each_alone():
    result = _search()
    plans = _plans(result)
    assert any(p.ep > 1 and p.cp > 1 for p in plans)
    assert any(p.ep > 1 and p.cp == 1 for p in plans) and any(p.ep == 1 and p.cp > 1 for p in plans)
    assert any("EP" in f and "CP" in f for f in result.best_by_family)
    assert "any EPxCP" not in result.rejected and "balance loss" not in explain(result)


def test_the_replica_rule_counts_a_replicas_cp_ranks_as_the_executor_does():
    """`Expert.limits` and the executor's expert mesh (`replica_split` over a replica's dp_shard x cp
    ranks) agree on which ep fits with replicas, for every small mesh."""
    from dtorch.parallel.expert import replica_split

    for r, s, cp in itertools.product((2, 3, 4), (1, 2, 3), (1, 2, 3, 4)):
        for ep in (e for e in range(2, r * s * cp + 1) if r * s * cp % e == 0):
            plan = Plan(dp_replicate=r, dp_shard=s, cp=cp, ep=ep, microbatch_size=1)
            refused = next(EXPERT.limits(plan), None) is not None
            assert refused == (replica_split(ep, r, s * cp) is None), plan
