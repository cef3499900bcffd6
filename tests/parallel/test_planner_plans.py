"""Every plan the planner emits for the reference models on a 4-process CPU cluster runs a step.

The plans come from `dtorch.plan.search.search` (the ranked top plans and the best plan of every
family), in the planner's default bfloat16 mixed precision, so this also exercises FSDP's
MixedPrecisionPolicy and autocast without FSDP. The step's loss must be finite and close to the
float32 single-process loss (bfloat16 rounding, 2%). Plans the executor refuses by design must be
refused with their ConfigError before any process group work: zero-bubble with sequence
parallelism over middle stages (see dtorch/parallel/check.py). CP under pipelines runs.
"""

from __future__ import annotations

import math
import sys
from functools import cache
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _training  # noqa: E402
from _harness import run_group  # noqa: E402

MODELS = ("llama-tiny", "gpt-tiny")
GLOBAL_BATCH = 8


def _planner_plans() -> dict[str, tuple[str, dict]]:
    from dtorch.cluster.load import parse_shorthand
    from dtorch.plan.profiles import get_profile
    from dtorch.plan.search import search

    cluster = parse_shorthand("cpu:1x4")
    out: dict[str, tuple[str, dict]] = {}
    for model in MODELS:
        res = search(get_profile(model, _training.SEQ), cluster, global_batch=GLOBAL_BATCH, seq_len=_training.SEQ)
        for plan, _ in [*res.ranked, *res.best_by_family.values()]:
            d = {k: v for k, v in plan.to_dict().items() if k not in ("predicted", "version")}
            out.setdefault(f"{model} {plan.describe()}", (model, d))
    return out


_BY_NAME = _planner_plans()
PLANS, IDS = list(_BY_NAME.values()), list(_BY_NAME)


def _worker(case: tuple[str, dict], rank: int) -> dict:
    from functools import partial

    from dtorch.errors import ConfigError
    from dtorch.parallel import parallelize
    from dtorch.plan.plan import Plan
    from dtorch.train.losses import next_token

    model, fields = case
    plan = Plan(**fields)
    try:
        pm = parallelize(partial(_training.factory, model), plan, loss_fn=next_token, seq_len=_training.SEQ)
    except ConfigError as e:
        return {"config_error": e.field}
    local = plan.local_batch()
    x, y = _training.batch(0, plan.dp * local)
    rows = slice(pm.dp_rank * local, (pm.dp_rank + 1) * local)
    return {"loss": float(pm.forward_backward(x[rows], y[rows]))}


@pytest.fixture(scope="module")
def results() -> list:
    return run_group(4, PLANS, _worker)


@cache
def _reference_first_loss(model: str) -> float:
    return _training.single_process(GLOBAL_BATCH, model)["losses"][0]


def test_planner_emits_several_families_for_the_reference_models() -> None:
    assert len(PLANS) >= 10


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(PLANS)), ids=IDS)
def test_planner_plan_runs_one_training_step(results: list, index: int) -> None:
    model, fields = PLANS[index]
    for r, res in enumerate(results[index]):
        assert "error" not in res, f"rank {r} {fields}:\n{res['error']}"
        if fields["schedule"] == "zero_bubble" and fields["sp"] and fields["pp"] * fields["virtual_stages"] > 2:
            assert res == {"config_error": "schedule"}
            continue
        assert math.isfinite(res["loss"])
        assert res["loss"] == pytest.approx(_reference_first_loss(model), rel=2e-2)
