"""Search the plan space: mesh factorisations x micro-batching x schedule x checkpointing x offload.

The outer loop enumerates meshes ``pp x dp_replicate x dp_shard x cp x tp`` (tp innermost, within a
node, dividing the attention and key/value heads; cp splitting the sequence; pp at most the number
of blocks; dp dividing the global batch). Meshes are visited in order of a time lower bound (ideal
compute at the mesh's best GEMM efficiency plus its TP traffic), and a mesh is skipped once the
bound cannot beat the k-th best plan found and its family already has a plan no slower than the
bound. Inside a mesh: micro-batch sizes dividing the local batch, schedules and virtual stages,
then checkpointing and FSDP resharding in order of cost, stopping at the first that fits (more
recomputation or more communication is never faster); offload is only tried where nothing else fits.

`check(plan, profile, cluster)` rejects invalid combinations with messages naming the field, the
value and the valid choices; the executor calls it too.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from dtorch.cluster.spec import Cluster, NodeGroup
from dtorch.errors import ConfigError, choices
from dtorch.model.profile import ModelProfile
from dtorch.plan.cost import (
    DEFAULT_CONSTANTS,
    CostConstants,
    Estimate,
    balanced_partition,
    base_efficiency,
    collective_time,
    estimate,
    partition,
    shape_factor,
)
from dtorch.plan.cost import DTYPE_BYTES as _DTYPE_BYTES
from dtorch.plan.limits import unsupported
from dtorch.plan.plan import AC_POLICIES, DTYPES, MESH_AXES, OFFLOAD_POLICIES, SCHEDULES, Plan

GiB = 2**30

FIX_ALIASES = {
    "microbatch": "microbatch_size",
    "mbs": "microbatch_size",
    "micro_batch": "microbatch_size",
    "nmb": "num_microbatches",
    "microbatches": "num_microbatches",
    "fsdp": "dp_shard",
    "ddp": "dp_replicate",
    "v": "virtual_stages",
    "reshard": "reshard_after_forward",
    "dtype": "param_dtype",
    "precision": "param_dtype",
}
FIXABLE = (*MESH_AXES, "microbatch_size", "num_microbatches", "schedule", "virtual_stages", "ac", "offload",
           "reshard_after_forward", "sp", "param_dtype", "reduce_dtype")
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
PRECISION_MARGIN = 0.03
"""A plan computing or reducing in less than float32 must be this much faster than the best plan at
higher precision to be ranked above it: numerics are worth a few per cent of speed."""
PARTITION_MARGIN = 0.01
"""An uneven pipeline partition must be this much faster than the even split to be ranked above it."""
SCHEDULE_ALIASES = {"interleaved": "interleaved_1f1b", "zb": "zero_bubble", "zbv": "zero_bubble"}


@dataclass
class SearchResult:
    """What the search found. `ranked` is best first; everything fits unless `ranked` is empty."""

    ranked: list[tuple[Plan, Estimate]]
    best_by_family: dict[str, tuple[Plan, Estimate]]
    """The fastest fitting plan of every strategy family (Plan.family())."""
    rejected: dict[str, str]
    """Families with no fitting plan -> why (the least memory any of their plans needed)."""
    suggestions: list[str] = field(default_factory=list)
    """When nothing fits: the smallest changes that would make a plan fit."""
    profile: ModelProfile | None = None
    cluster: Cluster | None = None
    global_batch: int = 0
    seq_len: int = 0
    fixed: dict[str, Any] = field(default_factory=dict)
    evaluated: int = 0
    meshes: int = 0
    meshes_pruned: int = 0
    seconds: float = 0.0
    closest: tuple[Plan, Estimate] | None = None
    """When nothing fits: the plan that came closest (least memory per rank)."""
    notes: list[str] = field(default_factory=list)
    """Caveats about the whole result (e.g. fixed fields this DTorch cannot execute)."""
    best_by_precision: dict[str, tuple[Plan, Estimate]] = field(default_factory=dict)
    """The fastest fitting plan of every precision searched ('param_dtype/reduce_dtype')."""

    @property
    def best(self) -> tuple[Plan, Estimate] | None:
        return self.ranked[0] if self.ranked else None


# ---- fixed fields -------------------------------------------------------------------------------
def parse_fix(text: str | None) -> dict[str, Any]:
    """``"tp=8,pp=2,microbatch=1,ac=full"`` -> {'tp': 8, 'pp': 2, 'microbatch_size': 1, 'ac': 'full'}."""
    out: dict[str, Any] = {}
    if not text:
        return out
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, eq, raw = item.partition("=")
        if not eq or not raw.strip():
            raise ConfigError("fix", item, "use key=value pairs, e.g. tp=8,pp=2,microbatch=1,ac=full")
        out[key.strip()] = raw.strip()
    return normalize_fixed(out)


def normalize_fixed(fixed: dict[str, Any] | None) -> dict[str, Any]:
    """Resolve aliases and types of fixed fields; ConfigError for unknown keys or bad values."""
    out: dict[str, Any] = {}
    for key, val in (fixed or {}).items():
        k = FIX_ALIASES.get(key, key)
        if k not in FIXABLE:
            raise ConfigError("fix", key, "unknown plan field; " + choices(list(FIXABLE) + sorted(FIX_ALIASES)))
        if k in (*MESH_AXES, "microbatch_size", "num_microbatches", "virtual_stages"):
            try:
                iv = int(val)
                if isinstance(val, bool) or iv != float(val) or iv < 1:
                    raise ValueError
            except (TypeError, ValueError):
                raise ConfigError(k, val, "must be a positive integer") from None
            out[k] = iv
        elif k in ("reshard_after_forward", "sp"):
            if isinstance(val, bool):
                out[k] = val
            elif str(val).lower() in ("1", "true", "yes", "on"):
                out[k] = True
            elif str(val).lower() in ("0", "false", "no", "off"):
                out[k] = False
            else:
                raise ConfigError(k, val, "use true or false")
        else:
            v = str(val).lower()
            if k == "schedule":
                v = SCHEDULE_ALIASES.get(v, v)
            if k in ("param_dtype", "reduce_dtype"):
                v = DTYPE_ALIASES.get(v, v)
                if v in ("float8", "fp8"):
                    raise ConfigError(k, val, "float8 training is not implemented by this executor; "
                                      "use bfloat16 or float32")
            allowed = {"schedule": SCHEDULES, "ac": AC_POLICIES, "offload": OFFLOAD_POLICIES,
                       "param_dtype": DTYPES, "reduce_dtype": DTYPES}[k]
            if v not in allowed:
                raise ConfigError(k, val, choices(allowed))
            out[k] = v
    return out


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def valid_tp(profile: ModelProfile, cluster: Cluster) -> list[int]:
    """TP degrees that divide the query and key/value heads and fit in one node."""
    g = math.gcd(profile.num_heads, profile.num_kv_heads)
    per_node = cluster.devices_per_node
    return [t for t in _divisors(g) if per_node % t == 0 and cluster.world_size % t == 0]


def _check_fixed(fixed: dict[str, Any], profile: ModelProfile, cluster: Cluster, global_batch: int) -> None:
    W = cluster.world_size
    L = profile.num_layers
    if "tp" in fixed:
        tp = fixed["tp"]
        if profile.num_heads % tp or profile.num_kv_heads % tp:
            ok = [t for t in _divisors(math.gcd(profile.num_heads, profile.num_kv_heads)) if W % t == 0]
            raise ConfigError("tp", tp, f"tensor parallel degree {tp} does not divide {profile.num_heads} attention "
                              f"heads and {profile.num_kv_heads} kv heads; use tp in {{{', '.join(map(str, ok))}}}")
    if "pp" in fixed and fixed["pp"] > L:
        ok = [p for p in _divisors(W) if p <= L]
        raise ConfigError("pp", fixed["pp"], f"pipeline degree above the {L} blocks of {profile.name}; "
                          f"use pp in {{{', '.join(map(str, ok))}}}")
    prod = 1
    for a in MESH_AXES:
        prod *= fixed.get(a, 1)
    if W % prod:
        fixed_axes = {a: fixed[a] for a in MESH_AXES if a in fixed}
        raise ConfigError("degrees", fixed_axes, f"their product {prod} does not divide the world size {W}; "
                          f"use degrees whose product divides {W}")
    if all(a in fixed for a in MESH_AXES) and prod != W:
        raise ConfigError("degrees", {a: fixed[a] for a in MESH_AXES},
                          f"pp*dp_replicate*dp_shard*cp*tp = {prod} but the world size is {W}")
    if "cp" in fixed and fixed["cp"] > 1:
        cp, tp = fixed["cp"], fixed.get("tp", 1)
        if profile.seq_len % (2 * cp * tp):
            raise ConfigError("cp", cp, f"seq_len {profile.seq_len} is not divisible by 2*cp*tp = {2 * cp * tp}; "
                              "use a cp (and tp) whose 2*cp*tp divides the sequence length")
    if "microbatch_size" in fixed and global_batch % fixed["microbatch_size"]:
        raise ConfigError("microbatch_size", fixed["microbatch_size"],
                          f"does not divide the global batch {global_batch}; use one of its divisors "
                          f"{{{', '.join(map(str, _divisors(global_batch)[:12]))}}}")
    if "virtual_stages" in fixed and fixed["virtual_stages"] > 1 and fixed.get("schedule") in ("gpipe", "1f1b"):
        raise ConfigError("virtual_stages", fixed["virtual_stages"],
                          f"schedule {fixed['schedule']} runs one stage per rank; use schedule=interleaved_1f1b")
    per_dp = fixed.get("num_microbatches", 1) * fixed.get("microbatch_size", 1)
    if global_batch % per_dp:
        raise ConfigError("num_microbatches" if "num_microbatches" in fixed else "microbatch_size",
                          fixed.get("num_microbatches", fixed.get("microbatch_size")),
                          f"microbatch_size x num_microbatches = {per_dp} does not divide the global batch "
                          f"{global_batch}; use values whose product divides it")
    dp_fixed = fixed.get("dp_replicate", 1) * fixed.get("dp_shard", 1)
    if global_batch % dp_fixed:
        raise ConfigError("global_batch", global_batch,
                          f"not divisible by the fixed data-parallel degree {dp_fixed}; use a multiple of it")


def check(plan: Plan, profile: ModelProfile, cluster: Cluster) -> Plan:
    """Reject a plan that cannot run this model on this cluster (ConfigError naming the field, the
    value and the valid choices). Returns the plan. Internal consistency: `Plan.validate`."""
    W = cluster.world_size
    L = profile.num_layers
    plan.validate()
    if profile.num_heads % plan.tp or profile.num_kv_heads % plan.tp:
        ok = [t for t in _divisors(math.gcd(profile.num_heads, profile.num_kv_heads)) if W % t == 0]
        raise ConfigError("tp", plan.tp, f"tensor parallel degree {plan.tp} does not divide {profile.num_heads} "
                          f"attention heads and {profile.num_kv_heads} kv heads; use tp in {{{', '.join(map(str, ok))}}}")
    if plan.pp > L:
        raise ConfigError("pp", plan.pp, f"pipeline degree above the {L} blocks of {profile.name}; use pp <= {L}")
    if plan.num_stages > L:
        raise ConfigError("virtual_stages", plan.virtual_stages,
                          f"pp*virtual_stages = {plan.num_stages} stages for {L} blocks; use virtual_stages <= {L // plan.pp}")
    if plan.world_size != W:
        raise ConfigError("degrees", plan.mesh_shape,
                          f"pp*dp_replicate*dp_shard*cp*tp = {plan.world_size} but the world size is {W}")
    seq = plan.seq_len or profile.seq_len
    if plan.cp > 1 and seq % (2 * plan.cp * plan.tp):
        raise ConfigError("cp", plan.cp, f"seq_len {seq} is not divisible by 2*cp*tp = {2 * plan.cp * plan.tp}; "
                          "use a cp whose 2*cp*tp divides the sequence length")
    if plan.tp > 1 and plan.sp and seq % plan.tp:
        raise ConfigError("sp", plan.sp, f"sequence parallelism needs seq_len {seq} divisible by tp={plan.tp}")
    if plan.pp > 1 and plan.schedule in ("interleaved_1f1b", "zero_bubble") and plan.num_microbatches % plan.pp:
        raise ConfigError("num_microbatches", plan.num_microbatches,
                          f"schedule {plan.schedule} runs micro-batches in rounds of pp={plan.pp}; "
                          f"use a multiple of {plan.pp}")
    if plan.layer_partition is not None and sum(plan.layer_partition) != L:
        raise ConfigError("layer_partition", plan.layer_partition,
                          f"sums to {sum(plan.layer_partition)} but the model has {L} blocks")
    return plan


# ---- search ---------------------------------------------------------------------------------------
def rescale_seq(profile: ModelProfile, seq_len: int) -> ModelProfile:
    """The profile at another sequence length (attention FLOPs 12 h s and the 5 a s activation term
    are the only per-token quantities that depend on s)."""
    if seq_len == profile.seq_len:
        return profile
    ds = seq_len - profile.seq_len
    acts = dict(profile.act_bytes_per_token_block)
    # Korthikanti's 5 a s term exists only without flash attention: it is the gap none - selective
    if "none" in acts and "selective" in acts and acts["none"] - acts["selective"] > 4.9 * profile.num_heads * profile.seq_len:
        acts["none"] += 5.0 * profile.num_heads * ds
    return replace(profile, seq_len=seq_len, flops_per_token_block=profile.flops_per_token_block + 12.0 * profile.hidden * ds,
                   act_bytes_per_token_block=acts)


@dataclass
class _Mesh:
    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    bound: float = 0.0

    @property
    def family(self) -> str:
        return Plan(pp=self.pp, dp_replicate=self.dp_replicate, dp_shard=self.dp_shard, cp=self.cp, tp=self.tp,
                    sp=self.tp > 1).family()


def _meshes(profile: ModelProfile, cluster: Cluster, global_batch: int, fixed: dict[str, Any]) -> list[_Mesh]:
    W = cluster.world_size
    L = profile.num_layers
    s = profile.seq_len
    tps = [fixed["tp"]] if "tp" in fixed else valid_tp(profile, cluster)
    out = []
    for tp in tps:
        if W % tp:
            continue
        rest_tp = W // tp
        cps = [fixed["cp"]] if "cp" in fixed else [c for c in _divisors(rest_tp) if c <= 64 and s % (2 * c * tp) == 0
                                                   or c == 1]
        for cp in cps:
            if rest_tp % cp:
                continue
            rest_cp = rest_tp // cp
            pps = [fixed["pp"]] if "pp" in fixed else [p for p in _divisors(rest_cp) if p <= L]
            for pp in pps:
                if rest_cp % pp:
                    continue
                dp = rest_cp // pp
                if global_batch % dp:
                    continue
                if "dp_shard" in fixed:
                    shards = [fixed["dp_shard"]]
                elif "dp_replicate" in fixed:
                    shards = [dp // fixed["dp_replicate"]] if dp % fixed["dp_replicate"] == 0 else []
                else:
                    shards = _divisors(dp)
                for dps in shards:
                    if dps < 1 or dp % dps:
                        continue
                    dpr = dp // dps
                    if "dp_replicate" in fixed and fixed["dp_replicate"] != dpr:
                        continue
                    out.append(_Mesh(pp, dpr, dps, cp, tp))
    return out


def _bound(m: _Mesh, mbs: int, profile: ModelProfile, group: NodeGroup, global_batch: int,
           precisions: list[tuple[str, str]], c: CostConstants) -> float:
    """A lower bound of the step time of any plan on this mesh with micro-batches of `mbs` (or, with
    mbs=0, of any micro-batch size) in any of `precisions`: compute and element-wise work of an
    ideally balanced stage at the GEMM efficiency of the micro-batch in the fastest precision, its TP
    traffic without recomputation, and the smallest bubble any schedule leaves (zero-bubble with the
    most virtual stages)."""
    s = profile.seq_len
    dp = m.dp_replicate * m.dp_shard
    local = global_batch // dp
    rows = (mbs or local) * s / m.cp
    eff = base_efficiency(group, c) * shape_factor(profile.hidden / m.tp, rows, c)
    dev = group.device
    peak = max(dev.peak(p) for p, _ in precisions)
    elem = max(dev.elementwise(p) for p, _ in precisions)
    L, fb, fh = profile.num_layers, profile.flops_per_token_block, profile.flops_per_token_head
    blocks, flops = L / m.pp, (L * fb + fh) / m.pp
    tokens = local * s
    t = tokens * flops / (m.tp * m.cp) / (peak * eff)
    a_none = profile.act_bytes_per_token_block.get("none", 34.0 * profile.hidden)
    # the search estimates eager (uncompiled) runs, so the element-wise passes count in full
    t += c.elementwise_passes * 2.0 * tokens * blocks * a_none / (m.tp * m.cp) / (dev.memory_bandwidth * elem)
    if m.tp > 1:
        nmb = local // (mbs or local)
        act = (mbs or local) * s / m.cp * profile.hidden * 2
        t += nmb * blocks * 8 * collective_time("all_gather", act, m.tp, 1, group) * c.tp_exposed * 0.5
    if m.pp > 1:
        nmb_max = local // mbs if mbs else local
        t *= 1.0 + (m.pp - 1) / (3.0 * 2 * nmb_max)  # zero-bubble with 2 virtual stages leaves the least
    # data-parallel traffic is never less exposed than the contention floor (16-bit at least)
    p_stage = profile.params_total / (m.tp * m.pp)
    if m.dp_shard > 1:
        ag = collective_time("all_gather", p_stage * 2, m.dp_shard, m.tp * m.cp, group)
        rs = collective_time("reduce_scatter", p_stage * 2, m.dp_shard, m.tp * m.cp, group)
        t += c.dp_exposed_floor * (ag + rs)
    if m.dp_replicate > 1:
        t += c.dp_exposed_floor * collective_time("all_reduce", p_stage * 2 / m.dp_shard, m.dp_replicate,
                                                  m.tp * m.cp * m.dp_shard, group)
    return t


def precisions(group: NodeGroup, fixed: dict[str, Any]) -> tuple[list[tuple[str, str]], list[str]]:
    """(param_dtype, reduce_dtype) pairs worth searching on `group`'s device, and why others were left
    out. A 16-bit dtype is a candidate where the device has it (emulation is priced by its measured or
    detected peak, so an emulated one loses on its own) and this executor can train in it (float16 needs
    loss scaling: `dtorch.plan.limits`). Where a 16-bit peak is at least 4x float32's on a GPU, float32
    cannot win (more time, more activation memory) and is not evaluated. Gradients reduce in float32,
    or in the compute dtype when that is 16-bit."""
    dev = group.device
    notes: list[str] = []
    from dtorch.plan.limits import unsupported_dtype

    if "param_dtype" in fixed:
        params = [fixed["param_dtype"]]
    else:
        params = []
        for d in ("float32", "bfloat16", "float16"):
            if not dev.supports(d):
                continue
            why = unsupported_dtype(d)
            if why:
                if d != "float16" or not dev.supports("bfloat16"):
                    notes.append(f"{d} not searched: {why}")
                continue
            params.append(d)
        fast = [d for d in params if d != "float32" and dev.peak(d) >= 4.0 * dev.peak("float32")]
        if fast and dev.kind != "cpu" and "float32" in params:
            params.remove("float32")
            notes.append(f"float32 not searched: {fast[0]}'s peak is {dev.peak(fast[0]) / dev.peak('float32'):.0f}x "
                         f"float32's on {dev.name}")
    red = fixed.get("reduce_dtype", "float32")
    return [(p, red) for p in params], notes


def _reduced_reductions(plan: Plan, fixed: dict[str, Any]) -> list[Plan]:
    """Variants of a fitting plan that reduce gradients in its 16-bit compute dtype. Reduction
    precision changes only communication (and a little buffer memory), so the search tries it on
    the plans that made the ranking rather than on every plan."""
    if "reduce_dtype" in fixed or plan.param_dtype == "float32" or plan.reduce_dtype == plan.param_dtype:
        return []
    if plan.dp_shard * plan.cp == 1 and plan.dp_replicate == 1:
        return []  # no gradient reduction to make cheaper
    return [dataclasses.replace(plan, reduce_dtype=plan.param_dtype)]


def _precision_penalty(plan: Plan) -> float:
    """The ranking handicap of reduced precision (see PRECISION_MARGIN) and of an uneven pipeline
    partition (PARTITION_MARGIN): a plan that departs from the plain choice must earn it."""
    return ((1.0 + PRECISION_MARGIN * ((plan.param_dtype != "float32") + (plan.reduce_dtype != "float32")))
            * (1.0 + PARTITION_MARGIN * (plan.layer_partition is not None)))


def _partitions(pp: int, v: int, profile: ModelProfile) -> list[list[int] | None]:
    """Stage partitions to try: as even as possible (None) and, when it shortens the busiest pipeline
    rank, one that gives the rank holding the output head fewer blocks."""
    if pp == 1:
        return [None]
    return _partitions_cached(pp, v, profile.num_layers,
                              round(profile.flops_per_token_head / (profile.flops_per_token_block or 1.0), 3))


@functools.lru_cache(maxsize=4096)
def _partitions_cached(pp: int, v: int, L: int, head: float) -> list[list[int] | None]:
    if L < pp * v:
        return [None]
    even = partition(Plan(pp=pp, virtual_stages=v), L)
    per_rank = balanced_partition(pp, L, head)  # blocks per pipeline rank, head on the last
    if any(n < v for n in per_rank):
        return [None]
    # each rank's blocks over its v looped stages (rank r runs stages r, r + pp, ...), earlier first
    bal = [0] * (pp * v)
    for r, n in enumerate(per_rank):
        base, extra = divmod(n, v)
        for k in range(v):
            bal[r + k * pp] = base + (1 if k < extra else 0)

    def busiest(sizes: list[int]) -> float:
        ranks = [sum(sizes[r::pp]) for r in range(pp)]
        ranks[-1] += head
        return max(ranks)

    # worth trying only where it can win the ranking's margin for uneven partitions
    return [None, bal] if bal != even and busiest(bal) < busiest(even) * (1.0 - PARTITION_MARGIN) else [None]


def search(
    profile: ModelProfile,
    cluster: Cluster,
    *,
    global_batch: int,
    seq_len: int | None = None,
    fixed: dict[str, Any] | None = None,
    top_k: int = 5,
    dtype: str | None = None,
    constants: CostConstants = DEFAULT_CONSTANTS,
    suggest: bool = True,
    executable_only: bool = True,
    progress: Callable[[int, int, int], None] | None = None,
) -> SearchResult:
    """Rank the fitting plans for `profile` on `cluster` at `global_batch` sequences of `seq_len`
    tokens (default: the profile's). `fixed` pins plan fields (aliases: microbatch, mbs, nmb, fsdp, ddp,
    v, reshard, dtype); impossible ones raise ConfigError. Precision (param_dtype, reduce_dtype) is
    searched like the rest; `dtype`, when given, pins param_dtype. Returns the top `top_k`, the best
    plan of each family, why other families were rejected, and when nothing fits, suggestions.
    `progress(meshes_done, meshes_total, plans_estimated)`, when given, is called once per mesh
    (`dtorch.progress.search_progress` prints it)."""
    t0 = time.perf_counter()
    if not isinstance(global_batch, int) or global_batch < 1:
        raise ConfigError("global_batch", global_batch, "must be a positive integer (sequences per step)")
    if seq_len is not None:
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ConfigError("seq_len", seq_len, "must be a positive integer")
        profile = rescale_seq(profile, seq_len)
    fixed = normalize_fixed(fixed)
    if dtype is not None and "param_dtype" not in fixed:
        fixed = {**fixed, **normalize_fixed({"param_dtype": dtype})}
    _check_fixed(fixed, profile, cluster, global_batch)
    notes: list[str] = []
    forced = unsupported(Plan(**{k: v for k, v in fixed.items() if k in ("cp", "tp", "pp", "sp", "schedule",
                                                                        "virtual_stages", "param_dtype")}))
    if executable_only and forced:
        # the user asked for it: evaluate, but say that this DTorch cannot run it
        executable_only = False
        notes.append(f"the fixed fields ask for what this DTorch cannot run yet: {forced}")
    group = cluster.slowest_group()
    cap = group.device.memory_bytes
    L = profile.num_layers
    precs, prec_notes = precisions(group, fixed)
    if not precs:
        raise ConfigError("param_dtype", fixed.get("param_dtype"),
                          f"{group.device.name} computes in {{{', '.join(sorted(group.device.peak_flops))}}}; "
                          "use one of those")
    for p, _ in precs:
        if not group.device.supports(p):
            raise ConfigError("param_dtype", p, f"{group.device.name} has no {p} arithmetic; use one of "
                              f"{{{', '.join(sorted(group.device.peak_flops))}}}")
    notes += prec_notes
    lean_dtype = min((p for p, _ in precs), key=lambda d: _DTYPE_BYTES[d])

    meshes = _meshes(profile, cluster, global_batch, fixed)
    if not meshes:
        raise ConfigError(
            "global_batch", global_batch,
            f"no mesh of {cluster.world_size} devices has a data-parallel degree dividing it "
            f"(with the fixed fields {fixed or 'none'}); use a global batch that is a multiple of "
            f"{cluster.world_size // _max_non_dp(profile, cluster)} or fix fewer fields",
        )
    for m in meshes:
        m.bound = _bound(m, 0, profile, group, global_batch, precs, constants)
    meshes.sort(key=lambda m: m.bound)

    ranked: list[tuple[float, int, Plan, Estimate]] = []
    best_family: dict[str, tuple[Plan, Estimate]] = {}
    best_precision: dict[str, tuple[Plan, Estimate]] = {}
    least_mem: dict[str, tuple[Plan, Estimate]] = {}
    evaluated = 0
    pruned = 0
    counter = 0

    def kth() -> float:
        return ranked[top_k - 1][0] if len(ranked) >= top_k else math.inf

    seen: dict[tuple, Estimate] = {}
    not_runnable: dict[str, str] = {}

    def consider(plan: Plan) -> Estimate:
        nonlocal evaluated, counter
        key = (plan.pp, plan.dp_replicate, plan.dp_shard, plan.cp, plan.tp, plan.sp, plan.microbatch_size,
               plan.schedule, plan.virtual_stages, plan.ac, plan.offload, plan.reshard_after_forward,
               plan.param_dtype, plan.reduce_dtype, tuple(plan.layer_partition or ()))
        if key in seen:
            return seen[key]
        evaluated += 1
        est = seen[key] = estimate(plan, profile, cluster, constants=constants)
        fam = plan.family()
        if executable_only and est.fits and (why := unsupported(plan)):
            not_runnable.setdefault(fam, why)
            return est
        if est.fits:
            counter += 1
            score = est.step_time_s * _precision_penalty(plan)
            if len(ranked) < top_k or score < ranked[-1][0]:
                ranked.append((score, counter, plan, est))
                ranked.sort(key=lambda r: (r[0], r[1]))
                del ranked[top_k:]
            if fam not in best_family or score < best_family[fam][1].step_time_s * _precision_penalty(best_family[fam][0]):
                best_family[fam] = (plan, est)
            prec = f"{plan.param_dtype}/{plan.reduce_dtype}"
            if prec not in best_precision or est.step_time_s < best_precision[prec][1].step_time_s:
                best_precision[prec] = (plan, est)
        else:
            if fam not in least_mem or est.memory_bytes_per_rank < least_mem[fam][1].memory_bytes_per_rank:
                least_mem[fam] = (plan, est)
        return est

    def worth(bound: float, fam: str) -> bool:
        # a family keeps being explored until it has one fitting plan; after that only while it can
        # still reach the top k (its best is then exact whenever it matters, an upper bound otherwise)
        return bound < kth() or fam not in best_family

    for i, mesh in enumerate(meshes):
        if progress is not None:
            progress(i, len(meshes), evaluated)
        fam = mesh.family
        if not worth(mesh.bound, fam):
            pruned += 1
            continue
        dp = mesh.dp_replicate * mesh.dp_shard
        local = global_batch // dp
        mbss = [fixed["microbatch_size"]] if "microbatch_size" in fixed else _divisors(local)
        mbss = [b for b in sorted(mbss, reverse=True) if local % b == 0
                and ("num_microbatches" not in fixed or local // b == fixed["num_microbatches"])]
        offloads = [fixed["offload"]] if "offload" in fixed else list(OFFLOAD_POLICIES)
        if mesh.dp_shard == 1 and "offload" not in fixed:
            offloads.remove("params")  # CPU offload of parameters is an FSDP feature

        for offload in offloads:
            fitted = False
            # a whole offload level is skipped when even its leanest plan (smallest micro-batch, full
            # checkpointing, resharding) does not fit
            if offload == "params" and mesh.dp_shard == 1:
                continue
            lean = _leanest(mesh, local, offload, mbss[-1], L, fixed, lean_dtype, profile, global_batch) if mbss else None
            if lean is None or not consider(lean).fits:
                continue
            for mbs in mbss:
                nmb = local // mbs
                if "num_microbatches" in fixed and fixed["num_microbatches"] != nmb:
                    continue
                if not worth(_bound(mesh, mbs, profile, group, global_batch, precs, constants), fam):
                    continue
                if mbs != mbss[-1]:
                    lean = _leanest(mesh, local, offload, mbs, L, fixed, lean_dtype, profile, global_batch)
                    if lean is None or not consider(lean).fits:
                        continue  # activations grow with the micro-batch: try a smaller one
                for sched, v in _schedules(mesh.pp, nmb, L, fixed):
                    for (pdt, rdt), part in itertools.product(precs, _partitions(mesh.pp, v, profile)):
                        base = Plan(
                            pp=mesh.pp, dp_replicate=mesh.dp_replicate, dp_shard=mesh.dp_shard, cp=mesh.cp,
                            tp=mesh.tp, sp=fixed.get("sp", mesh.tp > 1) and mesh.tp > 1, microbatch_size=mbs,
                            num_microbatches=nmb, schedule=sched, virtual_stages=v, offload=offload,
                            param_dtype=pdt, reduce_dtype=rdt, layer_partition=part, seq_len=profile.seq_len,
                            global_batch=global_batch,
                        )
                        fitted |= _inner(base, fixed, consider, lambda t, f=fam: not worth(t, f))
            if fitted:
                break  # offloading is only worth it where nothing else fits on this mesh
    for plan in [p for _, _, p, _ in list(ranked)] + [p for p, _ in list(best_family.values())]:
        for variant in _reduced_reductions(plan, fixed):
            consider(variant)
    suggestions: list[str] = []
    closest = None
    if not ranked:
        pool = list(least_mem.values())
        if pool:
            closest = min(pool, key=lambda pe: pe[1].memory_bytes_per_rank)
        if suggest:
            suggestions = _suggest(profile, cluster, global_batch, fixed, constants, closest)
    rejected = {fam: f"fits, but cannot run here: {why}" for fam, why in sorted(not_runnable.items())
                if fam not in best_family}
    for fam, (plan, est) in sorted(least_mem.items()):
        if fam in best_family or fam in rejected:
            continue
        rejected[fam] = (f"does not fit: its leanest plan tried needs {est.memory_bytes_per_rank / GiB:.1f} GiB "
                         f"per rank ({plan.describe()}), {cap / GiB:.0f} GiB available"
                         + "".join(f"; {n}" for n in est.notes))
    return SearchResult(
        ranked=[(p, e) for _, _, p, e in ranked],
        best_by_family=dict(sorted(best_family.items(), key=lambda kv: kv[1][1].step_time_s)),
        rejected=rejected,
        suggestions=suggestions,
        profile=profile,
        cluster=cluster,
        global_batch=global_batch,
        seq_len=profile.seq_len,
        fixed=fixed,
        evaluated=evaluated,
        meshes=len(meshes),
        meshes_pruned=pruned,
        seconds=time.perf_counter() - t0,
        closest=closest,
        notes=notes,
        best_by_precision=dict(sorted(best_precision.items(), key=lambda kv: kv[1][1].step_time_s)),
    )


def _leanest(mesh: _Mesh, local: int, offload: str, mbs: int, L: int, fixed: dict[str, Any], param_dtype: str,
             profile: ModelProfile, global_batch: int) -> Plan | None:
    """The plan of this mesh, offload level and micro-batch size that needs the least memory: full
    checkpointing (unless ac is fixed), resharding, the schedule with the fewest micro-batches in flight."""
    nmb = local // mbs
    sched = _schedules(mesh.pp, nmb, L, fixed)
    if not sched:
        return None
    return Plan(
        pp=mesh.pp, dp_replicate=mesh.dp_replicate, dp_shard=mesh.dp_shard, cp=mesh.cp, tp=mesh.tp,
        sp=fixed.get("sp", mesh.tp > 1) and mesh.tp > 1, microbatch_size=mbs, num_microbatches=nmb,
        schedule=sched[0][0], virtual_stages=sched[0][1], offload=offload,
        ac=fixed.get("ac", "full"),
        reshard_after_forward=fixed.get("reshard_after_forward", True) if mesh.dp_shard > 1 else False,
        param_dtype=param_dtype, reduce_dtype="float32", seq_len=profile.seq_len, global_batch=global_batch,
    )


def _max_non_dp(profile: ModelProfile, cluster: Cluster) -> int:
    return max(valid_tp(profile, cluster) or [1])


def _schedules(pp: int, nmb: int, L: int, fixed: dict[str, Any]) -> list[tuple[str, int]]:
    if pp == 1:
        return [(fixed.get("schedule", "1f1b"), 1)] if fixed.get("virtual_stages", 1) == 1 else []
    out: list[tuple[str, int]] = []
    want = fixed.get("schedule")
    vs = [fixed["virtual_stages"]] if "virtual_stages" in fixed else [1, 2, 4]
    for sched in ([want] if want else ["1f1b", "interleaved_1f1b", "zero_bubble"]):
        if sched != "gpipe" and nmb < pp:
            continue
        for v in vs:
            if pp * v > L:
                continue
            if sched in ("gpipe", "1f1b") and v != 1:
                continue
            if sched == "interleaved_1f1b" and (v == 1 or nmb % pp):
                continue
            if sched == "zero_bubble" and (v > 2 or nmb % pp):
                continue  # torch's interleaved zero-bubble schedule runs micro-batches in rounds of pp
            out.append((sched, v))
    return out


# (ac, reshard_after_forward) in order of cost: stop at the first that fits with reshard off
_MEMORY_LADDER = [("none", False), ("none", True), ("selective", False), ("selective", True),
                  ("full", False), ("full", True)]


def _inner(base: Plan, fixed: dict[str, Any], consider, hopeless) -> bool:
    """Walk the checkpointing/resharding ladder for one base plan; True if something fit.

    Every rung is at least as slow as the one before it (more recomputation or more traffic), so
    the walk stops at the first rung that fits with reshard off, as soon as the cheapest rung is
    too slow to matter (`hopeless(step_time)`), or when even the most frugal rung does not fit."""
    if base.offload == "params" and base.dp_shard == 1:
        return False  # CPU offload of parameters is an FSDP feature
    rungs = []
    for ac, reshard in _MEMORY_LADDER:
        if "ac" in fixed and fixed["ac"] != ac:
            continue
        if base.dp_shard == 1:
            if reshard:
                continue  # nothing to reshard without FSDP
        elif "reshard_after_forward" in fixed and fixed["reshard_after_forward"] != reshard:
            continue
        rungs.append((ac, reshard))
    if not rungs:
        return False
    first = consider(dataclasses.replace(base, ac=rungs[0][0], reshard_after_forward=rungs[0][1]))
    if first.fits:
        return True
    if hopeless(first.step_time_s) or len(rungs) == 1:
        return False
    last = consider(dataclasses.replace(base, ac=rungs[-1][0], reshard_after_forward=rungs[-1][1]))
    if not last.fits:
        return False
    for ac, reshard in rungs[1:-1]:
        est = consider(dataclasses.replace(base, ac=ac, reshard_after_forward=reshard))
        if est.fits and (not reshard or base.dp_shard == 1):
            return True
    return True


def _suggest(profile: ModelProfile, cluster: Cluster, global_batch: int, fixed: dict[str, Any],
             constants: CostConstants, closest: tuple[Plan, Estimate] | None) -> list[str]:
    """The smallest changes that make some plan fit: unfix a field, more nodes, a shorter sequence."""
    out: list[str] = []
    if closest is not None:
        plan, est = closest
        out.append(f"closest plan needs {est.memory_bytes_per_rank / GiB:.1f} GiB per rank "
                   f"({plan.describe()}); {est.memory_capacity / GiB:.0f} GiB available"
                   + "".join(f"; {n}" for n in est.notes))

    def fits(prof: ModelProfile, cl: Cluster, fx: dict[str, Any], gb: int) -> SearchResult | None:
        try:
            r = search(prof, cl, global_batch=gb, fixed=fx, top_k=1, constants=constants, suggest=False)
        except ConfigError:
            return None
        return r if r.ranked else None

    for key in list(fixed):
        fx = {k: v for k, v in fixed.items() if k != key}
        r = fits(profile, cluster, fx, global_batch)
        if r is not None:
            p, e = r.best
            out.append(f"drop the fixed {key}={fixed[key]}: {p.describe()} fits "
                       f"({e.memory_bytes_per_rank / GiB:.1f} GiB, {e.tokens_per_s_per_gpu:,.0f} tokens/s/GPU)")
    g0 = cluster.slowest_group()
    for mult in (2, 4, 8, 16, 32, 64):
        nodes = cluster.num_nodes * mult
        cl = Cluster([dataclasses.replace(g0, num_nodes=nodes)], name=f"{cluster.name} x{mult}")
        r = fits(profile, cl, fixed, global_batch)
        if r is not None:
            p, e = r.best
            out.append(f"use {nodes} nodes ({cl.world_size} x {g0.device.name}): {p.describe()} fits "
                       f"({e.memory_bytes_per_rank / GiB:.1f} GiB per rank)")
            break
    for div in (2, 4, 8, 16):
        s = profile.seq_len // div
        if s < 128:
            break
        r = fits(rescale_seq(profile, s), cluster, fixed, global_batch)
        if r is not None:
            p, e = r.best
            out.append(f"use seq_len {s}: {p.describe()} fits ({e.memory_bytes_per_rank / GiB:.1f} GiB per rank)")
            break
    if not out[1:]:
        out.append("no single change tried (unfixing a field, up to 64x the nodes, a 16x shorter sequence) fits; "
                   "use devices with more memory")
    return out
