"""Multi-process checkpoints over gloo with real files: save at world size 3, load at 2 and 1
bit-exact (DTensor and FSDP2 state), a round trip at 2, a damaged shard seen by all ranks, and a
rank killed mid-save (no commit)."""

from __future__ import annotations

import multiprocessing
import os
import socket
import sys
from pathlib import Path

import pytest
import torch

from dtorch.checkpoint import CheckpointManager

HERE = Path(__file__).parent
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
sys.path.insert(0, str(HERE.parent / "parallel"))
from _harness import PRELOAD  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, scenario: str, world: int, root: str, port: int, env: dict, log: str) -> None:
    """One rank of `_dist_worker.py SCENARIO ROOT`, in a process forked from the forkserver: the
    environment a launched worker would have, its output into `log`."""
    os.environ.clear()
    os.environ.update(env, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.path.insert(0, str(HERE))
    import _dist_worker

    _dist_worker.main(scenario, Path(root))


def _launch(scenario: str, world: int, root: Path, killed: tuple[int, ...] = ()) -> None:
    """Run the scenario on `world` ranks forked from the forkserver the parallel tests use (torch
    and DTorch imported once per session, not once per rank); ranks in `killed` must die of SIGKILL,
    the others exit 0."""
    multiprocessing.set_forkserver_preload(PRELOAD)  # takes effect when the server first starts
    log_dir = root.with_name(root.name + "-logs")  # beside the checkpoint root, not in it
    log_dir.mkdir(exist_ok=True)
    logs = [str(log_dir / f"{scenario}-rank{r}.log") for r in range(world)]
    ctx, port, env = multiprocessing.get_context("forkserver"), _free_port(), dict(os.environ)
    procs = [ctx.Process(target=_rank, args=(rank, scenario, world, str(root), port, env, logs[rank]))
             for rank in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    if any(p.is_alive() for p in procs):
        for p in procs:
            p.kill()
        raise AssertionError(f"{scenario}: a rank did not finish within 120 s")
    for rank, p in enumerate(procs):
        want = -9 if rank in killed else 0
        out = Path(logs[rank]).read_text() if Path(logs[rank]).exists() else ""
        assert p.exitcode == want, f"{scenario} rank {rank} exit {p.exitcode}, expected {want}:\n{out[-4000:]}"


@pytest.mark.slow
def test_save_at_3_load_at_2_and_1_bit_exact_round_trip_and_shared_fallback(tmp_path):
    sys.path.insert(0, str(HERE))
    try:
        import _dist_worker as w
    finally:
        sys.path.remove(str(HERE))
    _launch("save3", 3, tmp_path)
    info = CheckpointManager(tmp_path).list()
    assert [(i.step, i.world_size) for i in info] == [(2, 3), (1, 3)]
    _launch("load2", 2, tmp_path, killed=(1,))
    assert [i.step for i in CheckpointManager(tmp_path, keep_last=None).list()] == [3, 2, 1]
    # World size 1 (this process, no process group): plain tensors and a plain model.
    net = w.model()
    state = {"t": {k: torch.zeros_like(v) for k, v in w.full_tensors(0).items()}, "model": net.state_dict(),
             "meta": {"step": -1}}
    mgr = CheckpointManager(tmp_path, keep_last=None)
    assert mgr.load(2, state) == 2 and state["meta"] == {"step": 2}
    assert all(torch.equal(state["t"][k], v) for k, v in w.full_tensors(2).items())
    ref = w.model().state_dict()
    assert all(torch.equal(net.state_dict()[k], ref[k] * 2.0) for k in ref)
    assert mgr.load(1, state) == 1 and all(torch.equal(state["t"][k], v) for k, v in w.full_tensors(1).items())
    assert not mgr.verify(3).ok and mgr.verify(2).ok  # step 3's rank-1 shard was damaged by the workers
