"""Metric sinks people use (`dtorch.train.callbacks.TensorBoard`, `WandB`): what each wrote is read
back with the tools' own readers (TensorBoard's EventAccumulator, the W&B offline run file) and is
what metrics.jsonl holds; a sink asked for whose package is missing names its extra (exit 2)."""

from __future__ import annotations

import json
import math
import struct
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dtorch.errors import ConfigError

SPEC = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=16"


def _fit(tmp_path: Path, sinks: list, steps: int = 4, checkpoint_every: int = 100):
    from dtorch.models import build_model
    from dtorch.train.optim import AdamW, Constant
    from dtorch.train.trainer import Trainer

    g = torch.Generator().manual_seed(0)
    data = [torch.randint(64, (17,), generator=g) for _ in range(40)]
    tr = Trainer(model=partial(build_model, SPEC), data=data, global_batch=4, seq_len=16, plan={},
                 optimizer=AdamW(lr=1e-2), lr_schedule=Constant(), console=False, straggler_every=0, metrics_every=0,
                 eval_every=2, eval_split=0.2, checkpoint_dir=tmp_path / "run", checkpoint_every=checkpoint_every,
                 sinks=sinks)
    tr.fit(steps)
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps_ = {r["step"]: r for r in recs if "event" not in r and "loss" in r}
    evals = {r["step"]: r for r in recs if r.get("event") == "eval"}
    return steps_, evals


