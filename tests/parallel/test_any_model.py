"""Models DTorch did not write train through the Trainer at world 2 with one process's numerics.

A CNN classifier on images (one nn.Sequential, integer labels, cross entropy), a ViT of the user's
own fed dict items, an MLP regressor with MSE and no repeated blocks, and a model whose blocks pick
a branch per sample plus a custom autograd.Function (`_any_models`). Each trains 5 AdamW steps in
float32 under the auto plan, DDP and FSDP (dp_shard=2): per-step losses within 1e-5 relative of a
plain single-process PyTorch loop with the same initial weights, data order and optimizer. For the
branchy model the data puts every sample of rank 0 on one branch and every sample of rank 1 on the
other at every step, so each rank leaves the other branch's parameters without a gradient (DDP's
find_unused_parameters, FSDP's zero-gradient reduce-scatter; before: torch's find_unused_parameters
error, and a gloo collective mismatch). One group of 2 gloo processes runs every case.
"""

from __future__ import annotations

import sys
from functools import cache
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _any_models as Z  # noqa: E402
from _harness import run_group  # noqa: E402

REL = 1e-5
STEPS = 5
GLOBAL_BATCH = 4
LR = 3e-3
FP32 = {"param_dtype": "float32", "reduce_dtype": "float32"}
PLANS = {"auto": {}, "ddp": {"dp_replicate": 2}, "fsdp": {"dp_shard": 2}}


IDLE_STEPS = (1, 2)
"""Steps at which, in the "branchy-idle" data, no rank takes the negative branch."""


def branch_signs(idle: tuple[int, ...] = ()) -> list[float]:
    """Sample signs such that at every step rank 0's samples take the positive branch and rank 1's
    the negative one (the Trainer's data order: GlobalSampler, seed 0); at the `idle` steps every
    sample takes the positive branch."""
    from dtorch.train.sampler import GlobalSampler

    sampler = GlobalSampler(Z.NUM_SAMPLES, GLOBAL_BATCH, seed=0)
    signs = [1.0] * Z.NUM_SAMPLES
    for step in range(STEPS):
        for i in sampler.local_indices(step, 1, 2):
            signs[i] = 1.0 if step in idle else -1.0
    return signs


def model_spec(name: str):
    """(factory, dataset factory, loss kind); "branchy-idle": the branchy model whose negative
    branch no rank uses at IDLE_STEPS (its parameters must then keep grad None, as in one process,
    or AdamW moves them and the later steps that use the branch again differ)."""
    return Z.MODELS["branchy" if name == "branchy-idle" else name]


def dataset(name: str):
    data = model_spec(name)[1]
    if data is not None:
        return data()
    return Z.branch_data(branch_signs(IDLE_STEPS if name == "branchy-idle" else ()))


def optimizer():
    from dtorch.train.optim import AdamW

    return AdamW(lr=LR)


def _case(case: tuple[str, str], rank: int) -> dict:
    from dtorch.train.optim import Constant
    from dtorch.train.trainer import Trainer

    name, plan = case
    factory, _, loss = model_spec(name)
    trainer = Trainer(model=factory, data=dataset(name), loss=Z.loss_fn(loss), optimizer=optimizer(),
                      lr_schedule=Constant(), global_batch=GLOBAL_BATCH, plan={**PLANS[plan], **FP32},
                      checkpoint_dir=None, console=False, straggler_every=0, max_grad_norm=None, seed=0)
    result = trainer.fit(STEPS)
    return {"losses": [result.losses[s] for s in range(1, STEPS + 1)], "plan": result.plan.describe()}


def reference(name: str) -> list[float]:
    """A plain PyTorch loop in this process: seed, construct, AdamW, the global batches in order."""
    from dtorch.model.outputs import call_model, logits_of
    from dtorch.train.data import batch_for
    from dtorch.train.sampler import GlobalSampler

    factory, _, loss_kind = model_spec(name)
    loss_fn = Z.loss_fn(loss_kind)
    data = dataset(name)
    torch.manual_seed(0)
    model = factory()
    opt = optimizer().build(model.parameters())
    sampler = GlobalSampler(len(data), GLOBAL_BATCH, seed=0)
    losses = []
    for step in range(STEPS):
        x, y = batch_for(data, sampler.local_indices(step, 0, 1))
        loss = loss_fn(logits_of(call_model(model, x)), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


CASES = [(name, plan) for name in Z.MODELS for plan in PLANS] + [("branchy-idle", "ddp"), ("branchy-idle", "fsdp")]


@cache
def _results() -> dict:
    return dict(zip(CASES, run_group(2, CASES, _case)))


def test_the_branchy_data_sends_the_two_ranks_down_different_branches():
    from dtorch.train.sampler import GlobalSampler

    data = Z.branch_data(branch_signs())
    sampler = GlobalSampler(len(data), GLOBAL_BATCH, seed=0)
    for step in range(STEPS):
        first = [{bool(data[i][0][0] > 0) for i in sampler.local_indices(step, r, 2)} for r in range(2)]
        assert first == [{True}, {False}]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[f"{n}-{p}" for n, p in CASES])
def test_any_model_trains_like_one_process(case):
    per_rank = _results()[case]
    for r in per_rank:
        assert "error" not in r, r.get("error")
    expected = reference(case[0])
    for r in per_rank:
        assert r["losses"] == pytest.approx(expected, rel=REL), (r["plan"], r["losses"], expected)
    if case[1] != "auto":
        assert f"{'dp_replicate' if case[1] == 'ddp' else 'dp_shard'}=2" in per_rank[0]["plan"], per_rank[0]["plan"]
