"""Only what applies is offered: a strategy that cannot apply to a model is never searched, `dtorch
plan` lists it with the reason, `--fix` of it is a one-line ConfigError, and the executor refuses
the same plans (`dtorch.parallel.check`), so that no plan the planner ranks is refused at run time.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from dtorch.cluster.load import load_cluster
from dtorch.errors import ConfigError
from dtorch.plan import strategies
from dtorch.plan.explain import explain
from dtorch.plan.profiles import get_profile
from dtorch.plan.search import search

sys.path.insert(0, str(Path(__file__).parent))
USED = ("tp", "cp", "pp", "ep")


def _facts(**kw):
    return dataclasses.replace(get_profile("llama3-8b", 4096), **kw)


def _degrees(result) -> set[tuple[str, int]]:
    plans = [p for p, _ in result.ranked] + [p for p, _ in result.best_by_family.values()]
    return {(a, getattr(p, a)) for p in plans for a in USED if getattr(p, a) > 1}


def test_refused_strategies_are_never_searched_and_are_listed_with_their_reason():
    prof = _facts(tp_roles_reason="block 'h.0': layer 'qkv' has no tensor-parallel role",
                  pipeline_reason="block 'h.1' does not take the output of block 'h.0'")
    cluster = load_cluster("h100:1x8")
    free = _degrees(search(get_profile("llama3-8b", 4096), cluster, global_batch=64))
    assert ("tp", 2) in {(a, 2) for a, d in free if a == "tp"} and any(a == "pp" for a, _ in free)
    result = search(prof, cluster, global_batch=64)
    assert result.ranked
    assert not {a for a, _ in _degrees(result)} & {"tp", "pp"}
    assert set(result.refused) == {"tensor", "pipeline", "expert"}
    text = explain(result)
    assert "not offered for this model:" in text
    assert "tensor (tp)    block 'h.0': layer 'qkv' has no tensor-parallel role" in text
    assert "pipeline (pp)  block 'h.1' does not take the output of block 'h.0'" in text


def test_fixing_a_refused_strategy_is_a_one_line_error_with_the_reason():
    prof = _facts(num_heads=0, num_kv_heads=0, input_kind="other")
    with pytest.raises(ConfigError) as err:
        search(prof, load_cluster("h100:1x8"), global_batch=64, fixed={"tp": 2})
    assert err.value.field == "tp" and "no attention heads found" in err.value.fix and "\n" not in str(err.value)
    with pytest.raises(ConfigError) as err:
        search(prof, load_cluster("h100:1x8"), global_batch=64, fixed={"cp": 2})
    assert err.value.field == "cp" and "not a token sequence" in err.value.fix


def test_a_model_without_attention_plans_data_parallel_and_pipeline_only():
    prof = _facts(num_heads=0, num_kv_heads=0, input_kind="other")
    result = search(prof, load_cluster("h100:1x8"), global_batch=64)
    assert result.ranked and {a for a, _ in _degrees(result)} <= {"pp"}
    assert set(result.refused) == {"tensor", "context", "expert"}


@pytest.mark.parametrize("preset", ["llama3-8b", "gpt2-xl", "qwen3-30b-a3b", "llama3-70b"])
def test_reference_models_keep_every_strategy(preset):
    prof = get_profile(preset, 1024)
    expected = {} if prof.num_experts else {"expert"}
    assert set(strategies.refusals(prof)) == set(expected)


USER_MODELS = {
    # spec: (strategies that must be offered, strategies that must be listed as not offered)
    "_user_cnn:cnn": (set(), {"tensor", "context"}),
    # (no CP: it declares none of the hooks the executor's context parallelism fills)
    "_user_gpt:gpt": ({"pipeline"}, {"context"}),
}


@pytest.mark.parametrize("spec", list(USER_MODELS))
def test_dtorch_plan_lists_what_it_cannot_apply_to_a_user_model(spec, capsys):
    from dtorch.cli import main

    offered, refused = USER_MODELS[spec]
    assert main(["plan", "--model", spec, "--cluster", "cpu:1x2", "--seq-len", "16", "--global-batch", "4"]) == 0
    out = capsys.readouterr().out
    listed = out.split("not offered for this model:")[1] if "not offered for this model:" in out else ""
    names = {line.split()[0] for line in listed.strip().splitlines()}
    assert refused <= names and not offered & names, out
    prof = get_profile(spec, 16)
    for why in strategies.refusals(prof).values():
        assert why in out  # every reason, as the strategy gives it


@pytest.mark.parametrize("spec", list(USER_MODELS))
def test_no_ranked_plan_for_a_user_model_is_refused_by_the_executor(spec):
    """Each ranked candidate through the executor's checks, with the facts read off the model itself
    (not the profile): the rules, the limits and whether each strategy applies."""
    import importlib

    import torch

    from dtorch.parallel.check import check_applies, check_executable, check_plan, model_dims, model_facts

    module_name, _, factory = spec.partition(":")
    module = importlib.import_module(module_name)
    with torch.device("meta"):
        model = getattr(module, factory)()
    example = getattr(module, "example_input", None)
    prof = get_profile(spec, 16)
    result = search(prof, load_cluster("cpu:1x2"), global_batch=4, top_k=10)
    assert result.ranked
    for plan, _ in result.ranked:
        sample = (example()[0][:plan.microbatch_size],) if example else (
            torch.zeros(plan.microbatch_size, 16, dtype=torch.long),)
        check_plan(plan, model_dims(model), seq_len=16 if not example else None, world_size=2)
        check_executable(plan)
        check_applies(plan, model_facts(model, plan, sample, 16))
