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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache

from dtorch.cluster.spec import Cluster, NodeGroup
from dtorch.errors import ConfigError
from dtorch.model.profile import ModelProfile
from dtorch.plan.plan import Plan

GiB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1}


@dataclass(frozen=True)
class CostConstants:
    """Calibratable constants of the cost model (fitted values in `DEFAULT_CONSTANTS`)."""

    gemm_width_half: float = 192.0
    """Per-rank GEMM width (hidden / tp) at which the shape factor is 1/2."""
    gemm_rows_half: float = 256.0
    """Per-rank tokens per micro-batch (mbs * seq / cp) at which the shape factor is 1/2."""
    device_efficiency: tuple[tuple[str, float], ...] = ()
    """(device name, base matmul efficiency) overrides of DeviceType.matmul_efficiency."""
    fsdp_overlap: float = 0.9
    """Share of compute that FSDP/DDP communication can hide behind."""
    dp_exposed_floor: float = 0.0
    """Share of FSDP/DDP communication exposed even when compute could hide it (NCCL kernels take
    SMs and HBM bandwidth from the overlapped compute)."""
    tp_exposed: float = 1.0
    """Share of TP communication on the critical path (synchronous TP)."""
    async_tp_factor: float = 0.5
    """Async TP (micro-pipelined all-gather/matmul) leaves this share of the exposed TP time."""
    elementwise_passes: float = 8.0
    """Memory-bound work (norms, activations, residuals, softmax/loss) modelled as this many passes
    over the block's saved activations (AC 'none' bytes) and the head's, at HBM bandwidth."""
    compile_elementwise_factor: float = 0.5
    """torch.compile fuses element-wise kernels: share of the memory-bound passes left."""
    float8_linear_speedup: float = 0.0
    """Speed-up of linear-layer GEMMs in float8 over bf16; 0 = the device's float8 / bf16 peak ratio
    (2.0 on H100 and B200 spec sheets), the device efficiency covering both dtypes alike."""
    optimizer_bytes_per_param: float = 28.0
    """Adam step memory traffic: read p, g, m, v (16 B) and write p, m, v (12 B), fp32."""
    host_link_bandwidth: float = 25e9
    """Device <-> host copies for offload, bytes/s per device (PCIe gen4 x16, effective)."""
    cpu_adam_bytes_per_s: float = 10e9
    """CPU Adam throughput per device share of a host, bytes of optimizer traffic per second."""
    fixed_overhead_bytes: float = 2.0 * GiB
    """CUDA context, NCCL buffers, cuBLAS workspaces per rank."""
    fragmentation: float = 0.05
    """Allocator fragmentation, as a share of the rest of the memory."""
    pp_p2p_exposed: float = 0.5
    """Share of pipeline send/recv time on the critical path (isend/irecv overlap the next op)."""
    # ---- host overhead of eager execution (see `step_counts`) ----
    backward_ops_per_forward_op: float = 2.0
    """Autograd dispatches about two operators per forward operator (measured on the reference
    models in torch 2.13: Llama 1.7, GPT 2.4)."""
    selective_recompute_ops: float = 0.15
    """Share of a block's forward operators the published runs' selective AC re-runs (the attention
    core; 'attention_core' and 'every_second_mm' policies)."""
    checkpoint_detach_ops_per_forward_op: float = 0.85
    """torch's non-reentrant checkpoint detaches every tensor the recomputed forward saves or returns
    from its cache: operators per forward operator of the block, beside the recomputed ones (counted
    in torch 2.13 on the reference blocks: Llama 63 per 93, GPT 45 per 38)."""
    default_ops_per_block: int = 93
    """Forward operators per block when the profile does not say (the reference Llama's count)."""
    default_ops_head: int = 20
    optimizer_ops_per_tensor: float = 10.0
    """AdamW's per-tensor implementation (the default on CPU tensors): operators per parameter tensor."""
    optimizer_foreach_ops: float = 30.0
    """AdamW's foreach implementation (the default on CUDA): operators per step, whatever the tensor count."""
    tp_small_collectives_per_block: tuple[float, float, float] = (4.0, 8.0, 4.0)
    """Collectives of tensor parallelism per block per micro-batch beyond the four activation-sized
    ones each way (forward, backward, full-AC recompute): DTensor redistributions of RoPE tables,
    norm weights and attention reshapes. Counted with a TorchDispatchMode on a tp=2 step of the
    reference Llama (torch 2.13), as are the two below."""
    tp_collectives_head: float = 16.0
    """TP collectives per micro-batch of the vocabulary-parallel embedding, output and loss."""
    tp_collectives_per_step: tuple[float, float] = (6.0, 4.0)
    """TP collectives per step: per block on the stage, and fixed (replicated parameters' gradients)."""
    ddp_bucket_bytes: float = 25 * 2**20
    """DistributedDataParallel's gradient bucket size (one all-reduce per bucket)."""
    autocast_ops_per_weight: float = 3.0
    """Under autocast each matmul adds a cast of its input (forward and backward) and of its weight's
    gradient: operators per weight tensor per micro-batch."""


