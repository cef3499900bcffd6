"""Search the plan space: mesh factorisations x micro-batching x schedule x checkpointing x offload.

The outer loop enumerates meshes ``pp x dp_replicate x dp_shard x cp x tp`` (tp innermost, within a
node, dividing the attention and key/value heads; cp splitting the sequence; pp at most the number
of blocks; dp dividing the global batch). Meshes are visited in order of a time lower bound (ideal
compute at the mesh's best GEMM efficiency plus its TP traffic), and a mesh is skipped once the
bound cannot beat the k-th best plan found and its family already has a plan no slower than the
bound. Inside a mesh: micro-batch sizes dividing the local batch, schedules and virtual stages,
then checkpointing and FSDP resharding in order of cost, stopping at the first that fits (more
recomputation or more communication is never faster), and beside each FSDP plan ZeRO-1/2 down their
own ladder (`_zero`); offload is only tried where nothing else fits.

What each strategy contributes (its mesh degrees, schedules, precisions, the memory ladder, its
ranking handicap, its rules) comes from the registry, `dtorch.plan.strategies`.
`check(plan, profile, cluster)` rejects invalid combinations with messages naming the field, the
value and the valid choices; the executor runs the same rules (`dtorch.parallel.check`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

from dtorch.cluster.spec import Cluster, NodeGroup
from dtorch.errors import ConfigError
from dtorch.model.profile import ModelProfile
from dtorch.plan import hetero, strategies
from dtorch.plan.cost import (
    DEFAULT_CONSTANTS,
    DTYPE_BYTES,
    NO_COUNTS,
    CostConstants,
    Estimate,
    StepShape,
    compute_time,
    estimate,
)
from dtorch.plan.plan import MESH_AXES, Plan
from dtorch.plan.strategies import (  # noqa: F401
    DECLARED_NAMES,
    FIX_ALIASES,
    FIXABLE,
    Dims,
    RankShare,
    normalize_fixed,
    pinned,
    unsupported,
)
from dtorch.plan.strategies.base import divisors as _divisors

# Inside a mesh the search walks four strategies' candidates in an order that prunes (module doc):
# memory's offload levels and checkpointing ladder in order of cost, each stopping at the first that
# fits; the pipeline's schedules and partitions per micro-batch count; expert parallelism's degrees,
# which borrow data-parallel ranks rather than being a mesh axis; ZeRO's stages beside each FSDP plan,
# ZeRO-2 only where ZeRO-1 needs more checkpointing. Those name their strategy, as do
# the precisions a device offers (searched around every mesh) and valid_tp (an error's hint); the
# meshes, the lower bound and the checks of fixed fields are loops over the registry.
from dtorch.plan.strategies.expert import EXPERT
from dtorch.plan.strategies.memory import MEMORY, OFFLOAD_POLICIES
from dtorch.plan.strategies.pipeline import PARTITION_MARGIN, PIPELINE, bubble_fraction, ideal_load  # noqa: F401
from dtorch.plan.strategies.precision import PRECISION, PRECISION_MARGIN  # noqa: F401
from dtorch.plan.strategies.tensor import TENSOR
from dtorch.plan.strategies.zero import ZERO

GiB = 2**30


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
    steps: int | None = None
    """The run's length the ranking amortised one-off seconds (compilation) over; None: unknown,
    ranked by step time alone (`strategies.amortised_s`)."""
    constants: CostConstants | None = None
    """The cost model's constants the plans were priced with (e.g. whether the run clips gradients)."""
    refused: dict[str, str] = field(default_factory=dict)
    """Strategies that cannot apply to this model -> why (`strategies.refusals`): never searched."""

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


def valid_tp(profile: ModelProfile, cluster: Cluster) -> list[int]:
    """TP degrees that divide the query and key/value heads and fit in one node (the error message's
    largest non-data-parallel degree, `_max_non_dp`)."""
    return TENSOR.degrees(profile.num_heads, profile.num_kv_heads, cluster.devices_per_node, cluster.world_size)


def dims(profile: ModelProfile, world_size: int | None, seq_len: int | None = None) -> Dims:
    """What the registry's rules check a plan against in the planner (the model's sequence is
    given, so a bad sequence split is reported on the plan's own field)."""
    return Dims(profile.num_layers, profile.num_heads, profile.num_kv_heads, world_size,
                seq_len or profile.seq_len, seq_field=None, name=profile.name, num_experts=profile.num_experts)


