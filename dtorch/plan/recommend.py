"""Resource sizing: how many nodes of a device type to train a model on a token budget or by a
deadline, and how many tokens each optimizer step should take on that cluster.

Tokens per step is a choice, not a constant: a cluster twice as large needs twice the sequences
per step to keep every data-parallel rank and every pipeline stage busy. The user bounds it
(`max_batch_tokens`, `--max-batch-tokens`; or fixes it with `global_batch`); without a bound the
default rule `default_max_batch_tokens` applies. Per cluster size:

1. the planner searches at the largest batch the bound allows (throughput never falls with more
   micro-batches or more sequences per data-parallel rank: bubbles and exposed gradient syncs
   are amortised over more work);
2. the batch is then shrunk, on that plan, to the smallest power of two that keeps the throughput
   within `batch_tolerance` (3 %) of it, but never below the batch a smaller cluster chose
   without offloading (offload traffic is amortised per step, whatever the cluster size): fewer
   tokens per step is what the optimiser prefers, so the batch grows with the cluster only as far
   as the cluster needs;
3. the same plan with twice the batch says whether the batch, not the hardware, limits scaling:
   if that would be more than `BATCH_BOUND_GAIN` (5 %) faster per GPU, the size is batch-bound.

Then, with a deadline: the smallest cluster whose predicted time to train meets it. Sizes whose
time cannot meet it even at the device's best matmul efficiency (compute alone, at
peak x efficiency) are ruled out without a search, and sizes above the first one that meets the
deadline are not searched either: that is what keeps sizing a 16k-GPU cluster to a few seconds.
With a token budget only: the cluster with the fewest GPU-hours (ties: the faster), searching
sizes upwards until per-GPU throughput has fallen below 90 % of the best for two sizes in a row.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from dataclasses import dataclass, field

from dtorch.cluster.load import preset_group
from dtorch.cluster.spec import Cluster
from dtorch.errors import ConfigError
from dtorch.model.profile import ModelProfile
from dtorch.plan.cost import DEFAULT_CONSTANTS, Estimate, base_efficiency, estimate
from dtorch.plan.plan import Plan
from dtorch.plan.search import check, search

# the module, not the function `dtorch.plan` re-exports under the same name
_search_module = importlib.import_module("dtorch.plan.search")

BATCH_BOUND_GAIN = 0.05
"""A size is batch-bound when twice the tokens per step would give more than this much more
throughput per GPU on the same plan."""

MIN_DEFAULT_BATCH_TOKENS = 2**22
"""4M tokens (1,024 x 4,096): Llama 2's batch for every model size (Touvron et al. 2023, sec. 2.2)."""
MAX_DEFAULT_BATCH_TOKENS = 2**24
"""16M tokens (2,048 x 8,192): Llama 3 405B's batch on 8,192 and 16,384 H100s (Llama 3 paper, Table 4)."""


def default_max_batch_tokens(tokens: float) -> int:
    """The default bound on tokens per step for a training budget of `tokens`: about one million
    optimizer steps (Llama 3 405B: 15.6T tokens at 16M per step), rounded to a power of two and
    kept within [4M, 16M], the batches of Llama 2 (2T tokens, 4M) and Llama 3 405B (16M)."""
    target = 2.0 ** round(math.log2(max(tokens, 1.0) / 1e6))
    return int(min(MAX_DEFAULT_BATCH_TOKENS, max(MIN_DEFAULT_BATCH_TOKENS, target)))


@dataclass
class SizeOption:
    nodes: int
    gpus: int
    plan: Plan | None
    estimate: Estimate | None
    time_to_train_s: float | None
    gpu_hours: float | None
    note: str = ""
    tokens_per_step: int | None = None
    """Tokens per optimizer step the plan takes (global batch x sequence length)."""
    batch_gain: float | None = None
    """Relative per-GPU throughput gain of the same plan with twice the tokens per step."""
    lower_bound_s: float | None = None
    """Time to train at the device's best matmul efficiency, compute only (no search needed)."""

    @property
    def batch_bound(self) -> bool:
        return self.batch_gain is not None and self.batch_gain > BATCH_BOUND_GAIN


