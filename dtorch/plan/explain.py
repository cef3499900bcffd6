"""Explain a search: the ranked table, the chosen plan's time and memory breakdown, one line per
losing family (what made it slower, or why it does not fit), and when nothing fits, the smallest
changes that would. Plain text (fast, greppable, the same in a log and a terminal)."""

from __future__ import annotations

from dataclasses import replace

from dtorch.plan import strategies
from dtorch.plan.cost import DEFAULT_CONSTANTS, Estimate, estimate
from dtorch.plan.plan import Plan
from dtorch.plan.search import SearchResult
from dtorch.plan.strategies.expert import routing_traffic

GiB = 2**30

TIME_LABELS = {
    "compute": "compute", "recompute": "recompute", "host": "host overhead", "tp": "TP comm", "cp": "CP comm", "ep": "EP all-to-all", "fsdp": "FSDP comm",
    "dp": "DP all-reduce", "pp_p2p": "PP send/recv", "bubble": "PP bubble", "optimizer": "optimizer",
    "offload": "CPU offload",
}


def _gib(b: float) -> str:
    return f"{b / GiB:.1f}"


def count(n: float) -> str:
    """A parameter count in the unit that reads: '70.6B', '124.4M', '2.1K', '950'."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


def _secs(s: float) -> str:
    """Seconds with the digits that read: two decimals, or two significant digits under 0.01 s."""
    return f"{s:.2f}" if s >= 0.01 else f"{s:.2g}"


def _unit(result: SearchResult) -> str:
    """What a step's batch counts: tokens for a token-sequence model, else samples."""
    return "tokens" if result.profile.input_kind == "tokens" else "samples"


def _per_gpu(result: SearchResult) -> str:
    """The throughput column's unit: 'tok/s/GPU' or 'samples/s/GPU'."""
    return "tok/s/GPU" if _unit(result) == "tokens" else "samples/s/GPU"


