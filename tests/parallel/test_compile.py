"""torch.compile per block (dtorch/parallel/compile.py): applied where the plan says, refused where
it cannot run, numerically the eager model, and its cost reported and recorded.

The plan's `compile` field is declared by the planner's strategy (dtorch/plan/strategies/compile.py)
and read by the executor with getattr. Compiling takes tens of
seconds on this CPU (Inductor generates and builds C++), so the compiled runs are marked slow and
use 2-layer models; everything else here is fast.
"""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import _training  # noqa: E402
from _harness import run_group  # noqa: E402

from dtorch.errors import ConfigError  # noqa: E402
from dtorch.parallel import compile as pc  # noqa: E402
from dtorch.plan.plan import Plan  # noqa: E402
from dtorch.train.losses import next_token  # noqa: E402

TINY = "llama-tiny:layers=2,heads=8,kv_heads=4"
REL = 1e-5


def _plan(**fields) -> Plan:
    return Plan(compile=True, **fields)


# ---- fast: refusals, names, the record ---------------------------------------------------------------
def test_dropout_under_tensor_parallelism_is_refused_before_any_process_group() -> None:
    from dtorch.parallel import parallelize

    with pytest.raises(ConfigError) as e:
        parallelize(partial(_training.factory, "gpt-tiny:dropout=0.1"), _plan(tp=2), loss_fn=next_token)
    assert e.value.field == "compile" and "dropout" in str(e.value)
    assert not dist.is_initialized()


def test_checkpointed_tensor_parallel_blocks_are_refused() -> None:
    with pytest.raises(ConfigError, match="ac=none"):
        pc.check_compile(_plan(tp=2, ac="full"), _training.factory(TINY), "cpu")
    pc.check_compile(_plan(dp_shard=2, ac="selective"), _training.factory(TINY), "cpu")


def test_the_dry_run_names_what_compile_refuses() -> None:
    from dtorch.parallel.dryrun import verify

    res = verify(_plan(tp=2, ac="full"), "llama-tiny:layers=2", 16)
    assert "compile" in res["not_executable_because"] and "ac=none" in res["not_executable_because"]
    assert verify(_plan(dp_shard=2), "llama-tiny:layers=2", 16)["not_executable_because"] is None


def test_a_missing_cpu_compiler_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(ConfigError, match="C\\+\\+ compiler"):
        pc.check_compile(_plan(), _training.factory(TINY), "cpu")
    pc.check_compile(Plan(), _training.factory(TINY), "cpu")  # not compiling: nothing to check


def test_every_block_is_compiled_and_names_stay_those_of_the_model() -> None:
    from torch._dynamo.eval_frame import OptimizedModule

    from dtorch.parallel.ac import apply_ac
    from dtorch.parallel.materialize import clean_name

    with torch.device("meta"):
        model = _training.factory(TINY)
    names = [n for n, _ in model.named_parameters()]
    apply_ac(model, "full")
    assert pc.apply_compile(model) == 2
    assert all(isinstance(b, OptimizedModule) for b in model.layers.values())
    assert all(pc.fullgraph_for(b._orig_mod) for b in model.layers.values())  # reference model: fullgraph
    assert [clean_name(n) for n, _ in model.named_parameters()] == names


def test_first_step_cost() -> None:
    assert pc.first_step_cost([30.0, 0.5, 0.7, 0.6]) == {
        "seconds": 29.4, "first_step_s": 30.0, "steady_step_s": 0.6, "steps_measured": 4}
    assert pc.first_step_cost([12.0])["seconds"] == 12.0


def test_measurement_is_recorded_in_the_cluster_calibration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dtorch.cluster.probe import stored_calibration, write_calibration

    monkeypatch.setenv("DTORCH_CALIBRATION_DIR", str(tmp_path))
    monkeypatch.delenv("DTORCH_NO_CALIBRATION", raising=False)
    probe = {"version": 1, "cluster": "local:1x2", "device": {"matmul_efficiency": 0.5}, "links": {}}
    write_calibration(probe, tmp_path / "local_1x2.json")
    pc.record_measurement("local:1x2", {"family": "FSDP", "eager_step_s": 0.2, "compiled_step_s": 0.1, "compile_s": 30})
    pc.record_measurement("local:1x2", {"family": "TP", "eager_step_s": 0.3, "compiled_step_s": 0.4, "compile_s": 50})
    doc = stored_calibration("local:1x2")
    assert doc["device"] == probe["device"]  # the probe's numbers are kept
    sec = doc["compile"]
    assert sec["samples"] == 2 and [m["speedup"] for m in sec["measurements"]] == pytest.approx([2.0, 0.75])
    assert sec["by_family"]["FSDP"] == {"speedup": 2.0, "compile_s": 30, "samples": 1}
    assert sec["by_family"]["TP"]["speedup"] == pytest.approx(0.75) and sec["compile_s"] == 40
    with pytest.raises(ConfigError):
        pc.record_measurement("local:1x2", {"family": "TP", "eager_step_s": 0, "compiled_step_s": 1, "compile_s": 1})


