"""The eval loop on models DTorch did not write (benchmarks/zoo.py: a CNN on images, a nanoGPT with
tied weights, a transformers Qwen2 built from a config): after two steps with `eval_data=`, the eval
loss is a plain single-process evaluation of the trained weights on the same batches."""

from __future__ import annotations

import json

import pytest
import torch

zoo = pytest.importorskip("benchmarks.zoo")
GB, BATCHES = 4, 3


def _eval_set(case):
    if case.kind == "pairs":
        return zoo.images(n=GB * BATCHES, seed=9)
    return zoo.TokenWindows(n=GB * BATCHES, seed=9)


@pytest.mark.parametrize("name", ["cnn", "nanogpt-tied", "hf-qwen2"])
def test_eval_loss_is_a_plain_evaluation_of_the_trained_weights(name, tmp_path):
    from dtorch.parallel.hf import adapt
    from dtorch.train.optim import AdamW, Constant
    from dtorch.train.trainer import Trainer

    case = next(c for c in zoo.cases() if c.name == name)
    if name.startswith("hf-"):
        pytest.importorskip("transformers")
    torch.manual_seed(0)
    ev = _eval_set(case)
    tr = Trainer(model=case.factory, data=case.dataset(), loss=case.loss, global_batch=GB, seq_len=zoo.SEQ,
                 checkpoint_dir=tmp_path, optimizer=AdamW(lr=1e-3, weight_decay=0.0), lr_schedule=Constant(),
                 plan={"param_dtype": "float32", "reduce_dtype": "float32"}, console=False,
                 eval_data=ev, eval_every=2, eval_batches=BATCHES)
    tr.fit(steps=2)
    got = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if '"eval"' in line][-1]["loss"]
    model = case.factory()
    model = adapt(model) if name.startswith("hf-") else model  # the trainer's names are the adapter's
    model.load_state_dict(tr.full_state_dict(), strict=True)
    model.eval()
    losses = []
    with torch.no_grad():
        for b in range(BATCHES):
            items = [zoo.split(case, ev[i]) for i in range(b * GB, (b + 1) * GB)]
            losses.append(case.loss(model(torch.stack([x for x, _ in items])), torch.stack([y for _, y in items])))
    want = float(torch.stack(losses).mean())
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)


def _world2_worker(case: tuple[str, dict], rank: int) -> dict:
    """One rank of a world-2 run of `case` = (zoo model, plan): its eval loss after two steps, and on
    rank 0 the plain single-process evaluation of the gathered weights."""
    from dtorch.parallel.hf import adapt
    from dtorch.train.optim import AdamW, Constant
    from dtorch.train.trainer import Trainer

    name, plan = case
    c = next(c for c in zoo.cases() if c.name == name)
    torch.manual_seed(0)
    ev = _eval_set(c)
    tr = Trainer(model=c.factory, data=c.dataset(), loss=c.loss, global_batch=GB, seq_len=zoo.SEQ,
                 optimizer=AdamW(lr=1e-3, weight_decay=0.0), lr_schedule=Constant(), console=False,
                 plan={**plan, "param_dtype": "float32", "reduce_dtype": "float32"},
                 eval_data=ev, eval_every=2, eval_batches=BATCHES, metrics_every=0)
    result = tr.fit(2)
    out = {"eval": result.eval_losses[max(result.eval_losses)], "plan": tr.plan.describe()}
    full = tr.full_state_dict()
    if full is not None:
        model = c.factory()
        model = adapt(model) if name.startswith("hf-") else model
        model.load_state_dict(full, strict=True)
        model.eval()
        with torch.no_grad():
            losses = []
            for b in range(BATCHES):
                items = [zoo.split(c, ev[i]) for i in range(b * GB, (b + 1) * GB)]
                losses.append(c.loss(model(torch.stack([x for x, _ in items])), torch.stack([y for _, y in items])))
        out["reference"] = float(torch.stack(losses).mean())
    return out


@pytest.mark.slow
def test_eval_loss_of_user_models_at_world_2_is_a_plain_evaluation():
    """The CNN and the tied nanoGPT under DDP and FSDP, and the transformers Qwen2 under FSDP and TP,
    in one gloo group: every rank reports one eval loss, a plain evaluation of the trained weights."""
    import sys
    from pathlib import Path

    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))
    from _harness import run_group

    cases = [("cnn", {"dp_replicate": 2}), ("nanogpt-tied", {"dp_shard": 2}), ("hf-qwen2", {"dp_shard": 2}),
             ("hf-qwen2", {"tp": 2})]
    for case, (r0, r1) in zip(cases, run_group(2, cases, _world2_worker)):
        assert "error" not in r0 and "error" not in r1, (case, r0.get("error") or r1.get("error"))
        assert r0["eval"] == r1["eval"], (case, r0["eval"], r1["eval"])
        assert abs(r0["eval"] - r0["reference"]) <= 1e-5 * abs(r0["reference"]), (case, r0["plan"], r0, r1)
