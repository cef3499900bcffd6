"""The central executor test: every parallelism gives single-process numerics.

From the same initial weights, 5 AdamW steps in float32 of the tiny reference Llama under each plan
give per-step losses (and global gradient norms, which checks clip_grad_norm_ across DTensors and
pipeline stages) within 1e-4 relative of one process training on the same global batch. The
single-process run always takes the whole global batch in one forward, so every case with
num_microbatches > 1 also checks that gradient accumulation / pipeline micro-batching equals one
large batch. One group of 4 and one group of 2 gloo processes run all cases.

With dropout (GPT at p = 0.1) the plans follow the rule of dtorch/parallel/rng.py. Where that rule
gives exact equivalence, it is asserted exactly: activation checkpointing changes nothing (the
recompute draws the forward's masks), and a pipeline equals one process that draws every stage's
masks from that stage's stream (`_training.pipeline_oracle`). TP+SP and CP ranks hold parts of
one tensor and draw with a sequential CPU generator, so they cannot reproduce the single-device
masks bit for bit; for them the test pins the rule itself: TP replicas of a replicated
activation draw identical masks, TP shards and CP / DP ranks draw different ones, and every mask
drops about p of its elements.
"""

from __future__ import annotations

import sys
from functools import cache
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _training  # noqa: E402
from _harness import run_group  # noqa: E402

from dtorch.plan.plan import Plan  # noqa: E402

REL = 1e-4
# Gradient norms after a few AdamW steps amplify reduction-order rounding (Adam moves near-zero
# gradient elements by a full lr step whatever their size): under TP the norms at steps 3-4 sit
# 1-3e-4 from single-process while the losses stay within 1e-4 (the initial weights are
# bit-identical: tests/parallel/test_materialize.py).
REL_NORM = 5e-4