def test_tensorboard_sink_writes_what_metrics_jsonl_holds(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dtorch.train.callbacks import TensorBoard

    steps, evals = _fit(tmp_path, [TensorBoard()])
    acc = EventAccumulator(str(tmp_path / "run" / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/tokens_per_s", "train/mfu", "memory/peak_bytes", "eval/loss",
            "eval/perplexity"} <= tags

    def series(tag):
        return {e.step: e.value for e in acc.Scalars(tag)}

    assert series("train/loss") == {s: pytest.approx(r["loss"], rel=1e-6) for s, r in steps.items()}
    assert series("train/mfu") == {s: pytest.approx(r["mfu"], rel=1e-6) for s, r in steps.items()}
    assert series("train/tokens_per_s") == {s: pytest.approx(r["tokens_per_s"], rel=1e-6) for s, r in steps.items()}
    assert series("memory/peak_bytes") == {s: pytest.approx(r["peak_memory_bytes"], rel=1e-6) for s, r in steps.items()}
    assert sorted(evals) == [2, 4]
    assert series("eval/loss") == {s: pytest.approx(e["loss"], rel=1e-6) for s, e in evals.items()}
    assert series("eval/perplexity") == {s: pytest.approx(math.exp(e["loss"]), rel=1e-5) for s, e in evals.items()}
    assert "plan/text_summary" in acc.Tags()["tensors"]


def _wandb_records(path: Path):
    """The protobuf records of a W&B run file (`run-<id>.wandb`): a 7-byte header (':W&B', magic,
    version), then LevelDB-log records (crc32c, length, type: full/first/middle/last) in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, part = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(part + chunk)
            part = b""
            yield rec
        elif kind in (2, 3):
            part += chunk


def _wandb_history(run_file: Path) -> tuple[list[dict], dict, dict[str, str]]:
    """(history rows in `_step` order, config, each metric's x-axis) of a finished W&B run file.
    wandb's service process writes the file after `finish()` returns: wait (at most 30 s) for the
    run's exit record."""
    deadline = time.monotonic() + 30
    while not any(r.WhichOneof("record_type") == "exit" for r in _wandb_records(run_file)):
        assert time.monotonic() < deadline, f"{run_file} has no exit record"
        time.sleep(0.1)
    history, config, axes = {}, {}, {}
    for rec in _wandb_records(run_file):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in rec.history.item}
            history.setdefault(row["_step"], {}).update(row)
        elif kind == "run":
            config.update({u.key: json.loads(u.value_json) for u in rec.run.config.update})
        elif kind == "metric" and rec.metric.step_metric:
            axes[rec.metric.name or rec.metric.glob_name] = rec.metric.step_metric
    return [history[s] for s in sorted(history)], config, axes


def test_wandb_sink_offline_run_holds_the_metrics_and_a_resume_continues_it(tmp_path, monkeypatch):
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wb").mkdir()
    # wandb keeps its settings (the run directory among them) process-wide from its first run: an
    # earlier test's run in this session (a doc command's --wandb) would put this one's elsewhere
    wandb.teardown()
    from dtorch.train.callbacks import WandB

    steps, evals = _fit(tmp_path, [WandB("dtorch-test")])
    runs = sorted((tmp_path / "wb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    rows, config, axes = _wandb_history(runs[0])
    assert axes == {"*": "train/step"}  # every chart's x-axis is the global step
    history = {r["train/step"]: r for r in rows}
    assert [r["train/step"] for r in rows] == sorted(steps)  # one row per step, the evaluations in theirs
    for s, r in steps.items():
        for key, tag in (("loss", "train/loss"), ("lr", "train/lr"), ("tokens_per_s", "train/tokens_per_s"),
                         ("mfu", "train/mfu"), ("peak_memory_bytes", "memory/peak_bytes")):
            assert history[s][tag] == pytest.approx(r[key], rel=1e-9), (s, tag)
    for s, e in evals.items():
        assert history[s]["eval/loss"] == pytest.approx(e["loss"]) and history[s]["eval/perplexity"] > 1
    assert config["world_size"] == 1 and config["plan"] and config["mfu_peak_flops_per_rank"] > 0
    run_id = (tmp_path / "run" / "wandb-run-id").read_text()
    assert runs[0].name == f"run-{run_id}.wandb"

    # the same command again resumes from the checkpoint: the same W&B run, steps 5-6 only, in rows
    # after the first start's
    steps2, _ = _fit(tmp_path, [WandB("dtorch-test")], steps=6)
    again = [p for p in (tmp_path / "wb" / "wandb").glob("offline-run-*/run-*.wandb") if p != runs[0]]
    assert [p.name for p in again] == [f"run-{run_id}.wandb"]
    rows2 = _wandb_history(again[0])[0]
    assert [r["train/step"] for r in rows2] == [5, 6] and rows2[0]["_step"] > rows[-1]["_step"]


def _offline_wandb(tmp_path: Path, monkeypatch) -> Path:
    """W&B in offline mode writing under `tmp_path`/wb (its run files: wb/wandb/offline-run-*)."""
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wb").mkdir()
    wandb.teardown()  # wandb's settings are process-wide from its first run (see above)
    return tmp_path / "wb" / "wandb"


def test_steps_rerun_after_a_recovery_are_kept_by_wandb_and_tensorboard(tmp_path, monkeypatch):
    """A run that logged steps 1-6 and crashed, resumed from its checkpoint of step 4, logs steps
    5 and 6 again. W&B refuses a `_step` below its last one, so the sink's rows only grow and the
    global step is the `train/step` metric: the re-run points are there, with the values of the
    re-run. TensorBoard's event files keep both points too (its viewer shows the re-run's)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dtorch.train import hooks
    from dtorch.train.callbacks import TensorBoard, WandB

    wb = _offline_wandb(tmp_path, monkeypatch)

    def crash(step, loss):
        if step == 6:
            raise RuntimeError("crash after step 6")

    hooks.register(after_step=crash)
    try:
        with pytest.raises(RuntimeError, match="crash after step 6"):
            _fit(tmp_path, [TensorBoard(), WandB("dtorch-test")], steps=8, checkpoint_every=4)
    finally:
        hooks.clear()
    _fit(tmp_path, [TensorBoard(), WandB("dtorch-test")], steps=8, checkpoint_every=4)

    logged = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
              if "event" not in r and "loss" in r]
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8]
    assert logged[4]["step_time_s"] != logged[6]["step_time_s"]  # step 5's two points tell apart

    files = sorted(wb.glob("offline-run-*/run-*.wandb"), key=lambda p: p.parent.name)
    assert len(files) == 2 and files[0].name == files[1].name  # one W&B run, resumed
    rows = [r for f in files for r in _wandb_history(f)[0]]
    assert [r["_step"] for r in rows] == sorted({r["_step"] for r in rows})  # only growing: none refused
    assert [r["train/step"] for r in rows] == [r["step"] for r in logged]
    for row, rec in zip(rows, logged):
        assert row["train/loss"] == pytest.approx(rec["loss"], rel=1e-9)
        assert row["train/step_time_s"] == pytest.approx(rec["step_time_s"], rel=1e-9)
    evals = [(r["train/step"], r["eval/loss"]) for r in rows if "eval/loss" in r]
    assert [s for s, _ in evals] == [2, 4, 6, 8]

    acc = EventAccumulator(str(tmp_path / "run" / "tb"))
    acc.Reload()
    tb = [(e.step, e.value) for e in acc.Scalars("train/step_time_s")]
    assert tb == [(r["step"], pytest.approx(r["step_time_s"], rel=1e-6)) for r in logged]


def test_sinks_write_on_rank_0_only(tmp_path):
    from dtorch.train.callbacks import TensorBoard

    sink = TensorBoard(log_dir=str(tmp_path / "tb"))
    worker = SimpleNamespace(rank=1, log_dir=tmp_path, metrics=SimpleNamespace(sinks=[]))
    sink.on_start(worker, None)
    sink.close(worker, None)
    assert not worker.metrics.sinks and not (tmp_path / "tb").exists()


@pytest.mark.parametrize("flag,extra", [(["--tensorboard"], "tensorboard"), (["--wandb", "proj"], "wandb")])
def test_a_sink_asked_for_and_missing_names_its_extra(monkeypatch, capsys, flag, extra):
    import importlib.util

    from dtorch.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == extra else real(name, *a))
    capsys.readouterr()
    assert main(["train", *flag, "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"pip install 'dtorch-os[{extra}]'" in err, err
    with pytest.raises(ConfigError, match=extra):
        from dtorch.train.job import JobConfig

        JobConfig(**{"tensorboard": True} if extra == "tensorboard" else {"wandb": "proj"})
