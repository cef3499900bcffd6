"""Checkpoint faults are known at once: free space is checked against the checkpoint's expected
size before writing (retention frees older checkpoints first), a save that fills a real disk
fails at the next step with the bytes needed and the last good checkpoint, which still verifies.
Real small filesystems (tmpfs), mounted as root."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import time

import pytest
import torch

from dtorch.checkpoint import CheckpointError, CheckpointManager

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

KB = 1024


@contextlib.contextmanager
def small_fs(path, size_kb: int):
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k,mode=0700", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def _state(seed: int, kb: int = 256) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(kb * KB // 4, generator=g)}, "meta": {"step": seed}}


def _fill(directory) -> None:
    """Take every free byte of the filesystem (a real full disk, not an injected error)."""
    with open(directory / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * (64 * KB))
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC


def test_save_that_cannot_fit_is_refused_before_writing_with_bytes_needed_and_last_good(tmp_path):
    with small_fs(tmp_path / "fs", 448) as fs:
        mgr = CheckpointManager(fs / "ckpt", keep_last=None)
        mgr.save(1, _state(1))
        with pytest.raises(CheckpointError, match=r"needs [\d,]+ bytes, [\d,]+ are free; last good checkpoint: .*step-00000001") as e:
            mgr.save(2, _state(2))
        assert not e.value.retryable
        assert sorted(p.name for p in (fs / "ckpt").iterdir() if p.is_dir()) == ["step-00000001"]  # nothing written
        assert mgr.verify(1).ok


def test_retention_frees_older_checkpoints_first_when_space_is_short(tmp_path):
    with small_fs(tmp_path / "fs", 768) as fs:
        mgr = CheckpointManager(fs / "ckpt", keep_last=2)
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
        mgr.save(3, _state(3))  # fits only once step 1, which retention drops anyway, is gone
        assert [s for s, _ in sorted((i.step, i.path) for i in mgr.list())] == [2, 3]
        assert mgr.verify(3).ok


def test_async_save_that_fills_the_disk_fails_at_the_next_check_and_keeps_the_last_good(tmp_path):
    with small_fs(tmp_path / "fs", 1024) as fs:
        root = fs / "ckpt"
        filled = []

        def hook(phase: str) -> None:
            if phase == "begin" and len(filled) == 1:  # the second save: after its space check
                _fill(fs)
            if phase == "begin":
                filled.append(phase)

        mgr = CheckpointManager(root, keep_last=None, fault_hook=hook)
        mgr.save(1, _state(1))
        mgr.save(2, _state(2), async_=True)
        deadline = time.time() + 30
        with pytest.raises(CheckpointError) as e:
            while time.time() < deadline:  # what the trainer does once per step
                mgr.raise_if_failed()
                time.sleep(0.01)
        msg = str(e.value)
        assert "No space left" in msg and "needs about" in msg and "step-00000001" in msg, msg
        assert not e.value.retryable
        os.unlink(fs / "filler")
        assert mgr.verify(1).ok
        assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step-00000001"]  # no torn step 2
        mgr.close()