CASES_4 = {
    "ddp": dict(dp_replicate=4, microbatch_size=2),
    "fsdp": dict(dp_shard=4, microbatch_size=2),
    "hsdp": dict(dp_replicate=2, dp_shard=2, microbatch_size=2),
    "tp": dict(tp=4, microbatch_size=4),
    "tp_sp": dict(tp=4, sp=True, microbatch_size=4),
    "fsdp_x_tp": dict(dp_shard=2, tp=2, microbatch_size=2),
    "fsdp_x_tp_sp": dict(dp_shard=2, tp=2, sp=True, microbatch_size=2),
    "ddp_x_tp": dict(dp_replicate=2, tp=2, microbatch_size=2),
    "pp_gpipe": dict(pp=4, schedule="gpipe", num_microbatches=4),
    "pp_1f1b": dict(pp=4, schedule="1f1b", num_microbatches=4),
    "ddp_x_pp_interleaved": dict(dp_replicate=2, pp=2, virtual_stages=2, schedule="interleaved_1f1b",
                                 num_microbatches=2),
    "pp_zero_bubble": dict(pp=4, schedule="zero_bubble", num_microbatches=4),
    # zero-bubble under FSDP: the stage stays gathered (resharded, torch's split backward loses the
    # weight gradients of every stage but the first: the pipeline strategy's limit)
    "fsdp_x_pp_zero_bubble": dict(dp_shard=2, pp=2, schedule="zero_bubble", num_microbatches=2,
                                  reshard_after_forward=False),
    "fsdp_x_pp": dict(dp_shard=2, pp=2, schedule="1f1b", num_microbatches=2, layer_partition=[3, 1]),
    "tp_x_pp": dict(tp=2, pp=2, schedule="1f1b", num_microbatches=2, microbatch_size=2),
    "tp_sp_x_pp": dict(tp=2, sp=True, pp=2, schedule="gpipe", num_microbatches=2),
    "ac_full_fsdp": dict(dp_shard=4, ac="full", microbatch_size=2),
    "ac_selective_fsdp": dict(dp_shard=4, ac="selective", microbatch_size=2),
    "ac_full_tp": dict(tp=4, ac="full", microbatch_size=4),
    "ac_selective_tp_sp": dict(tp=4, sp=True, ac="selective", microbatch_size=4),
    "fsdp_grad_accumulation": dict(dp_shard=4, microbatch_size=1, num_microbatches=3),
    "gpt_fsdp_x_tp_sp": dict(model="gpt-tiny", dp_shard=2, tp=2, sp=True, microbatch_size=2),
    "hf_llama_fsdp_x_tp_sp": dict(model="hf-llama", dp_shard=2, tp=2, sp=True, microbatch_size=2),
    "hf_gpt2_fsdp_x_tp_sp": dict(model="hf-gpt2", dp_shard=2, tp=2, sp=True, microbatch_size=2),
    "hsdp_no_reshard_accumulation": dict(dp_replicate=2, dp_shard=2, num_microbatches=2,
                                         reshard_after_forward=False),
    "fsdp_x_cp_accumulation": dict(dp_shard=2, cp=2, microbatch_size=1, num_microbatches=2),
    "cp_x_tp_sp": dict(cp=2, tp=2, sp=True, microbatch_size=4),
}
# Uneven work (docs/heterogeneous.md): data-parallel ranks with their own micro-batch counts
# (dp_shares) and pipeline stages of uneven size (layer_partition); held to UNEVEN_REL.
UNEVEN_4 = {
    "uneven_fsdp_shares": dict(dp_shard=4, num_microbatches=2, dp_shares=[3, 1, 2, 2], reshard_after_forward=False),
    "uneven_hsdp_shares": dict(dp_replicate=2, dp_shard=2, num_microbatches=2, dp_shares=[1, 2, 3, 2],
                               reshard_after_forward=False),
    "uneven_fsdp_x_tp_shares": dict(dp_shard=2, tp=2, num_microbatches=2, dp_shares=[3, 1],
                                    reshard_after_forward=False),
    "uneven_ddp_x_pp_shares_partition": dict(dp_replicate=2, pp=2, schedule="1f1b", num_microbatches=3,
                                             dp_shares=[4, 2], layer_partition=[3, 1]),
    "uneven_fsdp_x_pp_shares_partition": dict(dp_shard=2, pp=2, schedule="1f1b", num_microbatches=3,
                                              dp_shares=[2, 4], layer_partition=[1, 3], reshard_after_forward=False),
}
UNEVEN_2 = {
    "uneven_ddp_shares": dict(dp_replicate=2, num_microbatches=2, dp_shares=[3, 1]),
    "uneven_fsdp_shares": dict(dp_shard=2, num_microbatches=3, dp_shares=[1, 5], reshard_after_forward=False),
    "uneven_pp_partition_1_3": dict(pp=2, schedule="1f1b", num_microbatches=2, layer_partition=[1, 3]),
}
UNEVEN_REL = 1e-5
CASES_2 = {
    "ddp": dict(dp_replicate=2, microbatch_size=2),
    "fsdp": dict(dp_shard=2, microbatch_size=2),
    "tp_sp": dict(tp=2, sp=True, microbatch_size=4),
    "pp_1f1b": dict(pp=2, schedule="1f1b", num_microbatches=4),
    "pp_interleaved": dict(pp=2, virtual_stages=2, schedule="interleaved_1f1b", num_microbatches=4),
    "pp_zero_bubble_interleaved": dict(pp=2, virtual_stages=2, schedule="zero_bubble", num_microbatches=2),
    "ac_full_fsdp_accumulation": dict(dp_shard=2, ac="full", num_microbatches=2, microbatch_size=2),
    "fsdp_cpu_offload": dict(dp_shard=2, offload="params", microbatch_size=2),
    "gpt_tp_sp": dict(model="gpt-tiny", tp=2, sp=True, microbatch_size=4),
    "hf_llama_tp": dict(model="hf-llama", tp=2, microbatch_size=4),
    "hf_llama_pp": dict(model="hf-llama", pp=2, schedule="1f1b", num_microbatches=2, microbatch_size=2),
    "hf_gpt2_fsdp": dict(model="hf-gpt2", dp_shard=2, microbatch_size=2),
    "hf_gpt2_pp": dict(model="hf-gpt2", pp=2, schedule="gpipe", num_microbatches=2, microbatch_size=2),
    "gpt_pp_interleaved": dict(model="gpt-tiny", pp=2, virtual_stages=2, schedule="interleaved_1f1b",
                               num_microbatches=2),
    "cp": dict(cp=2, microbatch_size=4),
    "gpt_cp": dict(model="gpt-tiny", cp=2, microbatch_size=4),
}

