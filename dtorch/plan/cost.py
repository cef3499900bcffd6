"""The analytic cost model: step time and per-rank memory of a Plan for a model on a cluster.

Pure functions (no torch, no processes, no globals mutated): `estimate(plan, profile, cluster)` is
what the search ranks with, and what the trainer/benchmarks compare measurements against.
Units: seconds, bytes, FLOP/s. Each formula names its source:

- Training FLOPs per token: ``profile.flops_per_token`` = 6 N_matmul + 12 l h s (torchtitan
  `get_dense_model_nparams_and_flops`; attention over the full s^2, i.e. the Megatron
  72 B s l h^2 (1 + s/6h + V/12lh) count). We keep that convention for MFU everywhere: causal
  halving is left to the calibrated efficiency.
- Recompute: full AC repeats each block's forward, 1/3 of its training FLOPs (Korthikanti et al.
  2022, 96 B s l h^2 (...) = 4/3 of 72 ...). Selective AC as DTorch runs it ('matmuls_saved',
  `dtorch/parallel/ac.py`) keeps the outputs of the linear layers and of the attention kernel and
  repeats the block's element-wise forward (`matmuls_saved_act_bytes`, `recompute_ops_per_block`).
  Published runs' policies: Megatron's repeats the attention core only, 4 h s per token per block
  (QK^T and AV, full s^2; Korthikanti et al. 2022 section 5); torchtitan's op-level one every
  second matmul and the element-wise forward (`every_second_matmul_params`).
- Compute time = FLOPs / (peak x efficiency); efficiency = device base efficiency x a GEMM-shape
  factor x/(x + x0) for the per-rank GEMM width (hidden / tp) and height (tokens per micro-batch /
  cp): smaller per-GPU GEMMs under TP/CP run further from peak. x0's are calibrated
  (`dtorch/plan/calibration.py`, rows of shared/reference/CALIBRATION.md).
- Collectives, alpha-beta (NVIDIA nccl-tests doc/PERFORMANCE.md): all-gather and reduce-scatter move
  S (n-1)/n bytes per rank, all-reduce twice that, S the full array; per link class bandwidth =
  line rate x efficiency. An axis that spans nodes runs hierarchically: the intra-node phase on
  NVLink over S, the inter-node phase over S/k (k ranks of the axis per node, each on its own NIC,
  DGX-style one NIC per GPU). Latency: alpha per ring step inside a node, alpha x log2(nodes)
  across nodes (NCCL tree/PAT at scale).
- Mesh layout: axes pp, dp_replicate, dp_shard, cp, tp with tp innermost (stride 1), ranks of a node
  contiguous; an axis of size n and stride st has min(n, G/st) ranks per node.
- TP with SP (Korthikanti et al. 2022): per block per micro-batch 4 all-gathers/reduce-scatters of
  the activation (tokens x hidden x 2 bytes) forward and 4 backward, 4 more when the recompute
  repeats them (full AC, DTorch's selective AC: `recompute_reruns_collectives`);
  exposed unless async TP (fraction `async_tp_exposed`).
- CP (Llama 3's all-gather form, `dtorch/parallel/cp.py`): K and V all-gathered forward, again
  backward plus a reduce-scatter of their gradients; issued before attention, so exposed.
- Precision: compute in the plan's `param_dtype` at the device's peak for it; activations and
  element-wise bytes scale with its width, element-wise speed per dtype from the device (a GPU is
  memory-bound, a CPU converts to float32: measured); MFU over that dtype's peak.
- Pipeline stages: every pipeline rank is costed from its blocks (`layer_partition` or the even
  split), the embedding (first stage) and head (last stage); the slowest stage sets the pace.
- FSDP/ZeRO-3 (ZeRO paper; FSDP2) over dp_shard x cp (torchtitan): parameters all-gathered in param_dtype before forward (and again
  before backward when reshard_after_forward), gradients reduce-scattered in reduce_dtype; per
  micro-batch without PP (gradient accumulation as torchtitan does it), once per step with PP
  (pipelining syncs gradients on the last micro-batch only; parameters stay gathered when not
  resharding). Overlapped with compute up to `fsdp_overlap`; one block's gather is never hidden.
- DDP / HSDP replicate axis: one all-reduce of (sharded) gradients per step, overlapped with the
  last micro-batch's backward.
- PP: activations sent forward and gradients back per micro-batch and virtual stage; bubble
  (p-1)/v micro-batch times for 1F1B/interleaved (Narayanan et al. 2021), (p-1) for GPipe, a third of
  the 1F1B bubble for zero-bubble (ZB-H1, Qi et al. 2023).
- Memory, mixed-precision Adam (ZeRO paper, 16 bytes/param): fp32 params 4 + fp32 grads 4 + Adam
  moments 8, divided by dp_shard x cp (FSDP) and tp; activations per block by AC policy from the profile
  (Korthikanti Table 2 shapes), divided by tp with SP (10/34 stays replicated without SP) and by cp;
  micro-batches in flight: 1 without PP, min(p, m) for 1F1B/zero-bubble on the first stage,
  p (1 + (p-1)/(p v)) interleaved (Narayanan et al. 2021), m for GPipe.
- Mixed clusters (docs/heterogeneous.md): every data-parallel rank's pipeline is costed on the node
  groups its ranks land on (`hetero.cell_groups`: node-major ranks, groups in the cluster's order)
  with its own micro-batch count (`dp_shares`); the step waits for the slowest; every rank's memory
  is held against its own device's.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from dtorch.cluster.spec import Cluster, NodeGroup
from dtorch.errors import ConfigError
from dtorch.model.profile import ModelProfile
from dtorch.plan import hetero
from dtorch.plan.comm import _coll, axis_layout, collective_time, oversubscribed, p2p_time  # noqa: F401
from dtorch.plan.plan import Plan
from dtorch.plan.step import (  # noqa: F401  (re-exported: the cost model's shared helpers and constants)
    DEFAULT_CONSTANTS,
    DTYPE_BYTES,
    NO_COUNTS,
    CostConstants,
    GiB,
    MemoryBytes,
    RankMemory,
    StepCounts,
    StepShape,
    _block_params,
    autocast_applies,
    base_efficiency,
    mean_block_flops,
    mean_block_params,
    shape_factor,
)
from dtorch.plan.strategies import COUNTING, HOLDING, MEMORY_TERMS, PACED, TIMED, WORKING
from dtorch.plan.strategies.base import RankLoad, RankShare, StepTerm
from dtorch.plan.strategies.expert import gathered_params, local_params
from dtorch.plan.strategies.memory import (  # noqa: F401  (re-exported: the AC policies' terms)
    SELECTIVE_POLICIES,
    act_bytes_per_token_block,
    at_peak,
    every_second_matmul_params,
    full_ac_peak,
    host_adam_rate,
    matmuls_saved_act_bytes,
    model_buffer_bytes,
    rank_activations,
    recompute_reruns_collectives,
)
from dtorch.plan.strategies.memory import recompute_ops_per_block as _recompute_ops_per_block
from dtorch.plan.strategies.pipeline import (  # noqa: F401  (the stage split every rank is costed on; re-exports)
    activation_in_flight,
    balanced_partition,
    bubble_fraction,
    distinct_loads,
    partition,
    rank_loads,
)


@dataclass
class Estimate:
    """The predicted cost of one plan. Times in seconds, memory in bytes (max over ranks)."""

    step_time_s: float
    tokens_per_s: float
    """Whole-cluster tokens per second."""
    tokens_per_s_per_gpu: float
    mfu: float
    """Model FLOPs (no recompute) per second over the devices' peak in the compute dtype, summed over
    all devices (`mfu`; the one definition: `dtorch.cluster.peak`)."""
    time_breakdown: dict[str, float]
    """compute, recompute, host, tp, cp, ep, fsdp, dp, pp_p2p, bubble, optimizer, offload (exposed seconds)."""
    memory_bytes_per_rank: int
    memory_breakdown: dict[str, int]
    """params, grads, optimizer, activations, buffers, margin (bytes, on the fullest rank)."""
    memory_capacity: int
    fits: bool
    efficiency: float = 0.0
    """The matmul efficiency the compute time used."""
    host_bytes_per_rank: int = 0
    """Host (CPU) memory the rank's offloaded states take; `fits` requires the node's ranks to fit."""
    disk_bytes_per_rank: int = 0
    """Local-disk bytes of the rank's NVMe-tier files; `fits` requires the node's ranks to fit the
    node's declared or measured `disk_bytes` (when known)."""
    notes: list[str] = field(default_factory=list)
    groups: list[dict] = field(default_factory=list)
    """On a mixed cluster, one entry per node group: its ranks, the micro-batches per step and
    blocks of its ranks, its busiest pipeline's seconds, its fullest rank's bytes and its capacity
    (`hetero.group_summary`); empty on one kind of device."""

    @property
    def memory(self) -> MemoryBytes:
        """The fullest rank's bytes at its peak by category, typed (`memory_breakdown`'s figures)."""
        return MemoryBytes.of(self.memory_breakdown)

    def to_dict(self) -> dict:
        return {
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "mfu": self.mfu,
            "memory_bytes_per_rank": self.memory_bytes_per_rank,
            "memory_capacity": self.memory_capacity,
            "host_bytes_per_rank": self.host_bytes_per_rank,
            "fits": self.fits,
            **({"disk_bytes_per_rank": self.disk_bytes_per_rank} if self.disk_bytes_per_rank else {}),
            **({"groups": [dict(g) for g in self.groups]} if self.groups else {}),
            "time_breakdown": dict(self.time_breakdown),
            "memory_breakdown": dict(self.memory_breakdown),
        }


