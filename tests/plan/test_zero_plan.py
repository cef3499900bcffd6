"""The search choosing ZeRO-1/2 (`Zero.stages` beside every FSDP plan it tries; `search._zero`).

Where the executor runs them (dp_shard x cp, no replicas, no parameter offload, not ZeRO-2 with
EP under a pipeline) and where they are another plan than FSDP's (more than one micro-batch;
ZeRO-2 only under a pipeline), the search prices them and ranks them; where not, `rejected` says
why. The planner's pick runs: one world-4 group on gloo, losses within 1e-5 of one process.
(The field, its rules, limits and terms: tests/parallel/test_zero_plan.py; the executor:
tests/parallel/test_zero.py.)
"""

from __future__ import annotations

import sys
from functools import cache
from pathlib import Path

import pytest

from dtorch.cluster.load import parse_shorthand
from dtorch.plan.cost import estimate
from dtorch.plan.explain import explain
from dtorch.plan.plan import Plan
from dtorch.plan.profiles import get_profile
from dtorch.plan.search import search
from dtorch.plan.strategies import unsupported
from dtorch.plan.strategies.zero import ZERO


@pytest.fixture(autouse=True)
def _no_machine(monkeypatch):
    monkeypatch.setenv("DTORCH_NO_CALIBRATION", "1")


@cache
def _a100_8b():
    # 8B on 32 A100-80GB: replicated float32 states (16 B/param, 128 GB) do not fit, so DDP is out;
    # sharded, the 8 micro-batches per rank make FSDP gather and reduce every unit 8 times a step
    return search(get_profile("llama3-8b", 4096), parse_shorthand("a100:4x8"), global_batch=256, top_k=5)


def test_search_picks_zero_where_replicas_do_not_fit_and_fsdp_regathers_per_microbatch() -> None:
    r = _a100_8b()
    plan, est = r.best
    assert plan.family().startswith("ZeRO") and plan.num_microbatches > 1 and unsupported(plan) is None
    assert "does not fit" in r.rejected["DDP"]
    fsdp_plan, fsdp = r.best_by_family["FSDP"]
    assert est.step_time_s < fsdp.step_time_s
    # what it wins on: the data-parallel traffic, once per step instead of once per micro-batch
    assert est.time_breakdown["fsdp"] < fsdp.time_breakdown["fsdp"]
    same = estimate(Plan(**{**plan.to_dict(), "zero": 0, "predicted": None}), r.profile, r.cluster)
    assert same.time_breakdown["fsdp"] > est.time_breakdown["fsdp"]
    # ZeRO-2 (sharded gradients) is ranked too, and explained beside the choice
    assert any(f.startswith("ZeRO2") for f in r.best_by_family)
    text = explain(r)
    assert f"chosen: {plan.family()}" in text and "ZeRO2" in text


def test_every_ranked_zero_plan_is_one_the_executor_runs() -> None:
    r = _a100_8b()
    zero = [p for p, _ in [*r.ranked, *r.best_by_family.values()] if p.zero]
    assert zero
    for p in zero:
        assert unsupported(p) is None and p.dp_replicate == 1 and p.dp_shard * p.cp > 1
        assert not p.reshard_after_forward  # (nothing is resharded within a ZeRO step)
        assert p.zero == 2 or p.pp == 1  # ZeRO-1 under a pipeline is FSDP without resharding


def test_the_lower_bound_holds_for_zero_plans() -> None:
    """A mesh is skipped on a lower bound of its step time: it must hold for ZeRO's plans too."""
    from dtorch.plan.search import _bound, _Mesh, precisions

    r = _a100_8b()
    group = r.cluster.slowest_group()
    precs, _ = precisions(group, {})
    for fam, (p, e) in r.best_by_family.items():
        if not p.zero:
            continue
        mesh = _Mesh(p.pp, p.dp_replicate, p.dp_shard, p.cp, p.tp)
        for mbs in (0, p.microbatch_size):
            assert _bound(mesh, mbs, r.profile, group, r.global_batch, precs, r.constants) <= e.step_time_s, fam


