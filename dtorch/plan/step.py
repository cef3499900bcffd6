"""The step shape and the cost model's shared helpers: a leaf of the planner (no strategy, no Plan).

Every strategy's time and memory terms read one `StepShape` (the plan, its node group, the
calibratable `CostConstants`, a micro-batch's tokens and GEMM rows, the mesh strides); the helpers
here (`DTYPE_BYTES`, `shape_factor`, `base_efficiency`, the average block's parameters and FLOPs,
TP's activation share) are what both `dtorch.plan.cost` and the strategies of
`dtorch.plan.strategies` use. It imports neither, so the strategies can name the step shape's type
and `cost` can loop over them without an import cycle. Formulas and sources: `dtorch.plan.cost`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

from dtorch.cluster.shape import (
    ELEMENTWISE_PASSES,
    GEMM_ROWS_HALF,
    GEMM_WIDTH_HALF,
    attention_efficiency,
    streaming_multiprocessors,
    unfused_attention_s,
)
from dtorch.cluster.shape import shape_factor as _shape_factor
from dtorch.cluster.spec import NodeGroup
from dtorch.model.profile import ModelProfile

T = TypeVar("T")

@dataclass(frozen=True)
class RankLoad:
    """What one pipeline rank holds and runs: the blocks of all its (virtual) stages, and whether it
    has the first stage (input embedding) and the last (final norm, output head, loss). The search's
    lower bound uses an ideal rank: a fractional share of the blocks, embedding and head."""

    pp_rank: int
    blocks: float
    embedding: float
    head: float
    dense_blocks: float = 0.0
    """Of `blocks`, a MoE model's dense first blocks on this rank (smaller: no routed experts)."""


@dataclass(slots=True)
class RankShare:
    """One pipeline rank's share of a step (seconds per micro-batch and per step, bytes)."""

    compute: float = 0.0
    recompute: float = 0.0
    host: float = 0.0
    tp: float = 0.0
    cp: float = 0.0
    ep: float = 0.0
    """Expert-parallel all-to-all (dispatch and combine) per micro-batch."""
    tp_step: float = 0.0
    fsdp: float = 0.0
    dp: float = 0.0
    optimizer: float = 0.0
    offload: float = 0.0
    memory: dict = field(default_factory=dict)
    host_bytes: float = 0.0
    disk_bytes: float = 0.0
    """Bytes of the rank's NVMe-tier files (offload=optimizer_nvme)."""
    p_stage: float = 0.0
    """Parameters the rank holds per TP rank."""
    syncs: float = 0.0
    """Blocking collectives per micro-batch, every strategy's (`Strategy.blocking_collectives`): the
    rank's work between two of them is the stretch over which the ranks drift apart."""

    def segment_s(self) -> float:
        """Seconds of the rank's own work between two blocking collectives (0 without any)."""
        return (self.compute + self.recompute + self.host) / self.syncs if self.syncs else 0.0

    @property
    def per_microbatch(self) -> float:
        return self.compute + self.recompute + self.host + self.tp + self.cp + self.ep

    @property
    def per_step(self) -> float:
        return self.fsdp + self.dp + self.optimizer + self.offload + self.tp_step



@dataclass(slots=True)
class RankMemory:
    """What one pipeline rank holds, as the strategies' memory terms fill it in: the parameters
    (per TP rank) of its stage, those it holds unsharded when its stage is gathered and those it
    holds as its own shard (`Strategy.held`: the expert strategy's say), the gathered-parameter and
    gradient buffers of the strategy that syncs them, and the host and disk bytes of offloaded
    states (`Strategy.rank_memory`)."""

    p_stage: float
    p_gathered: float
    p_local: float
    buffers: float = 0.0
    host_bytes: float = 0.0
    disk_bytes: float = 0.0
    states: dict = field(default_factory=dict)
    """Model-state bytes by category (params, grads, optimizer) as `cost.rank_memory` computed them
    before the strategies' terms: a strategy that holds them differently (ZeRO-1/2) changes them."""