# ---- compute ----------------------------------------------------------------------------------
def _rank_params(load: RankLoad, profile: ModelProfile, tp: int) -> float:
    """Parameters of one pipeline rank per TP rank."""
    p = _block_params(load, profile)  # (a MoE model's dense first blocks are smaller)
    p += profile.params_embedding * load.embedding
    p += profile.params_head * load.head
    return p / tp


def model_state_bytes(plan: Plan, profile: ModelProfile) -> dict[str, int]:
    """Parameter, gradient and optimizer bytes on the fullest rank (mixed-precision Adam)."""
    states = [_states(plan, p, gathered_params(plan, profile, ld, p), local_params(plan, profile, ld, p))
              for ld in rank_loads(plan, profile.num_layers, profile.num_dense_layers)
              for p in (_rank_params(ld, profile, plan.tp),)]
    return max(states, key=lambda s: sum(s.values()))


def _states(plan: Plan, p_stage: float, p_gathered: float | None = None, p_local: float | None = None) -> dict[str, int]:
    """Model-state bytes of a rank holding `p_stage` parameters per TP rank (`p_gathered` of them
    unsharded when gathered: fewer with EP, `Expert.gathered_stage_params`; `p_local` of them as its
    shard: default p_stage / (dp_shard x cp), with EP the experts / `expert.expert_shard`)."""
    shard = plan.dp_shard * plan.cp  # FSDP shards over dp_shard x cp (context-parallel ranks hold the same weights)
    local = p_stage / shard if p_local is None else p_local
    grad_bytes = 4  # FSDP2/DDP keep gradients in the float32 master parameters' dtype (reduce_dtype is the wire)
    params = 0.0 if plan.offload == "params" else 4.0 * local
    grads = 0.0 if plan.offload == "params" else grad_bytes * local
    fsdp2 = shard > 1 or plan.ep > 1  # (EP runs DDP replicas as FSDP2 units over one-rank shard groups)
    if plan.pp > 1 and fsdp2 and plan.num_microbatches > 1 and plan.offload != "params":
        # pipelining accumulates unsharded gradients until the last micro-batch (no reduce-scatter
        # before), in reduce_dtype (FSDP2's `to_accumulated_grad_if_needed`); each unit's is freed as
        # its shard is made and the step's shards were set to None, so the two never coexist
        grads = DTYPE_BYTES[plan.reduce_dtype] * (p_stage if p_gathered is None else p_gathered)
    optim = 0.0 if plan.offload in ("optimizer", "optimizer_nvme", "params") else 8.0 * local
    return {"params": int(params), "grads": int(grads), "optimizer": int(optim)}