def test_zero_is_not_tried_where_fsdp_already_is_that_plan() -> None:
    """`Zero.stages` skips what the cost model prices as FSDP's own plan: one micro-batch (one gather
    and one reduction either way), and ZeRO-1 under a pipeline (torch's schedule already gathers
    and reduces once per step). These estimates are why; if they part, the skip must go."""
    prof, cl = get_profile("llama3-8b", 4096), parse_shorthand("h100:1x8")
    base = dict(param_dtype="bfloat16", seq_len=4096, global_batch=64, reshard_after_forward=False)

    def est(**kw):
        return estimate(Plan(**{**base, **kw}), prof, cl)

    one = dict(dp_shard=8, microbatch_size=8, num_microbatches=1)
    fsdp = est(**one)
    for z in (1, 2):
        e = est(**one, zero=z)
        assert (e.step_time_s, e.memory_bytes_per_rank) == (fsdp.step_time_s, fsdp.memory_bytes_per_rank)
    piped = dict(dp_shard=4, pp=2, schedule="1f1b", microbatch_size=1, num_microbatches=8)
    fsdp, z1 = est(**piped), est(**piped, zero=1)
    assert (z1.step_time_s, z1.memory_bytes_per_rank) == (fsdp.step_time_s, fsdp.memory_bytes_per_rank)

    assert ZERO.stages(Plan(dp_shard=8, num_microbatches=4), {}) == (1, 2)
    assert ZERO.stages(Plan(dp_shard=4, pp=2, num_microbatches=4), {}) == (2,)
    assert ZERO.stages(Plan(dp_shard=2, cp=2, tp=2, num_microbatches=4), {}) == (1, 2)
    for plan, fixed, why in ((Plan(dp_shard=8, num_microbatches=1), {}, "one micro-batch"),
                             (Plan(tp=8, num_microbatches=4), {}, "no dp_shard x cp axis"),
                             (Plan(dp_replicate=2, dp_shard=4, num_microbatches=4), {}, "dp_replicate"),
                             (Plan(dp_shard=8, num_microbatches=4), {"offload": "params"}, "offload=params"),
                             (Plan(dp_shard=8, num_microbatches=4), {"reshard_after_forward": True}, "reshard")):
        assert ZERO.stages(plan, fixed) == ()
        assert why in ZERO.not_searched(plan, fixed)
    assert ZERO.stages(Plan(dp_shard=8, num_microbatches=4), {"zero": 1}) == ()  # (--fix pins it on every plan)


