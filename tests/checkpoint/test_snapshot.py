"""In-memory snapshots (shared-memory files): a snapshot restores bit-exactly, a slot torn by a
death mid-copy is never used, other configurations are ignored. Single process, real files."""

from __future__ import annotations

import random

import pytest
import torch

from dtorch.checkpoint.snapshot import Snapshotter
from dtorch.checkpoint.state import RNGState


class _Box:
    """A Stateful holding tensors and plain values, like the trainer's state wrappers."""

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.sd = {"w": torch.randn(5, 3, generator=g), "h": torch.randn(4, generator=g).to(torch.bfloat16),
                   "step": seed, "groups": [{"lr": 0.1 * seed, "betas": (0.9, 0.95)}]}

    def state_dict(self):
        return self.sd

    def load_state_dict(self, sd):
        self.sd = sd


@pytest.mark.parametrize("background", [True, False])
def test_snapshot_restores_the_newest_step_bit_exactly_and_skips_a_torn_slot(tmp_path, background):
    snap = Snapshotter(tmp_path, rank=0, world_size=1, tag="plan-a", background=background)
    for step in (1, 2):
        random.seed(step)
        snap.take(step, {"m": _Box(step), "rng": RNGState()})
    snap.wait()  # the copy runs on a side thread until joined
    expected = _Box(2).sd
    random.seed(2)
    want_draw = random.random()
    got = {"m": _Box(0), "rng": RNGState()}
    random.seed(99)
    assert snap.restore(got, durable_step=None) == 2
    assert random.random() == want_draw  # the RNG streams are restored too
    assert torch.equal(got["m"].sd["w"], expected["w"]) and got["m"].sd["h"].dtype == torch.bfloat16
    assert torch.equal(got["m"].sd["h"], expected["h"]) and got["m"].sd["groups"] == expected["groups"]
    snap.take(3, {"m": _Box(3)})
    snap.wait()
    # a rank that dies while copying step 4 into slot 0 has removed that slot's header first,
    # then half-overwritten its buffers: the other slot (step 3) is what a restart gets
    (tmp_path / "rank0-slot0.hdr").unlink()
    for f in tmp_path.glob("rank0-slot0-*.bin"):
        f.write_bytes(b"\xff" * f.stat().st_size)
    box = _Box(0)
    assert Snapshotter(tmp_path, 0, 1, tag="plan-a").restore({"m": box}, durable_step=None) == 3
    assert torch.equal(box.sd["w"], _Box(3).sd["w"])
    # not newer than the durable checkpoint, another plan, another world: not restored
    assert Snapshotter(tmp_path, 0, 1, tag="plan-a").restore({"m": _Box(0)}, durable_step=3) is None
    assert Snapshotter(tmp_path, 0, 1, tag="plan-b").restore({"m": _Box(0)}, durable_step=None) is None
    assert Snapshotter(tmp_path, 0, 2, tag="plan-a").restore({"m": _Box(0)}, durable_step=None) is None


def test_full_shared_memory_turns_snapshots_off_instead_of_crashing(tmp_path):
    import os
    import subprocess

    import pytest

    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    fs = tmp_path / "shm"
    fs.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(fs)], check=True)
    try:
        snap = Snapshotter(fs, rank=0, world_size=1, tag="t")
        snap.take(1, {"m": {"w": torch.zeros(64 * 1024)}})  # 256 KiB into 64 KiB
        snap.wait()  # the buffers are reserved on the side thread: its failure is reported here
        assert snap.disabled and "cannot write snapshots" in snap.disabled
        assert snap.restore({"m": {"w": torch.ones(3)}}, durable_step=None) is None
    finally:
        subprocess.run(["umount", "-l", str(fs)], check=True)


def test_live_modules_reuse_the_state_dict_only_while_every_tensor_is_the_modules_own():
    from dtorch.checkpoint.snapshot import LiveModules

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    live = LiveModules([model])
    first = live.state_dict()
    assert live.state_dict() is first  # nothing changed: the same dict, read at copy time
    with torch.no_grad():
        model[0].weight.add_(1.0)  # in place: the reused dict sees the new values
    assert live.state_dict() is first and torch.equal(first["0"]["0.weight"], model[0].weight)
    model[0].weight = torch.nn.Parameter(torch.zeros(4, 3))  # replaced: rebuilt
    again = live.state_dict()
    assert again is not first and torch.equal(again["0"]["0.weight"], torch.zeros(4, 3))
    model[1].bias.data = torch.ones(4)  # storage moved under the same Parameter: rebuilt
    third = live.state_dict()
    assert third is not again and torch.equal(third["0"]["1.bias"], torch.ones(4))
    model.add_module("2", torch.nn.Linear(4, 2))  # a new submodule: rebuilt, with its keys
    assert "2.weight" in live.state_dict()["0"]
    model.register_buffer("scale", torch.ones(1))
    assert "scale" in live.state_dict()["0"]
