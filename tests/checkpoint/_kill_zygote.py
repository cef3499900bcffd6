"""Kill a saving process at random moments (used by test_kill.py).

    python _kill_zygote.py BASE TRIALS SEED

Imports torch once, then per trial forks a child that saves steps 1, 2, 3, ... into
BASE/trial-NN (odd steps sync, even steps async; a writer slowed at write_data and finish and a
fault hook that sleeps at every commit phase spread the save over time). The child appends
"phase <name>" and "committed <step>" lines to BASE/trial-NN.log with O_APPEND writes, which
survive SIGKILL. The zygote SIGKILLs the child after a random delay. A last child writes under a
file-size limit (EFBIG, as on a full disk) and logs to BASE/disk-full.log. The zygote itself runs no
torch ops, so forking it is safe (no thread pools exist yet).
"""

from __future__ import annotations

import os
import random
import resource
import signal
import sys
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemWriter

from dtorch.checkpoint import CheckpointError, CheckpointManager


def child(root: Path, log_path: Path, seed: int) -> None:
    torch.set_num_threads(1)
    rng = random.Random(seed)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)

    def note(line: str) -> None:
        os.write(fd, (line + "\n").encode())

    def hook(phase: str) -> None:
        note(f"phase {phase}")
        time.sleep(rng.uniform(0, 0.02))

    class SlowWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            note("phase write_data")
            time.sleep(rng.uniform(0, 0.04))
            return super().write_data(plan, planner)

        def finish(self, metadata, results):
            note("phase finish")
            time.sleep(rng.uniform(0, 0.02))
            return super().finish(metadata, results)

    mgr = CheckpointManager(root, keep_last=2, writer_factory=SlowWriter, fault_hook=hook)
    step = 0
    while True:
        step += 1
        state = {
            "model": {"w": torch.full((128, 64), float(step)), "i": torch.full((3000,), step, dtype=torch.int64)},
            "meta": {"step": step},
        }
        mgr.save(step, state, async_=step % 2 == 0, extra={"step": step})
        mgr.wait()
        note(f"committed {step}")


def disk_full_child(root: Path, log_path: Path) -> None:
    """Commit step 1, then hit a 256 KiB file-size limit (EFBIG, like a full disk) in step 2."""
    torch.set_num_threads(1)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG from write() instead of dying
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    mgr = CheckpointManager(root, keep_last=2)
    mgr.save(1, {"model": {"w": torch.full((16,), 1.0)}, "meta": {"step": 1}})
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    try:
        mgr.save(2, {"model": {"w": torch.full((1 << 20,), 2.0)}, "meta": {"step": 2}})
        os.write(fd, b"saved despite the limit\n")
    except CheckpointError as e:
        os.write(fd, f"refused {e}\n".encode())


def main(base: Path, trials: int, seed: int) -> None:
    rng = random.Random(seed)
    for i in range(trials):
        root, log_path = base / f"trial-{i:02d}", base / f"trial-{i:02d}.log"
        pid = os.fork()
        if pid == 0:
            try:
                child(root, log_path, seed * 1000 + i)
            finally:
                os._exit(1)
        time.sleep(rng.uniform(0.05, 0.9))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    pid = os.fork()
    if pid == 0:
        try:
            disk_full_child(base / "disk-full", base / "disk-full.log")
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    print("done", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
    sys.stdout.flush()
    os._exit(0)