# Fitted by `python -m dtorch.plan.calibration --fit` on the calibration rows (see that module). The
# fitted per-device base efficiencies live in the presets (DeviceType.matmul_efficiency: A100 0.8611,
# H100 SXM 0.7148, H100 96GB/500 W 0.542 over its power-capped peak), so that `dtorch probe` measurements replace them.
DEFAULT_CONSTANTS = CostConstants(
    gemm_width_half=64.0,
    gemm_rows_half=256.0,
    dp_exposed_floor=0.4,
    tp_exposed=0.5,
    elementwise_passes=16.0,
)


@dataclass
class Estimate:
    """The predicted cost of one plan. Times in seconds, memory in bytes (max over ranks)."""

    step_time_s: float
    tokens_per_s: float
    """Whole-cluster tokens per second."""
    tokens_per_s_per_gpu: float
    mfu: float
    """Model FLOPs (no recompute) per second over the cluster's bf16 peak (summed over all devices)."""
    time_breakdown: dict[str, float]
    """compute, recompute, host, tp, cp, fsdp, dp, pp_p2p, bubble, optimizer, offload (exposed seconds)."""
    memory_bytes_per_rank: int
    memory_breakdown: dict[str, int]
    """params, grads, optimizer, activations, buffers, margin (bytes, on the fullest rank)."""
    memory_capacity: int
    fits: bool
    efficiency: float = 0.0
    """The matmul efficiency the compute time used."""
    host_bytes_per_rank: int = 0
    """Host (CPU) memory the rank's offloaded states take; `fits` requires the node's ranks to fit."""
    notes: list[str] = field(default_factory=list)

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
            "time_breakdown": dict(self.time_breakdown),
            "memory_breakdown": dict(self.memory_breakdown),
        }