@dataclass
class Recommendation:
    device: str
    tokens: float
    deadline_s: float | None
    options: list[SizeOption] = field(default_factory=list)
    chosen: SizeOption | None = None
    reason: str = ""
    max_batch_tokens: int | None = None
    """The bound on tokens per step (None: the batch was fixed by `global_batch`)."""
    batch_rule: str = ""
    """Where the bound came from: the user, or the default rule."""
    notes: list[str] = field(default_factory=list)
    searches: int = 0
    """Planner searches this recommendation ran (the rest was ruled out by bounds)."""

    def to_dict(self) -> dict:
        return {
            "device": self.device,
            "tokens": self.tokens,
            "deadline_s": self.deadline_s,
            "chosen_nodes": self.chosen.nodes if self.chosen else None,
            "chosen_tokens_per_step": self.chosen.tokens_per_step if self.chosen else None,
            "max_batch_tokens": self.max_batch_tokens,
            "batch_rule": self.batch_rule,
            "reason": self.reason,
            "notes": list(self.notes),
            "options": [
                {
                    "nodes": o.nodes, "gpus": o.gpus,
                    "plan": o.plan.to_dict() if o.plan else None,
                    "tokens_per_step": o.tokens_per_step,
                    "tokens_per_s": o.estimate.tokens_per_s if o.estimate else None,
                    "mfu": o.estimate.mfu if o.estimate else None,
                    "time_to_train_s": o.time_to_train_s, "gpu_hours": o.gpu_hours,
                    "lower_bound_s": o.lower_bound_s, "batch_gain": o.batch_gain,
                    "batch_bound": o.batch_bound, "note": o.note,
                }
                for o in self.options
            ],
        }


def step_time_floor(profile: ModelProfile, cluster: Cluster, *, global_batch: int, dtype: str | None = None) -> float | None:
    """Seconds per step that no plan `search` can return for this cluster and batch beats: the
    smallest of the search's own per-mesh lower bounds (ideal compute at the best GEMM efficiency,
    unavoidable TP traffic, the least bubble, the data-parallel floor). Costs milliseconds, where the
    search costs seconds; None when no mesh exists (the search would raise and say why)."""
    fixed = _search_module.normalize_fixed({"param_dtype": dtype} if dtype else {})
    group = cluster.slowest_group()
    precs, _ = _search_module.precisions(group, fixed)
    meshes = _search_module._meshes(profile, cluster, global_batch, fixed) if precs else []
    if not meshes:
        return None
    return min(_search_module._bound(m, 0, profile, group, global_batch, precs, DEFAULT_CONSTANTS) for m in meshes)


def _with_local_batch(plan: Plan, mbs: int, nmb: int) -> Plan:
    return dataclasses.replace(plan, microbatch_size=mbs, num_microbatches=nmb,
                               global_batch=plan.dp * mbs * nmb, predicted=None)


def _variant(plan: Plan, mbs: int, nmb: int, profile: ModelProfile, cluster: Cluster, dtype: str):
    """(plan, estimate) of `plan` with another micro-batching, or None where it cannot run or fit."""
    p = _with_local_batch(plan, mbs, nmb)
    try:
        check(p, profile, cluster)
    except ConfigError:
        return None
    est = estimate(p, profile, cluster, dtype)
    return (p, est) if est.fits else None


def _shrink(plan: Plan, est: Estimate, profile: ModelProfile, cluster: Cluster, dtype: str,
            tolerance: float, min_sequences: int = 1) -> tuple[Plan, Estimate]:
    """The smallest local batch (halving micro-batches, then the micro-batch) on `plan` whose
    throughput stays within `tolerance` of `est`'s, and whose global batch stays at least
    `min_sequences`. Throughput only falls as the batch shrinks, so the walk stops at the first
    step that falls too far."""
    best = (plan, est)
    mbs, nmb = plan.microbatch_size, plan.num_microbatches
    while True:
        if nmb > 1 and nmb % 2 == 0:
            nmb //= 2
        elif mbs > 1 and mbs % 2 == 0:
            mbs //= 2
        else:
            return best
        if plan.dp * mbs * nmb < min_sequences:
            return best
        v = _variant(plan, mbs, nmb, profile, cluster, dtype)
        if v is None or v[1].tokens_per_s < (1.0 - tolerance) * est.tokens_per_s:
            return best
        best = v