def step_counts(plan: Plan, profile: ModelProfile, device_kind: str = "cuda",
                c: CostConstants = DEFAULT_CONSTANTS, load: RankLoad | None = None,
                selective: str = "matmuls_saved") -> StepCounts:
    """Operators and latency-bound collectives one step of `plan` dispatches on pipeline rank `load`
    (default: the rank that dispatches the most).

    Operators: the profile's forward count per block and outside the blocks, backward
    `backward_ops_per_forward_op` per forward op, AC's recompute per `recompute_ops_per_block`; the
    optimizer runs per tensor on CPU and foreach on GPUs. Under TP every operator is a
    DTensor operator; under FSDP the optimizer's are. The first and the last stage each hold half of
    the operators outside the blocks. Under autocast every matmul casts its input and weight
    (`autocast_ops_per_weight` per weight tensor per micro-batch)."""
    if load is None:
        loads = rank_loads(plan, profile.num_layers, profile.num_dense_layers)
        counts = [step_counts(plan, profile, device_kind, c, ld, selective) for ld in loads]
        return max(counts, key=lambda n: n.ops_per_microbatch + n.optimizer_ops)
    blocks = load.blocks
    head_share = 0.5 * load.embedding + 0.5 * load.head
    ob = profile.ops_per_block or c.default_ops_per_block
    oh = profile.ops_head or c.default_ops_head
    per_op = 1.0 + c.backward_ops_per_forward_op
    rec = recompute_ops_per_block(profile, plan.ac, selective, c)
    ops_mb = blocks * (ob * per_op + rec) + head_share * oh * per_op
    tpb = profile.tensors_per_block or 9
    if autocast_applies(plan):
        ops_mb += (blocks * max(1, tpb - 2) + head_share) * c.autocast_ops_per_weight
    tensors = blocks * tpb + head_share * (profile.tensors_other or 3)
    opt = tensors * c.optimizer_ops_per_tensor if device_kind == "cpu" else c.optimizer_foreach_ops
    filled = {k: v for s in COUNTING for k, v in s.counts(plan, blocks, head_share, c, selective).items()}
    return StepCounts(
        ops_per_microbatch=ops_mb,
        dtensor_ops_per_microbatch=ops_mb if plan.tp > 1 else 0.0,
        optimizer_ops=opt,
        dtensor_optimizer_ops=opt if plan.tp > 1 or plan.dp_shard * plan.cp > 1 or plan.ep > 1 else 0.0,
        **filled,
    )


