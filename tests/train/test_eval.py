"""The eval loop (`Trainer(eval_every=..., eval_data=... | eval_split=...)`, `dtorch.train.evaluate`):
the loss under a 2-rank plan is a plain single-process evaluation of the same weights on the same
held-out batches; held-out samples are never trained on; the `eval` records reach metrics.jsonl,
Prometheus and the report; bad values are refused before any work."""

from __future__ import annotations

import json
import math
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

from dtorch.errors import ConfigError

SPEC = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=16"
FP32 = {"param_dtype": "float32", "reduce_dtype": "float32"}
GLOBAL_BATCH = 4


class Recorder(torch.utils.data.Dataset):
    """Token windows that remember which of them were read with gradients on (training) or off."""

    def __init__(self, n: int):
        self.items = [torch.randint(0, 64, (17,), generator=torch.Generator().manual_seed(i)) for i in range(n)]
        self.seen: list[tuple[int, bool]] = []

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> torch.Tensor:
        self.seen.append((int(i), torch.is_grad_enabled()))
        return self.items[i]


def _reference(full: dict, data: Recorder, held: list[int]) -> float:
    """One process, plain PyTorch: the model with these weights, on the held-out samples in order, in
    global batches of GLOBAL_BATCH, mean of the batches' mean token cross entropy."""
    from dtorch.models import build_model

    model = build_model(SPEC)
    model.load_state_dict(full)
    model.eval()
    losses = []
    with torch.no_grad():
        for b in range(len(held) // GLOBAL_BATCH):
            w = torch.stack([data.items[i] for i in held[b * GLOBAL_BATCH:(b + 1) * GLOBAL_BATCH]])
            logits = model(w[:, :-1])
            losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), w[:, 1:].flatten()))
    return float(torch.stack(losses).mean())


def _worker(plan: dict, rank: int) -> dict:
    from dtorch.models import build_model
    from dtorch.train.optim import AdamW, Constant
    from dtorch.train.trainer import Trainer

    data = Recorder(48)
    tr = Trainer(model=partial(build_model, SPEC), data=data, global_batch=GLOBAL_BATCH, seq_len=16,
                 plan={**plan, **FP32}, optimizer=AdamW(lr=1e-2), lr_schedule=Constant(), console=False,
                 straggler_every=2, metrics_every=0, eval_every=2, eval_split=0.25)
    result = tr.fit(4)
    full = tr.full_state_dict()  # after the last evaluation: the weights it saw
    held = tr._datasets()[1].indices
    out = {"eval": result.eval_losses, "held": held, "plan": tr.plan.describe(),
           "trained": sorted({i for i, grad in data.seen if grad}),
           "evaluated": sorted({i for i, grad in data.seen if not grad})}
    if full is not None:
        out["reference"] = _reference(full, data, held)
    return out