def _check_fixed(fixed: dict[str, Any], profile: ModelProfile, cluster: Cluster, global_batch: int) -> None:
    """The fixed fields against the model and the world before any search: the registry's rules on
    the fixed mesh degrees the model decides (`strategies.DEGREED`), then what only a partial plan
    can break (products dividing the world size and the global batch), then each strategy's
    `fixed_rules`."""
    W = cluster.world_size
    strategies.check_applies(SimpleNamespace(**{f: fixed.get(f, 1) for f in strategies.refused_fields(profile)}),
                             profile)
    mesh = {s.axis: fixed[s.axis] for s in strategies.DEGREED if s.axis in fixed}
    # (gpipe takes any micro-batch count: only the degrees, and a fixed pipeline's virtual stages, are
    # under test)
    v = fixed.get("virtual_stages", 1) if mesh.get("pp", 1) > 1 else 1
    partial = Plan(**mesh, num_microbatches=max(mesh.get("pp", 1), 1), virtual_stages=v, sp=False,
                   schedule="gpipe" if v == 1 else "interleaved_1f1b")
    tested = {*mesh, "virtual_stages"} if v > 1 else set(mesh)
    for s in strategies.DEGREED:
        for violation in s.rules(partial, dims(profile, W)):
            if violation.field in tested:
                raise violation.error()
    _check_groups(cluster, 1, fixed.get("cp", 1), fixed.get("tp", 1))
    prod = math.prod(fixed.get(a, 1) for a in MESH_AXES)
    if W % prod:
        fixed_axes = {a: fixed[a] for a in MESH_AXES if a in fixed}
        raise ConfigError("degrees", fixed_axes, f"their product {prod} does not divide the world size {W}; "
                          f"use degrees whose product divides {W}")
    if all(a in fixed for a in MESH_AXES) and prod != W:
        raise ConfigError("degrees", {a: fixed[a] for a in MESH_AXES},
                          f"pp*dp_replicate*dp_shard*cp*tp = {prod} but the world size is {W}")
    if "microbatch_size" in fixed and global_batch % fixed["microbatch_size"]:
        raise ConfigError("microbatch_size", fixed["microbatch_size"],
                          f"does not divide the global batch {global_batch}; use one of its divisors "
                          f"{{{', '.join(map(str, _divisors(global_batch)[:12]))}}}")
    per_dp = fixed.get("num_microbatches", 1) * fixed.get("microbatch_size", 1)
    if global_batch % per_dp:
        raise ConfigError("num_microbatches" if "num_microbatches" in fixed else "microbatch_size",
                          fixed.get("num_microbatches", fixed.get("microbatch_size")),
                          f"microbatch_size x num_microbatches = {per_dp} does not divide the global batch "
                          f"{global_batch}; use values whose product divides it")
    strategies.check_fixed(fixed, profile, W)
    dp_fixed = fixed.get("dp_replicate", 1) * fixed.get("dp_shard", 1)
    if global_batch % dp_fixed:
        raise ConfigError("global_batch", global_batch,
                          f"not divisible by the fixed data-parallel degree {dp_fixed}; use a multiple of it")


def _check_groups(cluster: Cluster, pp: int, cp: int, tp: int) -> None:
    """On a mixed cluster, ConfigError naming the node group that cannot hold the tensor- and
    context-parallel groups of `cp` x `tp` (more tp than its node has, or a group spanning two kinds
    of device: `hetero.span_violation`)."""
    if cluster.homogeneous:
        return  # (one kind of device: the strategies' rules say it all)
    # (a product not dividing the world is reported after, without naming a group)
    bad = hetero.span_violation(cluster, cp, tp, cells=cluster.world_size % (pp * cp * tp) == 0)
    if bad:
        raise ConfigError(*bad)


def check(plan: Plan, profile: ModelProfile, cluster: Cluster) -> Plan:
    """Reject a plan that cannot run this model on this cluster (ConfigError naming the field, the
    value and the valid choices): every strategy's rules (`dtorch.plan.strategies.check`), the
    same the executor runs, and on a mixed cluster the node groups' (`_check_groups`). Returns the plan."""
    plan.validate()  # the document's version, then the rules over the plan alone
    strategies.check(plan, dims(profile, cluster.world_size, plan.seq_len))
    _check_groups(cluster, plan.pp, plan.cp, plan.tp)
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
    dense = {"flops_per_token_dense_block": profile.flops_per_token_dense_block + 12.0 * profile.hidden * ds} \
        if profile.num_dense_layers else {}
    return replace(profile, seq_len=seq_len, flops_per_token_block=profile.flops_per_token_block + 12.0 * profile.hidden * ds,
                   **dense,
                   act_bytes_per_token_block=acts)


@dataclass
class _Mesh:
    """One factorisation of the world over the mesh axes (`MESH_AXES`; a new axis is a field here),
    and the search's bookkeeping of it."""

    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    bound: float = 0.0
    stage_weights: tuple = ()
    """On a mixed cluster, the (speed, memory) of every pipeline rank (`hetero.stage_weights`)."""

    @property
    def degrees(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in MESH_AXES}

    def plan(self, **fields: Any) -> Plan:
        """A plan on this mesh: every plan the search builds is made here."""
        return Plan(**self.degrees, **fields)

    @property
    def family(self) -> str:
        return strategies.family(self.plan(sp=self.tp > 1))

    def families(self, fixed: dict[str, Any]) -> list[str]:
        """The families the search may rank on this mesh: its own, and ZeRO's where it tries them
        (`Zero.stages`; never over replicas, which the executor does not run)."""
        accumulating = self.plan(sp=self.tp > 1, num_microbatches=max(2, self.pp))
        return [self.family] + [strategies.family(replace(accumulating, zero=z))
                                for z in ZERO.stages(accumulating, fixed)]