def recompute_ops_per_block(profile: ModelProfile, ac: str, selective: str = "matmuls_saved",
                            c: CostConstants = DEFAULT_CONSTANTS) -> float:
    """`dtorch.plan.strategies.memory.recompute_ops_per_block` with the shipped constants."""
    return _recompute_ops_per_block(profile, ac, selective, c)


def float8_cast_bytes_per_token_block(profile: ModelProfile, compiled: bool) -> float:
    """HBM bytes per token per block that dynamic tensor-wise float8 scaling adds (torchao's
    Float8Linear as torchtitan ran it in 2024; Transformer Engine's current scaling does the same
    passes). Every GEMM operand that is not a weight is cast: each distinct linear input in the
    forward, each linear output's gradient in the backward. Per element: the 16-bit tensor read for
    its amax, read again for the cast (2 + 2 bytes), the float8 copy written (1) and its transpose
    for the weight-gradient GEMM written from it (1 + 1). torch.compile fuses the amax into the
    kernel that produced the tensor (-2). Weights are cast once per micro-batch on their shard
    (negligible per token)."""
    h, f = float(profile.hidden), float(profile.ffn_hidden)
    kv = h * profile.num_kv_heads / profile.num_heads if profile.num_heads else 0.0  # (0: no attention)
    if profile.family == "llama":  # inputs: x (q, k, v), attention out, x (w1, w3), w2's; grads of q k v o w1 w3 w2
        elements = (3 * h + f) + (3 * h + 2 * kv + 2 * f)
    else:  # qkv, proj, fc1, fc2
        elements = (3 * h + f) + (5 * h + f)
    return elements * (5.0 if compiled else 7.0)


# ---- the shared step shape --------------------------------------------------------------------
def step_shape(plan: Plan, profile: ModelProfile, cluster: Cluster, dtype: str | None = None, *,
               compiled: bool = False, async_tp: bool = False, selective: str = "matmuls_saved",
               constants: CostConstants = DEFAULT_CONSTANTS, group: NodeGroup | None = None) -> StepShape:
    """The step shape of `plan` on `group` (default: the cluster's slowest); ConfigError if the
    degrees do not make the world size or the device has no arithmetic in the compute dtype."""
    groups = cluster.groups
    one = len(groups) == 1  # (the common case, asked tens of thousands of times by the search)
    world = groups[0].num_devices if one else cluster.world_size
    if plan.world_size != world:
        raise ConfigError(
            "degrees", plan.mesh_shape,
            f"pp*dp_replicate*dp_shard*cp*tp = {plan.world_size} but the cluster has {world} devices",
        )
    g = group or (groups[0] if one else cluster.slowest_group())
    dev = g.device
    c = constants
    if dev.kind == "cpu":
        # a CPU rank computes and communicates on the same cores (gloo runs on host threads; with
        # more ranks than cores they take turns), so nothing hides behind anything
        c = replace(c, fsdp_overlap=0.0, dp_exposed_floor=1.0, tp_exposed=1.0, pp_p2p_exposed=1.0)
    dtype = dtype or plan.param_dtype
    compute_dtype = "bfloat16" if dtype == "float8" else dtype
    try:
        peak = dev.peak(compute_dtype)
    except KeyError:
        raise ConfigError("param_dtype", compute_dtype,
                          f"{dev.name} has no {compute_dtype} arithmetic; use one of "
                          f"{{{', '.join(sorted(dev.peak_flops))}}}") from None
    if dtype == "float8" and not dev.supports("float8"):
        raise ConfigError("dtype", dtype, f"{dev.name} has no float8 tensor cores; use bfloat16")
    step = StepShape(plan, profile, g, c, dtype, peak, dev.elementwise(compute_dtype), compiled, async_tp, selective)
    step.world, step.cluster = world, cluster  # (strategies read measured gains from cluster.calibration)
    return step


