"""The planner's memory per category against what torch measures, for every plan family.

One group of 2 and one of 4 gloo processes (the forkserver harness of tests/parallel) run one
steady-state training step (the second, the third under DDP: optimizer states exist, gradients
were zeroed to None, DDP has rebuilt its buckets) of every plan family on a tiny model, under
torch's `MemTracker` (`torch.distributed._tools.mem_tracker`), which attributes every tensor
storage to a category on any device. What is compared is the rank's peak and its composition at
that moment (MemTracker's peak snapshot), the fullest rank of the plan against the estimate's
`memory_breakdown`:

  params      PARAM: the rank's parameters, sharded masters and unsharded (gathered) copies alike
              (also those of an FSDP unit that holds its parameters itself, the routed experts:
              `_StepTracker` names them at the unit's forward, where MemTracker saw only the shards)
  grads       GRAD: gradients alive at the peak
  optimizer   OPT: AdamW's moments (and step counters)
  activations ACT + TEMP: what the forward saved and the backward's working tensors at the peak
              (MemTracker, a dispatch mode, makes autograd sum gradients out of place: in the
              routed experts' backward one stacked weight's gradient more than the executor holds,
              which the model leaves out, 2 % of EP's activations here)
  buffers     BUFFER: module buffers (RoPE tables), plus DDP's gradient buckets, which DDP allocates
              when it builds them, outside the tracked step (registered as buffers before it: else
              MemTracker would call them temporaries the first time the reducer writes into them)

The estimate's reserve (`margin`: CUDA context, fragmentation) is not tensor bytes and is left out.
Pipelines run several micro-batches through the same modules in one step, which MemTracker refuses
("multiple iterative calls"); `_StepTracker` starts a root module's statistics afresh each time
it runs forward again (the categories are per storage and unaffected).

About 40 s on two busy cores (the two groups and their imports dominate); marked slow, with the
multi-process tests.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))
from _memory_worker import CATEGORIES, SEQ, measure, memory_table  # noqa: E402

pytestmark = pytest.mark.slow  # two process groups (scripts/test.sh runs them with the multi-process tests)

LLAMA = "llama-tiny:layers=4,hidden=64,heads=4,kv_heads=2"
MOE = "moe-tiny"
TOLERANCE = 0.05

WORLD2 = {
    "DDP": (LLAMA, dict(dp_replicate=2, microbatch_size=2)),
    "FSDP": (LLAMA, dict(dp_shard=2, microbatch_size=2)),
    "FSDP no-reshard": (LLAMA, dict(dp_shard=2, microbatch_size=2, reshard_after_forward=False)),
    "FSDP ac=selective": (LLAMA, dict(dp_shard=2, microbatch_size=2, ac="selective")),
    "FSDP ac=full": (LLAMA, dict(dp_shard=2, microbatch_size=2, ac="full")),
    "TP": (LLAMA, dict(tp=2, microbatch_size=2)),
    "TP+SP": (LLAMA, dict(tp=2, sp=True, microbatch_size=2)),
    "TP ac=selective": (LLAMA, dict(tp=2, microbatch_size=2, ac="selective")),
    "TP ac=full": (LLAMA, dict(tp=2, microbatch_size=2, ac="full")),
    "TP+SP ac=selective": (LLAMA, dict(tp=2, sp=True, microbatch_size=2, ac="selective")),
    "TP+SP ac=full": (LLAMA, dict(tp=2, sp=True, microbatch_size=2, ac="full")),
    "PP 1f1b": (LLAMA, dict(pp=2, microbatch_size=2, num_microbatches=2)),
    "PP gpipe": (LLAMA, dict(pp=2, schedule="gpipe", microbatch_size=2, num_microbatches=2)),
    "PP interleaved": (LLAMA, dict(pp=2, schedule="interleaved_1f1b", virtual_stages=2, microbatch_size=2,
                                   num_microbatches=2)),
    "CP": (LLAMA, dict(cp=2, microbatch_size=2)),  # (cp_attention=allgather, the default)
    "CP ring": (LLAMA, dict(cp=2, cp_attention="ring", microbatch_size=2)),
    "EP": (MOE, dict(dp_shard=2, ep=2, microbatch_size=2)),
    # expert-tensor parallelism: every routed expert's hidden units split over tp
    "MoE TP": (MOE, dict(tp=2, microbatch_size=2)),
    "MoE TP ac=full": (MOE, dict(tp=2, microbatch_size=2, ac="full")),
    "ZeRO-1": (LLAMA, dict(dp_shard=2, zero=1, microbatch_size=2, num_microbatches=2)),
    "ZeRO-2": (LLAMA, dict(dp_shard=2, zero=2, microbatch_size=2, num_microbatches=2)),
    # FSDP2's casts: every activation in bfloat16 but the loss's float32 (its backward's two V-wide
    # float32 gradients, whatever the compute dtype)
    "bf16 FSDP": (LLAMA, dict(dp_shard=2, microbatch_size=2, param_dtype="bfloat16")),
}
WORLD4 = {
    "FSDP+TP": (LLAMA, dict(dp_shard=2, tp=2, microbatch_size=2)),
    "HSDP": (LLAMA, dict(dp_replicate=2, dp_shard=2, microbatch_size=2)),
    "FSDP+PP": (LLAMA, dict(dp_shard=2, pp=2, microbatch_size=2, num_microbatches=2)),
    "TP+SP+CP": (LLAMA, dict(tp=2, sp=True, cp=2, microbatch_size=2)),
    "DDP+PP": (LLAMA, dict(dp_replicate=2, pp=2, microbatch_size=2, num_microbatches=2)),
    # the routed experts FSDP-sharded over two ranks (at world 2 each rank holds its own whole)
    "FSDP+EP": (MOE, dict(dp_shard=4, ep=2, microbatch_size=2)),
    # two routed experts per rank (eight over ep=4), each rank its own: its peak is at the head's
    # backward (the root unit re-gathered), not in a block's
    "EP ep=4": (MOE, dict(dp_shard=4, ep=4, microbatch_size=2)),
}


AUTOCAST = {
    # bfloat16 without FSDP: the executor computes under torch.autocast, whose cast cache keeps a
    # bfloat16 copy of every matmul weight until the step's context ends (the float32 families above
    # never enter autocast); the worker counts those copies as parameters (`_memory_worker._tracker`).
    # The activations are mixed: the residual stream, the norms' inputs and outputs and the loss's
    # log-probabilities stay float32, each linear saves its own bfloat16 cast of a norm's output
    # (`memory.autocast_block_bytes`)
    "bf16 DDP": (LLAMA, dict(dp_replicate=2, microbatch_size=2, num_microbatches=2, param_dtype="bfloat16")),
    "bf16 TP": (LLAMA, dict(tp=2, microbatch_size=2, param_dtype="bfloat16")),
    "bf16 TP ac=selective": (LLAMA, dict(tp=2, microbatch_size=2, ac="selective", param_dtype="bfloat16")),
    "bf16 TP ac=full": (LLAMA, dict(tp=2, microbatch_size=2, ac="full", param_dtype="bfloat16")),
    "bf16 PP 1f1b": (LLAMA, dict(pp=2, microbatch_size=2, num_microbatches=2, param_dtype="bfloat16")),
}


def _predict(spec: str, fields: dict, world: int) -> dict:
    from dtorch.cluster.load import parse_shorthand
    from dtorch.plan.cost import estimate
    from dtorch.plan.plan import Plan
    from dtorch.plan.profiles import get_profile

    est = estimate(Plan(**fields), get_profile(spec, SEQ), parse_shorthand(f"cpu:1x{world}"))
    out = {c: int(est.memory_breakdown.get(c, 0)) for c in CATEGORIES}
    out["peak"] = sum(out.values())
    return out


def _runnable(cases: dict) -> dict:
    from dtorch.plan.plan import Plan

    ok = {}
    for name, (spec, fields) in cases.items():
        try:
            Plan(**fields)
        except TypeError:  # a field this checkout does not declare yet (zero: the ZeRO strategy)
            continue
        ok[name] = (spec, fields)
    return ok


@pytest.fixture(scope="module")
def table() -> dict:
    """{family: (world, predicted, measured on the fullest rank)}."""
    return memory_table([(2, _runnable({**WORLD2, **AUTOCAST})), (4, _runnable(WORLD4))], measure, _predict)


KNOWN: dict[str, str] = {
    # what the model still misses, measured (`table` prints every figure); strict: a fix must say so
}
FAMILIES = [pytest.param(f, marks=pytest.mark.xfail(strict=True, reason=KNOWN[f])) if f in KNOWN else f
            for f in (*WORLD2, *WORLD4)]
NOISE = 0.02
"""A category under 2 % of the rank's peak is judged against that floor: on a tiny model the
gradients some unit holds for an instant at the peak (the root's, the embedding's, a few hundred KB
of a few MB) are a detail a large model's peak never sees."""


