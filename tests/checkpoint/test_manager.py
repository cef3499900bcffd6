"""Single-process checkpoint behaviour: round trip, damage detection and fallback, retention,
async save, failed saves, export and the CLI. Real files, real DCP."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemWriter

from dtorch.checkpoint import CheckpointError, CheckpointManager, CheckpointWarning, RNGState
from dtorch.cli import main as cli_main
from dtorch.errors import ConfigError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    model = {"w": torch.randn(17, 5, generator=g), "b": torch.randn(5, generator=g), "i": torch.arange(7) * seed}
    return {"model": model, "meta": {"step": seed, "lrs": [0.1 * seed, 0.2], "name": f"run{seed}"}}


def _blank() -> dict:
    return {
        "model": {"w": torch.zeros(17, 5), "b": torch.zeros(5), "i": torch.zeros(7, dtype=torch.int64)},
        "meta": {"step": -1, "lrs": [], "name": ""},
    }


def _assert_same(a: dict, b: dict) -> None:
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["meta"] == b["meta"]


def test_round_trip_restores_tensors_plain_values_and_rng_bit_exact(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=None)
    src = _state(3)
    torch.manual_seed(11)
    random.seed(12)
    np.random.seed(13)
    res = mgr.save(3, {**src, "rng": RNGState()}, extra={"loss": 2.5}, plan={"dp_shard": 1})
    assert res.committed and res.bytes > 0 and mgr.latest_pointer() == "step-00000003"
    expected = (torch.rand(4), random.random(), np.random.rand())
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    dst = {**_blank(), "rng": RNGState()}
    assert mgr.load_latest(dst) == 3
    _assert_same(src, dst)
    assert torch.equal(torch.rand(4), expected[0]) and random.random() == expected[1] and np.random.rand() == expected[2]
    assert mgr.loaded.extra == {"loss": 2.5} and mgr.loaded.plan == {"dp_shard": 1}


def test_empty_directory_is_a_fresh_run(tmp_path):
    assert CheckpointManager(tmp_path / "new").load_latest(_blank()) is None


def _shard(path):
    return sorted(path.glob("__0_*.distcp"))[0]


@pytest.mark.parametrize("target", ["shard", ".metadata", "manifest.json", "rank-00000.pt"])
@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_file_is_named_and_the_previous_checkpoint_is_used(tmp_path, target, damage):
    mgr = CheckpointManager(tmp_path, keep_last=None)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    f = _shard(tmp_path / "step-00000002") if target == "shard" else tmp_path / "step-00000002" / target
    data = bytearray(f.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    else:
        data = data[: len(data) // 2]
    f.write_bytes(bytes(data))
    report = mgr.verify(2)
    assert not report.ok and f.name in " ".join(report.problems)
    dst = _blank()
    with pytest.warns(CheckpointWarning, match=f.name.replace(".", r"\.")):
        assert mgr.load_latest(dst) == 1
    _assert_same(_state(1), dst)


def test_no_intact_checkpoint_fails_with_the_directory_and_what_to_do(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, _state(1))
    _shard(tmp_path / "step-00000001").write_bytes(b"garbage")
    with pytest.warns(CheckpointWarning), pytest.raises(CheckpointError) as e:
        mgr.load_latest(_blank())
    assert str(tmp_path) in str(e.value) and "__0_0.distcp" in str(e.value) and "restore" in e.value.fix


def test_retention_keeps_the_newest_k_and_never_the_newest_good_one(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for s in range(1, 5):
        mgr.save(s, _state(s))
    assert [i.step for i in mgr.list()] == [4, 3]
    # Both kept checkpoints damaged: pruning to one must keep the newest one that verifies.
    mgr2 = CheckpointManager(tmp_path, keep_last=None)
    mgr2.save(5, _state(5))
    for s in (5, 4):
        _shard(tmp_path / f"step-{s:08d}").write_bytes(b"bad")
    deleted = mgr2.prune(keep_last=1)
    assert sorted(p.name for p in deleted) == ["step-00000004"]
    assert [i.step for i in mgr2.list()] == [5, 3]
    with pytest.warns(CheckpointWarning):
        assert mgr2.load_latest(_blank()) == 3


class _GatedWriter(FileSystemWriter):
    """A writer that blocks in write_data until the test opens the gate."""

    def __init__(self, path, gate: threading.Event):
        super().__init__(path)
        self.gate = gate

    def write_data(self, plan, planner):
        assert self.gate.wait(60)
        return super().write_data(plan, planner)


def test_async_save_returns_before_the_write_and_saves_the_state_at_call_time(tmp_path):
    gate = threading.Event()
    mgr = CheckpointManager(tmp_path, writer_factory=lambda p: _GatedWriter(p, gate))
    src = _state(7)
    res = mgr.save(7, src, async_=True)
    assert res.async_ and not res.committed and res.stall_s >= 0
    assert mgr.list() == []  # nothing committed while the writer is held
    src["model"]["w"].add_(1.0)  # training goes on and changes the weights
    gate.set()
    done = mgr.wait()
    assert done is res and res.committed and res.persist_s >= res.stall_s
    dst = _blank()
    assert mgr.load_latest(dst) == 7
    _assert_same(_state(7), dst)
    # A second async save reuses the staging buffers; the first checkpoint keeps its values.
    mgr.save(8, src, async_=True)
    mgr.wait()
    dst8 = _blank()
    assert mgr.load(8, dst8) == 8 and torch.equal(dst8["model"]["w"], src["model"]["w"])
    assert mgr.load(7, dst) == 7 and torch.equal(dst["model"]["w"], _state(7)["model"]["w"])
    # Identical bytes to a sync save of the same state.
    sync = CheckpointManager(tmp_path / "sync")
    sync.save(7, _state(7))
    assert _shard(tmp_path / "step-00000007").read_bytes() == _shard(tmp_path / "sync" / "step-00000007").read_bytes()


class _FailingWriter(FileSystemWriter):
    def finish(self, metadata, results):
        raise OSError(28, "No space left on device")


def test_failed_save_raises_keeps_the_previous_checkpoint_and_leaves_no_debris(tmp_path):
    CheckpointManager(tmp_path).save(1, _state(1))
    mgr = CheckpointManager(tmp_path, writer_factory=_FailingWriter)
    with pytest.raises(CheckpointError, match="No space left"):
        mgr.save(2, _state(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step-00000001"]
    dst = _blank()
    assert mgr.load_latest(dst) == 1
    _assert_same(_state(1), dst)


def test_saving_a_step_again_replaces_it_whole(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(4, _state(4))
    mgr.save(4, _state(9))
    dst = _blank()
    assert mgr.load_latest(dst) == 4 and [i.step for i in mgr.list()] == [4]
    _assert_same(_state(9), dst)


def test_export_safetensors_and_cli(tmp_path, capsys):
    mgr = CheckpointManager(tmp_path / "run")
    from dtorch.plan import Plan

    mgr.save(2, _state(2), extra={"loss": 1.25}, plan=Plan(dp_shard=2))
    out = tmp_path / "model.safetensors"
    assert cli_main(["ckpt", "export", str(tmp_path / "run"), str(out), "--key", "model"]) == 0
    tensors = load_file(out)
    assert sorted(tensors) == ["model.b", "model.i", "model.w"]
    assert all(torch.equal(tensors[f"model.{k}"], v) for k, v in _state(2)["model"].items())
    assert cli_main(["ckpt", "ls", str(tmp_path / "run")]) == 0
    listed = capsys.readouterr().out
    assert "loss=1.25" in listed and Plan(dp_shard=2).describe() in listed  # the plan it was written with
    assert cli_main(["ckpt", "verify", str(tmp_path / "run")]) == 0
    (tmp_path / "run" / "step-00000002" / ".metadata").write_bytes(b"x")
    assert cli_main(["ckpt", "verify", str(tmp_path / "run")]) == 1
    assert ".metadata" in capsys.readouterr().out
    assert cli_main(["ckpt", "ls", str(tmp_path / "missing")]) == 2


def test_optimizer_lr_schedule_and_sampler_round_trip_through_an_async_save(tmp_path):
    from dtorch.checkpoint import ModelState
    from dtorch.train.sampler import GlobalSampler

    def make():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))

    model, opt, sched = make()
    for _ in range(3):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    mgr = CheckpointManager(tmp_path)
    mgr.save(3, {"train": ModelState(model, opt), "sched": sched, "sampler": GlobalSampler(100, 8, 1)}, async_=True)
    mgr.wait()
    model2, opt2, sched2 = make()
    assert mgr.load_latest({"train": ModelState(model2, opt2), "sched": sched2, "sampler": GlobalSampler(100, 8, 1)}) == 3
    assert sched2.state_dict() == sched.state_dict() and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg_sq"], opt.state_dict()["state"][0]["exp_avg_sq"])
    with pytest.raises(Exception, match="sampler.seed"):
        mgr.load_latest({"train": ModelState(model2, opt2), "sched": sched2, "sampler": GlobalSampler(100, 8, 2)})
    with pytest.raises(ConfigError, match="JSON"):
        mgr.save(4, {"sched": sched}, extra={"bad": object()})