# ---- the terms of one pipeline rank -----------------------------------------------------------
def compute_time(step: StepShape, load: RankLoad, r: RankShare, *, head_elementwise: bool = True) -> float:
    """Matmul and memory-bound element-wise seconds of one micro-batch forward + backward on `load`
    (float8 linear layers at `StepShape.linear` with their casts, the attention core and the head in
    16 bits).
    `head_elementwise=False` leaves out the head's element-wise passes (the search's lower bound).
    Returns the micro-batch's FLOPs on the rank."""
    plan, prof = step.plan, step.profile
    div = plan.tp * plan.cp
    flops_mb = step.tokens_mb * (load.blocks * step.block_flops + prof.flops_per_token_head * load.head) / div
    attn_part = step.tokens_mb * load.blocks * 3 * step.attn_fwd / div  # the attention core, at its own speed
    if step.dtype == "float8":
        # float8 covers the blocks' linear layers; the output head stays in bf16 (torchao's and
        # Transformer Engine's recipes leave the output projection out); each linear's operands
        # are cast with a tensor-wide scale: element-wise traffic at HBM bandwidth
        head_mb = step.tokens_mb * prof.flops_per_token_head / div if load.head else 0.0
        r.compute = (flops_mb - attn_part - head_mb) / step.linear + attn_part / step.attn_speed + head_mb / step.speed
        cast_bytes = float8_cast_bytes_per_token_block(prof, step.compiled)
        r.compute += step.tokens_mb * load.blocks * cast_bytes / div / step.dev.memory_bandwidth
    else:
        r.compute = (flops_mb - attn_part) / step.speed + attn_part / step.attn_speed
    # memory-bound element-wise work, forward + backward (and forward again under full AC)
    # (the loss's passes run over float32 copies of the logits it keeps: 2 V more than it saves)
    head_bytes = (prof.act_bytes_per_token_head + 2.0 * prof.vocab_size) * load.head if head_elementwise else 0.0
    elem_bytes = step.tokens_mb * (load.blocks * step.a_elem + head_bytes) / div  # (unfused scores: in attn_speed)
    r.compute += elem_bytes * step.elem_s_per_byte
    return flops_mb


def host_time(step: StepShape, counts: StepCounts, r: RankShare) -> float:
    """Host overhead of eager execution per micro-batch: operators x seconds per operator (0 when
    unmeasured). A GPU's host runs ahead of its kernels, so it shows only where it exceeds them; a
    CPU's does not. Returns the optimizer's host seconds per step."""
    dev = step.dev
    host_mb = counts.ops_per_microbatch * dev.op_overhead_s + counts.dtensor_ops_per_microbatch * dev.dtensor_op_overhead_s
    r.host = host_mb if step.cpu else max(0.0, host_mb - (r.compute + r.recompute))
    return counts.optimizer_ops * dev.op_overhead_s + counts.dtensor_optimizer_ops * dev.dtensor_op_overhead_s


def optimizer_time(step: StepShape, held: RankMemory, r: RankShare, host_opt: float) -> None:
    """The optimizer step on the device unless offloaded, plus its host overhead: on a GPU 28 bytes
    of Adam traffic per parameter at 80% of HBM bandwidth; on a CPU torch's CPU AdamW at the rate
    the probe measured for the kernel the executor runs (`host_adam_rate`: the per-tensor loop by
    default, several times slower than the bandwidth rule, which stays where unmeasured)."""
    if step.plan.offload == "none":
        p_local = held.p_local  # (with EP: the rank's own experts)
        if step.cpu:
            r.optimizer = p_local / host_adam_rate(step)
        else:
            r.optimizer = p_local * step.c.optimizer_bytes_per_param / (step.dev.memory_bandwidth * 0.8)
    r.optimizer += host_opt if step.cpu else max(0.0, host_opt - r.optimizer)


def held_params(step: StepShape, load: RankLoad, p_stage: float) -> RankMemory:
    """What the rank holds of its stage's `p_stage` parameters: the whole stage when gathered and
    1/(dp_shard x cp) as its shard, as the strategies that change it say (`Strategy.held`)."""
    m = RankMemory(p_stage, p_stage, p_stage / step.fs)
    for s in HOLDING:
        s.held(step, load, m)
    return m