DROPOUT = "gpt-tiny:dropout=0.1"
DROPOUT_CASES_2 = {
    "pp_1f1b": dict(model=DROPOUT, pp=2, schedule="1f1b", num_microbatches=4, microbatch_size=2),
    "pp_1f1b_ac_selective": dict(model=DROPOUT, pp=2, schedule="1f1b", num_microbatches=4, microbatch_size=2,
                                 ac="selective"),
    "pp_gpipe_partition_3_1": dict(model=DROPOUT, pp=2, schedule="gpipe", num_microbatches=2, microbatch_size=2,
                                   layer_partition=[3, 1]),
    "tp": dict(model=DROPOUT, tp=2, microbatch_size=4),
    "tp_ac_selective": dict(model=DROPOUT, tp=2, microbatch_size=4, ac="selective"),
    "tp_sp": dict(model=DROPOUT, tp=2, sp=True, microbatch_size=4),
    "tp_sp_ac_full": dict(model=DROPOUT, tp=2, sp=True, microbatch_size=4, ac="full"),
    "cp": dict(model=DROPOUT, cp=2, microbatch_size=4),
    "cp_ac_full": dict(model=DROPOUT, cp=2, microbatch_size=4, ac="full"),
}
DROPOUT_CASES_4 = {
    "fsdp_x_tp_sp": dict(model=DROPOUT, dp_shard=2, tp=2, sp=True, microbatch_size=2),
    "fsdp_x_tp_sp_ac_selective": dict(model=DROPOUT, dp_shard=2, tp=2, sp=True, microbatch_size=2, ac="selective"),
}
AC_PAIRS = {"pp_1f1b_ac_selective": "pp_1f1b", "tp_ac_selective": "tp", "tp_sp_ac_full": "tp_sp", "cp_ac_full": "cp",
            "fsdp_x_tp_sp_ac_selective": "fsdp_x_tp_sp"}


def _worker(case: tuple[str, dict], rank: int) -> dict:
    return _training.parallel(case[1], rank)


@cache
def _reference(global_batch: int, model_name: str) -> dict:
    return _training.single_process(global_batch, model_name)


def _run(world: int, cases: dict, dropout_cases: dict, uneven_cases: dict) -> dict:
    """Every case of one world size in ONE process group; dropout cases keyed ("dropout", name),
    uneven ones ("uneven", name)."""
    keyed = {**cases, **{("dropout", k): v for k, v in dropout_cases.items()},
             **{("uneven", k): v for k, v in uneven_cases.items()}}
    return dict(zip(keyed, run_group(world, list(keyed.items()), _worker)))


@pytest.fixture(scope="module")
def world4() -> dict:
    return _run(4, CASES_4, DROPOUT_CASES_4, UNEVEN_4)


@pytest.fixture(scope="module")
def world2() -> dict:
    return _run(2, CASES_2, DROPOUT_CASES_2, UNEVEN_2)


def _assert_matches_single_process(plan_kwargs: dict, per_rank: list[dict], rel: float = REL,
                                   rel_norm: float = REL_NORM) -> None:
    for r, res in enumerate(per_rank):
        assert "error" not in res, f"rank {r}:\n{res['error']}"
    kwargs = dict(plan_kwargs)
    model_name = kwargs.pop("model", "llama-tiny")
    plan = Plan(**kwargs)
    ref = _reference(plan.dp * plan.local_batch(), model_name)
    for r, res in enumerate(per_rank):
        for key, tol in (("losses", rel), ("norms", rel_norm)):
            assert res[key] == pytest.approx(ref[key], rel=tol), f"rank {r} {key}"
    # the checkpoint state has the unsplit model's names whatever the plan (pipeline stages: union)
    assert set().union(*(res["keys"] for res in per_rank)) == set(ref["keys"])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES_4))
def test_world_size_4_matches_single_process_losses(world4: dict, name: str) -> None:
    _assert_matches_single_process(CASES_4[name], world4[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES_2))
def test_world_size_2_matches_single_process_losses(world2: dict, name: str) -> None:
    _assert_matches_single_process(CASES_2[name], world2[name])


