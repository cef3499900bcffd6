"""Snapshot replication to a peer node (`Snapshotter(group=, peer=, source=)`): two gloo ranks,
each with its own snapshot directory as if on two nodes. Rank 1's directory is wiped (its node
lost); a fresh pair of snapshotters (the restarted job) restores every rank's newest step, rank
1's from the replica that rank 0's node holds, bit-exactly; the newest step (4) is not restored:
rank 1 had turned snapshots off by then. About 4-13 s (two processes, forked from the suite's
forkserver that imported torch once: tests/parallel/_harness.py)."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dtorch.checkpoint.snapshot import Snapshotter, peer_ranks

sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))
from _harness import PRELOAD  # noqa: E402


def _start(worker, port: int, root: str):
    """Run `worker(rank, port, root, queue)` on ranks 0 and 1; returns the queue. The processes fork
    from the forkserver the parallel tests use (torch imported once per session, not per process);
    each gets this process's environment as it is now, as a spawned one would."""
    multiprocessing.set_forkserver_preload(PRELOAD)  # takes effect when the server first starts
    q = mp.get_context("forkserver").Queue()
    mp.start_processes(_in_env, args=(dict(os.environ), worker, port, root, q), nprocs=2, start_method="forkserver")
    return q


def _in_env(rank: int, env: dict, worker, port: int, root: str, q) -> None:
    os.environ.clear()
    os.environ.update(env)
    worker(rank, port, root, q)


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 3, generator=g), "b": torch.randn(7, generator=g).to(torch.float64),
            "empty": torch.zeros(0), "meta": {"step": seed, "name": f"s{seed}"}}


def _worker(rank: int, port: int, root: str, q) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        dirs = [os.path.join(root, f"node{r}") for r in range(2)]
        group = dist.new_group(backend="gloo")
        peer, source = peer_ranks([(0, 0), (1, 0)], rank)
        snap = Snapshotter(dirs[rank], rank, 2, tag="t", group=group, peer=peer, source=source)
        live = _state(100 * rank)
        for step in (1, 2, 3):
            snap.wait()  # as the elastic worker does before a step changes the state
            for k, v in _state(100 * rank + step).items():
                if isinstance(v, torch.Tensor):
                    live[k].copy_(v)
                else:
                    live[k] = v
            snap.take(step, {"s": live})
        snap.wait()
        if rank == 1:  # snapshots off on one rank (say /dev/shm full): rounds must still pair, no hang
            snap._turn_off("test", warn=False)
        live["w"].add_(1)
        snap.take(4, {"s": live})  # rank 0's own step 4; no rank 1 step 4 anywhere
        snap.close()
        dist.barrier()
        held = sorted(n for n in os.listdir(dirs[rank]) if n.endswith(".hdr"))
        if rank == 1:  # node 1 is lost: its snapshots with it
            shutil.rmtree(dirs[1])
            os.makedirs(dirs[1], mode=0o700)
        dist.barrier()
        fresh = {"s": _state(999)}
        snap2 = Snapshotter(dirs[rank], rank, 2, tag="t", group=group, peer=peer, source=source)
        got = snap2.restore(fresh, durable_step=None)
        want = _state(100 * rank + 3)
        same = all(torch.equal(fresh["s"][k], want[k]) and fresh["s"][k].dtype == want[k].dtype
                   for k in ("w", "b", "empty")) and fresh["s"]["meta"] == want["meta"]
        q.put((rank, got, same, held, list(snap2.restored_from)))
        snap2.close()
    finally:
        dist.destroy_process_group()


def test_a_lost_node_restores_from_the_replica_its_peer_node_holds(tmp_path):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    for r in range(2):
        os.makedirs(tmp_path / f"node{r}", mode=0o700)
    q = _start(_worker, port, str(tmp_path))
    res = sorted(q.get(timeout=5) for _ in range(2))
    for rank, got, same, held, restored_from in res:
        assert got == 3 and same, res
        # each node holds its rank's own two slots (rank 1 none: turned off) and the peer's two
        own = [f"rank{rank}-slot0.hdr", f"rank{rank}-slot1.hdr"] if rank == 0 else []
        assert held == sorted([f"peer{1 - rank}-slot0.hdr", f"peer{1 - rank}-slot1.hdr", *own]), held
        assert restored_from == [1]


def test_peer_ranks_pair_the_same_local_rank_on_the_next_node():
    nodes = [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert [peer_ranks(nodes, r) for r in range(6)] == [(2, 4), (3, 5), (4, 0), (5, 1), (0, 2), (1, 3)]
    assert peer_ranks([(0, 0), (0, 1)], 1) == (None, None)  # one node: nothing to replicate to
    assert peer_ranks([(0, 0), (0, 1), (1, 0)], 1) == (None, None)  # no local rank 1 elsewhere
    assert peer_ranks([(5, 0), (3, 0)], 0) == (1, 1)  # node ranks in any order


def _edited_worker(rank: int, port: int, root: str, q) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        from dtorch.checkpoint.snapshot import _read_header

        dirs = [os.path.join(root, f"node{r}") for r in range(2)]
        group = dist.new_group(backend="gloo")
        peer, source = peer_ranks([(0, 0), (1, 0)], rank)
        snap = Snapshotter(dirs[rank], rank, 2, tag="t", group=group, peer=peer, source=source)
        live = _state(100 * rank)
        for step in (1, 2, 3):
            snap.wait()
            for k, v in _state(100 * rank + step).items():
                if isinstance(v, torch.Tensor):
                    live[k].copy_(v)
            snap.take(step, {"s": live})
        snap.close()
        dist.barrier()
        if rank == 1:  # another process zeroes rank 1's own copy of step 3 in shared memory
            doc = _read_header(Path(dirs[1]) / "rank1-slot1.hdr")
            path = os.path.join(dirs[1], doc["tree"]["s"]["w"]["__shm__"])
            with open(path, "r+b") as f:
                f.write(bytes(os.path.getsize(path)))
        dist.barrier()
        fresh = {"s": _state(999)}
        snap2 = Snapshotter(dirs[rank], rank, 2, tag="t", group=group, peer=peer, source=source)
        got = snap2.restore(fresh, durable_step=None)
        want = _state(100 * rank + 3)
        same = all(torch.equal(fresh["s"][k], want[k]) for k in ("w", "b"))
        q.put((rank, got, same, list(snap2.restored_from),
               [(b["rank"], b["step"], b["held"]) for b in snap2.rejected]))
        snap2.close()
    finally:
        dist.destroy_process_group()


def test_an_edited_own_snapshot_is_restored_from_the_peer_nodes_replica(tmp_path):
    """Rank 1's own copy of step 3 fails its HMAC (zeroed in shared memory): it is skipped and
    named, and rank 1 gets step 3 from the replica node 0 holds, so no step is lost."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    for r in range(2):
        os.makedirs(tmp_path / f"node{r}", mode=0o700)
    q = _start(_edited_worker, port, str(tmp_path))
    res = sorted(q.get(timeout=5) for _ in range(2))
    for _, got, same, restored_from, rejected in res:
        assert got == 3 and same, res
        assert restored_from == [1] and rejected == [(1, 3, "own")], res
