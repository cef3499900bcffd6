"""Learning-rate schedules (`dtorch train --lr-schedule constant|cosine|linear|wsd`): each curve is its
formula, bad values are refused before any work, and a resumed run's learning rates are the
uninterrupted run's."""

from __future__ import annotations

import json
import math
from functools import partial
from pathlib import Path

import pytest
import torch

from dtorch.errors import ConfigError
from dtorch.train.job import JobConfig
from dtorch.train.optim import WSD, Constant, WarmupCosine, WarmupLinear, schedule

SPEC = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=16"
TOTAL, WARMUP, MIN = 40, 5, 0.1


def _curve(spec, total: int = TOTAL, base: float = 2.0) -> list[float]:
    """The learning rates a LambdaLR built from `spec` gives steps 0..total-1, read as the trainer reads them."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base)
    sched = spec.build(opt, total)
    out = []
    for _ in range(total):
        out.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return out


def _expected(name: str, s: int, decay_ratio: float = 0.25) -> float:
    if s < WARMUP and name != "constant0":
        return (s + 1) / WARMUP
    if name in ("constant", "constant0"):
        return 1.0
    p = (s - WARMUP) / (TOTAL - WARMUP)
    if name == "cosine":
        return MIN + (1 - MIN) * 0.5 * (1 + math.cos(math.pi * p))
    if name == "linear":
        return MIN + (1 - MIN) * (1 - p)
    decay = round(TOTAL * decay_ratio)
    start = TOTAL - decay
    return 1.0 if s < start else MIN + (1 - MIN) * (1 - (s - start) / decay)


@pytest.mark.parametrize("name", ["constant", "cosine", "linear", "wsd"])
def test_each_schedule_is_its_formula(name):
    spec = schedule(name, warmup_steps=WARMUP, min_ratio=MIN, decay_ratio=0.25)
    assert type(spec) is {"constant": Constant, "cosine": WarmupCosine, "linear": WarmupLinear, "wsd": WSD}[name]
    assert _curve(spec) == pytest.approx([2.0 * _expected(name, s) for s in range(TOTAL)], rel=1e-12)


def test_defaults_keep_the_schedules_runs_had():
    # dtorch train's default is today's cosine with a floor of 0.1; Constant() is flat with no warm-up
    assert JobConfig().schedule() == WarmupCosine(warmup_steps=20, min_ratio=0.1)
    assert _curve(Constant(), 5) == [2.0] * 5
    # wsd: flat at the peak between the warm-up and the last decay_ratio of the steps, then down
    lr = _curve(WSD(warmup_steps=WARMUP, min_ratio=MIN, decay_ratio=0.25))
    assert lr[WARMUP:30] == [2.0] * (30 - WARMUP) and lr[30] == 2.0 and lr[31] < 2.0 and lr[-1] > 2.0 * MIN


@pytest.mark.parametrize("kw,field", [
    ({"lr_schedule": "step"}, "lr_schedule"),
    ({"lr_schedule": "wsd", "lr_decay_ratio": 0.0}, "lr_decay_ratio"),  # the job's field, not the schedule's
    ({"lr_schedule": "wsd", "lr_decay_ratio": 1.5}, "lr_decay_ratio"),
    ({"lr_min_factor": -0.1}, "lr_min_factor"),
    ({"lr_min_factor": 2.0}, "lr_min_factor"),
    ({"warmup": -1}, "warmup"),
])
def test_bad_schedule_values_name_the_field_when_the_config_is_made(kw, field):
    with pytest.raises(ConfigError) as e:
        JobConfig(**kw)
    assert e.value.field == field


def test_a_decay_that_does_not_fit_the_steps_is_refused_before_any_work():
    from dtorch.models import build_model
    from dtorch.train.trainer import Trainer

    tr = Trainer(model=partial(build_model, SPEC), data=[torch.zeros(17, dtype=torch.long)] * 8, global_batch=4,
                 seq_len=16, lr_schedule=WSD(warmup_steps=8, decay_ratio=0.5), console=False)
    with pytest.raises(ConfigError, match="do not fit in 10 steps") as e:
        tr.fit(10)
    assert e.value.field == "decay_ratio" and tr.parallel is None  # nothing was built


def _lrs(log_dir: Path) -> dict[int, float]:
    out = {}
    for line in (log_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "lr" in rec and "event" not in rec:
            out[rec["step"]] = rec["lr"]
    return out


@pytest.mark.parametrize("spec", [WSD(warmup_steps=2, decay_ratio=0.5, min_ratio=0.0),
                                  WarmupLinear(warmup_steps=3, min_ratio=0.2)], ids=["wsd", "linear"])
def test_a_resumed_run_has_the_uninterrupted_runs_learning_rates(tmp_path, spec):
    from dtorch.models import build_model
    from dtorch.train import hooks
    from dtorch.train.optim import AdamW
    from dtorch.train.trainer import Trainer

    data = [torch.randint(0, 64, (17,), generator=torch.Generator().manual_seed(i)) for i in range(32)]

    def trainer(ckpt: Path) -> Trainer:
        return Trainer(model=partial(build_model, SPEC), data=data, global_batch=4, seq_len=16, plan={},
                       optimizer=AdamW(lr=1e-2), lr_schedule=spec, checkpoint_dir=ckpt, checkpoint_every=3,
                       async_checkpoint=False, console=False, straggler_every=0, metrics_every=0)

    class Killed(Exception):
        pass

    def kill(step: int) -> None:
        if step == 5:
            raise Killed  # the run dies at the start of step 5; its last checkpoint is step 3's

    trainer(tmp_path / "whole").fit(8)
    hooks.register(before_step=kill)
    try:
        with pytest.raises(Killed):
            trainer(tmp_path / "resumed").fit(8)
    finally:
        hooks._before.remove(kill)
    second = trainer(tmp_path / "resumed").fit(8)
    assert second.resumed_from == 3 and second.steps_run == 5
    whole, resumed = _lrs(tmp_path / "whole"), _lrs(tmp_path / "resumed")
    assert sorted(resumed) == list(range(1, 9))
    assert resumed == whole  # exactly: the factor is a pure function of the restored step
    assert whole == pytest.approx({s + 1: 1e-2 * spec.factor(s, 8) for s in range(8)}, rel=1e-12)
    resume = [r for r in _records(tmp_path / "resumed") if r.get("event") == "resume"]
    assert len(resume) == 1 and "changed" not in resume[0]  # the same schedule over the same steps


def _records(log_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines()]


def test_resuming_with_another_schedule_says_so(tmp_path, capsys):
    from dtorch.models import build_model
    from dtorch.train.trainer import Trainer

    data = [torch.randint(0, 64, (17,), generator=torch.Generator().manual_seed(i)) for i in range(16)]
    kw = dict(model=partial(build_model, SPEC), data=data, global_batch=4, seq_len=16, plan={}, checkpoint_dir=tmp_path,
              async_checkpoint=False, straggler_every=0, metrics_every=0)
    Trainer(lr_schedule=WarmupCosine(warmup_steps=1), console=False, **kw).fit(2)
    Trainer(lr_schedule=WSD(warmup_steps=1, decay_ratio=0.5), console=True, **kw).fit(4)  # decay from the checkpoint
    (resume,) = [r for r in _records(tmp_path) if r.get("event") == "resume"]
    (change,) = resume["changed"]
    assert "WarmupCosine(warmup_steps=1,min_ratio=0.1)/2 -> WSD(warmup_steps=1,min_ratio=0.1,decay_ratio=0.5)/4" in change
    assert "learning-rate schedule changed" in capsys.readouterr().err


def test_resuming_with_another_dataset_or_batch_says_so(tmp_path, capsys):
    """The sample order is a function of the dataset's size, the global batch, the seed and the step:
    a resume that changes one of them does not continue the checkpointed run's order, and says so."""
    from dtorch.models import build_model
    from dtorch.train.trainer import Trainer

    def data(n):
        return [torch.randint(0, 64, (17,), generator=torch.Generator().manual_seed(i)) for i in range(n)]

    kw = dict(model=partial(build_model, SPEC), seq_len=16, plan={}, checkpoint_dir=tmp_path, async_checkpoint=False,
              straggler_every=0, metrics_every=0)
    Trainer(data=data(16), global_batch=4, console=False, **kw).fit(2)
    Trainer(data=data(16), global_batch=4, console=False, **kw).fit(3)  # the same stream: nothing said
    Trainer(data=data(12), global_batch=2, console=True, **kw).fit(4)
    first, second = [r for r in _records(tmp_path) if r.get("event") == "resume"]
    stream = ("the dataset's size in samples", "the global batch", "the seed")
    assert not [c for c in first.get("changed", []) if c.startswith(stream)], first  # (its schedule: 2 -> 3 steps)
    assert sorted(c.split(" changed")[0] for c in second["changed"] if c.startswith(stream)) == [
        "the dataset's size in samples", "the global batch"], second
    assert "the dataset's size in samples changed (16 -> 12)" in capsys.readouterr().err
