"""One rank of a multi-process checkpoint scenario (launched by test_distributed.py).

    python _dist_worker.py save3 ROOT    world 3: DTensor + FSDP2 state, async saves at steps 1 and 2
    python _dist_worker.py load2 ROOT    world 2: resharded load of step 2, round trip at step 3,
                                         then a damaged rank-1 shard of step 3 -> both ranks fall back,
                                         then rank 1 is SIGKILLed mid-save of step 4 -> no commit

Rank/world/rendezvous come from the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
"""

from __future__ import annotations

import os
import signal
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from dtorch.checkpoint import CheckpointError, CheckpointManager, CheckpointWarning, RNGState


def full_tensors(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return {"a": torch.randn(10, 6, generator=g), "b": torch.randn(5, 7, generator=g), "c": torch.randn(4, generator=g)}


def model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank and in the test process
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))


def sharded_state(mesh, step: int, placements: dict[str, list]) -> dict:
    full = full_tensors(step)
    return {k: distribute_tensor(full[k], mesh, placements[k]) for k in full}


def check(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(f"rank {dist.get_rank()}: {what}")


def main(scenario: str, root: Path) -> None:
    t0 = time.perf_counter()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    net = model()
    fully_shard(net, mesh=mesh)
    mgr = CheckpointManager(root, keep_last=None)
    if scenario == "save3":
        place = {"a": [Shard(0)], "b": [Shard(1)], "c": [Replicate()]}  # 10 rows over 3 ranks: uneven
        with torch.no_grad():
            for p in net.parameters():
                p.mul_(2.0)  # a state that differs from the initial weights
        mgr.save(1, {"t": sharded_state(mesh, 1, place), "model": net.state_dict(), "meta": {"step": 1}}, async_=True)
        check(mgr.wait().committed, "async save committed")  # step 2 then reuses its staging buffers
        torch.manual_seed(100 + rank)
        state = {"t": sharded_state(mesh, 2, place), "model": net.state_dict(), "meta": {"step": 2}, "rng": RNGState()}
        mgr.save(2, state, async_=True, extra={"world": world})
        done = mgr.wait()
        check(done.committed and done.stall_s <= done.persist_s, "async save committed")
    elif scenario == "load2":
        place = {"a": [Shard(1)], "b": [Shard(0)], "c": [Shard(0)]}  # other placements than at save
        state = {"t": sharded_state(mesh, 0, place), "model": net.state_dict(), "meta": {"step": -1}, "rng": RNGState()}
        check(mgr.load_latest(state) == 2, "latest is step 2")
        got = torch.rand(3)  # first, before anything else draws from the CPU generator
        torch.manual_seed(100 + rank)
        check(torch.equal(got, torch.rand(3)), "this rank's CPU RNG stream restored")
        check(mgr.loaded.extra == {"world": 3}, "extra restored")
        check(state["meta"] == {"step": 2}, "plain values restored")
        for k, v in full_tensors(2).items():
            check(torch.equal(state["t"][k].full_tensor(), v), f"tensor {k} bit-exact after 3 -> 2 reshard")
        ref = model()
        for name, p in net.state_dict().items():
            check(torch.equal(p.full_tensor(), ref.state_dict()[name] * 2.0), f"FSDP2 param {name} bit-exact")
        # Round trip at world 2, then damage one shard written by rank 1.
        state3 = {"t": sharded_state(mesh, 3, place), "model": net.state_dict(), "meta": {"step": 3}}
        check(mgr.save(3, state3).committed, "world-2 save committed")
        fresh = {"t": sharded_state(mesh, 0, place), "model": net.state_dict(), "meta": {"step": -1}}
        check(mgr.load_latest(fresh) == 3, "round trip loads step 3")
        for k, v in full_tensors(3).items():
            check(torch.equal(fresh["t"][k].full_tensor(), v), f"tensor {k} bit-exact round trip")
        dist.barrier()
        if rank == 0:
            shard = sorted((root / "step-00000003").glob("__1_*.distcp"))[0]
            data = bytearray(shard.read_bytes())
            data[-3] ^= 0xFF
            shard.write_bytes(bytes(data))
        dist.barrier()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            check(mgr.load_latest(fresh) == 2, "both ranks fall back to step 2")
        warned = [w for w in caught if issubclass(w.category, CheckpointWarning)]
        if dist.get_rank() == 0:
            check(any("__1_0.distcp" in str(w.message) for w in warned), "warning names the damaged shard")
        else:
            check(not warned, "the fallback is reported once per job (rank 0), not by every rank")
        for k, v in full_tensors(2).items():
            check(torch.equal(fresh["t"][k].full_tensor(), v), f"tensor {k} from the fallback")
        # Rank 1 dies after its DCP writes (DCP's .metadata is already complete) but before the
        # agreement: rank 0 must not commit step 4.
        def die(phase: str) -> None:
            if phase == "rank_file" and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)

        mgr.fault_hook = die
        try:
            mgr.save(4, state3)
        except CheckpointError as e:
            check("nothing was committed" in str(e), f"error says nothing was committed: {e}")
        else:
            check(False, "save with a dead rank raised")
        check(not (root / "step-00000004").exists(), "step 4 not committed")
        print(f"rank {rank} ok in {time.perf_counter() - t0:.1f} s", flush=True)
        os._exit(0)  # the group is broken: no barrier, no teardown
    mgr.close()
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} ok in {time.perf_counter() - t0:.1f} s", flush=True)
    os._exit(0)  # skip interpreter teardown (seconds on a loaded machine); everything is flushed


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1], Path(sys.argv[2]))
