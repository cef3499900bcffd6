"""Optimizer offload (dtorch.train.offload): the host and NVMe tiers compute what the in-memory
optimizer computes, keep their files private and tidy, refuse a bad directory before training, and
checkpoint in the in-memory optimizer's shape (a run resumes across tiers).

Cost: about 30 s on 2 shared cores (three gloo groups: world 1, world 2 losses, world 2 resume); the
overlap cases (no clipping, 8 steps) add about 10 s of CPU.
"""

from __future__ import annotations

import copy
import os
import stat
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))
from _harness import run_group  # noqa: E402

from dtorch.errors import ConfigError  # noqa: E402
from dtorch.train.offload import OffloadedOptimizer, OptimizerOffload, check_directory  # noqa: E402
from dtorch.train.optim import SGD, AdamW  # noqa: E402

STEPS = 8  # enough for the loss to move (6+ distinct values) and for the NVMe buffers to cycle many times


def _trainer(case: dict, **kw):
    from dtorch.models import build_model
    from dtorch.plan.plan import Plan
    from dtorch.train.trainer import Trainer

    offload = case.get("offload")
    if offload == "nvme":
        offload = OptimizerOffload("nvme", directory=case["dir"], block_bytes=40_000, buffers=3,
                                   params_on_disk=case.get("params_on_disk", False))
    elif offload == "host_blocks":  # small blocks: the backward releases them one by one
        offload = OptimizerOffload("host", block_bytes=40_000)
    return Trainer(model=lambda: build_model("llama-tiny"), plan=Plan(**case["plan"]), global_batch=4, seq_len=32,
                   optimizer=AdamW(lr=3e-3), offload=offload, console=False, straggler_every=0, metrics_every=0,
                   seed=1, max_grad_norm=case.get("clip", 1.0), **kw)


def _losses_worker(case: dict, rank: int) -> dict:
    tr = _trainer(case)
    steps = case.get("steps", STEPS)
    res = tr.fit(steps)
    out = {"losses": [res.losses[s] for s in range(1, steps + 1)],
           "kind": [type(o).__name__ for o in tr.optimizers]}
    out["in_backward"] = sum(getattr(o, "stats", {}).get("in_backward", 0) for o in tr.optimizers)
    if case.get("offload") == "nvme":
        store = tr.optimizers[0].store
        out["files"] = [oct(stat.S_IMODE(os.stat(p).st_mode)) for p in store.paths]
        out["dir_mode"] = oct(stat.S_IMODE(os.stat(store.dir).st_mode))
        out["bytes_read"] = store.bytes_read
        for o in tr.optimizers:
            o.close()
        out["removed"] = not store.dir.exists()
    return out


def _cases(plan: dict, tmp: str) -> list[dict]:
    return [{"plan": plan}, {"plan": plan, "offload": "optimizer"},
            {"plan": plan, "offload": "nvme", "dir": tmp, "params_on_disk": True}]


def _check_same_losses(results: list[list[dict]]) -> None:
    for per_rank in results:
        for r in per_rank:
            assert "error" not in r, r["error"]
    ref = results[0][0]["losses"]
    assert len(set(ref)) > 5  # the loss moves: the comparison means something
    for per_rank in results[1:]:
        assert [r["losses"] for r in per_rank] == [ref] * len(per_rank)  # bit-identical, every rank
    assert results[1][0]["kind"] == ["OffloadedOptimizer"] and results[0][0]["kind"] == ["AdamW"]
    nvme = results[2]
    for r in nvme:
        assert r["bytes_read"] > 0
        assert set(r["files"]) == {"0o600"} and r["dir_mode"] == "0o700"
        assert r["removed"]