@dataclass(frozen=True, slots=True)
class MemoryBytes:
    """One rank's predicted bytes at its peak, by category (`Estimate.memory`): what torch's
    MemTracker attributes to each at that moment (tests/plan/test_memory_categories.py), and the
    reserve kept free beside them (CUDA context, NCCL and allocator fragmentation), which no tensor fills.

    params: the rank's parameters, its shard and the unsharded copies it holds gathered;
    grads: gradients alive at the peak; optimizer: AdamW's moments; activations: what the forward
    saved and the backward's working tensors; buffers: the model's buffers and the gradient
    strategy's communication buffers."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    buffers: int = 0
    reserve: int = 0

    @classmethod
    def of(cls, breakdown: dict) -> MemoryBytes:
        """From an estimate's `memory_breakdown` (its `margin` is the reserve; a search's `correction`
        for a measured plan counts with the activations, what it corrects)."""
        get = lambda k: int(breakdown.get(k, 0))  # noqa: E731
        return cls(get("params"), get("grads"), get("optimizer"), get("activations") + get("correction"),
                   get("buffers"), get("margin") + get("reserve"))

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def tensors(self) -> int:
        """The job's own bytes at its peak (everything but the reserve)."""
        return self.model_states + self.activations + self.buffers


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
    """Share of one unit's compute that the next unit's FSDP/DDP transfer can hide behind
    (`dtorch.plan.comm.prefetched`; 0 on a CPU)."""
    dp_exposed_floor: float = 0.0
    """Share of FSDP/DDP communication exposed whatever hides it (1 on a CPU, where the ranks'
    collectives run on the cores that compute; 0 on a GPU, whose contention `collective_sms` prices)."""
    collective_sms: float = 32.0
    """SMs a hidden NCCL collective occupies (its default limit of 32 channels, one thread block
    each): the GEMMs it overlaps run on the rest, so a hidden transfer still shows for this share of
    the device's SMs of its time (`StepShape.contention`)."""
    tp_exposed: float = 1.0
    """Share of TP communication on the critical path (synchronous TP)."""
    attention_kernel: str = "sdpa"
    """The fused attention kernel a flash model's plans run, priced from its published benchmarks
    (`dtorch.cluster.shape.attention_efficiency`): 'sdpa', what torch's SDPA picks on the device
    (DTorch's executor: cuDNN on Hopper and Blackwell, flash-attention 2 on Ampere); 'fa2', 'fa3',
    'cudnn' (Transformer Engine's fused attention, Megatron-Core)."""
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
    """CPU Adam throughput per device share of a host, bytes of optimizer traffic per second (a
    nominal figure: not measured on a GPU host yet; the offload benchmark's host tier on the shared
    2-core development machine reached about 6.8e9, benchmarks/results/offload.md)."""
    grad_clipping: bool = True
    """The run clips gradients (the trainer's default, max_grad_norm=1.0): the optimizer tiers then
    step after the backward; without clipping they step during it where the executor can
    (`strategies.memory.step_overlaps_backward`). The trainer sets it from its max_grad_norm."""
    cpu_adam_fused: bool = False
    """The run's AdamW uses torch's fused kernel (AdamW(fused=True)): what a CPU cluster's optimizer
    tier runs (beside an accelerator the tier always runs it). The trainer sets it from its spec."""
    disk_read_bytes_per_s: float = 1.0e9
    """Local disk read bandwidth per node when the cluster gives none (`dtorch probe --disk`): a
    conservative nominal figure, a SATA-class SSD (a datacenter NVMe drive reads 3-7 GB/s)."""
    disk_write_bytes_per_s: float = 0.5e9
    """Local disk write bandwidth per node when the cluster gives none: nominal, conservative."""
    offload_block_bytes: float = 64 * 2**20
    """The optimizer tiers' block of state moved at a time (`OptimizerOffload.block_bytes`)."""
    offload_buffers: int = 3
    """The NVMe tier's block buffers in host memory (`OptimizerOffload.buffers`)."""
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


