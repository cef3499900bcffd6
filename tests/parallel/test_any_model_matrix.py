"""Models DTorch did not write train on every plan the planner offers them, as a plain loop does.

A representative third of `python -m benchmarks.bench_anymodel` (the whole matrix: every model of
benchmarks/zoo.py): a tied nanoGPT with a fused q/k/v projection, a CNN on images with integer
labels, a model with a data-dependent branch and a custom autograd.Function, and transformers'
GPT-2 and Qwen3-MoE built from configs. For each, the planner is asked what it offers at world 2
(as `dtorch.Trainer` asks it), and the auto plan and the best plan of every offered family train
5 AdamW steps in one gloo group; every rank's per-step losses equal the plain single-process
loop's within 1e-5 relative. What is not offered carries a reason.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

SUBSET = ["nanogpt-tied", "cnn", "branchy", "hf-gpt2", "hf-qwen3_moe"]


@pytest.fixture(scope="module")
def matrix() -> dict:
    from benchmarks import bench_anymodel

    return bench_anymodel.run(only=SUBSET, steps=5, log=lambda m: None)


@pytest.mark.parametrize("name", SUBSET)
def test_every_offered_plan_matches_the_plain_loop(matrix: dict, name: str) -> None:
    entry = matrix["cases"][name]
    assert "error" not in entry, entry.get("error")
    assert entry["runs"], "the planner offered nothing"
    assert "auto" in entry["runs"]
    for label, run in entry["runs"].items():
        assert "error" not in run, f"{label}: {run.get('error')}"
        assert run["ranks_agree"], f"{label}: ranks report different losses"
        assert run["rel"] <= 1e-5, f"{label} ({run['plan']}): {run['losses']} vs {entry['reference']}"


def test_what_is_not_offered_says_why(matrix: dict) -> None:
    cnn = matrix["cases"]["cnn"]
    # a CNN has no attention and no column->row pair of linear layers: no TP, no CP
    assert {"tensor", "context"} <= set(cnn["not_offered"]), cnn["not_offered"]
    assert all(isinstance(why, str) and why for why in cnn["not_offered"].values())
    offered = {run["plan"] for run in cnn["runs"].values()}
    assert not any("tp=" in p or "cp=" in p for p in offered), offered


def test_context_parallelism_is_offered_only_where_the_executor_can_install_it(matrix: dict) -> None:
    # nanoGPT attends over token sequences but declares none of the hooks context parallelism fills:
    # the planner must not rank a CP plan the executor would refuse
    nano = matrix["cases"]["nanogpt-tied"]
    assert "hooks" in nano["not_offered"].get("context", ""), nano["not_offered"]
    assert not any("cp=" in run.get("plan", "") for run in nano["runs"].values())
