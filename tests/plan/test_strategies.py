"""The strategy registry: every Plan field declared once, one set of rules for planner and executor,
the cost model's named terms, and the search's lower bound built from the same terms. About 9 s."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from dtorch.cluster.load import parse_shorthand
from dtorch.errors import ConfigError
from dtorch.plan import strategies
from dtorch.plan.cost import DEFAULT_CONSTANTS, RankShare, compute_time, estimate, step_shape
from dtorch.plan.plan import Plan
from dtorch.plan.profiles import get_profile
from dtorch.plan.search import _bound, _Mesh, check, precisions
from dtorch.plan.strategies import FIELDS, FIX_ALIASES, FIXABLE, MESH_AXES, REGISTRY, Dims
from dtorch.plan.strategies.fsdp import FSDP
from dtorch.plan.strategies.pipeline import ideal_load
from dtorch.plan.strategies.tensor import TENSOR

ROOT = Path(__file__).resolve().parents[2]
INFORMATIONAL = {"model", "cluster", "seq_len", "global_batch", "predicted", "version"}


def test_every_plan_field_is_owned_by_exactly_one_strategy():
    owned = [f.name for s in REGISTRY for f in s.fields]
    assert len(owned) == len(set(owned))
    assert set(owned) | INFORMATIONAL == {f.name for f in dataclasses.fields(Plan)}
    assert MESH_AXES == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    assert set(FIX_ALIASES.values()) <= set(FIXABLE) <= set(FIELDS)


def test_every_strategy_names_an_executor_half_that_exists():
    for s in REGISTRY:
        assert s.executor and importlib.util.find_spec(s.executor) is not None, s.name


def test_the_registry_is_torch_free():
    code = "import sys, dtorch.plan.strategies, dtorch.plan.search; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize(
    "plan, field",
    [
        (Plan(tp=3), "tp"),
        (Plan(pp=8, num_microbatches=8), "pp"),  # 4 blocks
        (Plan(pp=2, virtual_stages=4, schedule="interleaved_1f1b", num_microbatches=4), "virtual_stages"),
        (Plan(pp=2, virtual_stages=2, schedule="zero_bubble", num_microbatches=3), "num_microbatches"),
        (Plan(pp=2, num_microbatches=2, layer_partition=[1, 2]), "layer_partition"),
        (Plan(sp=True), "sp"),
        (Plan(ac="most"), "ac"),
    ],
)
def test_planner_and_executor_run_the_same_rules(plan, field):
    """`search.check` (planner) and `parallel.check.check_plan` (executor) report the same field."""
    from dtorch.parallel.check import ModelDims, check_plan

    prof = get_profile("llama-tiny", 64)  # 4 blocks, 4 heads, 2 kv heads
    with pytest.raises(ConfigError) as planner:
        check(plan, prof, parse_shorthand(f"cpu:{plan.world_size}"))
    with pytest.raises(ConfigError) as executor:
        check_plan(plan, ModelDims(4, 4, 2), seq_len=64, world_size=plan.world_size)
    assert planner.value.field == executor.value.field == field


def test_a_bad_sequence_split_names_the_plan_field_in_the_planner_and_seq_len_in_the_executor():
    plan = Plan(cp=2, tp=2, sp=True)
    dims = dict(num_layers=4, num_heads=4, num_kv_heads=2, seq_len=20)
    with pytest.raises(ConfigError) as planner:
        strategies.check(plan, Dims(**dims, seq_field=None))
    with pytest.raises(ConfigError) as executor:
        strategies.check(plan, Dims(**dims))
    assert (planner.value.field, executor.value.field) == ("cp", "seq_len")
    assert "2*cp*tp = 8" in str(planner.value) and "2*cp*tp = 8" in str(executor.value)


def test_limits_are_what_the_planner_skips_and_the_executor_refuses():
    from dtorch.parallel.check import check_executable

    for plan, field in [(Plan(cp=2, cp_attention="ring", compile=True), "cp_attention"),
                        (Plan(param_dtype="float16"), "param_dtype"),
                        (Plan(pp=2, num_microbatches=2, schedule="zero_bubble", ac="selective"), "schedule")]:
        why = strategies.unsupported(plan)
        with pytest.raises(ConfigError) as err:
            check_executable(plan)
        assert why and err.value.field == field and why in str(err.value)
    assert strategies.unsupported(Plan(dp_shard=2, tp=2, sp=True)) is None
    for tier in ("optimizer", "optimizer_nvme"):  # dtorch.train.offload applies both: one rule set
        assert strategies.unsupported(Plan(offload=tier)) is None
        check_executable(Plan(offload=tier))


def test_family_and_describe_are_composed_from_the_strategies():
    plan = Plan(pp=2, dp_replicate=2, dp_shard=2, cp=2, tp=2, sp=True, num_microbatches=4,
                schedule="interleaved_1f1b", virtual_stages=2, ac="selective", reshard_after_forward=False,
                param_dtype="bfloat16", reduce_dtype="bfloat16", layer_partition=[2, 1, 1, 2])
    assert plan.family() == "HSDPxCPxTP+SPxPP"
    assert plan.describe() == ("pp=2 dp_replicate=2 dp_shard=2 cp=2 tp=2 mb=1x4 interleaved_1f1b(v=2) sp "
                               "ac=selective no-reshard stages=2/1x2/2 bf16/reduce-bf16")
    assert Plan().family() == "single" and Plan(dp_replicate=4).family() == "DDP"


def test_fixed_field_aliases_and_values_come_from_the_field_declarations():
    fixed = strategies.normalize_fixed({"fsdp": "4", "mbs": 2, "dtype": "bf16", "schedule": "zb", "reshard": "off"})
    assert fixed == {"dp_shard": 4, "microbatch_size": 2, "param_dtype": "bfloat16", "schedule": "zero_bubble",
                     "reshard_after_forward": False}
    with pytest.raises(ConfigError, match="float8 training is not implemented"):
        strategies.normalize_fixed({"precision": "fp8"})
    # Megatron's and NeMo's names for the same fields
    megatron = strategies.normalize_fixed({"tensor_parallel": "8", "pipeline_parallel": "4", "vpp": "2",
                                           "context_parallel": "2", "sequence_parallel": "true", "recompute": "off"})
    assert megatron == {"tp": 8, "pp": 4, "virtual_stages": 2, "cp": 2, "sp": True, "ac": "none"}


# ---- the named terms ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def l8():
    return get_profile("llama3-8b", 4096)


def test_compute_term_halves_with_tensor_parallelism(l8):
    cl = parse_shorthand("h100:1x8")
    times = []
    for tp in (1, 2):
        plan = Plan(dp_shard=8 // tp, tp=tp, sp=tp > 1, param_dtype="bfloat16")
        r = RankShare()
        compute_time(step_shape(plan, l8, cl), ideal_load(1, l8.num_layers), r)
        times.append(r.compute)
    assert times[1] > times[0] / 2  # half the work per rank, at a lower GEMM efficiency
    assert times[1] < times[0]


def test_tensor_and_fsdp_terms_are_zero_where_the_strategy_is_off(l8):
    cl = parse_shorthand("h100:1x8")
    off = step_shape(Plan(dp_replicate=8), l8, cl)
    assert not TENSOR.prepare(off) and not FSDP.prepare(off)
    on = step_shape(Plan(dp_shard=4, tp=2, sp=True), l8, cl)
    assert TENSOR.prepare(on) and FSDP.prepare(on)
    load, r = ideal_load(1, l8.num_layers), RankShare()
    TENSOR.rank_time(on, load, r, _counts(on))
    ag, rs = FSDP.comm(on, load, on.p_stage(load))
    ag1, rs1 = FSDP.comm(on, load, on.p_stage(load), unit_latency=False)
    assert r.tp > 0 and ag > ag1 > 0 and rs > rs1 > 0


def _counts(step):
    from dtorch.plan.cost import step_counts

    return step_counts(step.plan, step.profile, step.dev.kind, step.c)


@pytest.mark.parametrize("model, cluster, gb", [("llama3-8b", "h100:2x8", 64), ("llama3-70b", "h100:4x8", 128),
                                                ("gpt2-xl", "a100:1x8", 32), ("llama-tiny", "cpu:4", 8)])
def test_the_search_bound_is_below_every_plan_of_its_mesh(model, cluster, gb):
    """The lower bound (the same terms, optimistic settings) never exceeds the estimate of a plan on
    its mesh, at any micro-batch size: pruning by it cannot lose a better plan."""
    prof, cl = get_profile(model, 1024 if "tiny" not in model else 64), parse_shorthand(cluster)
    group = cl.slowest_group()
    precs, _ = precisions(group, {})
    checked = 0
    for plan in _plans(prof, cl, gb):
        est = estimate(plan, prof, cl)
        mesh = _Mesh(plan.pp, plan.dp_replicate, plan.dp_shard, plan.cp, plan.tp)
        for mbs in (0, plan.microbatch_size):
            assert _bound(mesh, mbs, prof, group, gb, precs, DEFAULT_CONSTANTS) <= est.step_time_s * (1 + 1e-12)
        checked += 1
    assert checked > 20


def _plans(prof, cl, gb):
    W = cl.world_size
    for tp in (1, 2, 4):
        for pp in (1, 2, 4):
            for cp in (1, 2):
                dp = W // (tp * pp * cp)
                if dp < 1 or gb % dp or prof.num_heads % tp or prof.num_kv_heads % tp or pp > prof.num_layers:
                    continue
                for dps in {1, dp}:
                    local = gb // dp
                    for mbs in {1, local}:
                        nmb = local // mbs
                        if pp > 1 and nmb < pp:
                            continue
                        for ac in ("none", "full"):
                            for dtype in ("float32", "bfloat16"):
                                yield Plan(pp=pp, dp_replicate=dp // dps, dp_shard=dps, cp=cp, tp=tp, sp=tp > 1,
                                           microbatch_size=mbs, num_microbatches=nmb, ac=ac, param_dtype=dtype)


def test_estimate_and_search_are_short_compositions_of_named_terms():
    for path, name in [("dtorch/plan/cost.py", "estimate"), ("dtorch/plan/search.py", "search")]:
        tree = ast.parse((ROOT / path).read_text())
        fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
        assert fn.end_lineno - fn.lineno + 1 < 60, (path, name)


def test_the_cluster_layer_never_imports_the_planner():
    """The calibration store and the device-shape model live below the planner (no circle)."""
    for path in (ROOT / "dtorch" / "cluster").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(m.startswith(("dtorch.plan", "dtorch.parallel")) for m in mods), (path.name, mods)


def test_dp_shares_must_give_one_count_per_data_parallel_rank_summing_to_the_global_batch():
    from dtorch.errors import ConfigError
    from dtorch.plan.plan import Plan

    ok = Plan(dp_shard=2, num_microbatches=2, dp_shares=[3, 1]).validate()
    assert ok.describe().endswith("shares=3/1")
    for bad, says in (([3, 3], "must sum to .* = 4"), ([1, 2, 1], "give 2 counts"), ([0, 4], "positive")):
        with pytest.raises(ConfigError, match=says):
            Plan(dp_shard=2, num_microbatches=2, dp_shares=bad).validate()
