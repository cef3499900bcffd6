"""The planner's half of torch.compile (dtorch/plan/strategies/compile.py): the `compile` Plan
field declared by the strategy, rules and limits that mirror the executor's refusals, candidates
only where the cluster's calibration measured a gain, and the search choosing it there and only
there, priced by the measured speed-up and its compile seconds amortised over a given run length.
Fast (about 3 s: tiny models, a 2-device CPU cluster)."""

from __future__ import annotations

import dataclasses

import pytest

from dtorch.cluster.load import parse_shorthand
from dtorch.errors import ConfigError
from dtorch.plan import strategies
from dtorch.plan.cost import estimate
from dtorch.plan.plan import Plan
from dtorch.plan.profiles import get_profile
from dtorch.plan.search import search
from dtorch.plan.strategies.compile import COMPILE, measured

MODEL, SEQ, GB = "llama-tiny", 64, 8


def _calibration(family: str, speedup: float, compile_s: float = 12.0) -> dict:
    return {"compile": {"version": 1, "speedup": speedup, "compile_s": compile_s, "samples": 3,
                        "by_family": {family: {"speedup": speedup, "compile_s": compile_s, "samples": 3}}}}


def _search(cluster, **kw):
    return search(get_profile(MODEL, SEQ), cluster, global_batch=GB, seq_len=SEQ, top_k=5, **kw)


def test_the_field_is_declared_by_the_strategy_not_plan_py():
    assert [f.name for f in dataclasses.fields(Plan)][-1] == "compile" and Plan().compile is False
    assert strategies.OWNER["compile"] is COMPILE and "compile" in strategies.FIXABLE
    assert Plan.from_dict({"compile": True}).compile is True and Plan.from_dict({}).compile is False
    with pytest.raises(ConfigError) as e:
        Plan(compile="yes").validate()
    assert e.value.field == "compile"
    with pytest.raises(ConfigError) as e:
        strategies.normalize_fixed({"compile": "maybe"})
    assert e.value.field == "compile"
    assert strategies.normalize_fixed({"compile": "true"}) == {"compile": True}
    assert Plan(dp_shard=2, compile=True).describe().endswith("compile") and "compile" not in Plan().describe()


def test_limits_mirror_the_executors_refusal_of_checkpointed_tensor_parallel_blocks():
    from dtorch.parallel.check import check_executable

    refused = Plan(tp=2, ac="full", compile=True)
    assert strategies.unsupported(refused) and "AOT autograd" in strategies.unsupported(refused)
    with pytest.raises(ConfigError) as e:
        check_executable(refused)
    assert e.value.field == "compile"
    for ok in (Plan(tp=2, compile=True), Plan(dp_shard=2, ac="selective", compile=True), Plan(tp=2, ac="full")):
        assert strategies.unsupported(ok) is None, ok.describe()


def test_candidates_need_a_measured_speedup_for_the_plans_family():
    fsdp = Plan(dp_shard=2)
    assert COMPILE.candidates(fsdp, {}, None) == [False]
    assert COMPILE.candidates(fsdp, {}, {}) == [False]
    assert COMPILE.candidates(fsdp, {}, _calibration("FSDP", 1.4)) == [False, True]
    assert COMPILE.candidates(fsdp, {}, _calibration("FSDP", 0.9)) == [False]  # measured slower
    assert COMPILE.candidates(fsdp, {}, _calibration("TP", 1.4)) == [False]  # another family's gain
    assert COMPILE.candidates(fsdp, {"compile": True}, None) == [True]  # --fix compile=true pins it
    assert COMPILE.candidates(fsdp, {"compile": False}, _calibration("FSDP", 1.4)) == [False]
    # never a candidate the executor refuses, calibrated or not
    assert COMPILE.candidates(Plan(tp=2, ac="full"), {}, _calibration("TP+SP", 2.0)) == [False]
    assert measured(_calibration("FSDP", 1.4), "FSDP")["compile_s"] == 12.0


def test_the_step_shape_prices_a_compiled_plan():
    profile, cluster = get_profile(MODEL, SEQ), parse_shorthand("cpu:1x2")
    eager = estimate(Plan(dp_shard=2), profile, cluster)
    compiled = estimate(Plan(dp_shard=2, compile=True), profile, cluster)
    assert compiled.step_time_s < eager.step_time_s
    assert compiled.step_time_s == pytest.approx(estimate(Plan(dp_shard=2), profile, cluster, compiled=True).step_time_s)