def test_offload_tiers_match_in_memory_losses_at_world_1(tmp_path):
    """Also without clipping, where the blocks are stepped during the backward (the overlap:
    post-accumulate-grad hooks, a worker thread; each parameter's hook counts to the last of two
    micro-batches). The overlap cases add about 5 s."""
    plan = {"microbatch_size": 2, "num_microbatches": 2}
    by_plan = {"plan": {**plan, "offload": "optimizer"}}  # the Plan's field selects the host tier
    results = run_group(1, _cases(plan, str(tmp_path)) + [by_plan] + _no_clip_cases(plan, str(tmp_path)),
                        _losses_worker)
    _check_same_losses(results[:3])
    assert results[3][0]["kind"] == ["OffloadedOptimizer"]
    assert results[1][0]["in_backward"] == 0  # clipping: the step waits for every gradient
    _check_same_losses(results[4:])
    assert results[5][0]["in_backward"] > 5 and results[6][0]["in_backward"] > 5  # it did overlap


def _no_clip_cases(plan: dict, tmp: str) -> list[dict]:
    """Without gradient clipping the tiers step each block during the backward (the overlap)."""
    return [{"plan": plan, "clip": None, "steps": 8}, {"plan": plan, "clip": None, "steps": 8, "offload": "host_blocks"},
            {"plan": plan, "clip": None, "steps": 8, "offload": "nvme", "dir": tmp}]


def test_offload_tiers_match_in_memory_losses_under_fsdp_and_ddp_at_world_2(tmp_path):
    fsdp = _cases({"dp_shard": 2, "microbatch_size": 2}, str(tmp_path / "f"))
    ddp = _cases({"dp_replicate": 2, "microbatch_size": 1, "num_microbatches": 2}, str(tmp_path / "d"))
    (tmp_path / "f").mkdir()
    (tmp_path / "d").mkdir()
    # without clipping: FSDP steps blocks during the backward; DDP, whose gradients are all-reduced
    # after they land, steps after it (about 8 s more)
    fsdp_overlap = _no_clip_cases({"dp_shard": 2, "microbatch_size": 2}, str(tmp_path / "f"))[:2]
    ddp_no_clip = [{"plan": {"dp_replicate": 2, "microbatch_size": 2}, "clip": None, "steps": 8,
                    "offload": "host_blocks"}]
    results = run_group(2, fsdp + ddp + fsdp_overlap + ddp_no_clip, _losses_worker)
    _check_same_losses(results[:3])
    _check_same_losses(results[3:6])
    ref = results[6][0]["losses"]
    assert len(set(ref)) > 5 and [r["losses"] for r in results[7]] == [ref, ref]
    assert all(r["in_backward"] > 5 for r in results[7])
    assert [r["losses"] for r in results[8]] == [ref, ref] and [r["in_backward"] for r in results[8]] == [0, 0]


def _resume_worker(case: dict, rank: int) -> dict:
    from dtorch.train.state import OptimizerState

    out: dict = {}
    if case["what"] == "shape":  # the state dict dtorch.checkpoint sees, per tier, after one step
        tr = _trainer(case)
        tr.fit(1)
        sd = OptimizerState(tr.parallel, tr.optimizers).state_dict()
        out["shape"] = {k: [type(v).__name__, list(v.shape), str(getattr(v, "placements", ""))]
                        if isinstance(v, torch.Tensor) else repr(v) for k, v in sorted(sd.items())}
        return out
    tr = _trainer(case, checkpoint_dir=case["ckpt"], checkpoint_every=100, async_checkpoint=True)
    res = tr.fit(case["steps"])
    return {"losses": {str(k): v for k, v in res.losses.items()}, "resumed": res.resumed_from}