def rank_memory(step: StepShape, load: RankLoad, r: RankShare, m: RankMemory) -> None:
    """Bytes of the rank: model states, activations in flight, the strategies' buffers
    (`Strategy.rank_memory`), margin; and the host and disk bytes of offloaded states."""
    plan, prof, c = step.plan, step.profile, step.c
    m.states = _states(plan, m.p_stage, m.p_gathered, m.p_local)
    in_flight = activation_in_flight(plan, load.pp_rank)
    acts = rank_activations(step, load, in_flight)
    m.states["grads"], acts = at_peak(step, m.states["grads"], acts, in_flight, load)  # (what coexists at the peak)
    at_peak_grads = m.states["grads"]
    for s in MEMORY_TERMS:
        s.rank_memory(step, load, m)
    # full AC: the peak may be a moment late in the backward (with what the strategies hold throughout)
    m.states["grads"], acts = full_ac_peak(step, load, m.states["grads"], acts, m.states["grads"] - at_peak_grads)
    states = {k: int(v) for k, v in m.states.items()}
    buffers = m.buffers + model_buffer_bytes(prof) * plan.virtual_stages  # (each stage module keeps its own)
    margin = c.fixed_overhead_bytes + c.fragmentation * (states.get("grads", 0) + acts + buffers)
    r.memory = {**states, "activations": int(acts), "buffers": int(buffers), "margin": int(margin)}
    r.host_bytes, r.disk_bytes = m.host_bytes, m.disk_bytes


def rank_share(step: StepShape, load: RankLoad, timed) -> RankShare:
    """One pipeline rank's share of the step: compute, recompute and host, then the time terms of
    the strategies that apply (`timed`, in registry order), the optimizer, and the rank's memory."""
    r = RankShare(p_stage=step.p_stage(load))
    held = held_params(step, load, r.p_stage)
    counts = step_counts(step.plan, step.profile, step.dev.kind, step.c, load, step.selective)
    flops_mb = compute_time(step, load, r)
    for s in WORKING:
        s.work(step, load, r, flops_mb)
    host_opt = host_time(step, counts, r)
    r.syncs = sum(s.blocking_collectives(step, load, counts) for s in timed)
    for s in timed:
        s.rank_time(step, load, r, counts)
    optimizer_time(step, held, r, host_opt)
    rank_memory(step, load, r, held)
    return r


# ---- the estimate -----------------------------------------------------------------------------
def estimate(
    plan: Plan,
    profile: ModelProfile,
    cluster: Cluster,
    dtype: str | None = None,
    *,
    compiled: bool = False,
    async_tp: bool = False,
    selective: str = "matmuls_saved",
    constants: CostConstants = DEFAULT_CONSTANTS,
) -> Estimate:
    """Predict step time, throughput, MFU and per-rank memory of `plan` (see module doc).

    The compute dtype is the plan's `param_dtype`: that is what the executor runs. `dtype`,
    `compiled` and `async_tp` describe published runs (float8 linear layers, their whole-model
    torch.compile, async TP): the calibration uses them for published measurements; the search
    never does (a plan's own fields, `compile` among them, are priced by their strategies).
    `selective` says what `ac='selective'` recomputes: 'matmuls_saved' (DTorch's own
    policy, the default: the element-wise forward, see `matmuls_saved_act_bytes`), 'attention_core'
    (the attention scores and their softmax, Korthikanti et al. 2022) or 'every_second_mm'
    (torchtitan's op-level policy, see `every_second_matmul_params`). The plan's degrees must
    multiply to the cluster's world size."""
    if selective not in SELECTIVE_POLICIES:
        raise ConfigError("selective", selective, f"one of {{{', '.join(SELECTIVE_POLICIES)}}}")
    if not cluster.homogeneous:  # every group at its own speed and memory
        return _estimate_mixed(plan, profile, cluster, dict(dtype=dtype, compiled=compiled, async_tp=async_tp,
                                                            selective=selective, constants=constants))
    step = step_shape(plan, profile, cluster, dtype, compiled=compiled, async_tp=async_tp, selective=selective,
                      constants=constants)
    timed = [s for s in TIMED if s.prepare(step)]
    m = plan.num_microbatches
    # ranks with the same blocks, embedding and head take the same time: cost one of each
    shares = [rank_share(step, ld, timed) for ld in distinct_loads(plan, profile.num_layers, profile.num_dense_layers)]
    pace, worst = _pace(shares, m)
    fullest = shares[0] if len(shares) == 1 else max(shares, key=lambda r: sum(r.memory.values()))
    step_s, terms = _paced(step, pace, worst, m)
    tps = plan.dp * plan.microbatch_size * m * profile.seq_len / step_s
    total = sum(fullest.memory.values())
    host, host_ok, notes = _host_memory(step, shares)
    return Estimate(
        step_time_s=step_s,
        tokens_per_s=tps,
        tokens_per_s_per_gpu=tps / step.world,
        mfu=mfu(tps, profile, cluster, step.compute_dtype),
        time_breakdown=_time_breakdown(m, pace, worst, terms),
        memory_bytes_per_rank=int(total),
        memory_breakdown=dict(fullest.memory),
        memory_capacity=int(step.dev.memory_bytes),
        fits=total <= step.dev.memory_bytes and host_ok,
        efficiency=step.eff,
        host_bytes_per_rank=int(host),
        disk_bytes_per_rank=int(max(r.disk_bytes for r in shares)),
        notes=notes,
    )