# Fitted by `python -m dtorch.plan.calibration` on the calibration rows (see that module). The
# fitted per-device base efficiencies live in the presets (DeviceType.matmul_efficiency: A100 0.7908,
# H100 SXM 0.6642, H100 96GB/500 W 0.6408 over its power-capped peak, H200 0.7401, B200 0.5938), so
# that `dtorch probe` measurements replace them.
DEFAULT_CONSTANTS = CostConstants(
    gemm_width_half=GEMM_WIDTH_HALF,  # the device-shape constants live below the planner (dtorch.cluster.shape),
    gemm_rows_half=GEMM_ROWS_HALF,  # where the probe and the CPU capability timing read them too
    elementwise_passes=ELEMENTWISE_PASSES,
    # Not fitted: of a block's eight sequence-parallel activation collectives (forward: all-gathers
    # before the column-parallel q/k/v and MLP-in GEMMs, reduce-scatters after the row-parallel
    # output and MLP-out GEMMs; backward: the all-gathers of the output gradients, the
    # reduce-scatters of the column-parallel input gradients), the last two run while autograd
    # computes the same layers' weight gradients, which do not wait for them: 6 of 8 block the step.
    tp_exposed=0.75,
)


def shape_factor(width: float, rows: float, c: CostConstants = DEFAULT_CONSTANTS) -> float:
    """GEMM-shape efficiency factor in (0, 1]: x/(x + x0) for per-rank width and rows, at the
    constants' half-points (`dtorch.cluster.shape`)."""
    return _shape_factor(width, rows, c.gemm_width_half, c.gemm_rows_half)


def base_efficiency(group: NodeGroup, c: CostConstants = DEFAULT_CONSTANTS) -> float:
    for name, eff in c.device_efficiency:
        if name == group.device.name:
            return eff
    return group.device.matmul_efficiency


def _block_params(load: RankLoad, profile: ModelProfile) -> float:
    """Parameters of the blocks of pipeline rank `load`: a MoE model's dense first blocks at their own
    size (`RankLoad.dense_blocks`), the others at a MoE block's."""
    if not profile.num_dense_layers:
        return load.blocks * mean_block_params(profile)
    return (load.dense_blocks * profile.params_per_dense_block
            + (load.blocks - load.dense_blocks) * profile.params_per_block)


def mean_block_params(profile: Any) -> float:
    """Parameters of an average block: a MoE model's dense first blocks are smaller (the even
    mean is exact without PP; a pipeline stage holding the dense blocks is approximated by it)."""
    if not profile.num_dense_layers:
        return float(profile.params_per_block)
    L, d = profile.num_layers, profile.num_dense_layers
    return ((L - d) * profile.params_per_block + d * profile.params_per_dense_block) / L


def mean_block_flops(profile: Any) -> float:
    if not profile.num_dense_layers:
        return float(profile.flops_per_token_block)
    L, d = profile.num_layers, profile.num_dense_layers
    return ((L - d) * profile.flops_per_token_block + d * profile.flops_per_token_dense_block) / L


