"""Expert parallelism (EP): the routed experts of every MoE block sharded over `ep` ranks borrowed
from the data-parallel ones (dp_replicate x dp_shard x cp), tokens moved to their experts' ranks by
all-to-all (dispatch) and back (combine).

Executor half: `dtorch.parallel.expert` (applied by `dtorch.parallel.parallelize` when ep > 1).

Rules: ep = 1 for a dense model; ep divides the routed experts and D = dp_replicate*dp_shard*cp
(what `expert_mesh` requires). `ep` is not a mesh axis of its own: the world is unchanged.

Limits (what the executor wiring runs today): ep > 1 with FSDP, HSDP or DDP over the data-parallel
ranks (with replicas, dp_replicate > 1, the ep ranks lie inside one replica, ep | dp_shard*cp, or over
whole replicas, ep = dp_shard*cp * k with k | dp_replicate: `replicas_fit`), optionally with TP
(sp=false: the routed experts' hidden units split over tp, expert-tensor parallelism) and PP (each
stage's ep groups are its own data-parallel ranks; zero-bubble under FSDP only without resharding
after forward, a limit of the pipeline strategy for every model) and CP (the ep ranks borrowed from
dp_shard x cp; each MoE's sequence-wise balance loss sums its statistics over the cp ranks,
`dtorch.models.moe.MoE.sequence_all_reduce`); no parameter offload, selective AC or compile. With TP each MoE block all-reduces its routed output (top_k rows per
token) over tp forward and the input gradient backward, priced here on top of the TP strategy's
collectives.

Time, per MoE block per micro-batch on the rank with the most traffic: the count exchange (latency)
plus dispatch and combine all-to-alls forward, the same two in backward (autograd's reverse
exchange) and two more when full AC re-runs the forward. Each moves, from every rank, its
tokens x top_k assignments x hidden x activation bytes x (ep-1)/ep to the other ep ranks, times
`load_imbalance` (the hottest rank's share over the mean); the executor waits for them (exposed).
The hottest rank's routed experts also compute `load_imbalance` x the mean. An all-to-all over a
group inside one node moves (k-1)/k of the bytes on NVLink; one that spans nodes sends the
(ep-k)/ep off-node share through the rank's NIC (the expensive case).

Memory: with FSDP over all D ranks the expert weights are sharded over ep x edp = D as the rest
are, so model states per rank do not change; what shrinks is the gathered block (its experts are
gathered over edp only, 1/ep of them) and FSDP's traffic (experts all-gathered and
reduce-scattered over edp only). With replicas (`expert_groups`, the executor's (edp_rep, edp_shard,
ep_rep, ep_shard) mesh) a rank's experts are sharded over edp_shard and replicated over edp_rep: model
states hold the experts / max(dp_shard, ep) (`local_params`; a DDP x EP rank 1/ep of them), and the
replicas' gradient all-reduce moves them over edp_rep only (`DataParallel.grad_comm`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from dtorch.model.profile import ModelProfile
from dtorch.plan.step import (  # noqa: F401  (re-exported: the average block)
    RankMemory,
    StepCounts,
    StepShape,
    base_efficiency,
    mean_block_flops,
    mean_block_params,
)
from dtorch.plan.strategies.base import Dims, Field, Limit, RankLoad, RankShare, Strategy, Violation, divisors

LOAD_IMBALANCE = 1.0
"""Default hottest-rank load over the mean (1: balanced). DeepSeek-V3's auxiliary-loss-free bias keeps
loads near balance; pass another value to `EXPERT.load_imbalance` (or the cost model's constants)
for what-if studies."""




def data_ranks(plan: Any) -> int:
    """D: the ranks EP borrows from (they see different tokens)."""
    return plan.dp_replicate * plan.dp_shard * plan.cp


def moe_fraction(profile: ModelProfile) -> float:
    """Share of the blocks that are MoE blocks (DeepSeek-V3: 58 of 61)."""
    if not profile.num_experts:
        return 0.0
    return (profile.num_layers - profile.num_dense_layers) / profile.num_layers


def moe_blocks(load: RankLoad, profile: ModelProfile) -> float:
    """MoE blocks on pipeline rank `load` (its blocks less the dense first ones it holds)."""
    if not profile.num_experts:
        return 0.0
    if not profile.num_dense_layers:
        return float(load.blocks)
    return float(load.blocks - load.dense_blocks)


_moe_blocks = moe_blocks  # (rank_time has a local of that name)


def expert_params_per_block(profile: ModelProfile) -> float:
    """Routed-expert parameters of one MoE block."""
    return float(profile.num_experts * profile.params_per_expert)


def all_to_all_time(nbytes: float, ep: int, stride: int, group: Any, *, node_limit: int | None = None,
                    top_k: int = 1) -> float:
    """Seconds of one all-to-all where every rank of an `ep`-rank group at rank stride `stride`
    holds `nbytes` to scatter evenly over the group (its own 1/ep stays). Pairwise exchange:
    intra-node share (k-1)/ep at NVLink bandwidth with a latency per peer, the off-node share
    (ep-k)/ep through the rank's own NIC with a latency per remote node; each link's all-to-all
    fit where the probe measured one (`a2a_link`).

    `node_limit` (a what-if of DeepSeek-V3's dispatch kernels, not what dtorch.parallel.expert does):
    node-limited routing with one copy per destination node. `nbytes` holds `top_k` copies of every
    token; each token reaches min(node_limit, nodes, top_k) nodes, so only that many copies, times
    the remote share (nodes-1)/nodes, cross the NICs, and NVLink fans them out to the experts."""
    if ep <= 1 or nbytes <= 0:
        return 0.0
    dpn = group.devices_per_node
    k = 1 if stride >= dpn else min(ep, max(1, dpn // stride))
    m = -(-ep // k)
    intra, inter = group.intra, group.inter
    intra_bytes, inter_bytes = nbytes * (k - 1) / ep, nbytes * (ep - k) / ep
    if node_limit is not None and m > 1:
        inter_bytes = nbytes / top_k * min(node_limit, m, top_k) * (m - 1) / m
        intra_bytes = nbytes * (k - 1) / k
    t = 0.0
    if k > 1:
        bw, lat = a2a_link(intra)
        t += intra_bytes / bw + (k - 1) * lat
    if m > 1:
        bw, lat = a2a_link(inter)
        t += inter_bytes / bw + (m - 1) * lat
    return t


def a2a_link(link: Any) -> tuple[float, float]:
    """(bytes/s, seconds per peer) of an all-to-all over `link`: the probe's own all-to-all fit where
    it measured one (`Link.a2a_bandwidth`; gloo's pairwise exchange runs well below its rings), else
    the link's ring alpha-beta (`bandwidth x efficiency`, `latency`: nominal links, older probes)."""
    if link.a2a_bandwidth > 0:
        return link.a2a_bandwidth, link.a2a_latency
    return link.bandwidth * link.efficiency, link.latency


@dataclass(frozen=True)
class Dispatcher:
    """How the executor moves tokens, as the cost model prices it. The default is what
    dtorch.parallel.expert does; the other settings describe DeepSeek-V3's own system (report
    arXiv:2412.19437 sec. 3.2) for what-if estimates only: `Expert.limits` is unchanged, so the
    planner never ranks a DTorch plan by them."""

    overlap: bool = False
    """False: every all-to-all is waited for (exposed). True: hidden under the compute of another
    micro-batch (DualPipe): exposed only beyond the rank's compute, and the overlapped compute runs
    on the SMs the communication kernels leave free (`comm_sm_share`)."""
    comm_sm_share: float = 20 / 132
    """Share of an H800/H100's 132 SMs the overlapped communication kernels occupy (DeepSeek: 20)."""
    node_limit: int | None = None
    """Node-limited routing deduplicated on the NIC (DeepSeek-V3: at most 4 nodes per token); None:
    top_k copies per token, as the executor sends."""
    dispatch_bytes: float | None = None
    """Bytes per element of the dispatch-direction all-to-alls (forward dispatch, backward gradient
    dispatch; DeepSeek: FP8, 1); None: the activation width. Combines stay at the activation width."""
    expert_gemm_efficiency: tuple[tuple[str, float], ...] = ()
    """(device name, efficiency over the dtype's peak) of the routed experts' GEMMs forward + backward,
    where the system computes them with a kernel measured apart from dense GEMMs; a device not listed:
    the executor's per-expert dense GEMMs at the dense efficiency and the shape factor of their rows."""
    ep_borrows_tp: bool = False
    """With TP: False, DTorch's expert-tensor parallelism (every TP rank routes all of the micro-batch's
    tokens over `ep` data-parallel ranks at stride tp, the experts' hidden units split over tp, their
    output all-reduced). True, torchtitan's expert_tensor_parallel_degree=1: the ep group takes in the
    TP ranks (ep consecutive ranks), each TP rank routes 1/tp of the tokens (its sequence-parallel share)
    to whole experts, and the block's input all-gather and output reduce-scatter over tp are sequence
    parallelism's (priced by the TP strategy with sp=true)."""


EXECUTOR_DISPATCH = Dispatcher()
DEEPSEEK_V3_DISPATCH = Dispatcher(overlap=True, node_limit=4, dispatch_bytes=1.0)
"""DeepSeek-V3's training system (report sec. 3.2.2 and 3.3): DualPipe overlap, node-limited
routing over at most 4 nodes, FP8 dispatch and BF16 combine, 20 SMs for communication."""
TORCH_GROUPED_MM_BF16 = (("B200-180GB", 11.27e12 / 14.9668e-3 / 2.25e15),)
"""bf16 `torch._grouped_mm` forward + backward at DeepSeek-V3's expert shapes (M 128,000 rows, N 2048,
K 7168, 8 local experts), as torchao measured it on a B200 (torchao
prototype/moe_training/README.md, "Microbenchmarks", torch 2.10 nightly): 14,966.8 us for
3 x 2 x 128000 x 2048 x 7168 FLOPs, 0.335 of the 2.25 PFLOP/s bf16 peak (dense GEMMs in the cost
model: 0.6 x the shape factor). No such measurement for other devices: none assumed."""
TORCHTITAN_ETP1_DISPATCH = Dispatcher(ep_borrows_tp=True, expert_gemm_efficiency=TORCH_GROUPED_MM_BF16)
"""torchtitan's default EP with TP and expert_tensor_parallel_degree=1 (torchtitan
`ParallelDims`: efsdp = dp_shard*cp*tp / ep; llama4 `apply_moe_ep_tp` with `ReordererSequenceParallel`):
all_to_all_single dispatch and combine, exposed, bf16, top_k copies per token, the routed experts in
`torch._grouped_mm` (`TORCH_GROUPED_MM_BF16`)."""


def expert_groups(plan: Any) -> tuple[int, int, int, int]:
    """(shard size, shard stride, replica size, replica stride) of the groups a rank's own routed experts
    (1/ep of every MoE block's) are FSDP-sharded and replicated over, strides in ranks (tp innermost), as
    `dtorch.parallel.expert.expert_mesh` lays them out: the data-parallel ranks are (edp_rep, edp_shard,
    ep_rep, ep_shard) = (R/k, S/m, k, m) for ep = k*m, with ep = m inside a replica's S shard ranks (k = 1)
    or over k whole replicas (m = S); the experts are sharded over edp_shard (stride ep ranks) and
    replicated over edp_rep (stride k replicas). Without replicas: sharded over edp = S/ep. A plan whose
    ep fits neither (refused by `Expert.limits`) is priced as if ep lay inside a replica."""
    ep, r, s, tp = plan.ep, plan.dp_replicate, plan.dp_shard * plan.cp, plan.tp
    k, m = (ep // s, s) if (r > 1 and s % ep and ep % s == 0 and r % (ep // s) == 0) else (1, ep)
    return max(1, s // m), tp * ep, max(1, r // k), tp * s * k


def expert_shard(plan: Any) -> int:
    """Ranks one MoE block's routed experts are divided over (ep x the expert shard group): what each
    rank holds of them, as model states, is 1/expert_shard (= dp_shard x cp without replicas, and with
    the ep group inside a replica; ep when it spans replicas, e.g. DDP x EP)."""
    return plan.ep * expert_groups(plan)[0]


def stage_experts(plan: Any, profile: ModelProfile, load: RankLoad, p_stage: float) -> float:
    """Routed-expert parameters among the `p_stage` of pipeline rank `load` (per TP rank), before EP."""
    if not profile.num_experts:
        return 0.0
    return min(p_stage, moe_blocks(load, profile) * expert_params_per_block(profile) / plan.tp)


def local_params(plan: Any, profile: ModelProfile, load: RankLoad, p_stage: float) -> float:
    """Parameters a rank holds as its (sharded) model states of the `p_stage` of pipeline rank `load`:
    the non-expert ones / (dp_shard x cp), the routed experts / `expert_shard` (with EP)."""
    fs = plan.dp_shard * plan.cp
    if plan.ep == 1 or not profile.num_experts:
        return p_stage / fs
    pe = stage_experts(plan, profile, load, p_stage)
    return (p_stage - pe) / fs + pe / expert_shard(plan)


def replicas_fit(plan: Any) -> bool:
    """With data-parallel replicas: the ep consecutive ranks lie inside one replica's shard group or
    over whole replicas (`dtorch.parallel.expert.replica_split`, what the executor's mesh can hold)."""
    ep, r, s = plan.ep, plan.dp_replicate, plan.dp_shard * plan.cp  # a replica's ranks, as the executor counts them
    return s % ep == 0 or (ep % s == 0 and r % (ep // s) == 0)


@dataclass(frozen=True, slots=True)
class ExpertExchange:
    """The expert strategy's per-plan terms (`Expert.prepare`): the routed experts' GEMM speed and,
    with ep > 1, the seconds of one combine, one dispatch and one count exchange per MoE block, and
    the bytes a rank sends per all-to-all."""

    speed: float
    combine_s: float = 0.0
    dispatch_s: float = 0.0
    counts_s: float = 0.0
    bytes_sent: float = 0.0


class Expert(Strategy):
    name = "expert"
    executor = "dtorch.parallel.expert"
    fields = (Field("ep", "int", aliases=("expert_parallel",)),)
    family_fields = ("ep",)
    refusal_fields = ("ep",)
    load_imbalance: float = LOAD_IMBALANCE
    dispatcher: Dispatcher = EXECUTOR_DISPATCH
    """What the all-to-alls cost (see Dispatcher); replaced only inside `what_if`."""

    @contextmanager
    def what_if(self, dispatcher: Dispatcher):
        """Estimates inside this block price the all-to-alls as `dispatcher` moves them (another
        system's executor, e.g. DEEPSEEK_V3_DISPATCH): for comparisons with published figures, never
        for ranking DTorch's plans."""
        saved, self.dispatcher = self.dispatcher, dispatcher
        try:
            yield
        finally:
            self.dispatcher = saved

    def unsupported_for(self, profile: ModelProfile) -> str | None:
        return None if profile.num_experts else "a dense model: no routed experts to spread"

    def rules(self, plan: Any, dims: Dims | None) -> Iterator[Violation]:
        ep = plan.ep
        if ep == 1:
            return
        D = data_ranks(plan)
        if D % ep:
            ok = [d for d in divisors(D)]
            yield Violation("ep", ep, f"expert parallelism borrows the dp_replicate*dp_shard*cp = {D} data-parallel "
                            f"ranks and must divide them; use ep in {{{', '.join(map(str, ok))}}}")
            return
        if dims is None:
            return
        n = dims.num_experts
        if not n:
            yield Violation("ep", ep, f"{dims.name} is dense (no routed experts); use ep=1")
        elif n % ep:
            yield Violation("ep", ep, f"must divide the {n} routed experts of {dims.name}; use ep in "
                            f"{{{', '.join(str(d) for d in divisors(n) if D % d == 0)}}}")

    def limits(self, plan: Any) -> Iterator[Limit]:
        if plan.ep == 1:
            return
        if plan.dp_replicate > 1 and not replicas_fit(plan):
            shard = "dp_shard" if plan.cp == 1 else "dp_shard*cp"
            yield Limit(f"with dp_replicate={plan.dp_replicate} x {shard}={plan.dp_shard * plan.cp} the ep={plan.ep} "
                        f"ranks must lie inside one replica (ep divides {shard}) or over whole replicas (ep = {shard} "
                        "times a divisor of dp_replicate)", "ep", plan.ep,
                        f"use an ep that divides {shard}, or {shard} times a divisor of dp_replicate")
        elif plan.tp > 1 and plan.sp:
            yield Limit("expert parallelism with sequence parallelism is not implemented (the MoE blocks would "
                        "route sequence shards)", "sp", plan.sp, "use sp=false with ep and tp")
        elif plan.offload == "params":
            yield Limit("expert parallelism with FSDP parameter offload is not implemented", "ep", plan.ep,
                        "use ep=1 or offload=none")
        elif plan.ac == "selective":
            # torch 2.13: the experts' nested FSDP unit inside a selectively checkpointed block fails in recompute
            yield Limit("expert parallelism with FSDP and selective activation checkpointing fails in torch 2.13",
                        "ep", plan.ep, "use ac=full or ac=none, or ep=1")
        elif getattr(plan, "compile", False):
            yield Limit("expert parallelism with torch.compile is not tested", "ep", plan.ep,
                        "use compile=false or ep=1")

    def family(self, plan: Any) -> str | None:
        return "EP" if plan.ep > 1 else None

    def describe(self, plan: Any):
        if plan.ep > 1:
            yield 5, f"ep={plan.ep}"

    def degrees(self, profile: ModelProfile, data: int, fixed: dict[str, Any]) -> list[int]:
        """The search's ep candidates on a mesh of `data` data-parallel ranks: divisors of both the
        routed experts and `data` (only 1 for a dense model)."""
        if "ep" in fixed:
            return [fixed["ep"]]
        if not profile.num_experts:
            return [1]
        return [d for d in divisors(data) if profile.num_experts % d == 0]

    def fixed_rules(self, fixed: dict[str, Any], profile: ModelProfile, world: int) -> Iterator[Violation]:
        ep = fixed.get("ep", 1)
        if ep > 1 and not profile.num_experts:
            yield Violation("ep", ep, f"{profile.name} is dense (no routed experts); use ep=1")
        elif ep > 1 and (profile.num_experts % ep or world % ep):
            ok = [d for d in divisors(profile.num_experts) if world % d == 0]
            yield Violation("ep", ep, f"must divide the {profile.num_experts} routed experts and the world size "
                            f"{world}; use ep in {{{', '.join(map(str, ok))}}}")

    def bound_plans(self, plan: Any, profile: ModelProfile) -> list[Any]:
        # the ep degrees the mesh's executor layout allows (EP's own all-to-all is left out of the
        # bound); with replicas a larger ep shrinks the gradient all-reduce too
        return [v for ep in self.degrees(profile, data_ranks(plan), {})
                for v in (dataclasses.replace(plan, ep=ep),) if ep == 1 or replicas_fit(v)]

    # ---- time --------------------------------------------------------------------------------
    def prepare(self, step: StepShape) -> bool:
        plan, prof = step.plan, step.profile
        if not prof.num_experts:
            return False
        ep, d = plan.ep, self.dispatcher
        speed = self._expert_speed(step)
        if ep == 1:
            return step.keep(ExpertExchange(speed))
        # each rank's assignments of one micro-batch (its tokens / cp, top_k each), hidden wide
        rows = step.tokens_mb / plan.cp * prof.experts_per_token * step.h * self.load_imbalance
        st = step.st_fs  # ep is the innermost part of the FSDP (dp_shard x cp) group
        if d.ep_borrows_tp and plan.tp > 1:  # torchtitan's ETP=1: 1/tp of the tokens, ep ranks consecutive
            rows, st = rows / plan.tp, 1
        nbytes = rows * step.act_b
        kw = dict(node_limit=d.node_limit, top_k=prof.experts_per_token)
        combine = all_to_all_time(nbytes, ep, st, step.g, **kw)
        return step.keep(ExpertExchange(
            speed, combine,
            all_to_all_time(rows * d.dispatch_bytes, ep, st, step.g, **kw) if d.dispatch_bytes else combine,
            all_to_all_time(8.0 * prof.num_experts, ep, st, step.g),  # the count exchange
            nbytes * (ep - 1) / ep))

    def _expert_speed(self, step: StepShape) -> float:
        """FLOP/s of the routed experts' GEMMs on one rank. The executor (`GroupedExperts.compute`)
        runs one dense GEMM chain per local expert, so each GEMM has that expert's rows, not the
        micro-batch's: tokens x top_k / (experts / ep) when balanced (1/tp of the tokens when the ep
        group takes in the TP ranks), under the cost model's own shape factor; a system whose expert
        kernel was measured (`Dispatcher.expert_gemm_efficiency`) at that efficiency."""
        from dtorch.cluster.shape import shape_factor

        plan, prof, d, c = step.plan, step.profile, self.dispatcher, step.c
        measured = dict(d.expert_gemm_efficiency).get(step.dev.name)
        if measured:
            return step.peak * measured
        tokens = step.tokens_mb / plan.cp / (plan.tp if d.ep_borrows_tp else 1)
        rows = tokens * prof.experts_per_token * plan.ep / prof.num_experts
        width = step.h / (1 if d.ep_borrows_tp else plan.tp)
        return step.peak * base_efficiency(step.g, c) * shape_factor(width, rows, c.gemm_width_half, c.gemm_rows_half)

    def rank_time(self, step: StepShape, load: RankLoad, r: RankShare, counts: StepCounts) -> None:
        plan, prof, x = step.plan, step.profile, step.term(ExpertExchange)
        moe_blocks = _moe_blocks(load, prof)
        # the routed experts' GEMMs at their own speed (the compute term priced them at the block's)
        routed_flops = step.tokens_mb / (plan.cp * plan.tp) * moe_blocks * 6.0 * prof.experts_per_token \
            * prof.params_per_expert
        if step.dtype != "float8" and x.speed > 0:  # (float8 published runs: left as priced)
            extra = routed_flops * (1.0 / x.speed - 1.0 / step.speed)
            r.compute += extra
            if plan.ac == "full":
                r.recompute += extra / 3.0
        if plan.ep == 1:
            return
        n_pairs = 2 + (1 if plan.ac == "full" else 0)  # (dispatch, combine) forward, backward (+ recompute)
        n_counts = 1 + (1 if plan.ac == "full" else 0)
        r.ep = moe_blocks * (n_pairs * (x.combine_s + x.dispatch_s) + n_counts * x.counts_s)
        if self.dispatcher.overlap:  # hidden under the rank's compute, which loses the SMs that communicate
            busy, f = r.compute + r.recompute, self.dispatcher.comm_sm_share
            r.ep = max(0.0, r.ep - busy) + min(r.ep, busy) * f / (1.0 - f)
        if plan.tp > 1 and step.tp_act and not self.dispatcher.ep_borrows_tp:
            # expert-tensor parallelism (dtorch.parallel.expert): the routed output, one row per
            # assignment, is all-reduced over tp forward and its input gradient backward (+ recompute);
            # without shared experts that replaces the dense MLP's all-reduce the TP strategy counts
            rows = prof.experts_per_token - (0 if prof.num_shared_experts else 1)
            n_ar = 2 + (1 if plan.ac == "full" else 0)
            r.ep += moe_blocks * n_ar * 2.0 * step.tp_act * rows * step.c.tp_exposed
        if self.load_imbalance > 1.0:  # the hottest rank's routed experts compute more than the mean
            routed = 6.0 * prof.experts_per_token * prof.params_per_expert * (1 + (plan.ac == "full") / 3.0)
            r.ep += (self.load_imbalance - 1.0) * step.tokens_mb / (plan.cp * plan.tp) * moe_blocks * routed \
                / x.speed

    # ---- memory and FSDP -----------------------------------------------------------------------
    def local_params(self, step: StepShape, load: RankLoad, p_stage: float) -> float:
        """Of the `p_stage` parameters of pipeline rank `load`, those a rank holds as sharded model
        states (and steps in the optimizer): `local_params`."""
        return local_params(step.plan, step.profile, load, p_stage)

    def held(self, step: StepShape, load: RankLoad, m: RankMemory) -> None:
        """With EP a rank gathers 1/ep of its stage's routed experts and holds its own shard of them."""
        m.p_gathered = self.gathered_stage_params(step, load, m.p_stage)
        m.p_local = self.local_params(step, load, m.p_stage)

    def rank_memory(self, step: StepShape, load: RankLoad, m: RankMemory) -> None:
        if step.fs == 1 and step.plan.ep > 1:  # DDP x EP: FSDP2 units over one-rank shard groups
            m.states["params"] = m.states.get("params", 0.0) + m.p_gathered * step.param_b  # never resharded

    def replica_buffers(self, step: StepShape, p_gathered: float) -> float:
        """Gathered-parameter bytes of EP with DDP replicas (dp_shard = 1): the executor runs them as
        FSDP2 HSDP units over one-rank shard groups (`apply_fsdp_with_experts`), which never reshard:
        every unit's unsharded copy in param_dtype stays from its first forward (the stage as a rank
        gathers it, `p_gathered`), and one unit's gradients are staged in reduce_dtype for the
        all-reduce. No DDP buckets."""
        return p_gathered * step.param_b + gathered_block_params(step.profile, step.plan) * step.red_b

    def expert_stage_params(self, step: StepShape, load: RankLoad) -> float:
        """Routed-expert parameters on pipeline rank `load` before EP (per TP rank)."""
        prof = step.profile
        return moe_blocks(load, prof) * expert_params_per_block(prof) / step.plan.tp

    def gathered_stage_params(self, step: StepShape, load: RankLoad, p_stage: float) -> float:
        """Of the `p_stage` parameters of pipeline rank `load` (per TP rank), those a rank holds
        unsharded when FSDP gathers the whole stage: its own routed experts only, 1/ep of them (each
        rank all-gathers its experts over edp, never the other ep ranks'). What stays gathered without
        resharding, and the unsharded gradients pipelining accumulates until the last micro-batch."""
        return gathered_params(step.plan, step.profile, load, p_stage)


def gathered_params(plan: Any, profile: ModelProfile, load: RankLoad, p_stage: float) -> float:
    """`Expert.gathered_stage_params` without a step shape (the dry run's model-state estimate)."""
    ep = plan.ep
    if ep == 1 or not profile.num_experts:
        return p_stage
    pe = min(p_stage, moe_blocks(load, profile) * expert_params_per_block(profile) / plan.tp)
    return p_stage - pe * (1.0 - 1.0 / ep)


def held_block_params(profile: ModelProfile, plan: Any) -> float:
    """Parameters of one block a rank holds unsharded beside its shards while FSDP has the block
    gathered (per TP rank): `gathered_block_params`. Its own routed experts count whatever their
    shard group: over one rank (edp = 1) FSDP2 still copies the shard into the unsharded parameter
    it computes with (measured with MemTracker in tests/plan/test_memory_categories.py)."""
    return gathered_block_params(profile, plan)


def allgather_block_params(profile: ModelProfile, plan: Any) -> float:
    """Parameters of one block in the flat all-gather outputs FSDP allocates to gather it (per TP
    rank): `gathered_block_params`, less its own routed experts where their shard group is one
    rank (edp = 1: their unit all-gathers nothing, the shard is copied out directly)."""
    p = gathered_block_params(profile, plan)
    if plan.ep > 1 and profile.num_experts and expert_groups(plan)[0] == 1:
        p -= expert_params_per_block(profile) / plan.ep / plan.tp
    return p


def gathered_block_params(profile: ModelProfile, plan: Any) -> float:
    """Parameters of one block FSDP gathers on a rank (per TP rank): the experts only 1/ep."""
    p = float(profile.params_per_block)
    if plan.ep > 1 and profile.num_experts:
        p -= expert_params_per_block(profile) * (1.0 - 1.0 / plan.ep)
    return p / plan.tp


EXPERT = Expert()


def routing_traffic(plan: Any, profile: ModelProfile, devices_per_node: int) -> str | None:
    """One line for the explanation: the bytes each rank sends per MoE block per micro-batch (one
    direction, mean load) and where the ep group lies, or None without EP."""
    if plan.ep == 1 or not profile.num_experts:
        return None
    act_b = 4 if plan.param_dtype == "float32" else (1 if plan.param_dtype == "float8" else 2)
    tokens = plan.microbatch_size * profile.seq_len / plan.cp
    nbytes = tokens * profile.experts_per_token * profile.hidden * act_b * (plan.ep - 1) / plan.ep
    blocks = (profile.num_layers - profile.num_dense_layers) / plan.pp  # a pipeline rank routes its stage's
    stride = plan.tp
    k = 1 if stride >= devices_per_node else min(plan.ep, devices_per_node // stride)
    where = "inside one node (NVLink)" if k >= plan.ep else \
        f"over {-(-plan.ep // k)} nodes ({(plan.ep - k) / plan.ep:.0%} of it through the NICs)"
    per_step = nbytes * 4 * blocks * plan.num_microbatches
    stage = " per pipeline stage" if plan.pp > 1 else ""
    return (f"routing: ep={plan.ep} all-to-all {where}; {nbytes / 2**20:,.1f} MiB per rank per MoE block per "
            f"micro-batch each way (dispatch, combine, x2 in backward: {per_step / 2**30:,.1f} GiB per rank per step "
            f"over {blocks:.3g} MoE blocks{stage}, load imbalance {EXPERT.load_imbalance:g})")