@pytest.mark.parametrize("family", FAMILIES)
def test_memory_per_category_and_peak_within_tolerance(family, table):
    if family not in table:
        pytest.skip(f"{family}: its plan fields are not in this checkout")
    world, pred, meas = table[family]
    assert pred is not None, f"{family} (world {world}) did not run: {meas}"
    off = {}
    for c in (*CATEGORIES, "peak"):
        if abs(pred[c] - meas[c]) > max(TOLERANCE * meas[c], NOISE * meas["peak"]):
            off[c] = (pred[c], meas[c])
    assert not off, f"{family} (world {world}): predicted vs measured bytes off by more than 5 %: {off}"


@pytest.mark.parametrize("family", list(AUTOCAST))
def test_autocast_weight_copies_priced_as_params(family, table):
    """Autocast's bfloat16 weight copies, alive at the peak whether or not its cache keeps them
    (autograd saves them for the backward), are in the predicted parameters."""
    world, pred, meas = table[family]
    assert pred is not None, f"{family} (world {world}) did not run: {meas}"
    spec, fields = AUTOCAST[family]
    masters = _predict(spec, {**fields, "param_dtype": "float32"}, world)["params"]
    assert meas["params"] > 1.3 * masters, f"{family}: the worker did not see the cast copies: {meas}"
    assert abs(pred["params"] - meas["params"]) <= TOLERANCE * meas["params"], (
        f"{family} (world {world}): params predicted {pred['params']}, measured {meas['params']}")


@pytest.mark.parametrize("family", list(AUTOCAST))
def test_autocast_every_category_and_peak(family, table):
    world, pred, meas = table[family]
    assert pred is not None, f"{family} (world {world}) did not run: {meas}"
    off = {c: (pred[c], meas[c]) for c in (*CATEGORIES, "peak")
           if abs(pred[c] - meas[c]) > max(TOLERANCE * meas[c], NOISE * meas["peak"])}
    assert not off, f"{family} (world {world}): predicted vs measured bytes off by more than 5 %: {off}"
