"""In-memory snapshots of an offloaded optimizer (dtorch.train.offload): the snapshot holds the
real optimizer state wherever the tier keeps it (host memory, or files on disk where the
optimizer's own `state` holds only meta tensors), and a restore continues bit-identically.
Single process, real files; about 2 s."""

from __future__ import annotations

import pytest
import torch

from dtorch.checkpoint.snapshot import LiveModules, LiveOptimizers, Snapshotter
from dtorch.train.offload import OffloadedOptimizer, OptimizerOffload
from dtorch.train.optim import AdamW


def _build(cfg: OptimizerOffload):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 3))
    # small blocks: the state is spread over several block files
    return model, OffloadedOptimizer(model.parameters(), AdamW(lr=0.05), cfg, tag="t")


def _step(model, opt, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    loss = model(torch.randn(4, 6, generator=g)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


@pytest.mark.parametrize("tier", ["host", "nvme", "nvme_params"])
def test_a_snapshot_of_an_offloaded_optimizer_restores_bit_identically(tmp_path, tier):
    def cfg(name: str) -> OptimizerOffload:
        if tier == "host":
            return OptimizerOffload("host")
        d = tmp_path / name
        d.mkdir()
        return OptimizerOffload("nvme", directory=str(d), block_bytes=256, params_on_disk=tier == "nvme_params")

    model, opt = _build(cfg("a"))
    (tmp_path / "shm").mkdir()
    snap = Snapshotter(tmp_path / "shm", rank=0, world_size=1, tag="t")
    state = {"model": LiveModules([model]), "optim": LiveOptimizers([opt])}
    for step in range(1, 4):
        _step(model, opt, step)
        snap.take(step, state)
    snap.wait()
    assert snap.disabled is None, snap.disabled  # before the fix: "Cannot copy out of meta tensor"
    want = opt.state_dict()
    want = {i: {k: v.clone() for k, v in s.items()} for i, s in want["state"].items()}
    assert all(torch.count_nonzero(s["exp_avg_sq"]) for s in want.values())  # real numbers, stepped
    later = [_step(model, opt, s) for s in range(4, 7)]  # the uninterrupted run

    model2, opt2 = _build(cfg("b"))  # a restarted worker: fresh model, fresh files
    restored = Snapshotter(tmp_path / "shm", 0, 1, tag="t").restore(
        {"model": LiveModules([model2]), "optim": LiveOptimizers([opt2])}, durable_step=None)
    assert restored == 3
    got = opt2.state_dict()["state"]
    assert got.keys() == want.keys()
    assert all(torch.equal(got[i][k], v) for i, s in want.items() for k, v in s.items())
    assert [_step(model2, opt2, s) for s in range(4, 7)] == later
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    snap.close()
    opt.close()
    opt2.close()