@pytest.mark.slow
@pytest.mark.parametrize("world,name", [(2, n) for n in UNEVEN_2] + [(4, n) for n in UNEVEN_4])
def test_uneven_shares_and_partitions_match_single_process_within_1e_5(world2: dict, world4: dict, world: int,
                                                                     name: str) -> None:
    """Each data-parallel rank runs its own micro-batch count (dp_shares) and/or pipeline stages hold
    different block counts: the same global batch, so the same losses as one process."""
    cases, results = (UNEVEN_2, world2) if world == 2 else (UNEVEN_4, world4)
    _assert_matches_single_process(cases[name], results[("uneven", name)], rel=UNEVEN_REL, rel_norm=REL_NORM)


def _ok(per_rank: list[dict]) -> list[dict]:
    for r, res in enumerate(per_rank):
        assert "error" not in res, f"rank {r}:\n{res['error']}"
    return per_rank


def _assert_dropout_active(per_rank: list[dict]) -> None:
    for res in per_rank:
        for name, prints in res["masks"].items():
            # elements, dropped: binomial(2048, 0.1) has a standard deviation of 0.7 %
            n, dropped, _ = prints[-1]
            assert abs(dropped / n - 0.1) < 0.05, (name, prints)


@pytest.mark.slow
@pytest.mark.parametrize("world,name", [(2, n) for n in AC_PAIRS if n in DROPOUT_CASES_2]
                         + [(4, n) for n in AC_PAIRS if n in DROPOUT_CASES_4])
def test_activation_checkpointing_with_dropout_changes_nothing(world2: dict, world4: dict, world: int,
                                                               name: str) -> None:
    results = world2 if world == 2 else world4
    with_ac, without = _ok(results[("dropout", name)]), _ok(results[("dropout", AC_PAIRS[name])])
    for a, b in zip(with_ac, without):
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-6)
        assert a["norms"] == pytest.approx(b["norms"], rel=1e-5)
    _assert_dropout_active(with_ac)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pp_1f1b", "pp_gpipe_partition_3_1"])
def test_pipeline_with_dropout_equals_one_process_drawing_each_stage_stream(world2: dict, name: str) -> None:
    per_rank = _ok(world2[("dropout", name)])
    ref = _training.pipeline_oracle(DROPOUT_CASES_2[name])
    for res in per_rank:
        assert res["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        assert res["norms"] == pytest.approx(ref["norms"], rel=1e-4)
    _assert_dropout_active(per_rank)


def _prints(res: dict, name: str) -> list:
    return res["masks"][name]


@pytest.mark.slow
def test_tensor_parallel_replicas_share_masks_and_sequence_shards_do_not(world2: dict, world4: dict) -> None:
    r0, r1 = _ok(world2[("dropout", "tp_sp")])
    # the embedding's dropout acts on an activation every TP rank holds whole
    assert _prints(r0, "emb_dropout") == _prints(r1, "emb_dropout")
    # inside a sequence-parallel block each rank holds other tokens: its own shard stream
    for name in ("layers.0.attention.resid_dropout", "layers.3.feed_forward.dropout"):
        assert _prints(r0, name) != _prints(r1, name), name
    _assert_dropout_active([r0, r1])
    # without SP the residual dropouts act on the row-wise layers' all-reduced (replicated) outputs
    t0, t1 = _ok(world2[("dropout", "tp")])
    assert t0["masks"] == t1["masks"]
    _assert_dropout_active([t0, t1])
    # dp_shard=2 x tp=2: ranks (0, 1) and (2, 3) are TP pairs of different data-parallel ranks
    w = _ok(world4[("dropout", "fsdp_x_tp_sp")])
    emb = [_prints(r, "emb_dropout") for r in w]
    assert emb[0] == emb[1] and emb[2] == emb[3] and emb[0] != emb[2]


@pytest.mark.slow
def test_context_parallel_ranks_draw_their_own_masks(world2: dict) -> None:
    r0, r1 = _ok(world2[("dropout", "cp")])
    for name in ("emb_dropout", "layers.0.attention.resid_dropout"):
        assert _prints(r0, name) != _prints(r1, name), name
    assert r0["losses"] == r1["losses"]
    _assert_dropout_active([r0, r1])