# ---- collectives ------------------------------------------------------------------------------
def axis_layout(stride: int, size: int, devices_per_node: int) -> tuple[int, int]:
    """(ranks of the axis group per node, nodes the group spans) for contiguous node-major ranks."""
    if size <= 1:
        return 1, 1
    if stride >= devices_per_node:
        return 1, size
    k = max(1, min(size, devices_per_node // stride))
    return k, math.ceil(size / k)


@lru_cache(maxsize=65536)
def _coll(kind: str, nbytes: float, k: int, m: int, bi: float, ai: float, be: float, ae: float) -> float:
    """Seconds for one collective over a group of k ranks per node x m nodes (see module doc)."""
    n = k * m
    if n <= 1 or nbytes <= 0:
        return 0.0
    factor = 2.0 if kind == "all_reduce" else 1.0
    t = 0.0
    if k > 1:
        t += factor * (nbytes * (k - 1) / k / bi + (k - 1) * ai)
    if m > 1:
        t += factor * ((nbytes / k) * (m - 1) / m / be + math.ceil(math.log2(m)) * ae)
    return t


def collective_time(kind: str, nbytes: float, size: int, stride: int, group: NodeGroup) -> float:
    """Seconds for `kind` in {'all_gather', 'reduce_scatter', 'all_reduce'} of a full array of
    `nbytes` over a mesh axis of `size` ranks at rank stride `stride` (alpha-beta, hierarchical)."""
    k, m = axis_layout(stride, size, group.devices_per_node)
    return _coll(kind, float(nbytes), k, m, group.intra.bandwidth * group.intra.efficiency, group.intra.latency,
                 group.inter.bandwidth * group.inter.efficiency, group.inter.latency)


def oversubscribed(group: NodeGroup) -> bool:
    """A CPU node running more ranks than it has cores: the ranks time-share the cores."""
    return group.device.kind == "cpu" and 0 < group.host_cores < group.devices_per_node


def p2p_time(nbytes: float, stride: int, group: NodeGroup) -> float:
    """Seconds to send `nbytes` to the neighbour `stride` ranks away. The probe's point-to-point
    latency is a ping-pong of idle ranks; on an oversubscribed CPU a pipeline's receive waits for a
    busy peer to be scheduled, which is what a ring step's latency (measured with all ranks
    contending) prices."""
    link = group.intra if stride < group.devices_per_node else group.inter
    latency = link.latency if oversubscribed(group) else (link.p2p_latency or link.latency)
    return nbytes / (link.bandwidth * link.efficiency) + latency


# ---- compute ----------------------------------------------------------------------------------
def shape_factor(width: float, rows: float, c: CostConstants = DEFAULT_CONSTANTS) -> float:
    """GEMM-shape efficiency factor in (0, 1]: x/(x + x0) for per-rank width and rows."""
    return (width / (width + c.gemm_width_half)) * (rows / (rows + c.gemm_rows_half))


def base_efficiency(group: NodeGroup, c: CostConstants = DEFAULT_CONSTANTS) -> float:
    for name, eff in c.device_efficiency:
        if name == group.device.name:
            return eff
    return group.device.matmul_efficiency


def partition(plan: Plan, num_layers: int) -> list[int]:
    """Blocks per pipeline stage: the plan's `layer_partition`, or as even as possible with the extra
    blocks on the earlier stages (exactly what `dtorch.parallel.pipeline.layer_partition` applies)."""
    if plan.layer_partition is not None:
        return list(plan.layer_partition)
    base, extra = divmod(num_layers, plan.num_stages)
    return [base + (1 if s < extra else 0) for s in range(plan.num_stages)]


@dataclass(frozen=True)
class RankLoad:
    """What one pipeline rank holds and runs: the blocks of all its (virtual) stages, and whether it
    has the first stage (input embedding) and the last (final norm, output head, loss)."""

    pp_rank: int
    blocks: int
    embedding: bool
    head: bool


def rank_loads(plan: Plan, num_layers: int) -> list[RankLoad]:
    """One RankLoad per pipeline rank (looped placement: rank r runs stages r, r + pp, ...)."""
    return list(_rank_loads(plan.pp, plan.virtual_stages, num_layers,
                            tuple(plan.layer_partition) if plan.layer_partition is not None else None))


@lru_cache(maxsize=4096)
def _distinct_loads(pp: int, v: int, num_layers: int, sizes: tuple[int, ...] | None) -> tuple[RankLoad, ...]:
    loads = _rank_loads(pp, v, num_layers, sizes)
    distinct: dict[tuple, RankLoad] = {}
    for ld in loads:
        # a middle rank with no more blocks than the first is dominated by it: no more time (the first
        # also runs the embedding) and no more memory (the first holds more micro-batches in flight)
        if ld.pp_rank > 0 and not ld.head and ld.blocks <= loads[0].blocks:
            continue
        distinct.setdefault((ld.blocks, ld.embedding, ld.head), ld)
    return tuple(distinct.values())


@lru_cache(maxsize=4096)
def _rank_loads(pp: int, v: int, num_layers: int, sizes: tuple[int, ...] | None) -> tuple[RankLoad, ...]:
    sizes = list(sizes) if sizes is not None else partition(Plan(pp=pp, virtual_stages=v), num_layers)
    S = pp * v
    out = []
    for r in range(pp):
        stages = range(r, S, pp)
        out.append(RankLoad(r, sum(sizes[s] for s in stages), 0 in stages, S - 1 in stages))
    return tuple(out)


def balanced_partition(num_stages: int, num_layers: int, head_blocks: float, embed_blocks: float = 0.0) -> list[int]:
    """Blocks per stage that minimise the busiest stage when the last stage also carries work worth
    `head_blocks` blocks (output head and loss) and the first `embed_blocks` (input embedding): the
    first and last stages get fewer blocks where that evens the load. Every stage keeps >= 1 block."""
    S, L = num_stages, num_layers
    if S == 1:
        return [L]
    extra = [0.0] * S
    extra[0] += embed_blocks
    extra[-1] += head_blocks
    lo, hi = L / S, L / S + max(extra) + 1.0
    best = None
    for _ in range(50):  # bisection on the busiest stage's load
        cap = (lo + hi) / 2
        sizes = [max(1, math.floor(cap - e + 1e-9)) for e in extra]
        if sum(sizes) >= L:
            hi, best = cap, sizes
        else:
            lo = cap
    sizes = list(best or [L // S] * S)
    # trim the surplus from the stages with the most load (keeping >= 1 block), earliest first
    while sum(sizes) > L:
        i = max((j for j in range(S) if sizes[j] > 1), key=lambda j: (sizes[j] + extra[j], -j))
        sizes[i] -= 1
    return sizes


def activation_in_flight(plan: Plan, pp_rank: int = 0) -> float:
    """Micro-batches of activations pipeline rank `pp_rank` holds at peak (the first holds the most:
    1F1B keeps p - r in flight on rank r; interleaving adds (p-1)/(p v); GPipe keeps all m)."""
    p, m, v = plan.pp, plan.num_microbatches, plan.virtual_stages
    if p == 1:
        return 1.0
    if plan.schedule == "gpipe":
        return float(m)
    if v > 1:
        first = min(float(m), p * (1.0 + (p - 1) / (p * v)))
        return max(1.0, first * (p - pp_rank) / p)
    return float(min(p - pp_rank, m))


def bubble_fraction_of_microbatch(plan: Plan) -> float:
    """Bubble length in units of one micro-batch's stage time (fwd+bwd)."""
    p, v = plan.pp, plan.virtual_stages
    if p == 1:
        return 0.0
    if plan.schedule == "gpipe":
        return float(p - 1)
    if plan.schedule == "zero_bubble":
        return (p - 1) / (3.0 * v)
    return (p - 1) / float(v)


def _rank_params(load: RankLoad, profile: ModelProfile, tp: int) -> float:
    """Parameters of one pipeline rank per TP rank."""
    p = load.blocks * profile.params_per_block
    p += profile.params_embedding if load.embedding else 0.0
    p += profile.params_head if load.head else 0.0
    return p / tp


def model_state_bytes(plan: Plan, profile: ModelProfile) -> dict[str, int]:
    """Parameter, gradient and optimizer bytes on the fullest rank (mixed-precision Adam)."""
    states = [_states(plan, _rank_params(ld, profile, plan.tp)) for ld in rank_loads(plan, profile.num_layers)]
    return max(states, key=lambda s: sum(s.values()))


def _states(plan: Plan, p_stage: float) -> dict[str, int]:
    """Model-state bytes of a rank holding `p_stage` parameters per TP rank."""
    shard = plan.dp_shard * plan.cp  # FSDP shards over dp_shard x cp (context-parallel ranks hold the same weights)
    grad_bytes = 4  # FSDP2/DDP keep gradients in the float32 master parameters' dtype (reduce_dtype is the wire)
    params = 0.0 if plan.offload == "params" else 4.0 * p_stage / shard
    grads = 0.0 if plan.offload == "params" else grad_bytes * p_stage / shard
    if plan.pp > 1 and shard > 1 and plan.num_microbatches > 1 and plan.offload != "params":
        # pipelining accumulates unsharded gradients until the last micro-batch (no reduce-scatter before)
        grads += DTYPE_BYTES[plan.param_dtype] * p_stage
    optim = 0.0 if plan.offload in ("optimizer", "params") else 8.0 * p_stage / shard
    return {"params": int(params), "grads": int(grads), "optimizer": int(optim)}


def autocast_applies(plan: Plan) -> bool:
    """The executor computes in param_dtype by autocast (not FSDP's parameter cast): no sharding and
    no FSDP-based replicate (`dtorch.parallel.model`)."""
    if plan.param_dtype == "float32" or plan.dp_shard * plan.cp > 1:
        return False
    classic_ddp = plan.dp_replicate > 1 and plan.tp == 1 and plan.pp == 1
    return plan.dp_replicate == 1 or classic_ddp


@dataclass(frozen=True)
class StepCounts:
    """What one step dispatches on the busiest rank besides arithmetic (see `step_counts`)."""

    ops_per_microbatch: float
    """Operators of one micro-batch's forward, backward and recompute on the worst stage."""
    dtensor_ops_per_microbatch: float
    """Those of them that run on DTensors (all of them under tensor parallelism)."""
    optimizer_ops: float
    dtensor_optimizer_ops: float
    tp_small_per_microbatch: float
    """Latency-bound TP collectives per micro-batch (the activation-sized ones are counted apart)."""
    tp_small_per_step: float


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
        loads = rank_loads(plan, profile.num_layers)
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
    tp_mb = tp_step = 0.0
    if plan.tp > 1:
        f, b, r = c.tp_small_collectives_per_block
        r = r if recompute_reruns_collectives(plan.ac, selective) else 0.0
        tp_mb = blocks * (f + b + r) + head_share * c.tp_collectives_head
        tp_step = blocks * c.tp_collectives_per_step[0] + c.tp_collectives_per_step[1]
    return StepCounts(
        ops_per_microbatch=ops_mb,
        dtensor_ops_per_microbatch=ops_mb if plan.tp > 1 else 0.0,
        optimizer_ops=opt,
        dtensor_optimizer_ops=opt if plan.tp > 1 or plan.dp_shard * plan.cp > 1 else 0.0,
        tp_small_per_microbatch=tp_mb,
        tp_small_per_step=tp_step,
    )


SELECTIVE_POLICIES = ("matmuls_saved", "attention_core", "every_second_mm")
"""What selective activation checkpointing recomputes (see `estimate`). 'matmuls_saved' is DTorch's
own (`dtorch.parallel.ac`): the outputs of matmuls and of the attention kernel are kept, every other
op of the block is re-run in backward. The other two describe published runs (calibration rows)."""

_LINEAR_ROLES = ("colwise", "rowwise")


def _saved_ops_per_block(profile: ModelProfile) -> int:
    """Operators per block whose outputs DTorch's selective checkpointing keeps (not re-run): one per
    linear layer (the profile's colwise/rowwise roles; Llama 7, GPT 6) and the attention kernel."""
    linears = sum(1 for role in profile.tp_roles.values() if role in _LINEAR_ROLES)
    if not linears:
        linears = {"llama": 7, "gpt": 6}.get(profile.family, 0)
    return linears + 1 if linears else 0


def recompute_ops_per_block(profile: ModelProfile, ac: str, selective: str = "matmuls_saved",
                            c: CostConstants = DEFAULT_CONSTANTS) -> float:
    """Operators one block's activation checkpointing dispatches in backward beside the backward's
    own: the re-run forward operators, plus torch's checkpoint detaching what the recompute saves
    (`checkpoint_detach_ops_per_forward_op`). Full AC re-runs the whole forward; DTorch's selective
    policy all but the matmuls and the attention kernel (their outputs come from its cache); the
    published policies re-run a share (`selective_recompute_ops`)."""
    ob = profile.ops_per_block or c.default_ops_per_block
    detach = ob * c.checkpoint_detach_ops_per_forward_op
    if ac == "full":
        return ob + detach
    if ac != "selective":
        return 0.0
    if selective == "matmuls_saved":
        return max(0.0, ob - _saved_ops_per_block(profile)) + detach
    return ob * c.selective_recompute_ops


def recompute_reruns_collectives(ac: str, selective: str = "matmuls_saved") -> bool:
    """Whether a block's recompute issues its tensor- and context-parallel collectives again: under
    full AC and DTorch's selective policy they are not among the saved ops, and the norm and the
    matmul inputs they produce are needed by the backward."""
    return ac == "full" or (ac == "selective" and selective == "matmuls_saved")


def matmuls_saved_act_bytes(profile: ModelProfile) -> float:
    """Activation bytes per token per block (16-bit) that DTorch's selective checkpointing keeps:
    the block input, the output of every linear layer and of the attention kernel (its output and a
    float32 log-sum-exp per head); norms, RoPE, activations and residual adds are recomputed.
    Llama: x h, q/k/v q + 2 kv, attention out q, o h, w1/w3 2 f, w2 h (q = h for every preset, kv =
    h kv_heads / heads). GPT: x h, q/k/v 3 h, attention out h, o h, w1 f, w2 h. Other modules: the
    profiler's measurement with the same op list (`act_bytes_per_token_block['selective']`)."""
    h, f, a = float(profile.hidden), float(profile.ffn_hidden), float(profile.num_heads)
    kv = h * profile.num_kv_heads / profile.num_heads
    lse = 4.0 * a
    if profile.family == "llama":
        return 2.0 * (3 * h + 2 * h + 2 * kv + 2 * f) + lse
    if profile.family == "gpt":
        return 2.0 * (7 * h + f) + lse
    per_tok = profile.act_bytes_per_token_block
    return per_tok.get("selective", per_tok.get("none", 34.0 * h))


def act_bytes_per_token_block(profile: ModelProfile, ac: str, selective: str = "matmuls_saved") -> float:
    """Activation bytes per token per block (16-bit) a block keeps for backward under `ac`."""
    per_tok = profile.act_bytes_per_token_block
    a_none = per_tok.get("none", 34.0 * profile.hidden)
    if ac == "selective" and selective == "matmuls_saved":
        return matmuls_saved_act_bytes(profile)
    return per_tok.get(ac, a_none)


def every_second_matmul_params(profile: ModelProfile) -> float:
    """Weights per block of the matmuls an op-level policy that saves every matmul output except
    every second one (torchtitan's 'op' selective AC, counting per block in call order) recomputes.
    Llama calls q, k, v, o, w1, w3, w2: k, o and w3 are re-run. A GPT block calls qkv, proj, fc1,
    fc2: proj and fc2."""
    h, f = float(profile.hidden), float(profile.ffn_hidden)
    if profile.family == "llama":
        return h * h * profile.num_kv_heads / profile.num_heads + h * h + h * f
    return h * h + f * h


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
    kv = h * profile.num_kv_heads / profile.num_heads
    if profile.family == "llama":  # inputs: x (q, k, v), attention out, x (w1, w3), w2's; grads of q k v o w1 w3 w2
        elements = (3 * h + f) + (3 * h + 2 * kv + 2 * f)
    else:  # qkv, proj, fc1, fc2
        elements = (3 * h + f) + (5 * h + f)
    return elements * (5.0 if compiled else 7.0)


def _exposed(comm: float, compute: float, c: CostConstants) -> float:
    """Exposed seconds of `comm` overlapped with `compute`: what does not fit under the overlappable
    share of compute, and never less than the contention floor."""
    return max(c.dp_exposed_floor * comm, comm - c.fsdp_overlap * compute)


# ---- the estimate -----------------------------------------------------------------------------
@dataclass
class _Rank:
    """One pipeline rank's share of a step (seconds per micro-batch and per step, bytes)."""

    compute: float = 0.0
    recompute: float = 0.0
    host: float = 0.0
    tp: float = 0.0
    cp: float = 0.0
    tp_step: float = 0.0
    fsdp: float = 0.0
    dp: float = 0.0
    optimizer: float = 0.0
    offload: float = 0.0
    memory: dict = field(default_factory=dict)
    host_bytes: float = 0.0

    @property
    def per_microbatch(self) -> float:
        return self.compute + self.recompute + self.host + self.tp + self.cp


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
    `compiled` and `async_tp` describe runs this executor does not make (float8 linear layers,
    torch.compile, async TP): the calibration uses them for published measurements; the search
    never does. `selective` says what `ac='selective'` recomputes: 'matmuls_saved' (DTorch's own
    policy, the default: the element-wise forward, see `matmuls_saved_act_bytes`), 'attention_core'
    (the attention scores and their softmax, Korthikanti et al. 2022) or 'every_second_mm'
    (torchtitan's op-level policy, see `every_second_matmul_params`). The plan's degrees must
    multiply to the cluster's world size."""
    if selective not in SELECTIVE_POLICIES:
        raise ConfigError("selective", selective, f"one of {{{', '.join(SELECTIVE_POLICIES)}}}")
    if plan.world_size != cluster.world_size:
        raise ConfigError(
            "degrees", plan.mesh_shape,
            f"pp*dp_replicate*dp_shard*cp*tp = {plan.world_size} but the cluster has {cluster.world_size} devices",
        )
    c = constants
    g = cluster.slowest_group()
    dev = g.device
    cpu = dev.kind == "cpu"
    if cpu:
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
    s = profile.seq_len
    h = profile.hidden
    tp, cp, pp, v = plan.tp, plan.cp, plan.pp, plan.virtual_stages
    dps, dpr = plan.dp_shard, plan.dp_replicate
    mbs, m = plan.microbatch_size, plan.num_microbatches
    st_tp, st_cp = 1, tp
    st_dpr, st_pp = tp * cp * dps, tp * cp * dps * dpr
    fs, st_fs = dps * cp, tp  # FSDP's group: dp_shard x cp flattened (contiguous at stride tp)
    act_b = DTYPE_BYTES[compute_dtype]
    act_scale = act_b / 2.0  # the profile's activation bytes are 16-bit
    param_b = DTYPE_BYTES[plan.param_dtype]
    red_b = DTYPE_BYTES[plan.reduce_dtype]
    tokens_mb = mbs * s
    rows = tokens_mb / cp
    eff = base_efficiency(g, c) * shape_factor(h / tp, rows, c)
    speed = peak * eff
    attn_fwd = 4.0 * h * s  # per token per block, full s^2 (selective recompute; float8 leaves it bf16)
    fb, fh = profile.flops_per_token_block, profile.flops_per_token_head
    per_tok = profile.act_bytes_per_token_block
    a_none = per_tok.get("none", 34.0 * h)
    passes = c.elementwise_passes * (c.compile_elementwise_factor if compiled else 1.0)
    # element-wise seconds per 16-bit activation byte: memory-bound on a GPU (a float32 element costs
    # twice a bf16 one), converted and computed in float32 on a CPU (measured per dtype)
    elem_s_per_byte = passes * 2.0 / (dev.memory_bandwidth * dev.elementwise(compute_dtype))
    act_full = tokens_mb / cp * h * act_b  # one activation tensor of the micro-batch, full over TP
    # collectives whose size does not depend on the pipeline rank: computed once
    tp_small = collective_time("all_gather", 64.0, tp, st_tp, g) if tp > 1 else 0.0  # latency-bound
    tp_act = collective_time("all_gather", act_full, tp, st_tp, g) if tp > 1 else 0.0
    kv_dim = h * profile.num_kv_heads / profile.num_heads
    cp_kv = collective_time("all_gather", 2.0 * tokens_mb * kv_dim * act_b / tp, cp, st_cp, g) if cp > 1 else 0.0
    p_block = profile.params_per_block / tp
    if fs > 1:
        ag_unit = collective_time("all_gather", 1.0, fs, st_fs, g)
        rs_unit = collective_time("reduce_scatter", 1.0, fs, st_fs, g)
        ag_block = collective_time("all_gather", p_block * param_b, fs, st_fs, g)
    ar_unit = collective_time("all_reduce", 1.0, dpr, st_dpr, g) if dpr > 1 else 0.0

    def rank_share(load: RankLoad) -> _Rank:
        r = _Rank()
        blocks = load.blocks
        flops_mb = tokens_mb * (blocks * fb + (fh if load.head else 0.0)) / (tp * cp)
        attn_part = tokens_mb * blocks * 3 * attn_fwd / (tp * cp)  # the attention core, at its own speed
        linear = speed * ((c.float8_linear_speedup or dev.peak("float8") / peak) if dtype == "float8" else 1.0)
        if dtype == "float8":
            # float8 covers the blocks' linear layers; the output head stays in bf16 (torchao's and
            # Transformer Engine's recipes leave the output projection out); each linear's operands
            # are cast with a tensor-wide scale: element-wise traffic at HBM bandwidth
            head_mb = tokens_mb * fh / (tp * cp) if load.head else 0.0
            r.compute = (flops_mb - attn_part - head_mb) / linear + (attn_part + head_mb) / speed
            cast_bytes = float8_cast_bytes_per_token_block(profile, compiled)
            r.compute += tokens_mb * blocks * cast_bytes / (tp * cp) / dev.memory_bandwidth
        else:
            r.compute = (flops_mb - attn_part) / linear + attn_part / speed
        # memory-bound element-wise work, forward + backward (and forward again under full AC)
        elem_bytes = tokens_mb * (blocks * a_none + (profile.act_bytes_per_token_head if load.head else 0.0)) / (tp * cp)
        r.compute += elem_bytes * elem_s_per_byte
        # the blocks' element-wise forward: a third of their forward + backward element-wise work
        elem_fwd = tokens_mb * blocks * a_none / (tp * cp) * elem_s_per_byte / 3.0
        if plan.ac == "full":
            rec_flops = tokens_mb * blocks * fb / 3.0 / (tp * cp)
            r.recompute = r.compute * (rec_flops / flops_mb) if flops_mb else 0.0
        elif plan.ac == "selective" and selective == "matmuls_saved":
            # DTorch's policy (dtorch/parallel/ac.py): matmul and attention outputs come from the
            # cache, every element-wise op of the block is re-run
            r.recompute = elem_fwd
        elif plan.ac == "selective" and selective == "every_second_mm":
            # torchtitan's op-level policy: every second matmul of a block re-run, and the block's
            # element-wise forward
            rec_mm = 2.0 * tokens_mb * blocks * every_second_matmul_params(profile) / (tp * cp)
            r.recompute = rec_mm / linear + elem_fwd
        elif plan.ac == "selective":
            r.recompute = tokens_mb * blocks * attn_fwd / (tp * cp) / speed
        # host overhead of eager execution: operators x seconds per operator (0 when unmeasured). A
        # GPU's host runs ahead of its kernels, so it shows only where it exceeds them; a CPU's does not.
        counts = step_counts(plan, profile, dev.kind, c, load, selective)
        host_mb = (counts.ops_per_microbatch * dev.op_overhead_s
                   + counts.dtensor_ops_per_microbatch * dev.dtensor_op_overhead_s)
        host_opt = counts.optimizer_ops * dev.op_overhead_s + counts.dtensor_optimizer_ops * dev.dtensor_op_overhead_s
        r.host = host_mb if cpu else max(0.0, host_mb - (r.compute + r.recompute))
        # TP / CP per micro-batch
        if tp > 1:
            n_ops = 8 + (4 if recompute_reruns_collectives(plan.ac, selective) else 0)
            r.tp = blocks * n_ops * tp_act + counts.tp_small_per_microbatch * tp_small  # norm weights, RoPE, loss
            r.tp *= c.tp_exposed * (c.async_tp_factor if async_tp else 1.0)
            r.tp_step = counts.tp_small_per_step * tp_small * c.tp_exposed
        if cp > 1:
            # K and V all-gathered forward, again in backward with a reduce-scatter of their gradients;
            # the executor issues them before attention, so nothing hides them (dtorch/parallel/cp.py)
            n_ops = 3 + (1 if recompute_reruns_collectives(plan.ac, selective) else 0)
            r.cp = blocks * n_ops * cp_kv
        # data parallel
        p_stage = _rank_params(load, profile, tp)
        states = _states(plan, p_stage)
        busy = r.compute + r.recompute
        if fs > 1:
            # FSDP2 gathers and reduces one unit (block, and the root's rest) at a time: one latency each
            units = blocks + 1
            ag = collective_time("all_gather", p_stage * param_b, fs, st_fs, g) + (units - 1) * ag_unit
            rs = collective_time("reduce_scatter", p_stage * red_b, fs, st_fs, g) + (units - 1) * rs_unit
            if pp == 1:
                comm = m * (ag * (2 if plan.reshard_after_forward else 1) + rs)
                r.fsdp = _exposed(comm, m * busy, c) + m * ag_block
            else:
                gathers = m * v * 2 if plan.reshard_after_forward else 1
                r.fsdp = _exposed(ag * gathers, m * busy, c) + ag_block
                # gradients sync on the last micro-batch only: hidden behind its backward at best
                r.fsdp += _exposed(rs, (2.0 / 3.0) * r.compute, c)
        if dpr > 1:
            grad_bytes = p_stage * red_b / fs
            ar = collective_time("all_reduce", grad_bytes, dpr, st_dpr, g)
            # DDP all-reduces a small first bucket, then one per `ddp_bucket_bytes`
            ar += math.ceil(grad_bytes / c.ddp_bucket_bytes) * ar_unit
            r.dp = _exposed(ar, (2.0 / 3.0) * r.compute, c)
        # optimizer and offload
        p_local = p_stage / fs
        if plan.offload == "none":
            r.optimizer = p_local * c.optimizer_bytes_per_param / (dev.memory_bandwidth * 0.8)
        else:
            r.offload = p_local * c.optimizer_bytes_per_param / c.cpu_adam_bytes_per_s
            r.offload += p_local * (red_b + param_b) / c.host_link_bandwidth  # grads down, params up
            if plan.offload == "params":
                n_ag = m * (2 if plan.reshard_after_forward else 1) if pp == 1 else m * v * 2
                r.offload += n_ag * p_local * param_b / c.host_link_bandwidth
                r.offload += m * p_local * red_b / c.host_link_bandwidth
        r.optimizer += host_opt if cpu else max(0.0, host_opt - r.optimizer)
        # memory of this rank
        a_pol = act_bytes_per_token_block(profile, plan.ac, selective) * act_scale
        if tp > 1 and not plan.sp:
            shard_act = 10.0 / 34.0 + (24.0 / 34.0) / tp  # Korthikanti Table 2, "TP only"
            shard_full = 1.0
        else:
            shard_act = shard_full = 1.0 / tp
        a_layer = a_pol * rows * (shard_full if plan.ac == "full" else shard_act)
        acts = a_layer * blocks * activation_in_flight(plan, load.pp_rank)
        if plan.ac == "full":
            acts += a_none * act_scale * rows * shard_act  # one block re-materialised during its backward
        if load.head:  # logits of every micro-batch the last stage holds (one under 1F1B, m under GPipe)
            acts += profile.act_bytes_per_token_head * act_scale * rows / tp * activation_in_flight(plan, load.pp_rank)
        buffers = 0.0
        if fs > 1:
            if plan.reshard_after_forward or plan.offload == "params":
                buffers = 2 * p_block * param_b + p_block * red_b  # gathered block + prefetch, one grad block
            else:
                buffers = p_stage * param_b + p_block * red_b  # whole stage stays gathered fwd -> bwd
        elif dpr > 1:
            buffers = 2 * 25 * 2**20  # DDP's default 25 MiB buckets, two in flight
        sub = sum(states.values()) + acts + buffers
        margin = c.fixed_overhead_bytes + c.fragmentation * sub
        r.memory = {**states, "activations": int(acts), "buffers": int(buffers), "margin": int(margin)}
        # Offloaded states live in the node's host memory, shared by all its ranks (ZeRO-Offload:
        # fp32 master params + Adam moments, plus fp32 grads when parameters are offloaded too).
        r.host_bytes = 12.0 * p_local if plan.offload == "optimizer" else (16.0 * p_local if plan.offload == "params" else 0.0)
        return r

    # Ranks with the same blocks, embedding and head take the same time; of those, the first holds
    # the most micro-batches in flight (activation_in_flight falls with the rank): cost one each.
    shares = [rank_share(ld) for ld in _distinct_loads(plan.pp, plan.virtual_stages, profile.num_layers,
                                                         tuple(plan.layer_partition) if plan.layer_partition else None)]
    worst = max(shares, key=lambda r: m * r.per_microbatch + r.fsdp + r.dp + r.optimizer + r.offload + r.tp_step)
    pace = max(shares, key=lambda r: r.per_microbatch)  # the pipeline runs at its slowest stage's pace
    t_mb = pace.per_microbatch

    # -- pipeline --
    t_p2p = 0.0
    t_bubble = 0.0
    if pp > 1:
        p2p_bytes = act_full / (tp if plan.sp or tp == 1 else 1)
        t_p2p = c.pp_p2p_exposed * 2.0 * p2p_time(p2p_bytes, st_pp, g) * (m * v + pp - 1)
        if oversubscribed(g):
            # The per-rank speed is a share of the cores measured with every rank busy; a stage idling
            # in the bubble hands its share to the stages that work, so the bubble costs only the cores
            # left idle while the pipeline fills and drains. Filling it with other work (zero-bubble's
            # deferred weight gradients, interleaving) moves work, it does not remove any: every
            # schedule pays the 1F1B ramp.
            t_bubble = (pp - 1) * t_mb * g.host_cores / g.devices_per_node
        else:
            t_bubble = bubble_fraction_of_microbatch(plan) * t_mb

    # the slowest stage sets the micro-batch pace; the busiest rank adds its own per-step work
    per_step = worst.fsdp + worst.dp + worst.optimizer + worst.offload + worst.tp_step
    step = m * t_mb + t_bubble + t_p2p + per_step
    tokens = plan.dp * mbs * m * s
    tps = tokens / step
    # MFU over the whole cluster's peak in the compute dtype (torchtitan's convention); a mixed
    # cluster's faster devices wait for the slowest
    mfu = tps * profile.flops_per_token / sum(gr.num_devices * gr.device.peak(compute_dtype)
                                              if gr.device.supports(compute_dtype) else 0.0 for gr in cluster.groups)

    fullest = max(shares, key=lambda r: sum(r.memory.values()))
    total = sum(fullest.memory.values())
    cap = dev.memory_bytes
    host = max(r.host_bytes for r in shares)
    host_ok = g.host_memory_bytes <= 0 or host * g.devices_per_node <= 0.9 * g.host_memory_bytes
    notes = [] if host_ok else [
        f"offloaded states need {host * g.devices_per_node / 2**30:,.0f} GiB of host memory per node, "
        f"{g.host_memory_bytes / 2**30:,.0f} GiB available"]
    return Estimate(
        step_time_s=step,
        tokens_per_s=tps,
        tokens_per_s_per_gpu=tps / cluster.world_size,
        mfu=mfu,
        time_breakdown={
            "compute": m * pace.compute,
            "recompute": m * pace.recompute,
            "host": m * pace.host,
            "tp": m * pace.tp + worst.tp_step,
            "cp": m * pace.cp,
            "fsdp": worst.fsdp,
            "dp": worst.dp,
            "pp_p2p": t_p2p,
            "bubble": t_bubble,
            "optimizer": worst.optimizer,
            "offload": worst.offload,
        },
        memory_bytes_per_rank=int(total),
        memory_breakdown=dict(fullest.memory),
        memory_capacity=int(cap),
        fits=total <= cap and host_ok,
        efficiency=eff,
        host_bytes_per_rank=int(host),
        notes=notes,
    )


def with_constants(**kw) -> CostConstants:
    """DEFAULT_CONSTANTS with some fields replaced (for calibration and what-if studies)."""
    return replace(DEFAULT_CONSTANTS, **kw)
