"""The planner's memory per category against what torch measures, on models DTorch did not write.

test_memory_categories.py checks the model on DTorch's own Llama and MoE; here the same
measurement (`_memory_worker`'s MemTracker machinery, through `_memory_user_worker`) runs on the
user's models, built by the user-model path (`parallelize` of the user's factory and loss) and
predicted from the user-model profile (`dtorch.model.profile` of the factory spec, measured on
fake tensors):

- transformers' GPT2LMHeadModel from a tiny config (tied embedding and head, dropout, Conv1D),
- transformers' LlamaForCausalLM from a tiny config (GQA, SwiGLU, RMSNorm, RoPE),
- a hand-written CNN classifier with its own names and an image input (`_user_cnn:cnn`).

Every family the planner offers for these models at world 2 (and four at world 4) runs one
steady-state step in one gloo group per world size; the fullest rank's peak and its composition
are held to `estimate(...).memory_breakdown` within 5 % per category (a category under 2 % of the
peak against that floor), as in test_memory_categories. The strategies the planner does not offer
for them (context parallelism; tensor parallelism for the CNN) are checked to be refused by the
planner and the executor alike, not measured. Marked slow, with the multi-process tests.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))
sys.path.insert(0, str(Path(__file__).parent))
from _memory_user_worker import measure  # noqa: E402
from _memory_worker import CATEGORIES, SEQ, memory_table  # noqa: E402

pytestmark = pytest.mark.slow  # two process groups (scripts/test.sh runs them with the multi-process tests)

GPT2 = "_memory_user_worker:gpt2"
LLAMA = "_memory_user_worker:llama"
CNN = "_user_cnn:cnn"
TOLERANCE = 0.05
NOISE = 0.02
"""As test_memory_categories: a category under 2 % of the rank's peak is judged against that floor."""

WORLD2 = {
    "gpt2 DDP": (GPT2, dict(dp_replicate=2, microbatch_size=2)),
    "gpt2 FSDP": (GPT2, dict(dp_shard=2, microbatch_size=2)),
    "gpt2 FSDP ac=selective": (GPT2, dict(dp_shard=2, microbatch_size=2, ac="selective")),
    "gpt2 FSDP ac=full": (GPT2, dict(dp_shard=2, microbatch_size=2, ac="full")),
    "gpt2 TP": (GPT2, dict(tp=2, microbatch_size=2)),
    "gpt2 TP+SP": (GPT2, dict(tp=2, sp=True, microbatch_size=2)),
    "gpt2 PP 1f1b": (GPT2, dict(pp=2, microbatch_size=2, num_microbatches=2)),
    "llama DDP": (LLAMA, dict(dp_replicate=2, microbatch_size=2)),
    "llama FSDP": (LLAMA, dict(dp_shard=2, microbatch_size=2)),
    "llama FSDP no-reshard": (LLAMA, dict(dp_shard=2, microbatch_size=2, reshard_after_forward=False)),
    "llama FSDP ac=selective": (LLAMA, dict(dp_shard=2, microbatch_size=2, ac="selective")),
    "llama FSDP ac=full": (LLAMA, dict(dp_shard=2, microbatch_size=2, ac="full")),
    "llama TP": (LLAMA, dict(tp=2, microbatch_size=2)),
    "llama TP+SP": (LLAMA, dict(tp=2, sp=True, microbatch_size=2)),
    "llama TP ac=selective": (LLAMA, dict(tp=2, microbatch_size=2, ac="selective")),
    "llama PP 1f1b": (LLAMA, dict(pp=2, microbatch_size=2, num_microbatches=2)),
    "llama PP gpipe": (LLAMA, dict(pp=2, schedule="gpipe", microbatch_size=2, num_microbatches=2)),
    "llama ZeRO-1": (LLAMA, dict(dp_shard=2, zero=1, microbatch_size=2, num_microbatches=2)),
    "llama bf16 FSDP": (LLAMA, dict(dp_shard=2, microbatch_size=2, param_dtype="bfloat16")),
    "cnn DDP": (CNN, dict(dp_replicate=2, microbatch_size=16)),
    "cnn FSDP": (CNN, dict(dp_shard=2, microbatch_size=16)),
    "cnn FSDP ac=full": (CNN, dict(dp_shard=2, microbatch_size=16, ac="full")),
    "cnn PP 1f1b": (CNN, dict(pp=2, microbatch_size=16, num_microbatches=2)),
}
WORLD4 = {
    "llama FSDP+TP": (LLAMA, dict(dp_shard=2, tp=2, microbatch_size=2)),
    "gpt2 DDP+PP": (GPT2, dict(dp_replicate=2, pp=2, microbatch_size=2, num_microbatches=2)),
    "llama HSDP": (LLAMA, dict(dp_replicate=2, dp_shard=2, microbatch_size=2)),
    "cnn FSDP+PP": (CNN, dict(dp_shard=2, pp=2, microbatch_size=16, num_microbatches=2)),
}
REFUSED = {
    # spec: the strategies the planner does not offer (`strategies.refusals`), by the plan field
    GPT2: {"context": "cp", "expert": "ep"},
    LLAMA: {"context": "cp", "expert": "ep"},
    CNN: {"context": "cp", "expert": "ep", "tensor": "tp"},
}