def _meshes(profile: ModelProfile, cluster: Cluster, global_batch: int, fixed: dict[str, Any]) -> list[_Mesh]:
    """Every mesh the strategies' candidates make (`_degrees`: tp innermost first, then cp and pp)
    with the data-parallel split of the rest (dp dividing the global batch)."""
    W = cluster.world_size
    out = []
    for picked, rest in _degrees(W, {}, profile, cluster, fixed, strategies.refused_fields(profile)):
        if global_batch % rest == 0:
            out += [_Mesh(dp_replicate=dpr, dp_shard=dps, **picked) for dpr, dps in _dp_splits(rest, fixed)]
    if not cluster.homogeneous:
        # tensor- and context-parallel groups stay on one kind of device (docs/heterogeneous.md)
        out = [m for m in out if not hetero.span_violation(cluster, m.cp, m.tp)]
        for m in out:
            m.stage_weights = hetero.stage_weights(cluster, m.pp, m.dp_replicate * m.dp_shard, m.cp, m.tp)
    if not out:
        raise ConfigError(
            "global_batch", global_batch,
            f"no mesh of {W} devices has a data-parallel degree dividing it "
            f"(with the fixed fields {fixed or 'none'}); use a global batch that is a multiple of "
            f"{W // _max_non_dp(profile, cluster)} or fix fewer fields",
        )
    return out