@pytest.mark.slow
def test_eval_loss_at_world_2_is_a_single_process_evaluation_and_held_out_samples_are_never_trained():
    """DDP, FSDP, PP (the schedule's forward-only eval), TP (loss parallel) and CP: one gloo group."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))
    from _harness import run_group

    plans = [{"dp_replicate": 2}, {"dp_shard": 2}, {"pp": 2}, {"tp": 2}, {"cp": 2}]
    for plan, (r0, r1) in zip(plans, run_group(2, plans, _worker)):
        assert "error" not in r0 and "error" not in r1, (plan, r0.get("error") or r1.get("error"))
        assert sorted(r0["eval"]) == ["2", "4"], r0["eval"]  # every 2 steps and at the end (JSON keys)
        assert r0["eval"] == r1["eval"]  # all-reduced: one value on every rank
        assert abs(r0["eval"]["4"] - r0["reference"]) < 1e-5, (plan, r0["plan"], r0["eval"]["4"], r0["reference"])
        held = set(r0["held"])
        assert len(held) == 12 and held == set(r1["held"])
        trained = set(r0["trained"]) | set(r1["trained"])
        assert trained and not trained & held, (plan, sorted(trained & held))
        assert held <= set(r0["evaluated"]) | set(r1["evaluated"])  # the whole held-out set, 3 batches


def test_eval_records_reach_metrics_prometheus_and_the_report(tmp_path):
    from dtorch.models import build_model
    from dtorch.monitor.report import load_run, summarize, write_report
    from dtorch.monitor.server import MonitorState, _Collector
    from dtorch.train.trainer import Trainer

    train, held = Recorder(24), Recorder(9)  # 9 samples: 2 whole batches of 4
    tr = Trainer(model=partial(build_model, SPEC), data=train, eval_data=held, eval_every=3, global_batch=4,
                 seq_len=16, plan={}, console=False, straggler_every=0, metrics_every=0, log_dir=tmp_path)
    result = tr.fit(4)
    assert sorted(result.eval_losses) == [3, 4]
    assert {i for i, _ in held.seen} == set(range(8)) and all(not g for _, g in held.seen)
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r.get("event") == "eval"]
    assert [e["step"] for e in evals] == [3, 4] and [e["batches"] for e in evals] == [2, 2]
    for e in evals:
        assert e["loss"] == result.eval_losses[e["step"]] and e["perplexity"] == pytest.approx(math.exp(e["loss"]))

    state = MonitorState()
    state.replay(tmp_path / "metrics.jsonl")
    assert [e["step"] for e in state.data()["events"] if e["event"] == "eval"] == [3, 4]  # the page's data
    metrics = {m.name: m for m in _Collector(state).collect()}
    assert metrics["dtorch_eval_loss"].samples[0].value == evals[-1]["loss"]
    assert metrics["dtorch_eval_perplexity"].samples[0].value == pytest.approx(evals[-1]["perplexity"])

    s = summarize(load_run(tmp_path))
    assert s["final_eval_loss"] == evals[-1]["loss"] and s["final_eval_step"] == 4
    index = write_report(tmp_path)
    assert "final eval loss" in index.read_text() and (index.parent / "loss.png").exists()


@pytest.mark.parametrize("kw,field,says", [
    ({"eval_every": -1}, "eval_every", "N >= 1"),
    ({"eval_split": 0.0}, "eval_split", "in \\(0, 1\\)"),
    ({"eval_split": 0.1, "eval_data": [torch.zeros(17, dtype=torch.long)] * 8}, "eval_split", "not both"),
    ({"eval_batches": 0, "eval_every": 1}, "eval_batches", "1 or more"),
    ({"eval_batches": 2}, "eval_batches", "evaluation is off"),
    ({"eval_split": 0.05}, "eval_split", "1 evaluation samples"),  # 0.05 of 16: 1 sample, not a batch of 4
    ({"eval_split": 0.99}, "eval_split", "leaving none"),
])
def test_bad_eval_values_name_the_field_before_any_work(kw, field, says):
    from dtorch.models import build_model
    from dtorch.train.trainer import Trainer

    with pytest.raises(ConfigError, match=says) as e:
        Trainer(model=partial(build_model, SPEC), data=[torch.zeros(17, dtype=torch.long)] * 16, global_batch=4,
                seq_len=16, console=False, **kw).fit(1)  # (the set's size: at fit, before any work)
    assert e.value.field == field


def test_eval_is_off_unless_asked_and_the_training_data_is_then_whole():
    from dtorch.models import build_model
    from dtorch.train.job import JobConfig
    from dtorch.train.trainer import Trainer

    data = [torch.zeros(17, dtype=torch.long)] * 16
    tr = Trainer(model=partial(build_model, SPEC), data=data, global_batch=4, seq_len=16, console=False)
    assert tr.eval_spec is None and tr._dataset() is data
    assert JobConfig().eval_every == 0 and JobConfig().eval_data is None
    with pytest.raises(ConfigError) as e:
        JobConfig(eval_split=2.0)
    assert e.value.field == "eval_split"


def test_the_sample_audit_names_samples_of_the_data_as_given_under_a_split(tmp_path, monkeypatch):
    from dtorch.models import build_model
    from dtorch.train.trainer import Trainer

    monkeypatch.setenv("DTORCH_RECORD_SAMPLES", "1")
    data = Recorder(40)
    tr = Trainer(model=partial(build_model, SPEC), data=data, eval_split=0.2, global_batch=4, seq_len=16, plan={},
                 console=False, straggler_every=0, metrics_every=0, log_dir=tmp_path)
    tr.fit(8)  # 32 samples: the whole training set of 32
    audited = [i for line in (tmp_path / "samples-rank0.jsonl").read_text().splitlines()
               for i in json.loads(line)["indices"]]
    held = set(tr._datasets()[1].indices)
    assert sorted(audited) == sorted(set(range(40)) - held)
    assert audited == [i for i, grad in data.seen if grad and i in set(audited)][-32:]


def test_resuming_with_a_new_held_out_split_warns_that_it_may_have_been_trained_on(tmp_path):
    from dtorch.models import build_model
    from dtorch.train.trainer import Trainer

    kw = dict(model=partial(build_model, SPEC), data=Recorder(40), global_batch=4, seq_len=16, plan={}, console=False,
              checkpoint_dir=tmp_path, async_checkpoint=False, straggler_every=0, metrics_every=0)
    Trainer(**kw).fit(2)
    Trainer(eval_split=0.2, **kw).fit(3)
    (resume,) = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()
                 if json.loads(x).get("event") == "resume"]
    assert any("held-out eval split changed (None -> 0.2)" in c for c in resume["changed"]), resume