class StepShape:
    """What every term of one plan's step shares: the plan, the node group it runs on, the constants
    (CPU-adjusted), the compute dtype's peak and widths, a micro-batch's tokens and GEMM rows, the
    matmul speed, the element-wise cost per byte and the mesh strides. Strategies read it by name."""

    __slots__ = (
        "plan", "profile", "g", "c", "dtype", "peak", "elem_speed", "compiled", "async_tp", "dev", "cpu",
        "compute_dtype", "s", "h", "act_b", "act_scale", "resid_b", "autocast", "param_b", "red_b", "tokens_mb", "rows", "eff",
        "speed", "attn_fwd", "attn_speed", "elem_s_per_byte", "act_full", "st_cp", "st_dpr", "st_pp", "fs", "st_fs",
        "a_none", "a_elem", "contention", "block_params", "block_flops", "world", "selective", "linear",
        "cluster", "tp_act", "_terms",
    )
    # No open attributes: what a strategy computes once per plan in `prepare` is its own typed record
    # (`keep`/`term`); what one strategy hands to another or to the shared terms is a field here
    # (`compiled`, `elem_s_per_byte` from compile; `tp_act` from tensor, read by expert).

    def __init__(self, plan: Any, profile: ModelProfile, g: NodeGroup, c: CostConstants, dtype: str, peak: float,
                 elem_speed: float, compiled: bool = False, async_tp: bool = False,
                 selective: str = "matmuls_saved") -> None:
        self.plan, self.profile, self.g, self.c, self.dtype = plan, profile, g, c, dtype
        self.peak, self.elem_speed, self.compiled, self.async_tp = peak, elem_speed, compiled, async_tp
        prof = profile
        self.dev = self.g.device
        self.cpu = self.dev.kind == "cpu"
        self.compute_dtype = "bfloat16" if self.dtype == "float8" else self.dtype
        self.s, self.h = prof.seq_len, prof.hidden
        tp, cp = plan.tp, plan.cp
        self.act_b = DTYPE_BYTES[self.compute_dtype]
        self.act_scale = self.act_b / 2.0  # the profile's activation bytes are 16-bit
        self.autocast = autocast_applies(plan)
        # the residual stream's width: under autocast the embedding and the residual adds keep the
        # float32 masters' dtype (only the ops on autocast's lists cast); else the compute dtype's
        self.resid_b = 4.0 if self.autocast else float(self.act_b)
        self.param_b = DTYPE_BYTES[plan.param_dtype]
        self.red_b = DTYPE_BYTES[plan.reduce_dtype]
        self.tokens_mb = plan.microbatch_size * self.s
        self.rows = self.tokens_mb / cp
        self.eff = base_efficiency(self.g, c) * _shape_factor(self.h / tp, self.rows, c.gemm_width_half,
                                                              c.gemm_rows_half)
        self.speed = self.peak * self.eff
        self.a_none = prof.act_bytes_per_token_block.get("none", 34.0 * self.h)  # 16-bit bytes per token per block
        self.selective = selective  # what ac='selective' recomputes (SELECTIVE_POLICIES)
        # matmul speed of the blocks' linear layers: float8 (published runs) at the device's
        # float8 / bf16 peak ratio unless a speed-up is given
        self.linear = self.speed * ((c.float8_linear_speedup or self.dev.peak("float8") / self.peak)
                                    if self.dtype == "float8" else 1.0)
        self.attn_fwd = 4.0 * self.h * self.s  # per token per block, full s^2 (selective recompute; float8 leaves it bf16)
        self.attn_speed = self._attention_speed()
        # element-wise bytes per token per block: an unfused core's a*s^2 scores (Korthikanti's 5as, or
        # as measured) are priced by the attention roofline, not as element-wise passes (on a CPU,
        # whose attention runs at the GEMMs' speed, a measured model's stay element-wise passes)
        self.a_elem = self.a_none - self._scores_bytes()
        # share of a hidden data-parallel transfer that still shows: the SMs its kernels take
        sms = streaming_multiprocessors(self.dev.name)
        self.contention = min(1.0, c.collective_sms / sms) if sms else 0.25
        passes = c.elementwise_passes * (c.compile_elementwise_factor if self.compiled else 1.0)
        # element-wise seconds per 16-bit activation byte: memory-bound on a GPU (a float32 element costs
        # twice a bf16 one), converted and computed in float32 on a CPU (measured per dtype)
        self.elem_s_per_byte = passes * 2.0 / (self.dev.memory_bandwidth * self.elem_speed)
        self.act_full = self.tokens_mb / cp * self.h * self.act_b  # one activation tensor of the micro-batch, full over TP
        # mesh strides (tp innermost); FSDP's group is dp_shard x cp flattened, contiguous at stride tp
        self.st_cp, self.st_dpr = tp, tp * cp * plan.dp_shard
        self.st_pp = self.st_dpr * plan.dp_replicate
        self.fs, self.st_fs = plan.dp_shard * cp, tp
        # an average block (a MoE model's dense first blocks are smaller; equal to the block for dense models)
        self.block_params = mean_block_params(prof)
        self.block_flops = mean_block_flops(prof)
        self.world = plan.pp * plan.dp_replicate * plan.dp_shard * cp * tp  # (step_shape checks it is the cluster's)
        self.cluster: Any = None
        """The cluster the plan runs on (strategies read measured gains from its `calibration`)."""
        self.tp_act = 0.0
        """Seconds of one activation all-gather over tp (set by the tensor strategy's `prepare`; expert
        parallelism's expert-tensor term reads it)."""
        self._terms: dict[type, Any] = {}

    def _scores_bytes(self) -> float:
        """16-bit bytes per token per block of an unfused attention core's s x s tensors (0: fused)."""
        prof = self.profile
        if not getattr(prof, "unfused_attention", False):
            return 0.0
        if getattr(prof, "source", "analytic") != "measured":
            return 5.0 * prof.num_heads * self.s
        return 0.0 if self.cpu else prof.act_bytes_per_token_block_scores

    def _attention_speed(self) -> float:
        """FLOP/s of the attention core (the cost model's 12 h s per token per block): as the probe
        measured it on this device; an unfused core as its roofline (`unfused_attention_s`); a fused
        kernel at its published speed for the device's generation, head dimension and sequence
        (`attention_efficiency`, `CostConstants.attention_kernel`); else (a CPU, an unlisted
        device, a model without attention) at the GEMMs' speed."""
        prof = self.profile
        if not prof.num_heads:
            return self.speed
        head_dim = self.h / prof.num_heads
        measured = self.dev.attention_speed(self.compute_dtype, head_dim, self.s)
        if measured:
            return measured
        if self.cpu:
            return self.speed
        if getattr(prof, "unfused_attention", False):
            t = unfused_attention_s(self.h, prof.num_heads, self.s, self.speed, self.dev.memory_bandwidth, self.act_b)
            return 3.0 * self.attn_fwd / t
        eff = attention_efficiency(self.dev.name, self.c.attention_kernel, head_dim, self.s)
        return self.peak * eff if eff else self.speed

    def keep(self, record: Any) -> bool:
        """Keep a strategy's per-plan record (what its `prepare` computed once), found by its type
        with `term`. Returns True: `prepare` ends with ``return step.keep(Record(...))``."""
        self._terms[type(record)] = record
        return True

    def term(self, kind: type[T]) -> T:
        """The per-plan record of type `kind` a strategy's `prepare` kept."""
        return self._terms[kind]

    def p_stage(self, load: RankLoad) -> float:
        """Parameters of pipeline rank `load` per TP rank (`_rank_params`)."""
        prof = self.profile
        return (_block_params(load, prof) + prof.params_embedding * load.embedding
                + prof.params_head * load.head) / self.plan.tp