def _degrees(rest: int, picked: dict[str, int], profile: ModelProfile, cluster: Cluster, fixed: dict[str, Any],
             refused: dict[str, str]) -> Iterator[tuple[dict[str, int], int]]:
    """Every choice of the model-decided mesh degrees (`strategies.DEGREED`, innermost axis first)
    dividing `rest` devices, as (axis -> degree, devices left for data parallelism). A fixed degree
    is the only one tried; a strategy that cannot apply to this model is never tried."""
    if len(picked) == len(strategies.DEGREED):
        yield picked, rest
        return
    s = strategies.DEGREED[len(picked)]
    axis = s.axis
    for d in [fixed[axis]] if axis in fixed else [1] if axis in refused else s.mesh_degrees(rest, profile, cluster,
                                                                                             picked):
        if rest % d == 0:
            yield from _degrees(rest // d, {**picked, axis: d}, profile, cluster, fixed, refused)


def _dp_splits(dp: int, fixed: dict[str, Any]) -> list[tuple[int, int]]:
    """(dp_replicate, dp_shard) splits of `dp` data-parallel ranks allowed by the fixed fields."""
    if "dp_shard" in fixed:
        shards = [fixed["dp_shard"]]
    elif "dp_replicate" in fixed:
        shards = [dp // fixed["dp_replicate"]] if dp % fixed["dp_replicate"] == 0 else []
    else:
        shards = _divisors(dp)
    return [(dp // dps, dps) for dps in shards if dps >= 1 and dp % dps == 0
            and ("dp_replicate" not in fixed or fixed["dp_replicate"] == dp // dps)]


def _bound(m: _Mesh, mbs: int, profile: ModelProfile, group: NodeGroup, global_batch: int,
           precisions: list[tuple[str, str]], c: CostConstants) -> float:
    """A lower bound of the step time of any plan on this mesh with micro-batches of `mbs` (or, with
    mbs=0, of any micro-batch size) in any of `precisions`: the cost model's own terms with
    optimistic settings. An ideally balanced pipeline rank (`ideal_load`) at the GEMM efficiency of
    the micro-batch, the fastest precision's peak and element-wise speed and 16-bit widths, no
    recomputation, no host overhead, async TP without its small collectives, the smallest bubble
    any schedule leaves (zero-bubble with two virtual stages), and data-parallel traffic exposed at
    the contention floor only, over the smallest groups, without per-unit or per-bucket latencies."""
    local = global_batch // (m.dp_replicate * m.dp_shard)
    mb = mbs or local
    # 16-bit widths; the step shape below takes the fastest precision's peak and element-wise speed
    plan = m.plan(**strategies.optimistic(m.degrees), microbatch_size=mb, num_microbatches=local // mb,
                  param_dtype="bfloat16", reduce_dtype="bfloat16")
    dev = group.device
    peak = max(dev.peak(p) for p, _ in precisions)
    elem = max(dev.elementwise(p) for p, _ in precisions)
    step = StepShape(plan, profile, group, c, "bfloat16", peak, elem, async_tp=True)
    # the attention kernel at the fastest speed any precision's plan could see (its measured speed or the GEMMs')
    step.attn_speed = max([step.speed, step.attn_speed] + [dev.attention_speed(p, step.h / profile.num_heads, step.s) or 0.0
                                          for p, _ in precisions if profile.num_heads])
    step.fs, step.st_fs = m.dp_shard, m.tp * m.cp  # the shard group without its context-parallel ranks
    load = ideal_load(m.pp, profile.num_layers, profile.num_dense_layers)  # (the cost model's pipeline rank)
    r = RankShare(p_stage=step.p_stage(load))
    compute_time(step, load, r, head_elementwise=False)
    for s in strategies.BOUNDED:  # (tensor parallelism: async, without its small collectives)
        if s.prepare(step):
            s.rank_time(step, load, r, NO_COUNTS)
    t = plan.num_microbatches * r.per_microbatch
    for s in strategies.PACE_BOUNDED:  # (the pipeline's bubble)
        t += s.bound_pace(step, t, local // mbs if mbs else local)
    # gradient and parameter traffic: the least over the bound's plan variants (expert parallelism's degrees)
    dp_terms = []
    for variant in strategies.bound_plans(plan, profile):
        step.plan, d = variant, 0.0
        for s in strategies.SYNC_BOUNDED:
            d += s.bound_sync(step, load, r.p_stage)
        dp_terms.append(d)
    step.plan = plan
    return t + c.dp_exposed_floor * min(dp_terms, default=0.0)


def precisions(group: NodeGroup, fixed: dict[str, Any]) -> tuple[list[tuple[str, str]], list[str]]:
    """(param_dtype, reduce_dtype) pairs worth searching on `group`'s device (the precision
    strategy's candidates), and why others were left out."""
    return PRECISION.candidates(group.device, fixed)


def _precision_penalty(plan: Plan) -> float:
    """The ranking handicap of a plan (every strategy's: reduced precision, an uneven partition)."""
    return strategies.penalty(plan)


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
    families: bool = True, steps: int | None = None,
    memory_correction: Callable[[Plan, Estimate], int] | None = None,
) -> SearchResult:
    """Rank the fitting plans for `profile` on `cluster` at `global_batch` sequences of `seq_len` tokens
    (default: the profile's). `fixed` pins plan fields (aliases: the fields' own, docs/plan.md); impossible
    ones raise ConfigError. Precision is searched like the rest; `dtype` pins param_dtype.
    Returns the top `top_k`, each family's best plan, why other families were rejected, and when nothing
    fits, suggestions. `progress(meshes_done, meshes_total, plans_estimated)` is called once per mesh.
    `families=False` skips each family's best (sizing needs only the top k: the bound prunes far more).
    `steps`, the run's length when known, ranks by (step time x steps + one-off seconds) / steps.
    `memory_correction(plan, estimate)` returns the bytes per rank a plan is judged by instead of the
    estimate's (never less), measured at run time (`dtorch.monitor.oom.Replan` after an OOM)."""
    t0 = time.perf_counter()
    profile, fixed = _inputs(profile, cluster, global_batch, seq_len, fixed, dtype)
    notes: list[str] = []
    if executable_only and (forced := _forced(fixed, profile)):
        # the user asked for it: evaluate, but say that this DTorch cannot run it
        executable_only = False
        notes.append(f"the fixed fields ask for what this DTorch cannot run yet: {forced}")
    group = cluster.slowest_group()
    precs = _precisions(group, fixed, notes)
    meshes = _meshes(profile, cluster, global_batch, fixed)
    bgroup = group if cluster.homogeneous else hetero.bound_group(cluster)  # a mixed cluster: its mean speed
    for m in meshes:
        m.bound = _bound(m, 0, profile, bgroup, global_batch, precs, constants)
    meshes.sort(key=lambda m: m.bound)
    book = _new_book(profile, cluster, constants, memory_correction, top_k, executable_only, families, steps)
    lean_dtype = min((p for p, _ in precs), key=lambda d: DTYPE_BYTES[d])
    for i, mesh in enumerate(meshes):
        if progress is not None:
            progress(i, len(meshes), book.evaluated)
        if not any(book.worth(mesh.bound, f) for f in mesh.families(fixed)):
            book.pruned += 1
            continue
        _search_mesh(mesh, book, profile, bgroup, global_batch, fixed, precs, lean_dtype, constants)
    _variants(book, fixed, cluster, notes)
    closest, suggestions = _when_nothing_fits(book, profile, cluster, global_batch, fixed, constants, suggest, notes)
    return SearchResult(
        ranked=[(p, e) for _, _, p, e in book.ranked],
        best_by_family=dict(sorted(book.best_family.items(), key=lambda kv: kv[1][1].step_time_s)),
        rejected=book.rejected(), suggestions=suggestions, profile=profile,
        cluster=cluster, global_batch=global_batch, seq_len=profile.seq_len, fixed=fixed,
        evaluated=book.evaluated, meshes=len(meshes), meshes_pruned=book.pruned, constants=constants,
        seconds=time.perf_counter() - t0, closest=closest, notes=notes, refused=strategies.refusals(profile),
        best_by_precision=dict(sorted(book.best_precision.items(), key=lambda kv: kv[1][1].step_time_s)), steps=steps,
    )


def _corrected(plan: Plan, est: Estimate, correction: Callable[[Plan, Estimate], int] | None) -> Estimate:
    """`est` with the memory `correction` gives (the difference kept as ``correction`` in the breakdown)."""
    if correction is None:
        return est
    extra = max(0, int(correction(plan, est)) - est.memory_bytes_per_rank)
    if not extra:
        return est
    mem = est.memory_bytes_per_rank + extra
    return replace(est, memory_bytes_per_rank=mem, memory_breakdown={**est.memory_breakdown, "correction": extra},
                   fits=est.fits and mem <= est.memory_capacity)


def _when_nothing_fits(book: _Book, profile: ModelProfile, cluster: Cluster, global_batch: int,
                       fixed: dict[str, Any], constants: CostConstants, suggest: bool,
                       notes: list[str]) -> tuple[tuple[Plan, Estimate] | None, list[str]]:
    """When no plan fits: the plan that came closest (least memory) and what would make one fit.
    When only offloaded plans fit the fixed fields: a note on what unfixing one buys (`notes`)."""
    if book.ranked:
        notes += _offload_forced(book, profile, cluster, global_batch, fixed, constants) if suggest else []
        return None, []
    closest = min(book.least_mem.values(), key=lambda pe: pe[1].memory_bytes_per_rank) if book.least_mem else None
    return closest, _suggest(profile, cluster, global_batch, fixed, constants, closest) if suggest else []


def _variants(book: _Book, fixed: dict[str, Any], cluster: Cluster, notes: list[str]) -> None:
    """The strategies' variants (bf16 reduction, calibrated compile) of the ranked plans, of each
    family's best and of the best plan of every ep degree, then what the ranked plans cost beyond
    their step time (compile seconds)."""
    plans = [p for _, _, p, _ in list(book.ranked)] + [p for p, _ in list(book.best_family.values())] \
        + [p for p, _ in list(book.best_ep.values())]
    for plan in plans:
        for variant in strategies.variants(plan, fixed, cluster):
            book.consider(variant)
    for _, _, plan, _ in book.ranked:
        notes += [n for n in strategies.notes(plan, cluster) if n not in notes]


def _forced(fixed: dict[str, Any], profile: ModelProfile) -> str | None:
    """Why this executor cannot run what the fixed fields ask for, or None."""
    if profile.num_experts and fixed.get("tp", 1) > 1 and fixed.get("sp", False):
        return ("sequence parallelism of a mixture of experts (the MoE blocks would route sequence shards) is not "
                "implemented; use sp=false with tp")
    return unsupported(Plan(**{k: v for k, v in fixed.items() if k in ("ep", "dp_replicate", "cp", "tp", "pp", "sp",
                                                                       "schedule", "ac", "virtual_stages",
                                                                       "param_dtype", *DECLARED_NAMES)}))


def _inputs(profile: ModelProfile, cluster: Cluster, global_batch: int, seq_len: int | None,
            fixed: dict[str, Any] | None, dtype: str | None) -> tuple[ModelProfile, dict[str, Any]]:
    """The search's inputs checked: the profile at `seq_len`, the fixed fields normalised (with
    `dtype` pinning param_dtype) and checked against the model and the cluster."""
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
    return profile, fixed


def _new_book(profile: ModelProfile, cluster: Cluster, constants: CostConstants,
              memory_correction: Callable[[Plan, Estimate], int] | None, top_k: int, executable_only: bool,
              families: bool, steps: int | None) -> _Book:
    """The search's book, scoring each plan by its (memory-corrected) estimate and ranking time."""
    def score(plan: Plan) -> Estimate:
        return _corrected(plan, estimate(plan, profile, cluster, constants=constants), memory_correction)

    return _Book(score, top_k, executable_only, families, _ranking_time(cluster, steps))


def _ranking_time(cluster: Cluster, steps: int | None) -> Callable[[Plan, Estimate], float]:
    """What the search ranks a plan by: its step time, or with the run's length `steps` known the
    amortised (step time x steps + one-off seconds) / steps (`strategies.amortised_s`)."""
    if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 1):
        raise ConfigError("steps", steps, "the run's length in optimizer steps: a positive integer, or None if unknown")
    return lambda plan, est: strategies.amortised_s(est.step_time_s, plan, cluster, steps)


def _precisions(group: NodeGroup, fixed: dict[str, Any], notes: list[str]) -> list[tuple[str, str]]:
    """The precisions to search on the group's device (notes say why others were left out)."""
    dev = group.device
    precs, prec_notes = precisions(group, fixed)
    if not precs:
        raise ConfigError("param_dtype", fixed.get("param_dtype"),
                          f"{dev.name} computes in {{{', '.join(sorted(dev.peak_flops))}}}; use one of those")
    for p, _ in precs:
        if not dev.supports(p):
            raise ConfigError("param_dtype", p, f"{dev.name} has no {p} arithmetic; use one of "
                              f"{{{', '.join(sorted(dev.peak_flops))}}}")
    notes += prec_notes
    return precs


class _Book:
    """What the search has seen: every plan estimated once, the top k by handicapped step time, the
    best plan of each family and precision, the leanest plan of families with none fitting, and the
    families whose fitting plans this executor cannot run."""

    def __init__(self, estimate_fn: Callable[[Plan], Estimate], top_k: int, executable_only: bool,
                 families: bool = True, time_fn: Callable[[Plan, Estimate], float] | None = None):
        self.estimate_fn, self.top_k, self.executable_only = estimate_fn, top_k, executable_only
        self.time_fn = time_fn or (lambda plan, est: est.step_time_s)
        """What a plan is ranked by before its handicap: the step time, amortised where the run's length is known."""
        self.families = families
        self.ranked: list[tuple[float, int, Plan, Estimate]] = []
        self.best_family: dict[str, tuple[Plan, Estimate]] = {}
        self.best_precision: dict[str, tuple[Plan, Estimate]] = {}
        self.best_ep: dict[int, tuple[Plan, Estimate]] = {}
        """The fastest fitting plan of every ep > 1 (their precision variants are tried too: EP's
        degree trades all-to-all against FSDP traffic, which the reduction dtype halves)."""
        self.least_mem: dict[str, tuple[Plan, Estimate]] = {}
        self.not_runnable: dict[str, str] = {}
        self.not_built: dict[str, str] = {}
        """Families this executor cannot run, never estimated (a ZeRO stage's limits) -> why."""
        self.zero_why: set[str] = set()
        """Why ZeRO-1/2 were not tried on some mesh (`Zero.not_searched`): `rejected` says it when
        they were tried nowhere."""
        self.seen: dict[tuple, Estimate] = {}
        self.evaluated = self.pruned = self.counter = 0

    def kth(self) -> float:
        return self.ranked[self.top_k - 1][0] if len(self.ranked) >= self.top_k else math.inf

    def worth(self, bound: float, fam: str) -> bool:
        # a family keeps being explored until it has one fitting plan; after that only while it can
        # still reach the top k (its best is then exact whenever it matters, an upper bound otherwise)
        return bound < self.kth() or (self.families and fam not in self.best_family)

    def consider(self, plan: Plan) -> Estimate:
        key = (plan.pp, plan.ep, plan.dp_replicate, plan.dp_shard, plan.cp, plan.tp, plan.sp, plan.microbatch_size,
               plan.schedule, plan.virtual_stages, plan.ac, plan.offload, plan.reshard_after_forward,
               plan.param_dtype, plan.reduce_dtype, tuple(plan.layer_partition or ()),
               *(_hashable(getattr(plan, n)) for n in DECLARED_NAMES))
        if key in self.seen:
            return self.seen[key]
        self.evaluated += 1
        est = self.seen[key] = self.estimate_fn(plan)
        fam = plan.family()
        if self.executable_only and est.fits and (why := unsupported(plan)):
            self.not_runnable.setdefault(fam, why)
        elif est.fits:
            self._rank(plan, est, fam)
        elif fam not in self.least_mem or est.memory_bytes_per_rank < self.least_mem[fam][1].memory_bytes_per_rank:
            self.least_mem[fam] = (plan, est)
        return est

    def _rank(self, plan: Plan, est: Estimate, fam: str) -> None:
        self.counter += 1
        score = self.score(plan, est)
        if len(self.ranked) < self.top_k or score < self.ranked[-1][0]:
            self.ranked.append((score, self.counter, plan, est))
            self.ranked.sort(key=lambda r: (r[0], r[1]))
            del self.ranked[self.top_k:]
        best = self.best_family.get(fam)
        if best is None or score < self.score(*best):
            self.best_family[fam] = (plan, est)
        if plan.ep > 1 and (plan.ep not in self.best_ep or est.step_time_s < self.best_ep[plan.ep][1].step_time_s):
            self.best_ep[plan.ep] = (plan, est)
        prec = f"{plan.param_dtype}/{plan.reduce_dtype}"
        if prec not in self.best_precision or est.step_time_s < self.best_precision[prec][1].step_time_s:
            self.best_precision[prec] = (plan, est)

    def score(self, plan: Plan, est: Estimate) -> float:
        return self.time_fn(plan, est) * _precision_penalty(plan)

    def rejected(self) -> dict[str, str]:
        """Families with no fitting plan -> why (cannot run here, or the least memory one needed)."""
        out = {fam: f"fits, but cannot run here: {why}" for fam, why in sorted(self.not_runnable.items())
               if fam not in self.best_family}
        for fam, (plan, est) in sorted(self.least_mem.items()):
            if fam in self.best_family or fam in out:
                continue
            out[fam] = (f"does not fit: its leanest plan tried needs {est.memory_bytes_per_rank / GiB:.1f} GiB "
                        f"per rank ({plan.describe()}), {est.memory_capacity / GiB:.0f} GiB available"
                        + "".join(f"; {n}" for n in est.notes))
        for fam, why in sorted(self.not_built.items()):
            if fam not in self.best_family and fam not in out:
                out[fam] = f"not searched: cannot run here: {why}"
        if self.zero_why and not any("ZeRO" in fam for fam in [*self.best_family, *out]):
            out["ZeRO1/2"] = "not searched: " + "; ".join(sorted(self.zero_why))
        return out


def _hashable(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v  # (dp_shares)


def _search_mesh(mesh: _Mesh, book: _Book, profile: ModelProfile, group: NodeGroup, global_batch: int,
                 fixed: dict[str, Any], precs: list[tuple[str, str]], lean_dtype: str, c: CostConstants) -> None:
    """Inside one mesh: offload levels (each only where the one before fits nothing), micro-batch
    sizes largest first (skipped when their bound cannot matter or their leanest plan does not
    fit), schedules, precisions and partitions, then the memory ladder."""
    fam, fams, L = mesh.family, mesh.families(fixed), profile.num_layers
    local = global_batch // (mesh.dp_replicate * mesh.dp_shard)
    mbss = [fixed["microbatch_size"]] if "microbatch_size" in fixed else _divisors(local)
    mbss = [b for b in sorted(mbss, reverse=True) if local % b == 0
            and ("num_microbatches" not in fixed or local // b == fixed["num_microbatches"])]
    if not mbss:
        return
    head_blocks = profile.flops_per_token_head / (profile.flops_per_token_block or 1.0)
    eps = EXPERT.degrees(profile, mesh.dp_replicate * mesh.dp_shard * mesh.cp, fixed)
    if book.executable_only:  # an ep this executor cannot run on the mesh is never ranked; `rejected` says why
        for e in [e for e in eps if e > 1]:
            if (lim := next(EXPERT.limits(on := mesh.plan(ep=e)), None)) is not None:
                book.not_built.setdefault(on.family(), lim.why)
                eps.remove(e)
    eps = [e for e in eps if (mesh.dp_replicate * mesh.dp_shard * mesh.cp) % e == 0]
    if not eps:
        return
    for offload in MEMORY.offloads(mesh.dp_shard, fixed):
        if offload == "params" and mesh.dp_shard == 1:
            continue  # CPU offload of parameters is an FSDP feature
        fitted = False
        # a whole offload level is skipped when even its leanest plan (smallest micro-batch, full
        # checkpointing, resharding) does not fit
        lean = _leanest(mesh, local, offload, mbss[-1], L, fixed, lean_dtype, profile, global_batch, max(eps))
        if lean is None or not book.consider(lean).fits:
            continue
        for mbs in mbss:
            nmb = local // mbs
            bound = _bound(mesh, mbs, profile, group, global_batch, precs, c)
            if not any(book.worth(bound, f) for f in fams):
                continue
            if mbs != mbss[-1]:
                lean = _leanest(mesh, local, offload, mbs, L, fixed, lean_dtype, profile, global_batch, max(eps))
                if lean is None or not book.consider(lean).fits:
                    continue  # activations grow with the micro-batch: try a smaller one
            for sched, v in _schedules(mesh.pp, nmb, L, fixed, profile):
                parts = PIPELINE.partitions(mesh.pp, v, L, head_blocks) + hetero.stage_partitions(
                    mesh.pp, v, L, head_blocks, mesh.stage_weights)  # (uneven stages on a mixed cluster)
                for (pdt, rdt), part, ep in itertools.product(precs, parts, eps):
                    base = _plan_on(mesh, profile, fixed, global_batch, ep=ep, microbatch_size=mbs,
                                    num_microbatches=nmb, schedule=sched, virtual_stages=v, offload=offload,
                                    param_dtype=pdt, reduce_dtype=rdt, layer_partition=part)
                    fitted |= _inner(base, fixed, book.consider, lambda t, f=fam: not book.worth(t, f))
                    fitted |= _zero(base, fixed, book)
        if fitted:
            return  # offloading is only worth it where nothing else fits on this mesh


def _zero(base: Plan, fixed: dict[str, Any], book: _Book) -> bool:
    """ZeRO-1/2 beside FSDP's `base` plan (`ZERO.stages`), each down its own memory ladder (nothing
    to reshard within a step); a stage this executor cannot run is not estimated, its family keeps
    why (`rejected`). ZeRO-2 only where ZeRO-1 does not fit at the cheapest rung: at any rung it is
    ZeRO-1's gradient memory bought with a reduce-scatter per micro-batch. True if something fit."""
    stages = ZERO.stages(base, fixed)
    if not stages:
        why = None if "zero" in fixed else ZERO.not_searched(base, fixed)
        if why:
            book.zero_why.add(why)
        return False
    fitted, first = False, None
    for z in stages:
        if first is not None and first.fits:
            break
        plan = Plan.__new__(Plan)
        plan.__dict__ = {**base.__dict__, "zero": z, "reshard_after_forward": False}  # (a shallow copy, as `_rung`)
        fam = plan.family()
        if book.executable_only and (why := unsupported(plan)):
            book.not_built.setdefault(fam, why)
            continue
        zfixed = {**fixed, "zero": z}
        fitted |= _inner(plan, zfixed, book.consider, lambda t, f=fam: not book.worth(t, f))
        if z == 1:
            rungs = MEMORY.rungs(plan.dp_shard, zfixed)
            first = book.consider(_rung(plan, *rungs[0])) if rungs else None  # (estimated: the book's)
    return fitted


def _schedules(pp: int, nmb: int, L: int, fixed: dict[str, Any], profile: ModelProfile) -> list[tuple[str, int]]:
    """The pipeline strategy's schedules (dense and MoE models alike)."""
    return PIPELINE.schedules(pp, nmb, L, fixed)


def _leanest(mesh: _Mesh, local: int, offload: str, mbs: int, L: int, fixed: dict[str, Any], param_dtype: str,
             profile: ModelProfile, global_batch: int, ep: int = 1) -> Plan | None:
    """The plan of this mesh, offload level and micro-batch size that needs the least memory: full
    checkpointing (unless ac is fixed), resharding, the schedule with the fewest micro-batches in flight."""
    nmb = local // mbs
    sched = _schedules(mesh.pp, nmb, L, fixed, profile)
    if not sched:
        return None
    return _plan_on(mesh, profile, fixed, global_batch, ep=ep, microbatch_size=mbs, num_microbatches=nmb,
                    schedule=sched[0][0], virtual_stages=sched[0][1], offload=offload, ac=fixed.get("ac", "full"),
                    reshard_after_forward=fixed.get("reshard_after_forward", True) if mesh.dp_shard > 1 else False,
                    param_dtype=param_dtype, reduce_dtype="float32")


def _plan_on(mesh: _Mesh, profile: ModelProfile, fixed: dict[str, Any], global_batch: int, **fields: Any) -> Plan:
    """A plan on `mesh`: its degrees, sequence parallelism with TP (unless fixed; not for MoE
    models), the model's sequence length and the batch, the declared fields `--fix` pins
    (`strategies.pinned`), and `fields` (the search's choices)."""
    return mesh.plan(sp=fixed.get("sp", mesh.tp > 1 and not profile.num_experts) and mesh.tp > 1,
                     seq_len=profile.seq_len, global_batch=global_batch, **pinned(fixed), **fields)


def _max_non_dp(profile: ModelProfile, cluster: Cluster) -> int:
    return max(valid_tp(profile, cluster) or [1])


def _rung(base: Plan, ac: str, reshard: bool) -> Plan:
    """`base` on one rung of the memory ladder (a shallow copy: `dataclasses.replace` re-runs the
    constructor, which the search would pay for every plan it tries)."""
    plan = Plan.__new__(Plan)
    plan.__dict__ = {**base.__dict__, "ac": ac, "reshard_after_forward": reshard}
    return plan


def _inner(base: Plan, fixed: dict[str, Any], consider: Callable[[Plan], Estimate],
           hopeless: Callable[[float], bool]) -> bool:
    """Walk the checkpointing/resharding ladder (`MEMORY.rungs`) for one base plan; True if something fit.

    Every rung is at least as slow as the one before it (more recomputation or more traffic), so
    the walk stops at the first rung that fits with reshard off, as soon as the cheapest rung is
    too slow to matter (`hopeless(step_time)`), or when even the most frugal rung does not fit."""
    if base.offload == "params" and base.dp_shard == 1:
        return False  # CPU offload of parameters is an FSDP feature
    rungs = MEMORY.rungs(base.dp_shard, fixed)
    if not rungs:
        return False
    first = consider(_rung(base, *rungs[0]))
    if first.fits:
        return True
    if hopeless(first.step_time_s) or len(rungs) == 1:
        return False
    last = consider(_rung(base, *rungs[-1]))
    if not last.fits:
        return False
    for ac, reshard in rungs[1:-1]:
        est = consider(_rung(base, ac, reshard))
        if est.fits and (not reshard or base.dp_shard == 1):
            return True
    return True


def _offload_forced(book: _Book, profile: ModelProfile, cluster: Cluster, global_batch: int,
                    fixed: dict[str, Any], constants: CostConstants) -> list[str]:
    """Where the fixed fields leave only offloaded plans and unfixing one of them fits a faster plan
    without offload: that plan, as a note (a what-if that pins the micro-batch or the checkpointing
    should not hide that its price is the offload)."""
    if not book.ranked or book.ranked[0][2].offload == "none" or "offload" in fixed or not fixed:
        return []
    plan, est = book.ranked[0][2:]
    faster = []
    for key in list(fixed):
        try:
            r = search(profile, cluster, global_batch=global_batch, top_k=1, constants=constants, suggest=False,
                       fixed={**{k: v for k, v in fixed.items() if k != key}, "offload": "none"})
        except ConfigError:
            continue
        if r.ranked and r.best[1].step_time_s < est.step_time_s:
            faster.append((r.best[1].step_time_s, key, *r.best))
    if not faster:
        return []
    _, key, p, e = min(faster, key=lambda f: f[0])
    others = [f"{k}={fixed[k]}" for _, k, _, _ in sorted(faster, key=lambda f: f[0])[1:]]
    return [f"only offload={plan.offload} fits the fixed fields; without the fixed {key}={fixed[key]}, "
            f"{p.describe()} fits without offload, {est.step_time_s / e.step_time_s:.1f}x faster "
            f"({e.tokens_per_s_per_gpu:,.0f} tokens/s/GPU)"
            + (f"; unfixing {', '.join(others)} is faster too" if others else "")]


def _suggest(profile: ModelProfile, cluster: Cluster, global_batch: int, fixed: dict[str, Any],
             constants: CostConstants, closest: tuple[Plan, Estimate] | None) -> list[str]:
    """The smallest changes that make some plan fit: unfix a field, an offload tier (where offload is
    fixed), more host memory or disk for the tiers, more nodes, a shorter sequence."""
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
    if "offload" in fixed:
        for tier in OFFLOAD_POLICIES[1:]:
            r = None if tier == fixed["offload"] else fits(profile, cluster, {**fixed, "offload": tier}, global_batch)
            if r is not None:
                p, e = r.best
                out.append(f"offload={tier}: {p.describe()} fits ({e.memory_bytes_per_rank / GiB:.1f} GiB per rank, "
                           f"{e.host_bytes_per_rank / GiB:.1f} GiB host memory per rank)")
                break
    budgets = [g for g in cluster.groups if g.host_memory_bytes > 0 or g.disk_bytes > 0]
    if budgets and fixed.get("offload", "optimizer") != "none":
        # the tiers may fail only on the host memory or the disk the cluster declares
        cl = Cluster([dataclasses.replace(g, host_memory_bytes=0, disk_bytes=0) for g in cluster.groups],
                     name=cluster.name, calibration=cluster.calibration)
        r = fits(profile, cl, fixed, global_batch)
        if r is not None and r.best[0].offload != "none":
            p, e = r.best
            g = cluster.slowest_group()
            need = f"{e.host_bytes_per_rank * g.devices_per_node / GiB:,.0f} GiB of host memory"
            if e.disk_bytes_per_rank:
                need += f" and {e.disk_bytes_per_rank * g.devices_per_node / GiB:,.0f} GiB of local disk"
            declared = [f"{v / GiB:,.0f} GiB {what}" for v, what in
                        ((g.host_memory_bytes, "host memory"), (g.disk_bytes, "disk")) if v > 0]
            out.append(f"with {need} per node (declared: {', '.join(declared)}): {p.describe()} fits "
                       f"({e.memory_bytes_per_rank / GiB:.1f} GiB per rank)")
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