def test_pipelined_fsdp_and_zero1_accumulate_full_gradients_in_reduce_dtype() -> None:
    """Under a pipeline FSDP (resharding or not) and ZeRO-1 run the same accumulation: FSDP2 keeps
    every unit's full-size gradients in reduce_dtype until the last micro-batch's reduce-scatter
    (`to_accumulated_grad_if_needed`), and the step's sharded gradients were set to None, so the
    two never coexist. Measured at world 4 (pp=2 x dp_shard=2, llama-tiny hidden 128, 4 micro-batches:
    the most gradient bytes held at any FSDP post-backward were 4 B x the stage's parameters in
    float32, and in bfloat16 with float32 reduction, for all three alike)."""
    prof, cl = get_profile("llama3-8b", 4096), parse_shorthand("h100:1x8")
    piped = dict(dp_shard=4, pp=2, schedule="1f1b", microbatch_size=1, num_microbatches=8, seq_len=4096,
                 global_batch=64, param_dtype="bfloat16")
    for reduce_dtype, b in (("float32", 4), ("bfloat16", 2)):
        grads = {estimate(Plan(**piped, reduce_dtype=reduce_dtype, **kw), prof, cl).memory_breakdown["grads"]
                 for kw in (dict(), dict(reshard_after_forward=False), dict(reshard_after_forward=False, zero=1))}
        assert len(grads) == 1, grads
        # (a stage: 16 of the 32 blocks and the embedding, or the head, as large)
        stage = (prof.num_layers // 2) * (prof.params_total - prof.params_embedding - prof.params_head) \
            / prof.num_layers + prof.params_embedding
        assert grads.pop() == pytest.approx(b * stage, rel=0.02)


def test_rejected_says_why_zero_was_not_searched() -> None:
    # nothing to shard on one device
    one = search(get_profile("llama3-1b", 2048), parse_shorthand("h100:1"), global_batch=8, top_k=1)
    assert "no dp_shard x cp axis" in one.rejected["ZeRO1/2"]
    assert "ZeRO1/2" in explain(one)
    # a fixed parameter offload
    off = search(get_profile("llama3-8b", 4096), parse_shorthand("h100:1x8"), global_batch=16, top_k=1,
                 fixed={"offload": "params"})
    assert "offload=params" in off.rejected["ZeRO1/2"]
    assert not any(p.zero for p, _ in [*off.ranked, *off.best_by_family.values()])


def test_a_stage_the_executor_does_not_build_is_named_not_estimated() -> None:
    """ZeRO-2 with expert parallelism under a pipeline is a limit: never ranked, `rejected` names it."""
    r = search(get_profile("mixtral-8x7b", 4096), parse_shorthand("h100:4x8"), global_batch=256, top_k=3)
    assert not any(p.zero == 2 and p.ep > 1 and p.pp > 1 for p, _ in [*r.ranked, *r.best_by_family.values()])
    assert "ZeRO-2 with expert parallelism under a pipeline" in r.rejected["ZeRO2xEPxPP"]
    assert "not searched" in r.rejected["ZeRO2xEPxPP"]


def test_fixing_zero_still_pins_it() -> None:
    r = search(get_profile("llama3-8b", 4096), parse_shorthand("h100:1x8"), global_batch=64,
               fixed={"zero": 2, "pp": 1}, top_k=3)
    assert r.ranked and all(p.zero == 2 for p, _ in r.ranked)
    off = search(get_profile("llama3-8b", 4096), parse_shorthand("h100:1x8"), global_batch=64,
                 fixed={"zero": 0, "pp": 1}, top_k=3)
    assert not any(p.zero for p, _ in [*off.ranked, *off.best_by_family.values()])


def test_the_planners_zero_pick_runs_and_matches_one_process() -> None:
    """On 4 CPU ranks with the data parallelism sharded (dp_replicate=1) and micro-batches of one,
    the planner picks ZeRO-1 (FSDP would gather every unit per micro-batch); that plan, as the
    search wrote it, trains 3 AdamW steps at world 4 within 1e-5 of one process."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))
    import _training
    from _harness import run_group
    from _zero_workers import worker

    r = search(get_profile("llama-tiny", _training.SEQ), parse_shorthand("cpu:1x4"), global_batch=8,
               seq_len=_training.SEQ, top_k=3,
               fixed={"dp_replicate": 1, "pp": 1, "microbatch_size": 1, "param_dtype": "float32"})
    plan, est = r.best
    assert plan.zero == 1 and plan.num_microbatches > 1
    assert est.step_time_s < r.best_by_family["FSDP"][1].step_time_s
    fields = {**{k: v for k, v in plan.to_dict().items() if k not in ("predicted", "version")}, "model": "llama-tiny", "steps": 2}
    (per_rank,) = run_group(4, [("planned", fields)], worker)
    ref = _training.single_process(plan.dp * plan.local_batch(), "llama-tiny")
    for rank, res in enumerate(per_rank):
        assert "error" not in res, f"rank {rank}:\n{res['error']}"
        assert res["losses"] == pytest.approx(ref["losses"][:len(res["losses"])], rel=1e-5), f"rank {rank}"
        # one all-gather and one reduce-scatter per FSDP unit in the step, whatever the micro-batches
        counts = res["counts"]
        assert sum(v for k, v in counts.items() if "reduce_scatter" in k) == res["units"]