def _batch_gain(plan: Plan, est: Estimate, profile: ModelProfile, cluster: Cluster, dtype: str) -> float | None:
    """Per-GPU throughput gain of the same mesh with the batch doubled: twice the micro-batches
    (amortises bubbles and per-step syncs) or twice the micro-batch (larger GEMMs, fewer gathers
    per token), whichever is faster and fits."""
    mbs, nmb = plan.microbatch_size, plan.num_microbatches
    gains = [v[1].tokens_per_s / est.tokens_per_s - 1.0
             for v in (_variant(plan, mbs, nmb * 2, profile, cluster, dtype),
                       _variant(plan, mbs * 2, nmb, profile, cluster, dtype)) if v is not None]
    return max(gains) if gains else None


def recommend(
    profile: ModelProfile,
    device: str,
    *,
    global_batch: int | None = None,
    tokens: float,
    deadline_s: float | None = None,
    max_nodes: int = 2048,
    devices_per_node: int | None = None,
    dtype: str = "bfloat16",
    max_batch_tokens: float | None = None,
    batch_tolerance: float = 0.03,
) -> Recommendation:
    """Plan `profile` on 1, 2, 4, ... `max_nodes` nodes of preset `device` and recommend a size and
    the tokens per step to train with (see module doc). `tokens` is the training budget in tokens,
    `deadline_s` in seconds. `global_batch` (sequences) fixes the batch for every size; otherwise
    tokens per step is chosen per size, at most `max_batch_tokens` (default:
    `default_max_batch_tokens(tokens)`)."""
    _validate(tokens, deadline_s, global_batch, max_batch_tokens, batch_tolerance)
    seq = profile.seq_len
    group = preset_group(device)
    if devices_per_node:
        group = dataclasses.replace(group, devices_per_node=devices_per_node)
    rec = Recommendation(device=group.device.name, tokens=float(tokens), deadline_s=deadline_s)
    seqs_max = _batch(rec, seq, tokens, global_batch, max_batch_tokens)

    # compute alone, at the best efficiency any plan can reach: no plan of W devices is faster
    dev = group.device
    speed_best = max(dev.peak(d) for d in {"bfloat16", "float16", dtype}) * base_efficiency(group)

    def lower_bound(gpus: int) -> float:
        return tokens * profile.flops_per_token / (gpus * speed_best)

    def evaluate(nodes: int) -> tuple[SizeOption, bool]:
        """The option for `nodes` nodes and whether larger sizes are still worth trying."""
        cl = Cluster([dataclasses.replace(group, num_nodes=nodes)], name=f"{device}:{nodes}x{group.devices_per_node}")
        W = cl.world_size
        rec.searches += 1
        try:
            r = search(profile, cl, global_batch=seqs_max, top_k=1, dtype=dtype, suggest=False, families=False)
        except ConfigError as e:
            if global_batch is None:
                note = (f"batch-bound: {seqs_max * seq:,} tokens per step cannot occupy {W} GPUs; "
                        "raise --max-batch-tokens")
            else:
                note = e.fix
            return SizeOption(nodes, W, None, None, None, None, note=note, lower_bound_s=lower_bound(W)), False
        if r.best is None:
            return SizeOption(nodes, W, None, None, None, None, note="no plan fits in memory",
                              lower_bound_s=lower_bound(W)), True
        plan, est = r.best
        if global_batch is None:
            # never below the batch a smaller cluster chose (tokens per step grows with the cluster),
            # unless that one offloaded: offload traffic is amortised per step, whatever the size
            floor = max((o.tokens_per_step // seq for o in rec.options
                         if o.tokens_per_step and o.plan.offload == "none"), default=1)
            plan, est = _shrink(plan, est, profile, cl, dtype, batch_tolerance, floor)
        gain = _batch_gain(plan, est, profile, cl, dtype)
        t = tokens / est.tokens_per_s
        return SizeOption(nodes, W, plan, est, t, t * W / 3600.0, tokens_per_step=plan.dp * plan.local_batch() * seq,
                          batch_gain=gain, lower_bound_s=lower_bound(W)), True

    sizes = []
    nodes = 1
    while nodes <= max_nodes:
        sizes.append(nodes)
        nodes *= 2

    if deadline_s is not None:
        _sweep_to_deadline(rec, sizes, group.devices_per_node, deadline_s, evaluate, lower_bound)
    else:
        _sweep_for_cost(rec, sizes, evaluate)

    _choose(rec, tokens, deadline_s, global_batch)
    return rec