def test_a_measured_speedup_prices_the_compiled_plan_where_one_exists():
    profile, cluster = get_profile(MODEL, SEQ), parse_shorthand("cpu:1x2")
    eager = estimate(Plan(dp_shard=2), profile, cluster)
    for speedup in (1.5, 0.8):  # a measured slow-down prices the plan slower
        cal = dataclasses.replace(cluster, calibration=_calibration("FSDP", speedup))
        on = estimate(Plan(dp_shard=2, compile=True), profile, cal)
        for k in ("compute", "recompute", "host"):  # what compile changes, divided by the measured ratio
            assert on.time_breakdown[k] == pytest.approx(eager.time_breakdown[k] / speedup)
        for k in ("fsdp", "dp", "optimizer"):  # what it does not, as eager
            assert on.time_breakdown[k] == pytest.approx(eager.time_breakdown[k])
        assert (on.step_time_s < eager.step_time_s) == (speedup > 1)
    # another family's measurement is not this one's: the cost model's own element-wise guess
    other = dataclasses.replace(cluster, calibration=_calibration("TP+SP", 3.0))
    assert estimate(Plan(dp_shard=2, compile=True), profile, other).step_time_s == pytest.approx(
        estimate(Plan(dp_shard=2), profile, cluster, compiled=True).step_time_s)


def test_compile_seconds_are_amortised_over_the_run_length_when_given():
    from dtorch.plan.explain import explain

    cluster = parse_shorthand("cpu:1x2")
    best, best_est = _search(cluster).best
    fam = best.family()
    cal = dataclasses.replace(cluster, calibration=_calibration(fam, 1.5, compile_s=60.0))
    on = estimate(dataclasses.replace(best, compile=True), get_profile(MODEL, SEQ), cal)
    gain = best_est.step_time_s - on.step_time_s
    assert gain > 0
    even = 60.0 / gain  # the run length at which compiling breaks even
    unknown = _search(cal)  # today's behaviour: ranked by step time, the seconds only noted
    assert unknown.best[0].compile and unknown.steps is None
    assert "no run length given" in explain(unknown)
    short, long_ = _search(cal, steps=max(1, int(even / 2))), _search(cal, steps=int(even * 2) + 1)
    assert not short.best[0].compile and long_.best[0].compile
    text = explain(long_)
    assert "amortised s" in text and f"over {long_.steps:,} steps" in text and "what the ranking used" in text
    with pytest.raises(ConfigError) as e:
        _search(cal, steps=0)
    assert e.value.field == "steps"


def test_the_search_chooses_compile_where_calibrated_and_only_there():
    cluster = parse_shorthand("cpu:1x2")
    plain = _search(cluster)
    assert not any(p.compile for p, _ in plain.ranked) and not any(p.compile for p, _ in plain.best_by_family.values())
    best, best_est = plain.best
    fam = best.family()
    calibrated = _search(dataclasses.replace(cluster, calibration=_calibration(fam, 1.5, compile_s=42.0)))
    top, top_est = calibrated.best
    assert top.compile and top.family() == fam and top_est.step_time_s < best_est.step_time_s
    assert dataclasses.replace(top, compile=False, predicted=None) == dataclasses.replace(best, predicted=None)
    assert any("42 s of compilation" in n for n in calibrated.notes)
    # other families were not measured: none of them is compiled
    assert all(not p.compile for f, (p, _) in calibrated.best_by_family.items() if f != fam)
    # a measured slow-down leaves the ranking as it was
    slower = _search(dataclasses.replace(cluster, calibration=_calibration(fam, 0.8)))
    assert [p.describe() for p, _ in slower.ranked] == [p.describe() for p, _ in plain.ranked]


def test_fix_compile_true_compiles_every_plan_and_says_nothing_was_measured():
    res = _search(parse_shorthand("cpu:1x2"), fixed={"compile": "true"})
    assert res.ranked and all(p.compile for p, _ in res.ranked)
    assert all(not (p.tp > 1 and p.ac != "none") for p, _ in res.ranked)  # the executor's refusal
    assert any("no compile measurement" in n for n in res.notes)
    # pinned together with what the executor refuses: said up front, not a silent empty ranking
    forced = _search(parse_shorthand("cpu:1x2"), fixed={"compile": True, "tp": 2, "ac": "full"})
    assert any("cannot run yet" in n and "AOT autograd" in n for n in forced.notes)