def _paced(step: StepShape, pace: RankShare, worst: RankShare, m: int) -> tuple[float, tuple[StepTerm, ...]]:
    """(step seconds, the strategies' per-step terms) of a pipeline whose slowest stage, `pace`,
    sets the micro-batch pace: m micro-batches at that pace, the terms at it (`Strategy.pace_terms`:
    the bubble, the sends), then the busiest rank's (`worst`) own per-step work."""
    terms = tuple(t for s in PACED for t in s.pace_terms(step, pace.per_microbatch))
    step_s = m * pace.per_microbatch
    for t in terms:
        step_s += t.seconds
    return step_s + worst.per_step, terms


def _pace(shares: list[RankShare], m: int) -> tuple[RankShare, RankShare]:
    """(pace, worst) of a pipeline's ranks: the slowest stage per micro-batch, which the pipeline
    runs at, and the busiest rank over the whole step (its per-step work included)."""
    if len(shares) == 1:
        return shares[0], shares[0]
    worst = max(shares, key=lambda r: m * r.per_microbatch + r.fsdp + r.dp + r.optimizer + r.offload + r.tp_step)
    return max(shares, key=lambda r: r.per_microbatch), worst


def _estimate_mixed(plan: Plan, profile: ModelProfile, cluster: Cluster, kw: dict) -> Estimate:
    """`estimate` on a mixed cluster (docs/heterogeneous.md). Every data-parallel rank runs its own
    pipeline: its stages on the groups its cells land on (`hetero.column_groups`, the executor's
    rank order), its own micro-batch count (`dp_shares`). The step waits for the slowest of them
    (the gradient reduction is synchronous); every rank's memory is held against its own device's."""
    counts = plan.dp_shares or [plan.num_microbatches] * plan.dp
    columns: dict[tuple, tuple] = {}
    for key in zip(hetero.column_groups(cluster, plan.pp, plan.dp, plan.cp, plan.tp), counts):
        if key not in columns:
            columns[key] = _column(plan, profile, cluster, *key, kw)
    slowest = max(columns, key=lambda k: columns[k][0])
    m, (step_s, pace, worst, terms, _) = slowest[1], columns[slowest]
    ranks = [(r, st) for col in columns.values() for _, r, st in col[4]]  # (share, its step shape)
    tight, tst = max(ranks, key=lambda rs: sum(rs[0].memory.values()) / rs[1].dev.memory_bytes)
    notes, host_ok = [], True
    for g in cluster.groups:  # every node's ranks against its own host memory and disk
        mine = [(r, st) for r, st in ranks if st.g is g]
        if mine:
            _, ok, n = _host_memory(mine[0][1], [r for r, _ in mine])
            host_ok, notes = host_ok and ok, notes + [x for x in n if x not in notes]
    tps = plan.dp * plan.microbatch_size * plan.num_microbatches * profile.seq_len / step_s  # sum(dp_shares) = dp m
    return Estimate(
        step_time_s=step_s, tokens_per_s=tps, tokens_per_s_per_gpu=tps / cluster.world_size,
        mfu=mfu(tps, profile, cluster, tst.compute_dtype),
        time_breakdown=_time_breakdown(m, pace, worst, terms),
        memory_bytes_per_rank=int(sum(tight.memory.values())), memory_breakdown=dict(tight.memory),
        memory_capacity=int(tst.dev.memory_bytes),
        fits=host_ok and all(sum(r.memory.values()) <= st.dev.memory_bytes for r, st in ranks),
        efficiency=min(st.eff for _, st in ranks),
        host_bytes_per_rank=int(max(r.host_bytes for r, _ in ranks)),
        disk_bytes_per_rank=int(max(r.disk_bytes for r, _ in ranks)), notes=notes,
        groups=hetero.group_summary(cluster, {key: (col[0], [(k, sum(r.memory.values()), b) for (k, b), r, _ in col[4]])
                                              for key, col in columns.items()}),
    )


