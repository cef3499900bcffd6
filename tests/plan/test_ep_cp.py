"""Expert parallelism with context parallelism is refused everywhere, with its reason.

Under cp each rank computes a MoE's sequence-wise balance loss on its own chunk of each sequence, so
ep x cp is not loss-equivalent to one process (`dtorch.plan.strategies.expert.EP_WITH_CP` has the
measurement). The planner never ranks it and says why under "why not", `--fix ep=..,cp=..` is a
one-line ConfigError (not a what-if with a note), and the executor and `dtorch train` refuse it
before any process group exists. About 10 s (two `dtorch train` subprocesses).
"""

from __future__ import annotations

import os
import subprocess
import sys
from functools import partial

import pytest

from dtorch.cli import main
from dtorch.cluster.load import parse_shorthand
from dtorch.errors import ConfigError
from dtorch.plan.explain import explain
from dtorch.plan.plan import Plan
from dtorch.plan.profiles import get_profile
from dtorch.plan.search import search
from dtorch.plan.strategies.expert import EP_WITH_CP

MODEL, CLUSTER, SEQ, BATCH = "moe-tiny", "cpu:1x4", 128, 16


def _search(**fixed):
    return search(get_profile(MODEL, SEQ), parse_shorthand(CLUSTER), global_batch=BATCH, fixed=fixed or None)


def _plans(result) -> list[Plan]:
    return [p for p, _ in result.ranked] + [p for p, _ in result.best_by_family.values()]


@pytest.mark.parametrize("fixed", [{"ep": 2, "cp": 2}, {"ep": 4, "cp": 4}, {"ep": 2, "cp": 2, "dp_shard": 2},
                                   {"ep": 2, "cp": 2, "pp": 1, "dp_replicate": 2}])
def test_fixing_ep_with_cp_is_a_one_line_error_naming_ep(fixed):
    with pytest.raises(ConfigError) as err:
        _search(**fixed)
    assert err.value.field == "ep" and err.value.value == fixed["ep"]
    assert "context parallelism" in str(err.value) and "balance loss" in str(err.value)
    assert "use ep=1, or cp=1" in str(err.value) and "\n" not in str(err.value)


def test_dtorch_plan_fix_ep_cp_exits_2_with_one_line(capsys):
    args = ["plan", "--model", MODEL, "--cluster", CLUSTER, "--seq-len", str(SEQ), "--global-batch", str(BATCH)]
    assert main([*args, "--fix", "ep=2,cp=2"]) == 2
    out = capsys.readouterr()
    err = out.err.strip()
    assert out.out == "" and len(err.splitlines()) == 1
    assert err.startswith("dtorch plan: error: ep=2:") and "context parallelism" in err and "cp=1" in err
    assert main([*args, "--fix", "ep=2"]) == 0  # each alone plans
    assert main([*args, "--fix", "cp=2"]) == 0


@pytest.mark.parametrize("fixed", [{}, {"cp": 2}, {"ep": 2}])
def test_the_search_never_ranks_ep_with_cp_and_says_why(fixed):
    result = _search(**fixed)
    plans = _plans(result)
    assert plans and not any(p.ep > 1 and p.cp > 1 for p in plans)
    if not fixed:  # both are searched apart, so leaving out their product is a choice to be explained
        assert any(p.ep > 1 for p in plans) and any(p.cp > 1 for p in plans)
    assert result.rejected["any EPxCP"] == f"not searched: cannot run here: {EP_WITH_CP}"
    assert "any EPxCP" in explain(result) and "balance loss" in explain(result)


def test_dense_model_searches_say_nothing_of_ep_with_cp():
    result = search(get_profile("llama-tiny", SEQ), parse_shorthand(CLUSTER), global_batch=BATCH)
    assert any(p.cp > 1 for p in _plans(result)) and "any EPxCP" not in result.rejected


def test_the_executor_refuses_ep_with_cp_before_any_process_group():
    import torch.distributed as dist

    from dtorch.models import build_model
    from dtorch.parallel import parallelize
    from dtorch.train.losses import next_token

    plan = Plan(dp_shard=2, cp=2, ep=2, microbatch_size=2)
    with pytest.raises(ConfigError) as err:
        parallelize(partial(build_model, MODEL), plan, loss_fn=next_token, seq_len=16)
    assert err.value.field == "ep" and "context parallelism" in err.value.fix
    assert not dist.is_initialized()


@pytest.mark.parametrize("given", ["fields", "file"])
def test_dtorch_train_refuses_ep_with_cp_up_front(tmp_path, given):
    """`--plan ep=2,cp=2` (fields the search would fix) and a whole plan file alike: one line, exit 2,
    before any worker starts."""
    plan = "ep=2,cp=2"
    if given == "file":
        plan = str(tmp_path / "plan.json")
        Plan(dp_shard=2, cp=2, ep=2, microbatch_size=8).save(plan)
    cli = [sys.executable, "-c", "import sys; from dtorch.cli import main; sys.exit(main())"]
    args = ["train", "--model", MODEL, "--nproc", "4", "--plan", plan, "--steps", "3", "--no-progress",
            "--checkpoint-dir", str(tmp_path / "ckpt")]
    p = subprocess.run([*cli, *args], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [x for x in (p.stdout + p.stderr).splitlines() if x.strip()]
    assert p.returncode == 2 and len(lines) == 1, lines
    assert lines[0].startswith("dtorch train: error: ep=2:") and "context parallelism" in lines[0]
    assert not (tmp_path / "ckpt").exists()  # no worker started, nothing written
