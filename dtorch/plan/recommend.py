"""Resource sizing: how many nodes of a device type to train a model on a token budget or by a
deadline. Plans every power-of-two node count with the planner, then picks:

- with a deadline: the smallest cluster whose predicted time to train meets it;
- with a token budget only: the cluster with the fewest GPU-hours (ties: the faster), since per-GPU
  throughput falls as the cluster grows (more communication, bubbles, smaller local batches).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from dtorch.cluster.load import preset_group
from dtorch.cluster.spec import Cluster
from dtorch.errors import ConfigError
from dtorch.model.profile import ModelProfile
from dtorch.plan.cost import Estimate
from dtorch.plan.plan import Plan
from dtorch.plan.search import search


@dataclass
class SizeOption:
    nodes: int
    gpus: int
    plan: Plan | None
    estimate: Estimate | None
    time_to_train_s: float | None
    gpu_hours: float | None
    note: str = ""


@dataclass
class Recommendation:
    device: str
    tokens: float
    deadline_s: float | None
    options: list[SizeOption] = field(default_factory=list)
    chosen: SizeOption | None = None
    reason: str = ""

    def to_dict(self) -> dict:
        return {
            "device": self.device,
            "tokens": self.tokens,
            "deadline_s": self.deadline_s,
            "chosen_nodes": self.chosen.nodes if self.chosen else None,
            "reason": self.reason,
            "options": [
                {
                    "nodes": o.nodes, "gpus": o.gpus,
                    "plan": o.plan.to_dict() if o.plan else None,
                    "tokens_per_s": o.estimate.tokens_per_s if o.estimate else None,
                    "mfu": o.estimate.mfu if o.estimate else None,
                    "time_to_train_s": o.time_to_train_s, "gpu_hours": o.gpu_hours, "note": o.note,
                }
                for o in self.options
            ],
        }


def recommend(
    profile: ModelProfile,
    device: str,
    *,
    global_batch: int,
    tokens: float,
    deadline_s: float | None = None,
    max_nodes: int = 2048,
    devices_per_node: int | None = None,
    dtype: str = "bfloat16",
) -> Recommendation:
    """Plan `profile` on 1, 2, 4, ... `max_nodes` nodes of preset `device` and recommend a size
    (see module doc). `tokens` is the training budget in tokens; `deadline_s` in seconds."""
    if not tokens or tokens <= 0:
        raise ConfigError("tokens", tokens, "give the training budget in tokens, e.g. --tokens 2e12 or 2T")
    if deadline_s is not None and deadline_s <= 0:
        raise ConfigError("deadline", deadline_s, "give a positive duration, e.g. --deadline 30d")
    group = preset_group(device)
    if devices_per_node:
        group = dataclasses.replace(group, devices_per_node=devices_per_node)
    rec = Recommendation(device=group.device.name, tokens=float(tokens), deadline_s=deadline_s)
    nodes = 1
    while nodes <= max_nodes:
        cl = Cluster([dataclasses.replace(group, num_nodes=nodes)], name=f"{device}:{nodes}x{group.devices_per_node}")
        try:
            r = search(profile, cl, global_batch=global_batch, top_k=1, dtype=dtype, suggest=False)
        except ConfigError as e:
            rec.options.append(SizeOption(nodes, cl.world_size, None, None, None, None, note=e.fix))
            break  # a larger cluster cannot divide the global batch either
        if r.best is None:
            rec.options.append(SizeOption(nodes, cl.world_size, None, None, None, None, note="no plan fits in memory"))
        else:
            plan, est = r.best
            t = tokens / est.tokens_per_s
            rec.options.append(SizeOption(nodes, cl.world_size, plan, est, t, t * cl.world_size / 3600.0))
        nodes *= 2
    feasible = [o for o in rec.options if o.estimate is not None]
    if not feasible:
        rec.reason = "no cluster size up to the limit fits the model; use devices with more memory or a smaller model"
        return rec
    if deadline_s is not None:
        meets = [o for o in feasible if o.time_to_train_s <= deadline_s]
        if meets:
            rec.chosen = min(meets, key=lambda o: o.gpus)
            rec.reason = f"smallest cluster that trains {tokens:.3g} tokens within the deadline"
        else:
            rec.chosen = min(feasible, key=lambda o: o.time_to_train_s)
            rec.reason = (f"no size up to {rec.options[-1].nodes} nodes meets the deadline; this is the fastest "
                          f"({_duration(rec.chosen.time_to_train_s)})")
    else:
        rec.chosen = min(feasible, key=lambda o: (round(o.gpu_hours, -1), o.time_to_train_s))
        rec.reason = "fewest GPU-hours for the token budget (give --deadline to trade GPU-hours for time)"
    return rec


def _duration(s: float) -> str:
    if s < 3600:
        return f"{s / 60:.1f} min"
    if s < 86400 * 2:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} days"


def format_recommendation(rec: Recommendation) -> str:
    lines = [f"sizing {rec.device} clusters for {rec.tokens:.3g} tokens"
             + (f", deadline {_duration(rec.deadline_s)}" if rec.deadline_s else ""), ""]
    hdr = f"{'nodes':>6} {'GPUs':>6} {'tok/s/GPU':>10} {'MFU':>6} {'time to train':>14} {'GPU-hours':>11}  plan"
    lines += [hdr, "-" * len(hdr)]
    for o in rec.options:
        mark = " *" if o is rec.chosen else ""
        if o.estimate is None:
            lines.append(f"{o.nodes:>6} {o.gpus:>6} {'-':>10} {'-':>6} {'-':>14} {'-':>11}  {o.note}")
            continue
        lines.append(f"{o.nodes:>6} {o.gpus:>6} {o.estimate.tokens_per_s_per_gpu:>10,.0f} {o.estimate.mfu:>6.1%} "
                     f"{_duration(o.time_to_train_s):>14} {o.gpu_hours:>11,.0f}  {o.plan.describe()}{mark}")
    lines.append("")
    if rec.chosen:
        lines.append(f"recommended: {rec.chosen.nodes} node{'s' if rec.chosen.nodes > 1 else ''} ({rec.chosen.gpus} GPUs), "
                     f"{_duration(rec.chosen.time_to_train_s)}: {rec.reason}")
    else:
        lines.append(rec.reason)
    return "\n".join(lines)