# ---- slow: numerics at world 2, the trainer's report ----------------------------------------------
CASES = {
    "fsdp": dict(dp_shard=2, microbatch_size=2),
    "tp": dict(tp=2, microbatch_size=4),
    "tp_sp": dict(tp=2, sp=True, microbatch_size=4),
}


def _train(case: tuple[str, dict, bool], rank: int) -> dict:
    from torch._dynamo.eval_frame import OptimizedModule

    from dtorch.model.structure import find_blocks
    from dtorch.parallel import parallelize

    _, fields, compiled = case
    plan = Plan(compile=compiled, **fields)
    pm = parallelize(partial(_training.factory, TINY), plan, loss_fn=next_token, seed=0, seq_len=_training.SEQ)
    blocks = list(find_blocks(pm.model_parts[0])[1].values())
    opt = torch.optim.AdamW(list(pm.parameters()), lr=_training.LR, foreach=False)
    local = plan.local_batch()
    losses, norms = [], []
    for step in range(4):
        x, y = _training.batch(step, plan.dp * local)
        rows = slice(pm.dp_rank * local, (pm.dp_rank + 1) * local)
        losses.append(float(pm.forward_backward(x[rows], y[rows])))
        norms.append(float(pm.clip_grad_norm_(1e9)))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "norms": norms, "compiled": [isinstance(b, OptimizedModule) for b in blocks],
            "keys": sorted(pm.state_dict_for_checkpoint())}


@pytest.fixture(scope="module")
def world2() -> dict:
    cases = [(name, fields, compiled) for name, fields in CASES.items() for compiled in (False, True)]
    return dict(zip([(n, c) for n, _, c in cases], run_group(2, cases, _train)))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_compiled_steps_match_eager_at_world_2(world2: dict, name: str) -> None:
    eager, compiled = world2[(name, False)], world2[(name, True)]
    for r, res in enumerate(eager + compiled):
        assert "error" not in res, f"{name} rank {r % 2}:\n{res['error']}"
    for e, c in zip(eager, compiled):
        assert c["compiled"] == [True, True] and e["compiled"] == [False, False]
        assert c["losses"] == pytest.approx(e["losses"], rel=REL)
        assert c["norms"] == pytest.approx(e["norms"], rel=1e-4)
        assert c["keys"] == e["keys"]  # checkpoints keep the model's names


@pytest.mark.slow
def test_trainer_reports_compile_time_and_its_checkpoint_resumes_eager(tmp_path: Path) -> None:
    from dtorch.train.optim import Constant
    from dtorch.train.trainer import Trainer

    data = [torch.randint(0, 256, (_training.SEQ + 1,), generator=torch.Generator().manual_seed(i)) for i in range(64)]

    def trainer(plan: Plan, run: str, **kw) -> Trainer:
        return Trainer(model=partial(_training.factory, TINY), data=data, global_batch=2, seq_len=_training.SEQ,
                       plan=plan, lr_schedule=Constant(), checkpoint_dir=str(tmp_path / run), checkpoint_every=100,
                       console=False, **kw)

    # (tracing collectives runs without torch's CommDebugMode under compile: monitor/live.py)
    # the plan as a document carries it (a saved plan file with "compile": true)
    plan = Plan.from_dict(Plan(microbatch_size=2, compile=True).to_dict())
    got = trainer(plan, "a", trace_comms=True).fit(3)
    assert got.compile_s is not None and got.compile_s > 0
    events = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    (ev,) = [e for e in events if e.get("event") == "compile"]
    assert ev["seconds"] == pytest.approx(got.compile_s) and ev["first_step_s"] > ev["steady_step_s"] > 0
    # the compiled run's checkpoint resumes in an eager run as if it had been eager all along
    import shutil

    shutil.copytree(tmp_path / "a", tmp_path / "b")
    resumed = trainer(Plan(microbatch_size=2), "b").fit(4)
    straight = trainer(Plan(microbatch_size=2), "c").fit(4)
    assert resumed.resumed_from == 3 and resumed.compile_s is None
    assert resumed.losses[4] == pytest.approx(straight.losses[4], rel=REL)