def test_checkpoint_resumes_across_tiers(tmp_path):
    """Saved with the NVMe tier, resumed in memory; saved in memory, resumed with the host tier:
    the continuation is the uninterrupted in-memory run's, bit for bit."""
    plan = {"dp_shard": 2, "microbatch_size": 2}
    (tmp_path / "nv").mkdir()
    nv = str(tmp_path / "nv")
    cases = [
        {"what": "run", "plan": plan, "ckpt": str(tmp_path / "ref"), "steps": 6},
        {"what": "run", "plan": plan, "ckpt": str(tmp_path / "a"), "steps": 3, "offload": "nvme", "dir": nv},
        {"what": "run", "plan": plan, "ckpt": str(tmp_path / "a"), "steps": 6},
        {"what": "run", "plan": plan, "ckpt": str(tmp_path / "b"), "steps": 3},
        {"what": "run", "plan": plan, "ckpt": str(tmp_path / "b"), "steps": 6, "offload": "optimizer"},
        {"what": "shape", "plan": plan},
        {"what": "shape", "plan": plan, "offload": "optimizer"},
        {"what": "shape", "plan": plan, "offload": "nvme", "dir": nv},
    ]
    res = run_group(2, cases, _resume_worker)
    for per_rank in res:
        for r in per_rank:
            assert "error" not in r, r["error"]
    ref = res[0][0]["losses"]
    for first, second in ((res[1], res[2]), (res[3], res[4])):
        assert second[0]["resumed"] == 3
        assert {k: ref[k] for k in ("1", "2", "3")} == first[0]["losses"]
        assert {k: ref[k] for k in ("4", "5", "6")} == second[0]["losses"]
    shapes = [res[i][0]["shape"] for i in (5, 6, 7)]
    assert any(".exp_avg_sq" in k and "DTensor" in str(v) for k, v in shapes[0].items())
    assert shapes[1] == shapes[0] and shapes[2] == shapes[0]


def test_bad_nvme_directory_is_one_line_naming_it_and_the_bytes(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match=r"nope.*does not exist.*1,000 bytes"):
        check_directory(missing, 1000)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if not os.access(locked, os.W_OK):  # (root may write anyway)
            with pytest.raises(ConfigError, match=r"locked.*not writable.*1,000 bytes"):
                check_directory(locked, 1000)
    finally:
        locked.chmod(0o700)
    with pytest.raises(ConfigError, match=r"bytes free but the optimizer state needs"):
        check_directory(tmp_path, 1 << 62)
    with pytest.raises(ConfigError, match=r"budget_bytes.*needs 5,000 bytes"):
        check_directory(tmp_path, 5000, budget_bytes=4000)
    for e in (ConfigError("x", 1, "y"),):
        assert "\n" not in str(e)


def test_bad_nvme_directory_fails_the_trainer_before_training(tmp_path):
    from dtorch.plan.plan import Plan
    from dtorch.train.trainer import Trainer

    with pytest.raises(ConfigError, match="offload_dir.*--offload-dir DIR.*offload_dir="):
        Trainer(model=lambda: None, offload="optimizer_nvme")  # no directory given: both spellings named
    with pytest.raises(ConfigError, match="offload"):
        Trainer(model=lambda: None, offload="disk")
    # a directory the host tier would never use is an error, not silently ignored
    with pytest.raises(ConfigError, match="offload_dir.*optimizer_nvme"):
        Trainer(model=lambda: None, offload="optimizer", offload_dir=tmp_path)
    from dtorch.models import build_model

    tr = Trainer(model=lambda: build_model("llama-tiny"), plan=Plan(microbatch_size=2), global_batch=2, seq_len=16,
                 offload="optimizer_nvme", offload_dir=tmp_path / "missing", console=False, straggler_every=0,
                 metrics_every=0)
    with pytest.raises(ConfigError, match=r"missing.*does not exist.*bytes"):
        tr.fit(2)
    assert tr.step == 0