def table(result: SearchResult) -> str:
    """The ranked plans as an aligned text table (with the amortised step time they were ranked by,
    when the run's length was given and a plan pays one-off seconds)."""
    amortise = bool(result.steps) and any(strategies.once_s(p, result.cluster) for p, _ in result.ranked)
    rows = [("#", "plan", "family", "step s", *(("amortised s",) if amortise else ()), _per_gpu(result), "MFU",
             "GiB/rank")]
    for i, (plan, est) in enumerate(result.ranked, 1):
        am = (f"{strategies.amortised_s(est.step_time_s, plan, result.cluster, result.steps):.2f}",) if amortise else ()
        rows.append((str(i), plan.describe(), plan.family(), _secs(est.step_time_s), *am,
                     f"{est.tokens_per_s_per_gpu:,.0f}", f"{est.mfu:.1%}", _gib(est.memory_bytes_per_rank)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    right = {0, *range(3, len(rows[0]))}
    lines = []
    for j, r in enumerate(rows):
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(cells).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def time_breakdown(est: Estimate) -> str:
    parts = [f"{TIME_LABELS[k]} {_secs(v)} ({v / est.step_time_s:.0%})"
             for k, v in sorted(est.time_breakdown.items(), key=lambda kv: -kv[1]) if v > 0.0005 * est.step_time_s]
    return ", ".join(parts)


RESERVE_KEYS = ("margin", "reserve")
"""Entries of a memory breakdown that are no prediction of the job's own bytes: what is kept free
(the fixed margin for the runtime, CUDA context and allocator fragmentation)."""
OWN_KEYS = ("activations", "buffers")
"""Entries that are the job's own bytes besides its model states; every other entry is a model state
(params, grads, optimizer, ...)."""


def size(b: float) -> str:
    """Bytes in the unit that reads: '412 KiB', '13.6 MiB', '2.1 GiB'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if abs(b) >= scale:
            return f"{b / scale:,.1f} {unit}"
    return f"{b / 2**10:,.0f} KiB"


def memory_parts(breakdown: dict[str, float]) -> dict[str, float]:
    """A rank's predicted memory as model states, activations, buffers and the reserve kept apart."""
    states = sum(v for k, v in breakdown.items() if k not in RESERVE_KEYS + OWN_KEYS)
    return {"model_states": states, "activations": breakdown.get("activations", 0),
            "buffers": breakdown.get("buffers", 0), "reserve": sum(breakdown.get(k, 0) for k in RESERVE_KEYS)}


def memory_summary(breakdown: dict[str, float], detail: bool = True) -> str:
    """'model states 13.6 MiB (params 3.4 MiB, ...) + activations 35.2 MiB + buffers 50.0 MiB =
    98.8 MiB; reserve 2.0 GiB apart (...)': the prediction of the job's bytes, and what is kept free
    beside it, which no step fills (without `detail`: no per-state figures, no explanation)."""
    parts = memory_parts(breakdown)
    states = ", ".join(f"{k} {size(v)}" for k, v in breakdown.items()
                       if k not in RESERVE_KEYS + OWN_KEYS and v > 0) if detail else ""
    own = parts["model_states"] + parts["activations"] + parts["buffers"]
    line = (f"model states {size(parts['model_states'])}{f' ({states})' if states else ''} + activations "
            f"{size(parts['activations'])}")
    if parts["buffers"]:
        line += f" + buffers {size(parts['buffers'])}"
    line += f" = {size(own)}"
    if parts["reserve"]:
        line += f"; reserve {size(parts['reserve'])} apart"
        if detail:
            line += " (fixed margin + allocator fragmentation)"
    return line


def mfu_note(result: SearchResult, plan: Plan) -> str:
    """What the plan's MFU divides by (`dtorch.cluster.peak`): the spec sheet's peak of a device; a
    CPU's peak from its features: this machine's as detected, the `cpu` preset's nominal socket, or
    a cluster file's figure, and then also what a run on this machine divides by."""
    import math

    from dtorch.cluster.peak import compute_dtype, cpu_peak
    from dtorch.cluster.presets import cpu_socket_peak

    dtype = compute_dtype(plan.param_dtype)
    g = result.cluster.slowest_group()
    dev = g.device
    flops = dev.mfu_peak(dtype)
    head = "model FLOPs (6N + attention, no recompute) x tokens/s over"
    if dev.kind != "cpu":
        return f"{head} {flops / 1e12:,.1f} TFLOP/s {dtype} per device (its spec sheet's dense peak)"
    here = cpu_peak(dtype)
    share = f" / {g.devices_per_node} ranks" if g.devices_per_node > 1 else ""
    if math.isclose(flops * g.devices_per_node, here.flops, rel_tol=1e-6):  # `cpu_device`: this machine's
        return f"{head} {flops / 1e9:,.1f} GFLOP/s {dtype} per rank, the CPU's peak from its flags: {here.describe()}{share}"
    socket = cpu_socket_peak(dtype)
    what = (f"the cpu preset's nominal socket by the same rule: {socket.describe()}"
            if math.isclose(flops, socket.flops, rel_tol=1e-6) else "the cluster file's figure")
    # a run here has all its ranks on this machine, which share its peak (`dtorch.train.build.device_peak`)
    ranks = plan.world_size
    return (f"{head} {flops / 1e9:,.1f} GFLOP/s {dtype} per device, {what}; not this machine's CPU: a run "
            f"here divides by {here.flops / ranks / 1e9:,.1f} GFLOP/s per rank ({here.describe()}"
            f"{f' / {ranks} ranks' if ranks > 1 else ''})")


def memory_breakdown(est: Estimate) -> str:
    return memory_summary(est.memory_breakdown)


def why_slower(plan: Plan, est: Estimate, best: Estimate) -> str:
    """What a slower plan spends more time on than the best one (the two largest differences)."""
    diffs = sorted(((est.time_breakdown[k] - best.time_breakdown.get(k, 0.0), k) for k in est.time_breakdown),
                   reverse=True)
    parts = [f"+{_secs(d)} s {TIME_LABELS[k]}" for d, k in diffs[:2] if d > 0.005 * best.step_time_s]
    return ", ".join(parts) or "slightly more of everything"


def one_off(result: SearchResult, plan: Plan, est: Estimate) -> str | None:
    """The chosen plan's one-off seconds (compilation) and how the ranking counted them."""
    once = strategies.once_s(plan, result.cluster)
    if not once:
        return None
    if not result.steps:
        return (f"{once:,.0f} s once (compilation, calibrated), not in the step time: no run length given, so the "
                f"ranking is by step time alone (dtorch plan --steps N, or the trainer's steps, amortises it)")
    am = strategies.amortised_s(est.step_time_s, plan, result.cluster, result.steps)
    return (f"{once:,.0f} s once (compilation, calibrated) over {result.steps:,} steps: "
            f"({est.step_time_s:.3f} x {result.steps:,} + {once:,.0f}) / {result.steps:,} = {am:.3f} s/step "
            f"amortised, what the ranking used")


KERNEL_NAMES = {"fa2": "flash-attention 2", "fa3": "flash-attention 3", "cudnn": "cuDNN's fused kernel"}


def kernels_note(result: SearchResult, plan: Plan, est: Estimate) -> str | None:
    """On GPUs, the kernels the step is priced with, which a run on another software stack may not
    have: the attention core's (the fused kernel and its speed at this shape, the unfused roofline,
    or the probe's measurement) and the element-wise work's share of the step, eager or compiled
    (a stack with fused norms and activations, Transformer Engine or torch.compile, does less of it:
    the smaller the model, the more that matters). None on CPUs."""
    from dtorch.cluster.peak import compute_dtype
    from dtorch.cluster.shape import SDPA_KERNEL, attention_efficiency, generation

    dev = result.cluster.slowest_group().device
    prof, consts = result.profile, result.constants or DEFAULT_CONSTANTS
    if dev.kind == "cpu" or prof is None:
        return None
    dtype = compute_dtype(plan.param_dtype)
    head_dim = prof.hidden / prof.num_heads if prof.num_heads else 0.0
    if not prof.num_heads:
        attn = None
    elif getattr(prof, "unfused_attention", False):
        attn = "attention unfused (its s x s scores in memory): a roofline of its GEMMs and softmax passes"
    elif dev.attention_speed(dtype, head_dim, prof.seq_len):
        attn = "attention as `dtorch probe` measured it"
    else:
        kernel = consts.attention_kernel
        name = SDPA_KERNEL.get(generation(dev.name) or "", "fa2") if kernel == "sdpa" else kernel
        eff = attention_efficiency(dev.name, kernel, head_dim, prof.seq_len)
        via = " through torch's SDPA" if kernel == "sdpa" else ""
        attn = (f"attention by {KERNEL_NAMES.get(name, name)}{via}, {eff:.0%} of the 16-bit peak in full-s^2 "
                f"FLOPs (head dim {head_dim:g}, {prof.seq_len:,} tokens)" if eff else "attention at the GEMMs' speed")
    bare = estimate(plan, prof, result.cluster, constants=replace(consts, elementwise_passes=0.0)).step_time_s
    share = max(0.0, 1.0 - bare / est.step_time_s)
    elem = (f"element-wise work {share:.0%} of the step, "
            + ("compiled (fused to half its passes)" if plan.compile else
               "eager (`--fix compile=true` prices torch.compile's fusion)"))
    return "; ".join(x for x in (attn, elem) if x)


def precision_reason(result: SearchResult, plan: Plan, est: Estimate) -> str:
    """Why the chosen plan computes in its param_dtype and reduces in its reduce_dtype: the best plan
    of every other precision searched, and how much slower it is."""
    head = f"{plan.param_dtype} compute, {plan.reduce_dtype} gradient reduction"
    others = []
    for prec, (p, e) in result.best_by_precision.items():
        if (p.param_dtype, p.reduce_dtype) == (plan.param_dtype, plan.reduce_dtype):
            continue
        rel = e.step_time_s / est.step_time_s - 1.0
        verdict = "slower" if rel > 0 else "faster, but within the margin kept for higher precision"
        others.append(f"{prec} {rel:+.0%} ({verdict})")
    prec_notes = [n for n in result.notes if "not searched" in n]
    if not others and not prec_notes:
        return head + (" (fixed)" if "param_dtype" in result.fixed else "")
    return head + "; " + "; ".join(others + prec_notes)


def uniform(plan: Plan) -> Plan | None:
    """`plan` with its work split evenly (no dp_shares, even stages), or None if it already is."""
    if plan.dp_shares is None and plan.layer_partition is None:
        return None
    return replace(plan, dp_shares=None, layer_partition=None)


def apportioned(result: SearchResult, plan: Plan, est: Estimate) -> list[str]:
    """On a mixed cluster: how the chosen plan apportions work over the node groups (ranks in the
    executor's order: node-major, groups in the cluster's order), and what the even split of the
    same plan would cost."""
    out = ["  work per node group (ranks node-major, groups in the cluster's order):"]
    for g in est.groups:
        mbs = "/".join(map(str, g["microbatches"]))
        blocks = "/".join(f"{b:g}" for b in g["blocks"])
        out.append(f"    group {g['group']} {g['device']} ranks {g['ranks']}: {blocks} blocks, {mbs} micro-batches "
                   f"per step per rank; {_gib(g['memory_bytes'])} of {_gib(g['memory_capacity'])} GiB; "
                   f"its slowest pipeline {g['step_s']:.2f} s")
    even = uniform(plan)
    if even is None:
        out.append("    split evenly: the even split is the fastest the search found for this cluster")
        return out
    e = estimate(even, result.profile, result.cluster)
    if not e.fits:
        worst = max(e.groups, key=lambda g: g["memory_bytes"] / g["memory_capacity"])
        out.append(f"    the even split ({even.describe()}) does not fit: {_gib(worst['memory_bytes'])} GiB per rank "
                   f"on group {worst['group']} ({worst['device']}), {_gib(worst['memory_capacity'])} GiB available")
    else:
        out.append(f"    the even split ({even.describe()}) would take {e.step_time_s:.2f} s per step "
                   f"({e.step_time_s / est.step_time_s - 1.0:+.0%}), every rank at the slowest group's pace")
    return out


def not_offered(result: SearchResult) -> list[str]:
    """One line per strategy that cannot apply to this model, with why (`Strategy.unsupported_for`)."""
    if not result.refused:
        return []
    fields = {s.name: ", ".join(s.refusal_fields) for s in strategies.REGISTRY}
    labels = {name: f"{name} ({fields[name]})" for name in result.refused}
    width = max(map(len, labels.values()))
    return ["", "not offered for this model:"] + [f"  {labels[n]:{width}s}  {why}" for n, why in result.refused.items()]


def explain(result: SearchResult, *, show_families: bool = True) -> str:
    """The whole explanation as text (see module doc)."""
    prof, cl = result.profile, result.cluster
    unit = _unit(result)
    batch = (f"seq_len {result.seq_len}, global batch {result.global_batch} "
             f"({result.global_batch * result.seq_len:,} tokens/step)" if unit == "tokens"
             else f"global batch {result.global_batch} (samples/step)")
    out = [
        f"{prof.name} ({count(prof.params_total)} params) on {cl.describe()}",
        batch
        + (f", fixed {', '.join(f'{k}={v}' for k, v in result.fixed.items())}" if result.fixed else ""),
        f"searched {result.meshes} meshes ({result.meshes_pruned} pruned by bound), "
        f"{result.evaluated:,} plans in {result.seconds:.2f} s",
        *(f"note: {n}" for n in result.notes if "not searched" not in n),
        "",
    ]
    if not result.ranked:
        out.append("no plan fits in memory.")
        for s in result.suggestions:
            out.append(f"  - {s}")
        if result.rejected:
            out.append("")
            out.append("families tried:")
            for fam, why in result.rejected.items():
                out.append(f"  {fam}: {why}")
        out += not_offered(result)
        return "\n".join(out)
    out.append(table(result))
    plan, est = result.ranked[0]
    out += [
        "",
        f"chosen: {plan.family()}  {plan.describe()}",
        f"  step {_secs(est.step_time_s)} s, {est.tokens_per_s:,.0f} {unit}/s ({est.tokens_per_s_per_gpu:,.0f} per GPU), "
        f"MFU {est.mfu:.1%}",
        f"  MFU: {mfu_note(result, plan)}",
        f"  time: {time_breakdown(est)}",
        f"  memory per rank: {memory_breakdown(est)}; {_gib(est.memory_bytes_per_rank)} of "
        f"{_gib(est.memory_capacity)} GiB with the reserve",
    ]
    if plan.offload != "none":
        from dtorch.plan.strategies.memory import MEMORY

        consts = result.constants or DEFAULT_CONSTANTS
        out.append(f"  offload: {MEMORY.offload_summary(plan, est, result.cluster.slowest_group(), consts)}")
    if est.groups:
        out += apportioned(result, plan, est)
    routing = routing_traffic(plan, prof, cl.devices_per_node)
    if routing:
        out.append(f"  {routing}")
    once = one_off(result, plan, est)
    if once:
        out.append(f"  one-off: {once}")
    kernels = kernels_note(result, plan, est)
    if kernels:
        out.append(f"  kernels: {kernels}")
    why_prec = precision_reason(result, plan, est)
    if why_prec:
        out.append(f"  precision: {why_prec}")
    if show_families:
        others = [(f, pe) for f, pe in result.best_by_family.items() if f != plan.family()]
        if others or result.rejected:
            out += ["", "why not the other families:"]
        for fam, (p, e) in others:
            slower = e.step_time_s / est.step_time_s - 1.0
            out.append(f"  {fam:20s} {slower:+.0%} step time ({e.tokens_per_s_per_gpu:,.0f} {_per_gpu(result)}, "
                       f"{p.describe()}): {why_slower(p, e, est)}")
        for fam, why in result.rejected.items():
            out.append(f"  {fam:20s} {why}")
    out += not_offered(result)
    return "\n".join(out)
