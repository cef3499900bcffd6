"""Every plan the planner emits for the tiny MoE on a 4-process CPU cluster runs a step.

The plans are `dtorch.plan.search.search`'s for `moe-tiny` on `cpu:1x4` (the ranked top plans and
the best plan of every family, expert parallelism among them), plus the best plan with ep fixed to
each value the planner allows (`--fix ep=2`, `--fix ep=4`) and the plans of `--fix tp=2`, so that `parallelize()` is seen to
honour `plan.ep`. Each runs one forward/backward through `parallelize()` in one group of 4 gloo
processes; the loss must be finite and within 2% of the float32 single-process loss (bfloat16
rounding). Then, through the same `parallelize()` path in float32, 5 AdamW steps of EP (ep=2, ep=4,
ep=2 with full AC, ep=2 with 2 accumulated micro-batches) with FSDP over the 4 ranks, and EP x TP
(dp_shard=2 x tp=2, ep=2) on moe-tiny and deepseek-tiny (its latent attention split by heads), and
EP x PP (pp=2 x dp_shard=2, ep=2, 1F1B, zero-bubble; interleaved with 2 stages per rank), and EP
with replicas (HSDP 2x2 with ep=2, DDP over 4 with ep=2 and 2 micro-batches, DDP x PP zero-bubble),
and ZeRO with EP (ZeRO-2 over 4; ZeRO-1 x PP, 1F1B and zero-bubble; ZeRO-1 and ZeRO-2 x TP), DDP x TP x EP,
give
per-step losses within 1e-5 relative, and
gradient norms (`clip_grad_norm_` over the EP-sharded DTensors) within 1e-4, of one process on the
global batch; the estimated model-state bytes of the EP plans equal the ranks' local shards (within 2 %).
About 70 s wall on the shared 2-core machine (one group of 4 processes for all cases).
"""

from __future__ import annotations

import math
import multiprocessing
import sys
from functools import cache
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _training  # noqa: E402
from _harness import run_group  # noqa: E402

MODEL = "moe-tiny"
GLOBAL_BATCH = 8


def _planner_plans() -> dict[str, dict]:
    from dtorch.cluster.load import parse_shorthand
    from dtorch.plan.profiles import get_profile
    from dtorch.plan.search import search

    cluster = parse_shorthand("cpu:1x4")
    prof = get_profile(MODEL, _training.SEQ)
    out: dict[str, dict] = {}
    results = [search(prof, cluster, global_batch=GLOBAL_BATCH, seq_len=_training.SEQ)]
    results += [search(prof, cluster, global_batch=GLOBAL_BATCH, seq_len=_training.SEQ, fixed={"ep": ep}, top_k=1)
                for ep in (2, 4)]
    # tensor parallelism of a MoE is searched when tp is fixed (expert-tensor parallelism)
    results += [search(prof, cluster, global_batch=GLOBAL_BATCH, seq_len=_training.SEQ, fixed={"tp": 2})]
    for res in results:
        for plan, _ in [*res.ranked, *res.best_by_family.values()]:
            d = {k: v for k, v in plan.to_dict().items() if k not in ("predicted", "version")}
            out.setdefault(plan.describe(), d)
    return out


