"""Tied weights stay tied on every plan: a head sharing the token embedding's weight.

Two models no one on the project wrote for DTorch: a nanoGPT-style GPT (`lm_head.weight =
wte.weight`, its own names) and transformers' GPT2LMHeadModel with its default config (tied).
Each trains 5 AdamW steps in float32 on one process (the default plan), and at world 2 under DDP,
FSDP, TP and PP (where the embedding and the head sit on different stages and their copies are
kept in sync); per-step losses are held to the user's own plain PyTorch loop of the unmodified
model within 1e-5 relative, and the tied weight's first gradient (the sum of both uses) to that
loop's. After training the two names hold the same values on every rank, and after a DCP save and
a load into a freshly built (differently seeded) model, and after loading a pipeline checkpoint
into an FSDP model (resharded), they still do. One group of two gloo processes runs every case.
"""

from __future__ import annotations

import sys
from functools import cache
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
import _tied  # noqa: E402
from _harness import run_group  # noqa: E402

from dtorch.plan.plan import Plan  # noqa: E402

REL = 1e-5
CASES = {
    "nanogpt_ddp": dict(model="nanogpt", plan=dict(dp_replicate=2, microbatch_size=2)),
    "nanogpt_fsdp": dict(model="nanogpt", plan=dict(dp_shard=2, microbatch_size=2)),
    "hf_gpt2_ddp": dict(model="hf-gpt2", plan=dict(dp_replicate=2, microbatch_size=2)),
    "hf_gpt2_fsdp": dict(model="hf-gpt2", plan=dict(dp_shard=2, microbatch_size=2)),
    "hf_gpt2_tp": dict(model="hf-gpt2", plan=dict(tp=2, microbatch_size=4)),
    "hf_gpt2_pp": dict(model="hf-gpt2", plan=dict(pp=2, schedule="1f1b", num_microbatches=2, microbatch_size=2)),
    "hf_gpt2_pp_interleaved": dict(model="hf-gpt2", plan=dict(pp=2, virtual_stages=2, schedule="interleaved_1f1b",
                                                              num_microbatches=2, microbatch_size=2)),
}
RESHARD = ("hf_gpt2_pp_into_fsdp", "hf_gpt2_pp", "hf_gpt2_fsdp")
"""(case, the checkpoint it loads, the plan it loads it under)."""


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> dict:
    ckpt = str(tmp_path_factory.mktemp("tied_ckpt"))
    cases = [(k, {**v, "ckpt": ckpt}) for k, v in CASES.items()]
    name, src, plan = RESHARD
    cases.append((name, {**CASES[plan], "ckpt": ckpt, "load_from": f"{ckpt}/{src}"}))
    return dict(zip([k for k, _ in cases], run_group(2, cases, _tied.worker)))


@cache
def _reference(model: str, global_batch: int) -> dict:
    return _tied.plain_loop(model, global_batch)


def _ok(per_rank: list[dict]) -> list[dict]:
    for r, res in enumerate(per_rank):
        assert "error" not in res, f"rank {r}:\n{res['error']}"
    return per_rank


def _assert_tied(reports: list[dict], model: str) -> None:
    """Both names hold the same values on every rank; one Parameter wherever a rank holds both."""
    prints = [p for rep in reports for p in rep["prints"].values()]
    held = {n for rep in reports for n in rep["prints"]}
    assert held == set(_tied.TIES[model])
    assert all(p == prints[0] for p in prints), prints
    for rep in reports:
        if len(rep["prints"]) == 2:
            assert rep["same_object"] is True


def _assert_grad_matches(grads: dict, ref: torch.Tensor) -> None:
    for name, g in grads.items():
        torch.testing.assert_close(torch.tensor(g), ref, rtol=REL, atol=REL * float(ref.abs().max()), msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_tied_model_trains_like_a_plain_loop_and_stays_tied_through_a_checkpoint(world2: dict, name: str) -> None:
    spec = CASES[name]
    per_rank = _ok(world2[name])
    plan = Plan(**spec["plan"])
    ref = _reference(spec["model"], plan.dp * plan.local_batch())
    for res in per_rank:
        assert res["losses"] == pytest.approx(ref["losses"], rel=REL)
        _assert_grad_matches(res["grads"], ref["tied_grad"])
    _assert_tied([r["trained"] for r in per_rank], spec["model"])
    _assert_tied([r["loaded"] for r in per_rank], spec["model"])
    # the fresh model (another seed) took the trained values from the checkpoint
    assert per_rank[0]["loaded"]["prints"] == per_rank[0]["trained"]["prints"]


@pytest.mark.slow
def test_pipeline_checkpoint_of_a_tied_model_loads_tied_into_fsdp(world2: dict) -> None:
    name, src, _ = RESHARD
    loaded = [r["loaded"] for r in _ok(world2[name])]
    _assert_tied(loaded, "hf-gpt2")
    trained = next(iter(_ok(world2[src])[0]["trained"]["prints"].values()))
    assert next(iter(loaded[0]["prints"].values())) == trained


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("model", ["nanogpt", "hf-gpt2"])
def test_tied_model_on_the_one_process_plan_trains_like_a_plain_loop(model: str, tmp_path) -> None:
    """The default plan at world 1 (no process group): it used to fail with a KeyError at start."""
    import torch.distributed.checkpoint as dcp

    from dtorch.parallel.parallelize import parallelize
    from dtorch.train.losses import next_token

    pm, losses, grads = _tied.train(model, Plan(), rank=0)
    ref = _reference(model, Plan().local_batch())
    assert losses == pytest.approx(ref["losses"], rel=REL)
    _assert_grad_matches(grads, ref["tied_grad"])
    trained = _tied.tie_report(pm, model)
    _assert_tied([trained], model)
    dcp.save(pm.state_dict_for_checkpoint(), checkpoint_id=str(tmp_path))
    fresh = parallelize(lambda: _tied.factory(model), Plan(), loss_fn=next_token, seed=1, seq_len=_tied.SEQ)
    dcp.load(fresh.state_dict_for_checkpoint(), checkpoint_id=str(tmp_path))
    loaded = _tied.tie_report(fresh, model)
    _assert_tied([loaded], model)
    assert loaded["prints"] == trained["prints"]


def test_a_tied_module_passed_as_an_instance_stays_tied_on_meta() -> None:
    """`parallelize(module)` copies the module to meta, where `.to` would untie it."""
    from dtorch.parallel.parallelize import meta_model

    meta = meta_model(_tied.NanoGPT())
    assert meta.lm_head.weight is meta.wte.weight and meta.wte.weight.is_meta