def _validate(tokens: float, deadline_s: float | None, global_batch: int | None, max_batch_tokens: float | None,
              batch_tolerance: float) -> None:
    if not tokens or tokens <= 0:
        raise ConfigError("tokens", tokens, "give the training budget in tokens, e.g. --tokens 2e12 or 2T")
    if deadline_s is not None and deadline_s <= 0:
        raise ConfigError("deadline", deadline_s, "give a positive duration, e.g. --deadline 30d")
    if global_batch is not None and max_batch_tokens is not None:
        raise ConfigError("max-batch-tokens", max_batch_tokens,
                          "give either a fixed --global-batch or a bound --max-batch-tokens, not both")
    if not 0.0 <= batch_tolerance < 1.0:
        raise ConfigError("batch_tolerance", batch_tolerance, "a fraction in [0, 1), e.g. 0.03")


def _batch(rec: Recommendation, seq: int, tokens: float, global_batch: int | None,
           max_batch_tokens: float | None) -> int:
    """The sequences per step to search with (a fixed --global-batch, or the largest power of two
    within the bound), recording the rule in `rec`."""
    if global_batch is None:
        if max_batch_tokens is None:
            bound = default_max_batch_tokens(tokens)
            rec.batch_rule = (f"default rule: ~1M optimizer steps for {tokens:.3g} tokens, "
                              f"within [4M, 16M] tokens per step")
        else:
            if max_batch_tokens < seq:
                raise ConfigError("max-batch-tokens", max_batch_tokens,
                                  f"must be at least one sequence ({seq} tokens), e.g. --max-batch-tokens 16M")
            bound = int(max_batch_tokens)
            rec.batch_rule = "--max-batch-tokens"
        # the largest power-of-two number of sequences within the bound (data-parallel degrees are
        # powers of two on power-of-two clusters); 5 % slack so that "16M" means 2**24 tokens
        seqs_max = 2 ** int(math.floor(math.log2(bound * 1.05 / seq)))
        rec.max_batch_tokens = seqs_max * seq
    else:
        seqs_max = global_batch
        rec.batch_rule = "fixed by --global-batch"
    return seqs_max


def _sweep_to_deadline(rec: Recommendation, sizes: list[int], devices_per_node: int, deadline_s: float,
                       evaluate, lower_bound) -> None:
    """Sizes in order until one meets the deadline (those that cannot even at the best efficiency
    are listed, not searched)."""
    for nodes in sizes:
        W = nodes * devices_per_node
        lb = lower_bound(W)
        if lb > deadline_s:
            rec.options.append(SizeOption(nodes, W, None, None, None, None, lower_bound_s=lb,
                                          note=f"cannot meet the deadline: >= {_duration(lb)} at best"))
            continue
        if any(o.time_to_train_s is not None and o.time_to_train_s <= deadline_s for o in rec.options):
            rec.options.append(SizeOption(nodes, W, None, None, None, None, lower_bound_s=lb,
                                          note="not searched: a smaller cluster meets the deadline"))
            continue
        opt, more = evaluate(nodes)
        rec.options.append(opt)
        if not more:
            break
    if rec.options and all(o.estimate is None and o.note.startswith("cannot meet") for o in rec.options):
        # not even the largest size can meet it: plan that one anyway, it is the fastest there is
        opt, _ = evaluate(rec.options[-1].nodes)
        if opt.estimate is not None:
            rec.options[-1] = opt