def _profile(spec: str):
    from dtorch.model import profile

    return profile(spec, SEQ)


def _predict(spec: str, fields: dict, world: int) -> dict:
    from dtorch.cluster.load import parse_shorthand
    from dtorch.plan.cost import estimate
    from dtorch.plan.plan import Plan

    est = estimate(Plan(**fields), _profile(spec), parse_shorthand(f"cpu:1x{world}"))
    out = {c: int(est.memory_breakdown.get(c, 0)) for c in CATEGORIES}
    out["peak"] = sum(out.values())
    return out


@pytest.fixture(scope="module")
def table() -> dict:
    """{family: (world, predicted, measured on the fullest rank)}."""
    return memory_table([(2, WORLD2), (4, WORLD4)], measure, _predict)


KNOWN: dict[str, str] = {
    # what the model still misses on these models, measured (`table` prints every figure); strict: a
    # fix must say so
}
FAMILIES = [pytest.param(f, marks=pytest.mark.xfail(strict=True, reason=KNOWN[f])) if f in KNOWN else f
            for f in (*WORLD2, *WORLD4)]


@pytest.mark.parametrize("family", FAMILIES)
def test_user_model_memory_per_category_and_peak_within_tolerance(family, table):
    if family not in table:
        pytest.skip(f"{family}: its plan fields are not in this checkout")
    world, pred, meas = table[family]
    assert pred is not None, f"{family} (world {world}) did not run: {meas}"
    off = {c: (pred[c], meas[c]) for c in (*CATEGORIES, "peak")
           if abs(pred[c] - meas[c]) > max(TOLERANCE * meas[c], NOISE * meas["peak"])}
    assert not off, f"{family} (world {world}): predicted vs measured bytes off by more than 5 %: {off}"


@pytest.mark.parametrize("spec", list(REFUSED))
def test_families_not_measured_are_not_offered_and_refused_by_the_executor(spec):
    """The strategies left out above: the planner lists them as not offered, never ranks a plan
    using them at world 2, and the executor refuses such a plan before any process group."""
    import importlib

    import torch

    from dtorch.cluster.load import parse_shorthand
    from dtorch.errors import ConfigError
    from dtorch.parallel.check import check_applies, model_facts
    from dtorch.plan import strategies
    from dtorch.plan.plan import Plan
    from dtorch.plan.search import search

    prof = _profile(spec)
    refused = REFUSED[spec]
    assert set(strategies.refusals(prof)) == set(refused)
    result = search(prof, parse_shorthand("cpu:1x2"), global_batch=4, top_k=10)
    assert result.ranked
    for plan, _ in result.ranked:
        assert all(getattr(plan, f) == 1 for f in refused.values()), plan.describe()
    module, _, name = spec.partition(":")
    mod = importlib.import_module(module)
    with torch.device("meta"):
        model = getattr(mod, name)()
    example = getattr(mod, "example_input", None)
    for field in refused.values():
        if field == "ep":
            continue  # (a dense model: expert parallelism has no experts to spread, a plan rule)
        plan = Plan(**{field: 2})
        sample = (example()[0][:1],) if example else (torch.zeros(1, SEQ, dtype=torch.long),)
        with pytest.raises(ConfigError) as err:
            check_applies(plan, model_facts(model, plan, sample, None if example else SEQ))
        assert err.value.field == field
