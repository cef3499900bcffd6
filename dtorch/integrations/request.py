"""A scheduler request sized from a plan: nodes, devices per node, device type, CPU and memory
per task, time limit, shared checkpoint location and the training command. `slurm.py` turns it
into an sbatch script, `k8s.py` into manifests.

Sizing (`size_request`):
- `--nodes N`: the planner's best plan for N nodes of the device type;
- `--tokens` with `--deadline`: the smallest power-of-two node count whose predicted time to train
  meets the deadline (`dtorch.plan.recommend`'s rule). Sizes that cannot meet it even at 100 %
  MFU are not planned, nor those where the planner's own lower bound on the step time misses it
  (the bounds skip most sizes, which keeps a 70B model on H100s to one search, about 1.5 s);
- `--tokens` alone: `dtorch.plan.recommend.recommend` (fewest GPU-hours over all sizes).
Pure arithmetic: never imports torch.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shlex
import sys
from dataclasses import dataclass, field

from dtorch.cluster.load import preset_group
from dtorch.cluster.presets import canonical
from dtorch.cluster.spec import Cluster, NodeGroup
from dtorch.errors import ConfigError
from dtorch.plan.cost import Estimate
from dtorch.plan.plan import Plan
from dtorch.plan.recommend import Recommendation, SizeOption, recommend, step_time_floor
from dtorch.plan.search import search

GiB = 2**30


@dataclass
class Request:
    """What to ask the scheduler for. Memory in bytes, times in seconds."""

    name: str
    nodes: int
    gpus_per_node: int
    """0 on CPU nodes."""
    device: str
    """Preset key of the device type (h100-sxm, a100-80gb, cpu, ...): the Slurm constraint and the
    Kubernetes GPU product label are derived from it."""
    device_name: str
    tasks_per_node: int
    cpus_per_task: int
    mem_per_node_bytes: int
    time_limit_s: float
    checkpoint_dir: str
    train_args: list[str]
    steps: int
    grace_s: int = 120
    python: str = sys.executable
    plan: Plan | None = None
    estimate: Estimate | None = None
    time_to_train_s: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node

    def train_command(self) -> list[str]:
        """The per-rank training command (every rank runs it; the scheduler starts one per task)."""
        return [self.python, "-m", "dtorch.train.job", *self.train_args]

    def describe(self) -> str:
        gpus = f"{self.gpus_per_node} x {self.device_name}" if self.gpus_per_node else "CPU"
        lines = [f"request: {self.nodes} node{'s' if self.nodes != 1 else ''} x {gpus}, "
                 f"{self.tasks_per_node} task{'s' if self.tasks_per_node != 1 else ''}/node "
                 f"({self.world_size} ranks), {self.cpus_per_task} CPUs/task, "
                 f"{self.mem_per_node_bytes / GiB:.0f} GiB/node, time limit {format_duration(self.time_limit_s)}, "
                 f"grace {self.grace_s} s",
                 f"  checkpoints: {self.checkpoint_dir}",
                 f"  command: {shlex.join(self.train_command())}"]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def format_duration(s: float) -> str:
    if s >= 2 * 86400:
        return f"{s / 86400:.1f} days"
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    return f"{s / 60:.0f} min"


def device_group(device: str, gpus_per_node: int | None) -> NodeGroup:
    """The node group of a device preset (ConfigError naming the choices when unknown)."""
    try:
        group = preset_group(device)
    except ConfigError as e:  # named as the flag the user typed
        raise ConfigError("device-type", device, e.fix) from None
    if gpus_per_node is not None:
        if gpus_per_node < 1:
            raise ConfigError("gpus-per-node", gpus_per_node, "use 1 or more devices per node")
        group = dataclasses.replace(group, devices_per_node=gpus_per_node)
    return group


def _cluster(group: NodeGroup, nodes: int) -> Cluster:
    return Cluster([dataclasses.replace(group, num_nodes=nodes)],
                   name=f"{group.device.name}:{nodes}x{group.devices_per_node}")


def _plan_on(profile, group: NodeGroup, nodes: int, global_batch: int, dtype: str):
    from dtorch.progress import search_progress

    cl = _cluster(group, nodes)
    cb, shown = search_progress(f"planning {nodes} node{'s' if nodes != 1 else ''} of {group.device.name}")
    try:
        r = search(profile, cl, global_batch=global_batch, top_k=1, dtype=dtype, suggest=False, progress=cb,
                   families=False)
    except ConfigError as e:
        return None, None, e.fix
    shown.close(f"searched {r.meshes:,} meshes, {r.evaluated:,} plans estimated")
    if r.best is None:
        return None, None, "no plan fits in memory"
    return r.best[0], r.best[1], ""


def size_for_deadline(profile, group: NodeGroup, *, tokens: float, deadline_s: float, global_batch: int,
                      max_nodes: int, dtype: str) -> Recommendation:
    """The smallest power-of-two node count that meets the deadline. Sizes whose throughput could
    not meet it even at the devices' peak FLOP/s are skipped; so are those where even the planner's
    own lower bound on the step time (`step_time_floor`, milliseconds) misses it, which spares the
    full search (seconds each) of sizes that cannot win. The rest are planned upward until one
    meets it. Raises ConfigError when none up to `max_nodes` does (naming the fastest)."""
    rec = Recommendation(device=group.device.name, tokens=float(tokens), deadline_s=deadline_s,
                         batch_rule="fixed by --global-batch")
    peak_tps_per_device = group.device.peak(dtype) / profile.flops_per_token
    need_devices = tokens / deadline_s / peak_tps_per_device
    nodes = 1
    while nodes * 2 <= max_nodes and nodes * group.devices_per_node < need_devices:
        nodes *= 2  # even at 100 % MFU, fewer devices than need_devices cannot meet the deadline
    best: SizeOption | None = None
    floor_best: tuple[int, float] | None = None
    while nodes <= max_nodes:
        gpus = nodes * group.devices_per_node
        cl = _cluster(group, nodes)
        floor_s = step_time_floor(profile, cl, global_batch=global_batch, dtype=dtype)
        if floor_s is not None:
            t_floor = tokens / (global_batch * profile.seq_len) * floor_s
            if t_floor > deadline_s:
                rec.options.append(SizeOption(nodes, gpus, None, None, None, None, lower_bound_s=t_floor,
                                              note=f"cannot meet the deadline: >= {format_duration(t_floor)} "
                                                   "with any plan (planner's bound, not searched)"))
                floor_best = (nodes, t_floor)
                nodes *= 2
                continue
        plan, est, note = _plan_on(profile, group, nodes, global_batch, dtype)
        if plan is None:
            rec.options.append(SizeOption(nodes, gpus, None, None, None, None, note=note))
            if "divide" in note or "batch" in note:
                break
        else:
            t = tokens / est.tokens_per_s
            opt = SizeOption(nodes, gpus, plan, est, t, t * gpus / 3600.0,
                             tokens_per_step=global_batch * profile.seq_len)
            rec.options.append(opt)
            best = opt if best is None or t < best.time_to_train_s else best
            if t <= deadline_s:
                rec.chosen = opt
                rec.reason = f"smallest cluster that trains {tokens:.3g} tokens within the deadline"
                return rec
        nodes *= 2
    if best:
        fastest = f"the fastest planned size, {best.nodes} nodes, needs {format_duration(best.time_to_train_s)}"
    elif floor_best:
        fastest = f"even at {floor_best[0]} nodes any plan needs at least {format_duration(floor_best[1])}"
    else:
        fastest = "no size fits the model"
    raise ConfigError("deadline", format_duration(deadline_s),
                      f"no cluster of up to {max_nodes} {group.device.name} nodes meets it ({fastest}); "
                      "give a later deadline, fewer --tokens, or a larger --max-nodes")


@dataclass
class Sizing:
    plan: Plan | None
    estimate: Estimate | None
    nodes: int
    group: NodeGroup
    recommendation: Recommendation | None = None
    time_to_train_s: float | None = None
    device_key: str = ""


def size_request(profile, device: str, *, nodes: int | None, gpus_per_node: int | None, tokens: float | None,
                 deadline_s: float | None, global_batch: int, max_nodes: int = 2048,
                 dtype: str = "bfloat16", plan: Plan | None = None) -> Sizing:
    """Choose the node count and plan (see module doc); a given `plan` fixes both."""
    group = device_group(device, gpus_per_node)
    if plan is not None:
        n, rem = divmod(plan.world_size, group.devices_per_node)
        if rem or n < 1 or (nodes is not None and nodes != n):
            raise ConfigError("plan", plan.describe(), f"its world size {plan.world_size} is not "
                              f"{nodes or 'a whole number of'} nodes x {group.devices_per_node} devices; "
                              "give --gpus-per-node to match, or drop --nodes")
        tps = (plan.predicted or {}).get("tokens_per_s")
        t = tokens / tps if tokens and tps else None
        return Sizing(plan, None, n, group, None, t, canonical(device) or device)
    if nodes is not None:
        if nodes < 1:
            raise ConfigError("nodes", nodes, "use 1 or more nodes")
        plan, est, note = _plan_on(profile, group, nodes, global_batch, dtype)
        if plan is None:
            raise ConfigError("nodes", nodes, f"no plan for this model on {nodes} {group.device.name} nodes: {note}")
        t = tokens / est.tokens_per_s if tokens else None
        if deadline_s is not None and t is not None and t > deadline_s:
            raise ConfigError("deadline", format_duration(deadline_s),
                              f"{nodes} nodes need {format_duration(t)}; give more --nodes (or none, to size "
                              "the cluster) or a later deadline")
        return Sizing(plan, est, nodes, group, None, t, canonical(device) or device)
    if tokens is None:
        raise ConfigError("tokens", None, "give --nodes N, or --tokens (and --deadline) to size the cluster")
    if deadline_s is not None:
        rec = size_for_deadline(profile, group, tokens=tokens, deadline_s=deadline_s, global_batch=global_batch,
                                max_nodes=max_nodes, dtype=dtype)
    else:
        rec = recommend(profile, device, global_batch=global_batch, tokens=tokens, max_nodes=max_nodes,
                        devices_per_node=gpus_per_node, dtype=dtype)
    if rec.chosen is None:
        raise ConfigError("model", profile.name if hasattr(profile, "name") else "?", rec.reason)
    c = rec.chosen
    return Sizing(c.plan, c.estimate, c.nodes, group, rec, c.time_to_train_s, canonical(device) or device)


TIME_MARGIN = 1.15
TIME_SLACK_S = 600.0
"""The time limit asked for: the predicted time to train x TIME_MARGIN + TIME_SLACK_S."""
DEFAULT_MAX_TIME_S = 24 * 3600.0
"""The cap when no partition limit is known (a day; the job requeues itself at the limit)."""


def build_request(sizing: Sizing, *, name: str, model: str, seq_len: int, global_batch: int, steps: int,
                  checkpoint_dir: str, time_limit_s: float | None, grace_s: int, max_time_s: float | None,
                  cpus_per_task: int | None = None, tasks_per_node: int | None = None,
                  extra_args: list[str] | None = None, python: str | None = None,
                  plan_arg: str = "auto") -> Request:
    """The request for `sizing`: one task per device (one per node on CPU), CPU cores and host
    memory per task from the preset node (plus what an offloading plan keeps on the host), a time
    limit from the predicted time to train (+15 %, +10 min, said in a note), capped by the
    partition's limit or, when none is known, by a day. The job
    runs `--plan plan_arg`: "auto" (re-planned at whatever size it starts) or a plan file."""
    g = sizing.group
    gpus = g.devices_per_node if g.device.kind != "cpu" else 0
    tpn = tasks_per_node or max(1, gpus)
    host_cores = g.host_cores or 8 * max(1, gpus)
    cpt = cpus_per_task or max(1, host_cores // tpn)
    host_per_task = (sizing.estimate.host_bytes_per_rank if sizing.estimate else 0) + 16 * GiB
    mem = tpn * host_per_task
    if g.host_memory_bytes:
        mem = min(mem, int(g.host_memory_bytes * 0.9))
    notes: list[str] = []
    cap, whose = (max_time_s, "the partition's") if max_time_s else (DEFAULT_MAX_TIME_S, "a day (no partition limit "
                                                                     "could be read)")
    if time_limit_s is None:
        t = sizing.time_to_train_s
        if t:
            time_limit_s = t * TIME_MARGIN + TIME_SLACK_S
            notes.append(f"time limit: the predicted {format_duration(t)} to train + {TIME_MARGIN - 1:.0%} "
                         f"+ {TIME_SLACK_S / 60:.0f} min for start-up and checkpoints")
        else:
            time_limit_s = cap
    if time_limit_s > cap:
        notes.append(f"time limit capped at {whose} {format_duration(cap)}: the job checkpoints "
                     f"{grace_s} s before it and requeues itself until training is done")
        time_limit_s = cap
    args = ["--model", model, "--steps", str(steps), "--global-batch", str(global_batch), "--seq-len", str(seq_len),
            "--checkpoint-dir", checkpoint_dir, "--plan", plan_arg, *(extra_args or [])]
    return Request(name=name, nodes=sizing.nodes, gpus_per_node=gpus, device=sizing.device_key, device_name=g.device.name, tasks_per_node=tpn, cpus_per_task=cpt,
                   mem_per_node_bytes=int(mem), time_limit_s=float(time_limit_s), checkpoint_dir=checkpoint_dir,
                   train_args=args, steps=steps, grace_s=grace_s, python=python or sys.executable,
                   plan=sizing.plan, estimate=sizing.estimate, time_to_train_s=sizing.time_to_train_s, notes=notes)


def steps_for(tokens: float | None, steps: int | None, global_batch: int, seq_len: int) -> int:
    if steps is not None:
        if steps < 1:
            raise ConfigError("steps", steps, "train for at least one step")
        return steps
    if tokens is None:
        raise ConfigError("steps", None, "give --steps, or --tokens (steps = tokens / (global batch x seq len))")
    return max(1, math.ceil(tokens / (global_batch * seq_len)))


def check_checkpoint_dir(path: str | None, *, must_exist_parent: bool = True) -> str:
    """The shared checkpoint location, absolute. It must be given and its parent must exist
    (a path every node mounts; the job creates the directory itself)."""
    if not path:
        raise ConfigError("checkpoint-dir", None, "give a path on storage every node mounts, e.g. "
                          "--checkpoint-dir /shared/ckpt/run1")
    p = os.path.abspath(path)
    if must_exist_parent and not os.path.isdir(os.path.dirname(p)):
        raise ConfigError("checkpoint-dir", path, f"its parent {os.path.dirname(p)} does not exist; create it on "
                          "storage every node mounts, or choose another path")
    return p