def test_cli_nvme_tier_without_a_directory_names_the_flag_before_any_worker(tmp_path, capsys):
    """`dtorch train --offload optimizer_nvme` without `--offload-dir`: one line naming the flag,
    exit 2, in the launcher's preflight (no run directory made, no worker started)."""
    from dtorch.cli import main

    run = tmp_path / "run"
    code = main(["train", "--nproc", "2", "--steps", "2", "--offload", "optimizer_nvme", "--model", "llama-tiny",
                 "--checkpoint-dir", str(tmp_path / "ckpt"), "--run-dir", str(run)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("dtorch train: error: offload_dir=None:") and "--offload-dir DIR" in err[0], err
    assert not run.exists() and not (tmp_path / "ckpt").exists()


def test_offloaded_state_lives_where_the_tier_says(tmp_path):
    """One process, no group: the NVMe tier's state is in its files (the host holds buffers only),
    SGD with momentum works through the same path, and closing removes the files."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8))
    twins = [copy.deepcopy(net) for _ in range(3)]
    spec = SGD(lr=0.05, momentum=0.9)
    opts = [spec.build(twins[0].parameters()),
            OffloadedOptimizer(twins[1].parameters(), spec, OptimizerOffload("host")),
            OffloadedOptimizer(twins[2].parameters(), spec, OptimizerOffload("nvme", directory=str(tmp_path),
                                                                             block_bytes=4096))]
    x, y = torch.randn(16, 32), torch.randn(16, 8)
    for _ in range(4):
        for m, o in zip(twins, opts):
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad()
    for a, b, c in zip(*(m.parameters() for m in twins)):
        assert torch.equal(a, b) and torch.equal(a, c)
    nvme = opts[2]
    assert len(nvme.blocks) > 1 and nvme.memory()["disk_bytes"] == sum(p.numel() for p in net.parameters()) * 4
    assert all(v.is_meta for st in nvme.state.values() for k, v in st.items() if k == "momentum_buffer")
    ref = opts[0].state_dict()["state"]
    got = nvme.state_dict()["state"]
    assert all(torch.equal(ref[i]["momentum_buffer"], got[i]["momentum_buffer"]) for i in ref)
    directory = nvme.store.dir
    nvme.close()
    assert not directory.exists()


def test_left_behind_directories_of_dead_processes_are_removed(tmp_path):
    from dtorch.train.offload.store import DiskBlocks, make_blocks

    old = tmp_path / "dtorch-offload-999999999-r0p0-old"  # no such pid
    fresh = tmp_path / "dtorch-offload-999999998-r0p0-new"
    for d in (old, fresh):
        d.mkdir()
        (d / "block00000.f32").write_bytes(b"\0" * 8)
    os.utime(old / "block00000.f32", (1, 1))
    store = DiskBlocks(make_blocks([10, 2000], ("exp_avg",), 64), tmp_path, "t")
    assert not old.exists() and fresh.exists()  # a recent one may belong to a live run elsewhere
    assert [p.stat().st_size for p in store.paths] == [4096, 8192]  # reserved up front, whole pages
    store.close()
    assert not store.dir.exists()


@pytest.mark.parametrize("direct", [True, False])
def test_tier_files_round_trip_direct_or_buffered_and_stay_private(tmp_path, direct):
    import stat

    from dtorch.cluster.disk import ALIGN, TierFile, aligned_buffer

    f = TierFile(tmp_path / "b", 1000, direct=direct)
    assert stat.S_IMODE(os.stat(f.path).st_mode) == 0o600 and os.path.getsize(f.path) == ALIGN
    src = aligned_buffer(1000)
    src[:1000] = os.urandom(1000)
    f.write(src, 1000)
    dst = aligned_buffer(1000)
    assert f.read(dst, 1000) == ALIGN and dst[:1000] == src[:1000]
    odd = bytearray(2 * ALIGN + 8)  # a buffer that is not page-aligned: buffered I/O, same bytes
    assert f.read(memoryview(odd)[8:], 1000) == ALIGN and bytes(odd[8:1008]) == src[:1000]
    assert f.mode == "buffered"
    f.close()


def test_disk_probe_measures_and_leaves_nothing(tmp_path):
    from dtorch.cluster.disk import measure_disk

    doc = measure_disk(tmp_path, nbytes=4 * 2**20, chunk=2**20)
    assert doc["bytes"] == 4 * 2**20 and doc["write_bytes_per_s"] > 0 and doc["read_bytes_per_s"] > 0
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ConfigError, match="disk"):
        measure_disk(tmp_path / "missing")


def _thp_eligible(address: int) -> bool:
    """Whether the mapping holding `address` may get transparent huge pages (/proc/self/smaps)."""
    hit = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            hit = lo <= address < hi
        elif hit and head == "THPeligible:":
            return line.split()[1] == "1"
    return False


def test_tier_and_probe_buffers_ask_for_huge_pages():
    # the disk sees a direct I/O as requests of physically contiguous runs of the buffer: huge pages
    # make them the device's largest, in the tier's block buffers and the probe's alike (disk.py)
    from dtorch.cluster.disk import HUGE_PAGE, aligned_buffer, huge_pages_mode
    from dtorch.train.offload.store import Slot

    if huge_pages_mode() != "madvise" or not os.path.exists("/proc/self/smaps"):
        pytest.skip("needs transparent huge pages in madvise mode (what the advice changes)")
    import ctypes

    slot = Slot(4 * HUGE_PAGE // 4, 4 * HUGE_PAGE // 4, pin=False)
    probe = aligned_buffer(4 * HUGE_PAGE)
    assert _thp_eligible(slot.data.data_ptr())
    assert _thp_eligible(ctypes.addressof(ctypes.c_char.from_buffer(probe)))
    assert not _thp_eligible(slot.grad.data_ptr())  # the gradient staging: no disk I/O, no advice
    assert not _thp_eligible(ctypes.addressof(ctypes.c_char.from_buffer(aligned_buffer(4 * HUGE_PAGE, huge=False))))


def _resident_bytes(t: torch.Tensor) -> int:
    """Bytes of `t`'s memory that are resident in this process (mincore(2) over its pages)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    lo = t.data_ptr() // page * page
    n = -(-(t.data_ptr() + t.numel() * t.element_size() - lo) // page)
    vec = (ctypes.c_ubyte * n)()
    assert libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(n * page), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) * page


def test_an_oversized_block_leaves_host_memory_once_written_back(tmp_path):
    # a slot is sized for the largest block (an embedding), but keeps only a regular block's pages
    # once that block is written back: otherwise the step's last block (the head) is still resident
    # when the next step's first (the embedding) comes in, two oversized blocks at the step's peak
    from dtorch.train.offload.store import Block, DiskBlocks, Pipeline

    mib = 2**20 // 4  # float32 elements of a MiB
    blocks = [Block([0], [8 * mib], ("exp_avg", "exp_avg_sq")), Block([1], [mib], ("exp_avg", "exp_avg_sq"))]
    store = DiskBlocks(blocks, tmp_path, "t")
    io = Pipeline(store, 2, blocks[0].numel, blocks[0].param_numel, pin=False,
                  keep=(blocks[1].numel, blocks[1].param_numel))
    try:
        slot, fut = io.start(0, read=False)
        store.buffer(0, slot).fill_(1.0)
        slot.grad[: blocks[0].param_numel].fill_(1.0)
        assert _resident_bytes(slot.data) >= 16 * 2**20 and _resident_bytes(slot.grad) >= 8 * 2**20
        io.finish(0, slot)
        io.drain()
        assert _resident_bytes(slot.data) <= 2 * 2**20 + 2 * 2**21  # a regular block's 2 MiB (+ a huge page each side)
        assert _resident_bytes(slot.grad) <= 1 * 2**20 + 2 * 4096
        with store.mapped(0) as flat:  # what was written is on the disk, not lost with the pages
            assert bool((flat == 1.0).all())
    finally:
        io.close()
        store.close()


def test_disk_probe_records_its_figures_in_the_calibration(tmp_path, monkeypatch, capsys):
    from dtorch.cli import main
    from dtorch.cluster.calibration_store import read_calibration

    disk, out = tmp_path / "disk", tmp_path / "calib.json"
    disk.mkdir()
    assert main(["probe", "--disk", str(disk), "--disk-bytes", str(2**20), "--out", str(out)]) == 0
    doc = read_calibration(out)["disk"]
    assert doc["write_bytes_per_s"] > 0 and doc["read_bytes_per_s"] > 0 and doc["free_bytes"] > 0
    assert f"recorded in {out}" in capsys.readouterr().out
    # without --out: this host's stored calibrations (none here: it says how to make one)
    monkeypatch.setenv("DTORCH_CALIBRATION_DIR", str(tmp_path / "empty"))
    assert main(["probe", "--disk", str(disk), "--disk-bytes", str(2**20)]) == 0
    assert "run `dtorch probe` first" in capsys.readouterr().out