def _column(plan: Plan, profile: ModelProfile, cluster: Cluster, stages: tuple[int, ...], m: int,
            kw: dict) -> tuple[float, RankShare, RankShare, tuple[StepTerm, ...], list]:
    """One data-parallel rank's pipeline on a mixed cluster: pipeline rank i on group `stages[i]`,
    `m` micro-batches. Returns (step seconds, pace, worst, per-step terms, ranks), ranks the distinct
    pipeline ranks as ((group, blocks), share, step shape): ranks of one group with the same load
    take the same time, and the first of them holds the most micro-batches in flight."""
    p = Plan.__new__(Plan)
    p.__dict__ = {**plan.__dict__, "num_microbatches": m, "dp_shares": None}
    steps = {k: step_shape(p, profile, cluster, group=cluster.groups[k], **kw) for k in dict.fromkeys(stages)}
    timed = {k: [s for s in TIMED if s.prepare(st)] for k, st in steps.items()}
    loads: dict[tuple, tuple] = {}
    for ld in rank_loads(p, profile.num_layers, profile.num_dense_layers):
        loads.setdefault((stages[ld.pp_rank], ld.blocks, ld.embedding, ld.head, ld.dense_blocks),
                         (stages[ld.pp_rank], ld))
    ranks = [((k, ld.blocks), rank_share(steps[k], ld, timed[k]), steps[k]) for k, ld in loads.values()]
    shares = [r for _, r, _ in ranks]
    pace, worst = _pace(shares, m)
    step_s, terms = _paced(ranks[shares.index(pace)][2], pace, worst, m)
    return step_s, pace, worst, terms, ranks


def mfu(tokens_per_s: float, profile: ModelProfile, cluster: Cluster, compute_dtype: str) -> float:
    """Model FLOPs per second over the whole cluster's peak in the compute dtype (torchtitan's
    convention; a CPU's peak is its detected one, `DeviceType.mfu_peak`, `dtorch.cluster.peak`);
    a mixed cluster's faster devices wait for the slowest."""
    groups = cluster.groups
    if len(groups) == 1 and groups[0].device.supports(compute_dtype):
        return tokens_per_s * profile.flops_per_token / (groups[0].num_devices * groups[0].device.mfu_peak(compute_dtype))
    return tokens_per_s * profile.flops_per_token / sum(gr.num_devices * gr.device.mfu_peak(compute_dtype)
                                                        if gr.device.supports(compute_dtype) else 0.0
                                                        for gr in groups)


def _time_breakdown(m: int, pace: RankShare, worst: RankShare, terms: tuple[StepTerm, ...]) -> dict[str, float]:
    return {
        "compute": m * pace.compute,
        "recompute": m * pace.recompute,
        "host": m * pace.host,
        "tp": m * pace.tp + worst.tp_step,
        "cp": m * pace.cp,
        "ep": m * pace.ep,
        "fsdp": worst.fsdp,
        "dp": worst.dp,
        **{t.key: t.seconds for t in terms},
        "optimizer": worst.optimizer,
        "offload": worst.offload,
    }


def _host_memory(step: StepShape, shares: list[RankShare]) -> tuple[float, bool, list[str]]:
    """(host bytes per rank, whether the node's ranks fit in its host memory, notes)."""
    g = step.g
    host = max(r.host_bytes for r in shares)
    ok = g.host_memory_bytes <= 0 or host * g.devices_per_node <= 0.9 * g.host_memory_bytes
    notes = [] if ok else [
        f"offloaded states need {host * g.devices_per_node / 2**30:,.0f} GiB of host memory per node, "
        f"{g.host_memory_bytes / 2**30:,.0f} GiB available"]
    disk = max(r.disk_bytes for r in shares) * g.devices_per_node
    if disk and 0 < g.disk_bytes < disk:
        ok = False
        notes.append(f"the NVMe tier's files need {disk / 2**30:,.1f} GiB of local disk per node, "
                     f"{g.disk_bytes / 2**30:,.1f} GiB available")
    return host, ok, notes


def with_constants(**kw) -> CostConstants:
    """DEFAULT_CONSTANTS with some fields replaced (for calibration and what-if studies)."""
    return replace(DEFAULT_CONSTANTS, **kw)