@dataclass(frozen=True)
class StepCounts:
    """What one step dispatches on the busiest rank besides arithmetic (`dtorch.plan.cost.step_counts`)."""

    ops_per_microbatch: float
    """Operators of one micro-batch's forward, backward and recompute on the worst stage."""
    dtensor_ops_per_microbatch: float
    """Those of them that run on DTensors (all of them under tensor parallelism)."""
    optimizer_ops: float
    dtensor_optimizer_ops: float
    tp_small_per_microbatch: float = 0.0
    """Latency-bound TP collectives per micro-batch (the activation-sized ones are counted apart;
    filled by the tensor strategy's `counts`, like every field after this one)."""
    tp_small_per_step: float = 0.0


NO_COUNTS = StepCounts(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
"""Nothing dispatched: the search's lower bound leaves host overhead and small collectives out."""


def autocast_applies(plan: Any) -> bool:
    """The executor computes in param_dtype by autocast (not FSDP's parameter cast): no sharding and
    no FSDP-based replicate (`dtorch.parallel.model`)."""
    if plan.param_dtype == "float32" or plan.dp_shard * plan.cp > 1:
        return False
    # (with EP, replicas are FSDP2 units: `dtorch.parallel.expert.apply_fsdp_with_experts`)
    classic_ddp = plan.dp_replicate > 1 and plan.tp == 1 and plan.pp == 1 and plan.ep == 1
    return plan.dp_replicate == 1 or classic_ddp
