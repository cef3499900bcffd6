"""A tiny data-parallel training script for the elastic tests (replaced later by the real trainer).

Each step: the global batch (a pure function of the step) is split over the ranks, gradients are
averaged with one gloo all_reduce, SGD with momentum updates the weights; rank 0 then saves the whole
state with torch.save to a temp file + os.replace, so a restarted group resumes from the last step.
Usage: toy_worker.py --out DIR --steps N [--step-sleep S [--pace-file F]] [--marker M]

--step-sleep paces the steps (a test that acts while the job runs needs the job to last); with
--pace-file the pacing holds only while that file exists: a test removes it once what it checks
in order has happened, and the rest of the run goes at full speed.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from dtorch.elastic import worker
from dtorch.monitor.straggler import StragglerDetector, gather_compute_times

GLOBAL_BATCH = 8


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 2, generator=g)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--pace-file", default="")
    p.add_argument("--coll-timeout", type=float, default=60.0)
    p.add_argument("--marker", default="")
    a = p.parse_args()
    torch.set_num_threads(1)
    w = worker.info()
    worker.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state_path = os.path.join(a.out, "state.pt")
    start = 0
    with worker.phase("replan"):
        pass  # the toy has one strategy for every world size; the trainer re-plans here
    with worker.phase("load"):
        if os.path.exists(state_path):
            st = torch.load(state_path, weights_only=True)
            model.load_state_dict(st["model"])
            opt.load_state_dict(st["opt"])
            start = st["step"] + 1
    detector = StragglerDetector(w.world_size)
    for step in range(start, a.steps):
        t0 = time.time()
        worker.step_begin(step)
        x, y = batch(step)
        xs, ys = x[w.rank::w.world_size], y[w.rank::w.world_size]
        # The samples this rank consumed, gathered so rank 0 can log the step's real global batch.
        mine = torch.arange(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)[w.rank::w.world_size]
        seen = [torch.zeros_like(mine) for _ in range(w.world_size)]
        with worker.phase("allgather_ids", step):
            dist.all_gather(seen, mine)
        loss = torch.nn.functional.mse_loss(model(xs), ys)
        opt.zero_grad()
        loss.backward()
        if a.step_sleep and (not a.pace_file or os.path.exists(a.pace_file)):
            time.sleep(a.step_sleep)  # stands for real compute (a chaos `slow` fault stretches it)
        with worker.phase("allgather_times", step):
            report = detector.update(gather_compute_times(time.time() - t0), step)
        if w.rank == 0 and report.new:
            print(report.warning(), flush=True)
        with worker.phase("allreduce", step):
            flat = torch.cat([q.grad.reshape(-1) for q in model.parameters()])
            dist.all_reduce(flat)
            flat /= w.world_size
            i = 0
            for q in model.parameters():
                q.grad.copy_(flat[i:i + q.numel()].view_as(q))
                i += q.numel()
        opt.step()
        with worker.phase("checkpoint", step):
            if w.rank == 0:
                tmp = state_path + ".tmp"
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
                os.replace(tmp, state_path)
                with open(os.path.join(a.out, "steps.jsonl"), "a") as f:
                    f.write(json.dumps({"step": step, "epoch": w.epoch, "world": w.world_size,
                                        "samples": sorted(torch.cat(seen).tolist()),
                                        "t": time.time(), "seconds": time.time() - t0,
                                        "loss": loss.item()}) + "\n")
        worker.checkpoint_committed(step)
        worker.step_done(step, t0)
        if step == start:
            worker.set_collective_timeout(a.coll_timeout)
    dist.barrier()
    if w.rank == 0:
        torch.save(model.state_dict(), os.path.join(a.out, "final.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
