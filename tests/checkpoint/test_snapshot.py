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


def test_live_optimizers_and_reused_packing_follow_every_change(tmp_path):
    """The optimizer state and the packed snapshot tree are reused between takes: a snapshot
    must still hold the values of the step it was taken at, and any replaced piece rebuilds."""
    from dtorch.checkpoint.snapshot import LiveModules, LiveOptimizers

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))

    def train(model, opt, sched):
        model(torch.randn(5, 3)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()

    model, opt, sched = build()
    train(model, opt, sched)
    live = LiveOptimizers([opt])
    first = live.state_dict()
    assert live.state_dict()["0"]["state"] is first["0"]["state"]  # nothing replaced: reused
    snap = Snapshotter(tmp_path, rank=0, world_size=1, tag="t")
    state = {"model": LiveModules([model]), "optim": live}
    want = {}
    for step in range(1, 6):  # both slots taken twice over: their packings are reused
        train(model, opt, sched)
        snap.take(step, state)
        snap.wait()
        want[step] = ({k: v.clone() for k, v in model.state_dict().items()}, copy_optim(opt))
    assert live.state_dict()["0"]["state"] is first["0"]["state"]
    assert live.state_dict()["0"]["param_groups"][0]["lr"] == opt.param_groups[0]["lr"]  # fresh scalars
    model2, opt2, _ = build()
    assert Snapshotter(tmp_path, 0, 1, tag="t").restore({"model": LiveModules([model2]), "optim": LiveOptimizers([opt2])},
                                                         durable_step=None) == 5
    assert_same_optim(copy_optim(opt2), want[5][1])
    assert all(torch.equal(v, want[5][0][k]) for k, v in model2.state_dict().items())

    # a replaced state tensor, a loaded state dict, a new param group: each rebuilds
    p = model[0].weight
    opt.state[p]["exp_avg"] = torch.full_like(p, 7.0)
    again = live.state_dict()
    assert again["0"]["state"] is not first["0"]["state"] and torch.equal(again["0"]["state"][0]["exp_avg"], p * 0 + 7)
    snap.take(6, state)
    snap.wait()
    opt3 = build()[1]
    Snapshotter(tmp_path, 0, 1, tag="t").restore({"optim": LiveOptimizers([opt3])}, durable_step=None)
    assert torch.equal(opt3.state[opt3.param_groups[0]["params"][0]]["exp_avg"], torch.full_like(p, 7.0))
    opt.load_state_dict(opt.state_dict())
    assert live.state_dict()["0"]["state"] is not again["0"]["state"]
    extra = torch.nn.Parameter(torch.ones(2))
    opt.add_param_group({"params": [extra], "lr": 0.5})
    groups = live.state_dict()["0"]["param_groups"]
    assert [g["params"] for g in groups] == [g["params"] for g in opt.state_dict()["param_groups"]]
    # an optimizer whose state-dict hook rewrites the dict is asked for it every time
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "marker": 1})
    assert live.state_dict()["0"]["marker"] == 1
    snap.close()


def copy_optim(opt):
    sd = opt.state_dict()
    return {"state": {i: {k: v.clone() for k, v in s.items()} for i, s in sd["state"].items()},
            "param_groups": [dict(g) for g in sd["param_groups"]]}


def assert_same_optim(a, b):
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i, s in a["state"].items():
        assert s.keys() == b["state"][i].keys() and all(torch.equal(v, b["state"][i][k]) for k, v in s.items())


def test_numpy_rng_state_read_cheaply_is_always_the_full_state():
    """RNGState reads NumPy's global generator raw while it has not moved: after every kind of
    draw (one consuming a held Gaussian included) it must equal `np.random.get_state()`."""
    import numpy as np

    def same():
        full = np.random.get_state(legacy=True)
        got = RNGState().state_dict()["numpy"]
        assert got["keys"].tolist() == full[1].tolist() and got["pos"] == full[2]
        assert got["has_gauss"] == full[3] and got["cached_gaussian"] == full[4]

    np.random.seed(3)
    same()
    same()  # unmoved: the raw read
    for draw in (lambda: np.random.random(3), lambda: np.random.standard_normal(),  # holds a Gaussian
                 lambda: None, lambda: np.random.standard_normal(),  # hands it out: key and pos unmoved
                 lambda: None, lambda: np.random.seed(3), lambda: np.random.randint(9, size=700)):
        draw()
        same()
    state = np.random.get_state()
    np.random.random(5)
    np.random.set_state(state)
    same()