# The group's processes import this module for `_worker`: only the test process plans (4 searches).
_BY_NAME = _planner_plans() if multiprocessing.parent_process() is None else {}
PLANS, IDS = list(_BY_NAME.values()), list(_BY_NAME)
EXACT = {
    "fsdp4_ep2": dict(dp_shard=4, ep=2, microbatch_size=2),
    "fsdp4_ep4": dict(dp_shard=4, ep=4, microbatch_size=2),
    "fsdp4_ep2_ac_full": dict(dp_shard=4, ep=2, ac="full", microbatch_size=2),
    # gradient accumulation: the balance loss's gradient is divided by m like the LM loss's
    "fsdp4_ep2_2mb": dict(dp_shard=4, ep=2, microbatch_size=1, num_microbatches=2),
    # EP x TP: experts split over ep=2 data-parallel ranks and their hidden units over tp=2, the
    # rest FSDP over dp=2 x TP (dtorch.parallel.expert, "expert-tensor parallelism")
    "fsdp2_tp2_ep2": dict(dp_shard=2, tp=2, ep=2, microbatch_size=4),
    "fsdp2_tp2_ep2_deepseek": dict(model="deepseek-tiny", dp_shard=2, tp=2, ep=2, microbatch_size=4),
    "fsdp2_tp2_deepseek": dict(model="deepseek-tiny", dp_shard=2, tp=2, microbatch_size=4),
    # EP x PP: each pipeline stage's experts over its own 2 data-parallel ranks
    "pp2_fsdp2_ep2_1f1b": dict(pp=2, dp_shard=2, ep=2, microbatch_size=2, num_microbatches=2, schedule="1f1b"),
    # zero-bubble's split backward (input, then weight gradients): FSDP must keep the stage gathered
    "pp2_fsdp2_ep2_zero_bubble": dict(pp=2, dp_shard=2, ep=2, microbatch_size=2, num_microbatches=2,
                                      schedule="zero_bubble", reshard_after_forward=False),
    # EP with replicas (dtorch.parallel.expert.expert_mesh): experts replicated over the replicas the
    # ep group does not span, HSDP (HSDP's shard group of one rank: the DDP plans) for the rest
    "hsdp2x2_ep2": dict(dp_replicate=2, dp_shard=2, ep=2, microbatch_size=2),  # ep inside a replica
    "ddp4_ep2_2mb": dict(dp_replicate=4, ep=2, microbatch_size=1, num_microbatches=2),  # ep over 2 replicas
    "pp2_ddp2_ep2_zero_bubble": dict(pp=2, dp_replicate=2, ep=2, microbatch_size=2, num_microbatches=2,
                                     schedule="zero_bubble"),
    "pp2v2_fsdp2_ep2_interleaved": dict(model="moe-tiny:layers=4", pp=2, dp_shard=2, ep=2, microbatch_size=2,
                                        num_microbatches=2, schedule="interleaved_1f1b", virtual_stages=2),
    # ZeRO (dtorch.parallel.zero) with EP, the combinations the planner offers: optimizer states (and
    # with ZeRO-2 gradients) sharded over the data-parallel ranks, the experts over ep
    "fsdp4_ep2_zero2": dict(dp_shard=4, ep=2, zero=2, microbatch_size=2),
    "pp2_fsdp2_ep2_zero1_1f1b": dict(pp=2, dp_shard=2, ep=2, zero=1, microbatch_size=2, num_microbatches=2,
                                     schedule="1f1b"),
    "pp2_fsdp2_ep2_zero1_zero_bubble": dict(pp=2, dp_shard=2, ep=2, zero=1, microbatch_size=2, num_microbatches=2,
                                            schedule="zero_bubble", reshard_after_forward=False),
    "fsdp2_tp2_ep2_zero1": dict(dp_shard=2, tp=2, ep=2, zero=1, microbatch_size=2, num_microbatches=2),
    "fsdp2_tp2_ep2_zero2": dict(dp_shard=2, tp=2, ep=2, zero=2, microbatch_size=2, num_microbatches=2),
    "ddp2_tp2_ep2": dict(dp_replicate=2, tp=2, ep=2, microbatch_size=4),  # EP over the 2 replicas, TP inside
}


def _worker(case: tuple[str, dict], rank: int) -> dict:
    kind, fields = case
    if kind == "exact":
        return _training.parallel({"model": MODEL} | fields, rank)
    return _one_step(fields)