def _sweep_for_cost(rec: Recommendation, sizes: list[int], evaluate) -> None:
    """Sizes in order until tokens/s per GPU has fallen below 90 % of the best twice in a row."""
    best_per_gpu = 0.0
    falling = 0
    for nodes in sizes:
        opt, more = evaluate(nodes)
        rec.options.append(opt)
        if not more:
            break
        if opt.estimate is not None:
            per_gpu = opt.estimate.tokens_per_s_per_gpu
            falling = falling + 1 if per_gpu < 0.9 * best_per_gpu else 0
            best_per_gpu = max(best_per_gpu, per_gpu)
            if falling >= 2:
                break  # GPU-hours only grow from here on


def _choose(rec: Recommendation, tokens: float, deadline_s: float | None, global_batch: int | None) -> None:
    """The chosen size and why, and the note on batch-bound sizes."""
    feasible = [o for o in rec.options if o.estimate is not None]
    if not feasible:
        if deadline_s is not None and rec.options and all(o.note.startswith("cannot meet") for o in rec.options):
            rec.reason = (f"no size up to {rec.options[-1].nodes} nodes can meet the deadline, even at the "
                          "device's best matmul efficiency; raise --max-nodes or the deadline")
        else:
            rec.reason = "no cluster size up to the limit fits the model; use devices with more memory or a smaller model"
        return
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

    bound_sizes = [o for o in feasible if o.batch_bound]
    if bound_sizes:
        first = min(bound_sizes, key=lambda o: o.gpus)
        what = "--max-batch-tokens" if global_batch is None else "--global-batch"
        rec.notes.append(
            f"from {first.gpus:,} GPUs up, the batch, not the hardware, limits scaling: at {first.tokens_per_step:,} "
            f"tokens per step, twice the batch would give {first.batch_gain:+.0%} tokens/s per GPU on the same plan "
            f"(raise {what} if the optimiser allows)")
    return rec


def _duration(s: float) -> str:
    if s < 3600:
        return f"{s / 60:.1f} min"
    if s < 86400 * 2:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} days"


def _tokens(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("M", 2**20), ("K", 2**10)):
        if n >= div:
            return f"{n / div:.4g}{unit}"
    return str(n)


def format_recommendation(rec: Recommendation) -> str:
    lines = [f"sizing {rec.device} clusters for {rec.tokens:.3g} tokens"
             + (f", deadline {_duration(rec.deadline_s)}" if rec.deadline_s else "")]
    if rec.max_batch_tokens:
        lines.append(f"tokens per step: chosen per size, at most {_tokens(rec.max_batch_tokens)} "
                     f"({rec.max_batch_tokens:,}; {rec.batch_rule})")
    else:
        lines.append(f"tokens per step: {rec.batch_rule}")
    lines.append("")
    hdr = (f"{'nodes':>6} {'GPUs':>6} {'tok/step':>9} {'tok/s/GPU':>10} {'MFU':>6} {'time to train':>14} "
           f"{'GPU-hours':>11}  plan")
    lines += [hdr, "-" * len(hdr)]
    for o in rec.options:
        mark = " *" if o is rec.chosen else ""
        if o.estimate is None:
            lines.append(f"{o.nodes:>6} {o.gpus:>6} {'-':>9} {'-':>10} {'-':>6} {'-':>14} {'-':>11}  {o.note}")
            continue
        bound = f" [batch-bound: 2x batch {o.batch_gain:+.0%}]" if o.batch_bound else ""
        lines.append(f"{o.nodes:>6} {o.gpus:>6} {_tokens(o.tokens_per_step):>9} "
                     f"{o.estimate.tokens_per_s_per_gpu:>10,.0f} {o.estimate.mfu:>6.1%} "
                     f"{_duration(o.time_to_train_s):>14} {o.gpu_hours:>11,.0f}  {o.plan.describe()}{mark}{bound}")
    lines.append("")
    if rec.chosen:
        c = rec.chosen
        lines.append(f"recommended: {c.nodes} node{'s' if c.nodes > 1 else ''} ({c.gpus} GPUs), "
                     f"{c.tokens_per_step:,} tokens per step, {c.estimate.mfu:.1%} MFU, "
                     f"{_duration(c.time_to_train_s)}: {rec.reason}")
    else:
        lines.append(rec.reason)
    lines += [f"note: {n}" for n in rec.notes]
    return "\n".join(lines)