def test_a_long_tuple_holding_a_tensor_is_walked_and_never_pickled_whole(tmp_path):
    """Long tuples are checked for scalars only on the side thread: one holding a tensor drops
    that take (its header would hold the tensor itself), and long tuples are walked from then on."""
    w = torch.zeros(3)
    snap = Snapshotter(tmp_path, rank=0, world_size=1, tag="t")
    snap.take(1, {"m": {"t": tuple(range(100)) + (w,)}})
    snap.wait()
    assert not (tmp_path / "rank0-slot1.hdr").exists()  # dropped
    w.add_(1.0)
    snap.take(2, {"m": {"t": tuple(range(100)) + (w,)}, "flat": {"r": tuple(range(1000))}})
    snap.wait()
    w.add_(1.0)
    got = {"m": {}, "flat": {}}
    assert Snapshotter(tmp_path, 0, 1, tag="t").restore(got, durable_step=None) == 2
    assert got["m"]["t"][:100] == tuple(range(100)) and torch.equal(got["m"]["t"][100], torch.ones(3))
    assert got["flat"]["r"] == tuple(range(1000))
    snap.close()


def _buffer_of(tmp_path, slot: int, key: str):
    """The shared-memory file holding tensor `key` of box "m" in rank 0's snapshot slot `slot`."""
    from dtorch.checkpoint.snapshot import _read_header

    doc = _read_header(tmp_path / f"rank0-slot{slot}.hdr")
    return tmp_path / doc["tree"]["m"][key]["__shm__"]


def test_a_snapshot_edited_in_shared_memory_is_skipped_for_the_next_source(tmp_path):
    """Snapshots are signed with the job's key (HMAC over the header and every byte of state): a
    process of the same user that zeroes a tensor in the shared-memory files, or rewrites a header,
    gets its edit skipped and named, and the next source is restored: the older slot, else none
    (the durable checkpoint)."""
    key = b"k" * 32
    snap = Snapshotter(tmp_path, rank=0, world_size=1, tag="t", key=key)
    for step in (1, 2, 3):  # step 3 in slot 1, step 2 in slot 0
        snap.take(step, {"m": _Box(step)})
        snap.wait()
    snap.close()
    w3 = _buffer_of(tmp_path, 1, "w")
    w3.write_bytes(bytes(w3.stat().st_size))  # the "embedding" of step 3 zeroed in place
    box = _Box(0)
    reader = Snapshotter(tmp_path, 0, 1, tag="t", key=key)
    assert reader.restore({"m": box}, durable_step=None) == 2
    assert torch.equal(box.sd["w"], _Box(2).sd["w"])
    (bad,) = reader.rejected
    assert bad["rank"] == 0 and bad["step"] == 3 and bad["held"] == "own" and "HMAC" in bad["why"]
    # a header rewritten to claim another step (its MAC kept): skipped as well
    hdr = tmp_path / "rank0-slot0.hdr"
    raw = hdr.read_bytes()
    step_at = raw.index(b"step") + len(b"step") + 2  # BININT1 opcode 'K', then the step byte
    assert raw[step_at - 1:step_at] == b"K" and raw[step_at] == 2
    hdr.write_bytes(raw[:step_at] + bytes([4]) + raw[step_at + 1:])
    reader = Snapshotter(tmp_path, 0, 1, tag="t", key=key)
    assert reader.restore({"m": _Box(0)}, durable_step=None) is None
    assert sorted(b["step"] for b in reader.rejected) == [3, 4]
    # intact snapshots signed with another key (another job, another user) are never restored
    hdr.write_bytes(raw)
    w3.unlink()
    (tmp_path / "rank0-slot1.hdr").unlink()
    assert Snapshotter(tmp_path, 0, 1, tag="t", key=key).restore({"m": _Box(0)}, durable_step=None) == 2
    other = Snapshotter(tmp_path, 0, 1, tag="t", key=b"x" * 32)
    assert other.restore({"m": _Box(0)}, durable_step=None) is None and [b["step"] for b in other.rejected] == [2]