def _one_step(fields: dict) -> dict:
    from functools import partial

    from dtorch.parallel import parallelize
    from dtorch.plan.plan import Plan
    from dtorch.train.losses import next_token

    plan = Plan(**fields)
    pm = parallelize(partial(_training.factory, MODEL), plan, loss_fn=next_token, seq_len=_training.SEQ)
    local = plan.local_batch()
    x, y = _training.batch(0, plan.dp * local)
    rows = slice(pm.dp_rank * local, (pm.dp_rank + 1) * local)
    experts = [m for part in pm.model_parts for m in part.modules() if hasattr(type(m), "dispatcher")]
    return {"loss": float(pm.forward_backward(x[rows], y[rows])),
            "ep_dispatch": max([m.dispatcher.keywords["ep"] for m in experts if m.dispatcher is not None] or [1]),
            "tp_experts": any(m.dispatcher is not None and m.dispatcher.keywords["tp_group"] is not None
                              for m in experts)}


@pytest.fixture(scope="module")
def results() -> list:
    return run_group(4, [("step", p) for p in PLANS] + [("exact", p) for p in EXACT.values()], _worker)


@cache
def _reference(model: str = MODEL) -> dict:
    return _training.single_process(GLOBAL_BATCH, model)


def _reference_first_loss() -> float:
    return _reference()["losses"][0]


def test_planner_emits_expert_parallel_plans_for_the_moe() -> None:
    assert any(p["ep"] > 1 for p in PLANS)
    assert {p["ep"] for p in PLANS} >= {1, 2, 4}


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(PLANS)), ids=IDS)
def test_moe_planner_plan_runs_one_training_step(results: list, index: int) -> None:
    fields = PLANS[index]
    for r, res in enumerate(results[index]):
        assert "error" not in res, f"rank {r} {fields}:\n{res['error']}"
        assert res["ep_dispatch"] == fields["ep"]  # plan.ep honoured: the all-to-all dispatcher over ep ranks
        assert res["tp_experts"] == (fields["tp"] > 1)  # and plan.tp: the experts' hidden units split
        assert math.isfinite(res["loss"])
        assert res["loss"] == pytest.approx(_reference_first_loss(), rel=2e-2)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hsdp2x2_ep2", "ddp4_ep2_2mb", "pp2_ddp2_ep2_zero_bubble", "fsdp4_ep2"])
def test_estimated_model_states_of_ep_plans_match_the_ranks_measured_ones(results: list, name: str) -> None:
    """The cost model's parameter, gradient and AdamW bytes per rank (`model_state_bytes`, the fullest
    rank) against the local shards the ranks hold after their last step: with replicas each rank holds
    1/ep of the routed experts (DDP x EP: the other weights whole)."""
    from dtorch.plan.cost import model_state_bytes
    from dtorch.plan.plan import Plan
    from dtorch.plan.profiles import get_profile

    fields = dict(EXACT[name])
    plan = Plan(**{k: v for k, v in fields.items() if k != "model"})
    est = model_state_bytes(plan, get_profile(fields.get("model", MODEL), _training.SEQ))
    ranks = results[len(PLANS) + list(EXACT).index(name)]
    assert all("error" not in r for r in ranks)
    got = max((r["state_bytes"] for r in ranks), key=lambda b: sum(b.values()))
    assert got["params"] == pytest.approx(est["params"], rel=0.02)
    assert got["optimizer"] == pytest.approx(est["optimizer"], rel=0.02)
    if plan.pp == 1:  # (under PP the estimate adds the unsharded gradients the step accumulates)
        assert got["grads"] == pytest.approx(est["grads"], rel=0.02)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EXACT))
def test_expert_parallel_plans_match_one_process_in_float32(results: list, name: str) -> None:
    ref = _reference(EXACT[name].get("model", MODEL))
    for r, res in enumerate(results[len(PLANS) + list(EXACT).index(name)]):
        assert "error" not in res, f"rank {r}:\n{res['error']}"
        assert res["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        assert res["norms"] == pytest.approx(ref["norms"], rel=1e-4)
