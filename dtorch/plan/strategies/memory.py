"""Memory policies: activation checkpointing (`ac`: none, selective, full) and offload (`offload`:
none; optimizer: optimizer states and fp32 master weights in host memory, the step on the CPU;
optimizer_nvme: the same with the optimizer states in files on a local disk; params: FSDP's CPU
offload of parameters, gradients and optimizer states).

Executor halves: `dtorch.parallel.ac` (checkpoint wrappers per block), `dtorch.train.offload`
(the host and NVMe optimizer tiers, docs/memory-tiers.md) and `dtorch.parallel.fsdp` (CPUOffloadPolicy).

Time: full AC repeats each block's forward, 1/3 of its training FLOPs (Korthikanti et al. 2022);
selective AC (DTorch's own policy, `dtorch.parallel.ac`) keeps the outputs of matmuls and of the
attention kernel and re-runs the block's element-wise forward; the published runs' policies
(Korthikanti's attention core, 4 h s per token per block; torchtitan's every second matmul) are
priced when the calibration names them (`StepShape.selective`). The optimizer tiers (`tier_terms`)
copy the float32 gradients down and the float32 weights back up the host link and run torch's CPU
AdamW at the rate `dtorch probe` measured (`host_adam_rate`); the NVMe tier also reads and writes
the states on the node's disk (shared by its ranks), overlapped with the CPU step. Where the
executor steps blocks during the backward (`step_overlaps_backward`: no gradient clipping, FSDP or
one rank) an accelerator's backward of the last micro-batch hides that work up to the last block;
a CPU's does not (the same cores: measured, the backward grows by what the worker does). With parameters offloaded every gather and
reduction crosses the host link too. Memory: activations per block by policy from
the profile (Korthikanti Table 2 shapes); full AC re-materialises one block during its backward.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from dtorch.errors import choices
from dtorch.model.analytic import loss_chunk_rows
from dtorch.plan.step import RankMemory, StepShape
from dtorch.plan.strategies.base import Dims, Field, RankLoad, RankShare, Strategy, Violation

AC_POLICIES = ("none", "selective", "full")
OFFLOAD_POLICIES = ("none", "optimizer", "optimizer_nvme", "params")
"""In the order the search tries them, each only where the one before fits nothing: the host tier
saves the optimizer states' device memory (8 B/param), the NVMe tier the same device memory and most
of the host memory the host tier needs, FSDP's CPU offload also the parameters and gradients."""
OPTIMIZER_TIERS = ("optimizer", "optimizer_nvme")
"""The plan values `dtorch.train.offload` applies (host tier, NVMe tier)."""
STATE_BYTES = 8.0
"""AdamW's two float32 moments per parameter (what the tiers take off the device)."""
MASTER_BYTES = 4.0
"""The float32 master weights the tiers keep beside the state (host memory)."""
LADDER = [("none", False), ("none", True), ("selective", False), ("selective", True), ("full", False), ("full", True)]
"""(ac, reshard_after_forward) in order of cost: more recomputation or more traffic is never faster."""


SELECTIVE_POLICIES = ("matmuls_saved", "attention_core", "every_second_mm")
"""What selective activation checkpointing recomputes (see `Memory.recompute`). 'matmuls_saved' is DTorch's
own (`dtorch.parallel.ac`): the outputs of matmuls and of the attention kernel are kept, every other
op of the block is re-run in backward. The other two describe published runs (calibration rows)."""

_LINEAR_ROLES = ("colwise", "rowwise")


def _saved_ops_per_block(profile: Any) -> int:
    """Operators per block whose outputs DTorch's selective checkpointing keeps (not re-run): one per
    linear layer (the profile's colwise/rowwise roles; Llama 7, GPT 6) and the attention kernel."""
    linears = sum(1 for role in profile.tp_roles.values() if role in _LINEAR_ROLES)
    if not linears:
        linears = {"llama": 7, "gpt": 6}.get(profile.family, 0)
    return linears + 1 if linears else 0


def recompute_ops_per_block(profile: Any, ac: str, selective: str, c: Any) -> float:
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


def matmuls_saved_act_bytes(profile: Any) -> float:
    """Activation bytes per token per block (16-bit) that DTorch's selective checkpointing keeps:
    the block input, the output of every linear layer and of the attention kernel (its output and a
    float32 log-sum-exp per head); norms, RoPE, activations and residual adds are recomputed.
    Llama: x h, q/k/v q + 2 kv, attention out q, o h, w1/w3 2 f, w2 h (q = h for every preset, kv =
    h kv_heads / heads). GPT: x h, q/k/v 3 h, attention out h, o h, w1 f, w2 h. Measured profiles and
    other modules: the profiler's measurement with the same op list
    (`act_bytes_per_token_block['selective']`: a model's own attention may save more, e.g. the math
    kernel's matmul outputs)."""
    if measured_selective(profile):
        return profile.act_bytes_per_token_block["selective"]
    h, f, a = float(profile.hidden), float(profile.ffn_hidden), float(profile.num_heads)
    kv = h * profile.num_kv_heads / profile.num_heads if profile.num_heads else 0.0  # (0: no attention)
    lse = 4.0 * a
    if profile.family == "llama":
        return 2.0 * (3 * h + 2 * h + 2 * kv + 2 * f) + lse
    if profile.family == "gpt":
        return 2.0 * (7 * h + f) + lse
    per_tok = profile.act_bytes_per_token_block
    return per_tok.get("selective", per_tok.get("none", 34.0 * h))


def measured_selective(profile: Any) -> bool:
    """Whether the profile measured what DTorch's selective policy keeps (`source` 'measured', with a
    'selective' figure): then that figure, its float32 share and its TP split are the model's own."""
    return getattr(profile, "source", "") == "measured" and "selective" in profile.act_bytes_per_token_block


def act_float32_bytes(profile: Any, ac: str, selective: str = "matmuls_saved") -> float:
    """Of `act_bytes_per_token_block` (16-bit), the bytes the model keeps in float32 whatever the
    compute dtype (`act_bytes_float32_per_token_block`: an explicit upcast, a math attention kernel's
    scores and softmax), which do not widen with it. Measured profiles only (analytic ones: none), and
    for DTorch's selective policy only where its figure is the measured one (`measured_selective`)."""
    f32 = getattr(profile, "act_bytes_float32_per_token_block", None) or {}
    if ac == "selective" and selective == "matmuls_saved" and not measured_selective(profile):
        return 0.0
    return min(f32.get(ac, 0.0), act_bytes_per_token_block(profile, ac, selective))


def at_compute_dtype(step: StepShape, total: float, float32: float) -> float:
    """16-bit profile bytes `total`, of which `float32` are float32 whatever the compute dtype, at the
    step's compute dtype: the float32 share as is, the rest x `act_scale`."""
    return float32 + (total - float32) * step.act_scale


def act_bytes_per_token_block(profile: Any, ac: str, selective: str = "matmuls_saved") -> float:
    """Activation bytes per token per block (16-bit) a block keeps for backward under `ac`."""
    per_tok = profile.act_bytes_per_token_block
    a_none = per_tok.get("none", 34.0 * profile.hidden)
    if ac == "selective" and selective == "matmuls_saved":
        return matmuls_saved_act_bytes(profile)
    return per_tok.get(ac, a_none)


TP_FAMILIES = ("llama", "gpt", "moe")
"""DTorch's own block families, whose saved tensors `tp_split_bytes` and `tp_partial_sum_bytes` count."""


def tp_split_bytes(profile: Any, ac: str) -> float:
    """16-bit bytes per token per block, of what a block keeps under `ac` (`act_bytes_per_token_block`),
    that tensor parallelism splits over its ranks by heads or hidden units: the tensors between a
    column-wise and a row-wise linear. The attention's q, k, v (after RoPE, or the linears' outputs
    under selective AC), its output and log-sum-exp; the feed-forward's column-wise outputs and,
    without AC, their element-wise products (SwiGLU: silu out and product; GeLU: its output); a MoE
    block's shared and routed experts' the same way (`dtorch.parallel.expert` splits each expert's
    hidden units over tp). Under full AC, none (the block input). For DTorch's families
    (`TP_FAMILIES`: `matmuls_saved_act_bytes`, `dtorch.model.analytic`); other profiles
    (published shapes without module roles, profiled modules) as Korthikanti et al. 2022, Table 2
    ("TP only"): of a GPT block's 34 h + 5 a s bytes, all but 10 h (norm inputs, attention and MLP
    inputs, dropout masks). A measured profile's own split where it has one
    (`act_bytes_tp_split_per_token_block`: the block measured as a TP rank runs it)."""
    h, per_tok = float(profile.hidden), profile.act_bytes_per_token_block
    total = per_tok.get(ac, per_tok.get("none", 34.0 * h))
    if ac == "full":
        return 0.0
    measured = _measured_split(profile, ac)
    if measured is not None:
        return min(total, measured[0])
    fam, f, a = profile.family, float(profile.ffn_hidden), float(profile.num_heads)
    if fam not in TP_FAMILIES:
        return max(0.0, total - 10.0 * h)
    kv = h * profile.num_kv_heads / profile.num_heads if profile.num_heads else 0.0
    attention = 2.0 * (2.0 * h + 2.0 * kv) + 4.0 * a if profile.num_heads else 0.0
    kept = 1.0 if ac == "selective" else 2.0  # f-wide tensors kept per column-wise output
    if fam == "llama":
        ffn = 2.0 * kept * 2.0 * f
    elif fam == "gpt":
        ffn = 2.0 * kept * f
    else:
        ffn = 2.0 * kept * 2.0 * (profile.num_shared_experts + profile.experts_per_token) * profile.expert_hidden
    return min(total, attention + ffn)


def _measured_split(profile: Any, ac: str) -> tuple[float, float] | None:
    """(16-bit bytes per token per block TP splits, their float32 share) as the profile measured them
    for `ac`, or None (analytic profiles; no measurement for `ac`)."""
    if getattr(profile, "source", "") != "measured":
        return None
    split = getattr(profile, "act_bytes_tp_split_per_token_block", None) or {}
    if ac not in split:
        return None
    f32 = getattr(profile, "act_bytes_float32_tp_split_per_token_block", None) or {}
    return split[ac], min(split[ac], f32.get(ac, 0.0))


def tp_split_float32_bytes(profile: Any, ac: str) -> float:
    """Of `tp_split_bytes`, the bytes that are float32 whatever the compute dtype (measured splits
    only)."""
    measured = _measured_split(profile, ac) if ac != "full" else None
    return min(measured[1], tp_split_bytes(profile, ac)) if measured else 0.0


def tp_partial_sum_bytes(profile: Any, ac: str) -> float:
    """16-bit bytes per token per block, of what a block keeps under DTorch's selective AC without
    TP, that its policy does not keep under TP: the row-wise linears' outputs (attention
    out-projection, feed-forward down-projection; a MoE block's shared expert's and, per
    assignment, its routed experts'), which would be the partial sums each rank computes over the
    whole sequence before their all-reduce or reduce-scatter (`dtorch.parallel.ac` re-runs them;
    `Memory.recompute` prices it). None for other policies or families."""
    if ac != "selective" or profile.family not in TP_FAMILIES:
        return 0.0
    h = 2.0 * profile.hidden
    if profile.family != "moe":
        return 2.0 * h
    return h * (1.0 + (1.0 if profile.num_shared_experts else 0.0) + profile.experts_per_token)


def tp_rank_bytes(step: StepShape, ac: str) -> float:
    """`block_act_bytes` on one TP rank: the split part (`tp_split_bytes`) over tp, no row-wise
    output (`tp_partial_sum_bytes`), the rest (the residual stream's side: norms' inputs and
    outputs, the block input) whole without SP and a sequence shard with it (what SP gathers whole
    beside is `sp_gathered_bytes`)."""
    a = block_act_bytes(step, ac)
    tp = step.plan.tp
    if tp == 1:
        return a
    prof = step.profile
    split = min(a, at_compute_dtype(step, tp_split_bytes(prof, ac), tp_split_float32_bytes(prof, ac)))
    rest = a - split - min(a - split, tp_partial_sum_bytes(step.profile, ac) * step.act_scale)
    return split / tp + (rest / tp if step.plan.sp else rest)


RMSNORM_FAMILIES = ("llama", "moe")
"""Model families whose norms are `nn.RMSNorm` (GPT's LayerNorm is one aten kernel on every device)."""


def composite_norm_bytes(profile: Any, in_b: float, cpu: bool) -> float:
    """Bytes per token one RMSNorm keeps beyond the fused kernel's input and statistics (what the
    profile counts): none on an accelerator; on a CPU torch 2.13 runs RMSNorm as composite operators
    that keep the input upcast to float32 (4h; none when the input, `in_b` bytes wide, is float32
    already: the same tensor) and the normalised product in the input's dtype (`in_b` h) for the
    weight's multiply. None either where the profile measured the model's own norms as they run
    (`composite_norms_measured`: counted there already)."""
    if not cpu or profile.family not in RMSNORM_FAMILIES or getattr(profile, "composite_norms_measured", False):
        return 0.0
    return profile.hidden * ((4.0 if in_b < 4 else 0.0) + in_b)


NORM_CONSUMERS = {"llama": (3, 2), "gpt": (3, 1)}
"""Linear layers reading the attention norm's and the feed-forward norm's output (q, k, v; SwiGLU's
w1 and w3, GeLU's w1), where the profile does not name them (`norm_consumers`)."""


def norm_consumers(profile: Any) -> tuple[int, int]:
    """(linears reading the attention norm's output, those reading the feed-forward norm's): the
    profile's column-wise layers under `attention.` and `feed_forward.`, else `NORM_CONSUMERS` by
    family, else one each. (A MoE block's router and routed experts are not counted.)"""
    roles = getattr(profile, "tp_roles", None) or {}
    attn = sum(1 for k, r in roles.items() if r == "colwise" and k.startswith("attention."))
    ffn = sum(1 for k, r in roles.items() if r == "colwise" and k.startswith("feed_forward."))
    if attn and ffn:
        return attn, ffn
    return NORM_CONSUMERS.get(profile.family, (1, 1))


def autocast_block_bytes(step: StepShape, ac: str) -> float:
    """Bytes per token per block on one TP rank that autocast over float32 masters keeps beyond
    `block_act_bytes` (none without autocast: FSDP's casts leave every activation in param_dtype).
    Autocast casts only the ops on its lists: the embedding and the residual adds keep the masters'
    float32, so each norm's input (the block's input under selective or full AC) is `resid_b` wide,
    and the norms' outputs stay float32 (the input's dtype; CUDA's autocast also lists the norms
    as float32 ops); each linear that reads a norm's output casts it to the compute dtype itself
    (autocast's cast cache keeps only the parameters' casts), and saves its own copy for its
    weight gradient: one per consumer (`norm_consumers`), not one per norm, each whole over TP
    (the input is replicated, or gathered under SP). The norms' own tensors are sharded over TP
    with SP only."""
    if not step.autocast:
        return 0.0
    plan, h = step.plan, step.h
    norm_share = 1.0 / plan.tp if plan.sp else 1.0
    wider = (step.resid_b - step.act_b) * h * norm_share
    if ac != "none":
        return wider
    attn, ffn = norm_consumers(step.profile)
    return 2.0 * wider + (attn + ffn - 2) * step.act_b * h


def block_act_bytes(step: StepShape, ac: str) -> float:
    """Bytes per token per block (compute dtype, full over TP and CP) a block keeps for backward
    under `ac`: the profile's 16-bit figure at the compute dtype's width (its float32 share as is:
    `act_float32_bytes`), plus on a CPU what the composite norms keep (two per block, kept unless the
    policy re-runs them)."""
    prof = step.profile
    a = at_compute_dtype(step, act_bytes_per_token_block(prof, ac, step.selective),
                         act_float32_bytes(prof, ac, step.selective))
    if ac == "none":
        a += 2 * composite_norm_bytes(step.profile, step.resid_b, step.cpu)
    return a


def regathers(plan: Any) -> bool:
    """Whether sequence parallelism keeps only each rank's shard of the inputs it all-gathers for
    the column-wise layers and gathers them again in the backward (Megatron-LM's way;
    `dtorch.parallel.tp._Regather`): without activation checkpointing (whose re-run gathers them
    anyway) and without torch.compile (which would trace the saved-tensor hooks). Else the
    column-wise layers keep the gathered input, whole on every TP rank."""
    return bool(plan.sp) and plan.tp > 1 and plan.ac == "none" and not getattr(plan, "compile", False)


def sp_gathered_bytes(step: StepShape, ac: str) -> float:
    """Bytes per token per block that sequence parallelism keeps whole on every TP rank: the executor
    all-gathers the attention's and the feed-forward's input on entry (`dtorch.parallel.tp`,
    `gather_sequence_on_entry`) and their column-wise linears save that gathered input for the
    weight gradient (Megatron re-gathers it in backward instead). Beyond the 1/tp share the profile's
    norm outputs already count: 2 h (1 - 1/tp) at the compute dtype. Not kept where the policy
    re-runs the gathers in backward (selective, full), nor where the executor gathers them again in
    the backward instead (`regathers`: no AC, not compiled)."""
    plan = step.plan
    if not plan.sp or plan.tp == 1 or ac != "none" or regathers(plan):
        return 0.0
    return 2.0 * step.h * step.act_b * (1.0 - 1.0 / plan.tp)


def chunked_loss(step: StepShape) -> bool:
    """Whether the loss runs as `dtorch.model.loss.cross_entropy` (keeping the logits in the compute
    dtype, the softmax recomputed in float32 chunks in its backward): everywhere but under TP, whose
    vocabulary-sharded logits go through torch's `loss_parallel` cross entropy, which keeps float32
    log-probabilities (`dtorch.train.losses.next_token`)."""
    return step.plan.tp == 1


def head_act_bytes(step: StepShape) -> float:
    """Bytes per token the head keeps for backward at the compute dtype: of the profile's 16-bit
    figure (`dtorch.model.analytic.head_act_bytes`) the two h-wide tensors (the final norm's input,
    the output projection's input: 4 h at 16 bits) follow the step's widths, the norm's input the
    residual stream's (`resid_b`: float32 under autocast), the projection's input the compute
    dtype's; the logits the loss keeps (2 V at 16 bits) the compute dtype's, or under TP the float32
    log-probabilities torch's loss keeps instead (4 V, `chunked_loss`); the norm's float32
    statistics and the token ids as they are."""
    prof = step.profile
    total = prof.act_bytes_per_token_head
    scaled = min(total, 4.0 * prof.hidden)
    logits = min(total - scaled, 2.0 * prof.vocab_size)
    kept = logits * step.act_b / 2.0 if chunked_loss(step) else 2.0 * logits
    return total - scaled - logits + scaled * (step.resid_b + step.act_b) / 4.0 + kept


def cp_gathered_bytes(step: StepShape, ac: str) -> float:
    """Bytes per local token per block that all-gather context parallelism keeps beyond the local
    K and V the profile counts: the executor gathers the whole sequence's K and V
    (`dtorch.parallel.cp`, `_gathered`) and the attention kernel saves them for its backward,
    (cp - 1) x 2 kv per local token (kv heads split over tp). The ring keeps only its local K/V
    (one block in flight is transient); a policy that re-runs the gather in backward keeps none."""
    plan, prof = step.plan, step.profile
    if plan.cp == 1 or getattr(plan, "cp_attention", "allgather") != "allgather" or ac != "none" or not prof.num_heads:
        return 0.0
    kv = prof.hidden * prof.num_kv_heads / prof.num_heads
    return (plan.cp - 1) * 2.0 * kv * step.act_b / plan.tp


def rank_activations(step: StepShape, load: RankLoad, in_flight: float) -> float:
    """Activation bytes pipeline rank `load` holds at its peak: its blocks' saved activations for the
    `in_flight` micro-batches (`pipeline.activation_in_flight`), sharded by TP (all of them with SP,
    the split part without: `tp_rank_bytes`) and CP; under full AC one block re-materialised during
    its backward (under selective AC, what one block's re-run forward makes is part of the block's
    moment of the backward: `selective_recompute_bytes`); on the last stage the head's (final norm, logits and loss) for every micro-batch in flight, and
    under a pipeline their logits, which the stage keeps as its output."""
    plan, prof = step.plan, step.profile
    per_token = (tp_rank_bytes(step, plan.ac) + sp_gathered_bytes(step, plan.ac)
                 + cp_gathered_bytes(step, plan.ac) + autocast_block_bytes(step, plan.ac))
    acts = per_token * step.rows * load.blocks * in_flight
    if plan.ac == "full" and not block_moment_applies(step):
        acts += recomputed_block_bytes(step)  # (else priced at its own moment: `full_ac_peak`)
    head = head_saved_bytes(step, load)
    if load.head:
        acts += head * in_flight
        if plan.pp > 1 and not chunked_loss(step):
            # torch's pipeline stage keeps each micro-batch's output (the logits, compute dtype) for
            # its backward (`fwd_cache`), beside TP's float32 log-probabilities (the chunked loss
            # keeps that output itself: counted in the head's bytes)
            acts += step.act_b * prof.vocab_size * step.rows / plan.tp * in_flight
    else:
        # a first or middle pipeline stage: what it holds outside its blocks (`held_bytes`: a conv
        # stem's input, its last block's output), and on the first stage of a language model the
        # embedding's output, the first block's input (which the head's bytes stand for where one
        # rank holds both ends of the model), residual-stream wide
        first = step.h * step.resid_b * step.rows if load.embedding and prof.input_kind == "tokens" else 0.0
        acts += (first + held_bytes(step, before=load.embedding, output=load.blocks > 0)) * in_flight
    acts += sp_embedding_bytes(step, load) * in_flight
    return acts + backward_working_set(step, load, head_freed_bytes(step, load))


def sp_embedding_bytes(step: StepShape, load: RankLoad) -> float:
    """Bytes the first block's input keeps beyond its sequence shard under SP, on the rank holding
    the embedding: the vocabulary-parallel embedding's output is all-reduced whole and each rank's
    shard is a view of it, so the whole sequence stays alive while the block keeps its input
    (residual-stream wide)."""
    plan = step.plan
    if not (load.embedding and load.blocks and plan.sp and plan.tp > 1):
        return 0.0
    return step.h * step.resid_b * step.rows * (1.0 - 1.0 / plan.tp)


def root_unit_params(step: StepShape, load: RankLoad) -> float:
    """Parameters of the root unit (embedding, final norm, head) on rank `load`, one TP shard of them:
    what FSDP keeps gathered beside the blocks, and whose unsharded gradients it holds after the head's
    backward."""
    prof = step.profile
    return (prof.params_embedding * load.embedding + prof.params_head * load.head) / step.plan.tp


def head_saved_bytes(step: StepShape, load: RankLoad) -> float:
    """Bytes one micro-batch's head (final norm, logits, loss) keeps for backward on rank `load`:
    under a pipeline the last stage's, without what the model saves before its first block."""
    if not load.head:
        return 0.0
    prof = step.profile
    before = held_bytes(step, before=not load.embedding, output=False)
    return max(0.0, (head_act_bytes(step) + composite_norm_bytes(prof, step.resid_b, step.cpu)) * step.rows
               / step.plan.tp - before)


def held_bytes(step: StepShape, *, before: bool, output: bool) -> float:
    """Bytes one micro-batch keeps outside the blocks through the blocks' backward (the profile's
    16-bit figures at the compute dtype): with `before`, what the model saves before its first block
    (`act_bytes_per_token_before_blocks`: on the rank holding it), with `output` the last block's
    output its own op keeps (`act_bytes_per_token_last_block_output`: on every rank with blocks)."""
    prof = step.profile
    per_token = ((prof.act_bytes_per_token_before_blocks if before else 0.0)
                 + (prof.act_bytes_per_token_last_block_output if output else 0.0))
    return per_token * step.act_scale * step.rows / step.plan.tp


def head_freed_bytes(step: StepShape, load: RankLoad) -> float:
    """Of `head_saved_bytes`, what is freed before the blocks' backward: all but `held_bytes` and,
    under a pipeline, the logits the chunked loss kept, which are the stage's output: torch's stage
    holds its output until the stage's backward ends."""
    if not load.head:
        return 0.0
    output = step.act_b * step.profile.vocab_size * step.rows if step.plan.pp > 1 and chunked_loss(step) else 0.0
    return max(0.0, head_saved_bytes(step, load) - output
               - held_bytes(step, before=load.embedding, output=load.blocks > 0))


GATED_FAMILIES = ("llama", "moe")
"""Families whose feed-forward is SwiGLU (w1 and w3 out, silu out, their product: f wide each)."""


def backward_working_set(step: StepShape, load: RankLoad, head_saved: float) -> float:
    """Bytes the backward holds beyond the saved activations at the rank's peak, the larger of two
    moments of the last micro-batch's backward: the loss's (on the last stage, `loss_working_set`:
    the logits' gradient and one float32 chunk of the softmax; under TP torch's float32 gradients,
    vocabulary-parallel), and the first block's (`block_working_set`, and under FSDP the
    all-gather output of the block it prefetches for the backward next: `prefetch_bytes`), once the
    head's saved activations (`head_saved`) are freed. The two are compared with what else the rank
    holds at each. For a MoE model (`block_moment_states`): under FSDP the first block's moment also
    holds the gathered block and the root unit's parameters and gradients; at the head, `loss_side`,
    the output projection's backward holds the root unit gathered, the loss's nothing: its
    first block's working set is small beside the loss's, yet that moment is the fuller one
    (measured). For a dense model (`dense_root_grads`, `block_moment_grads`): the block's moment also
    holds the root unit's unsharded gradients under FSDP, or without sharding the head's and the
    down-projection's; both hold the root unit and one block gathered (FSDP keeps the last block
    gathered after the forward), measured at the loss's backward."""
    loss = loss_working_set(step, load)
    if not load.blocks:
        return loss
    block = block_moment_bytes(step, load)
    states = block_moment_states(step, load) if step.profile.num_experts else 0.0
    if states:
        loss, weighed = loss_side(step, load)
        return loss if weighed > block - head_saved + states else block - head_saved
    grads = dense_root_grads(step, load) + block_moment_grads(step, load)
    return loss if loss > block - head_saved + grads else block - head_saved


def dense_root_grads(step: StepShape, load: RankLoad) -> float:
    """Bytes of the root unit's (embedding, final norm, head) unsharded gradients a dense FSDP rank
    holds at its first block's moment of the backward and not at the loss's: one stage, resharding,
    no ZeRO (`FSDP.rank_memory`); none for a MoE model (`block_moment_states`) or otherwise, nor
    under full AC, whose peak is a block's re-run later in the backward, after the root unit's
    gradients exist (`full_ac_peak`)."""
    plan, prof = step.plan, step.profile
    if (prof.num_experts or step.fs == 1 or getattr(plan, "zero", 0) or plan.pp > 1 or plan.ac == "full"
            or not (plan.reshard_after_forward or plan.offload == "params")):
        return 0.0
    return root_unit_params(step, load) * step.param_b


def dense_loss_moment_peaks(step: StepShape, load: RankLoad) -> bool:
    """Whether a dense FSDP rank's peak is the loss's moment (`backward_working_set`), where it holds
    none of the root unit's gradients (`dense_root_grads`)."""
    grads = dense_root_grads(step, load)
    if not (grads and load.head and load.blocks):
        return False
    return loss_working_set(step, load) > block_moment_bytes(step, load) - head_freed_bytes(step, load) + grads


def loss_side(step: StepShape, load: RankLoad) -> tuple[float, float]:
    """(activation bytes beyond the saved ones, those plus the states it holds beyond the shards) of
    the fuller of the last stage's two moments at the head, where FSDP reshards
    (`block_moment_states`): the log-softmax's backward (`loss_working_set`; the root unit still a
    shard, since the loss is outside the model and FSDP's root re-gathers at the logits' gradient),
    and the output projection's backward (`head_backward_bytes`, with the root unit gathered)."""
    loss = loss_working_set(step, load)
    root = root_unit_params(step, load) * step.param_b
    head = head_backward_bytes(step, load)
    return (head, head + root) if head + root > loss else (loss, loss)


def head_backward_bytes(step: StepShape, load: RankLoad) -> float:
    """Bytes beyond the saved activations at the output projection's backward on an FSDP rank that
    re-gathers the root unit for it: what the loss kept freed (`head_act_bytes`: the logits, or under
    TP the float32 log-probabilities), the logits' gradient in the compute dtype, the projection's unsharded weight gradient before its reduce-scatter
    (param dtype: a working tensor, MemTracker's TEMP), its input gradient (h) and the all-gather
    output of the last block, which FSDP prefetches for the backward next (`prefetch_bytes`)."""
    if not load.head:
        return 0.0
    plan, prof = step.plan, step.profile
    v = prof.vocab_size / plan.tp
    freed = step.act_b if chunked_loss(step) else 4.0
    out = ((step.act_b - freed) * v + step.h * step.act_b) * step.rows + v * step.h * step.param_b
    return out + (prefetch_bytes(step) if load.blocks else 0.0)


def loss_working_set(step: StepShape, load: RankLoad) -> float:
    """The loss's moment of `backward_working_set` (see there); none off the last stage."""
    if not load.head:
        return 0.0
    v = step.profile.vocab_size
    if chunked_loss(step):
        # the logits' gradient (compute dtype) and, for 16-bit logits, one float32 chunk of the
        # softmax being formed (float32 logits' chunks are formed in the gradient itself)
        chunk = 4.0 * v * min(step.rows, loss_chunk_rows(v)) if step.act_b < 4.0 else 0.0
        return step.act_b * v * step.rows + chunk
    # torch's loss_parallel: the float32 gradients of the log-probabilities and of the upcast logits,
    # and exp(log-probabilities), of V/tp each
    return 12.0 * v * step.rows / step.plan.tp


def block_moment_bytes(step: StepShape, load: RankLoad) -> float:
    """The first block's moment of `backward_working_set`: its working set net of what it freed,
    what selective AC's re-run forward of it made (`selective_recompute_bytes`), and FSDP's
    prefetch of the block next."""
    return (block_working_set(step, net=True, load=load) + selective_recompute_bytes(step)
            + (prefetch_bytes(step) if load.blocks > 1 else 0.0))


def selective_recompute_bytes(step: StepShape) -> float:
    """Bytes selective AC's re-run forward of the block in backward makes beside what the policy
    kept (its norms, RoPE, element-wise products; under SP the re-gathered inputs of the column-wise
    linears; under autocast the casts of the norms' outputs), on one TP rank. Alive only during that block's backward: the block's moment, not the loss's."""
    plan = step.plan
    if plan.ac != "selective":
        return 0.0
    remade = (tp_rank_bytes(step, "none") + sp_gathered_bytes(step, "none") - tp_rank_bytes(step, "selective")
              + autocast_block_bytes(step, "none") - autocast_block_bytes(step, "selective"))
    # beside them, what the policy's cache does not free by then: the re-run stops at the last tensor
    # the backward needs (the down-projection's input), so the down-projection's cached output (h;
    # not cached under TP) stays until the block's backward ends; and the residual stream's
    # gradient (h, a sequence shard under SP), which no kept block output offsets (the policy
    # keeps none)
    kept = (step.h * step.act_b if plan.tp == 1 else 0.0) + step.h * step.resid_b / (plan.tp if plan.sp else 1)
    return (remade + kept) * step.rows


def loss_moment_peaks(step: StepShape, load: RankLoad) -> bool:
    """Whether a MoE rank's peak is the loss's moment, where `backward_working_set` weighs the two
    moments with the states FSDP holds only at the block's (`block_moment_states`): there FSDP
    holds the root unit gathered for the head's backward and neither the re-gathered block nor the
    root's gradients (`FSDP.rank_memory`). False for dense models (priced at the block's states)."""
    if not (step.profile.num_experts and load.head and load.blocks):
        return False
    states = block_moment_states(step, load)
    head = head_freed_bytes(step, load)
    return bool(states) and loss_side(step, load)[1] > block_moment_bytes(step, load) - head + states


def block_moment_states(step: StepShape, load: RankLoad) -> float:
    """Model-state bytes the rank holds at its first block's backward and not at the loss's, where
    FSDP prices the states at that block's re-gather (`FSDP.rank_memory`: one pipeline stage,
    resharding, no ZeRO): the re-gathered block and the root unit (embedding, final norm, head:
    re-gathered for its backward, measured), and the root unit's unsharded gradients."""
    plan, prof = step.plan, step.profile
    if step.fs == 1 or getattr(plan, "zero", 0) or plan.pp > 1 or not (plan.reshard_after_forward
                                                                         or plan.offload == "params"):
        return 0.0
    from dtorch.plan.strategies.expert import held_block_params

    root = root_unit_params(step, load)
    return (held_block_params(prof, plan) + 2.0 * root) * step.param_b


def prefetch_bytes(step: StepShape) -> float:
    """Bytes of the flat all-gather output FSDP holds for the block it prefetches while one block's
    backward runs (param dtype; MemTracker: a temporary), where it re-gathers blocks for the backward
    (resharding after forward). None without sharding, without resharding or under ZeRO (the
    parameters stay gathered). Under EP the routed experts are an FSDP unit of their own, which
    FSDP2 prefetches only once the block's backward has begun (after the block's unit in reverse
    forward order): the block's prefetch is its unit without them, whatever their shard group."""
    plan, prof = step.plan, step.profile
    if step.fs == 1 or not plan.reshard_after_forward or getattr(plan, "zero", 0) or plan.offload == "params":
        return 0.0
    from dtorch.plan.strategies.expert import expert_params_per_block, gathered_block_params

    p = gathered_block_params(prof, plan)
    if plan.ep > 1 and prof.num_experts:
        p -= expert_params_per_block(prof) / plan.ep / plan.tp
    return p * step.param_b


def block_working_set(step: StepShape, net: bool = False, load: RankLoad | None = None) -> float:
    """Bytes a block's backward holds beyond its saved activations at its fullest, inside the
    feed-forward's backward: the gradients of the f-wide tensors autograd holds at once (f/tp each;
    SwiGLU: those of the silu output and of w3's output beside the one the silu's backward makes,
    three; GeLU: the activation's and the one its backward makes, two) and the residual stream's
    (h wide, sharded with SP). `net`: less what the backward has freed of the block's saved tensors
    by then (the product w2 kept as its input, f wide, and the block's output, h wide), which is
    what the peak holds beyond the saved activations. A MoE block (the last block of `load`, or of
    any stage of a MoE model without `load`): `moe_block_working_set`. Measured per module with
    MemTracker (tests/plan/test_memory_categories.py)."""
    plan, prof = step.plan, step.profile
    if prof.num_experts and (load is None or load.blocks > load.dense_blocks):
        return moe_block_working_set(step, net)
    measured = getattr(prof, "backward_working_bytes_per_token_block", 0.0)
    if net and measured:
        # a measured profile: the block's backward as it ran on the fake tensors (its activation
        # function's own temporaries included: a composite GELU holds more than two), split by TP
        return measured * step.act_scale * step.rows / plan.tp
    if not prof.ffn_hidden:
        # a block with no feed-forward DTorch can see (a user's conv block, ...): at its last op's
        # backward autograd holds the gradient of the block's output and the one that op makes, h
        # wide each, and has freed none of the block's saved tensors yet (net or not: MemTracker
        # on tests/plan/_user_cnn.py, one process: two feature maps)
        return 2.0 * step.h * step.act_b * step.rows
    wide = 3.0 if prof.family in GATED_FAMILIES else 2.0
    h_share = 1.0 / plan.tp if plan.sp else 1.0
    if net:
        return (wide - 1.0) * prof.ffn_hidden / plan.tp * step.act_b * step.rows
    return (wide * prof.ffn_hidden / plan.tp * step.act_b + step.h * h_share * step.resid_b) * step.rows


EXPERT_GRAD_BUFFERS = 4.0 / 3.0
"""The routed experts' weight gradients autograd holds at once during their backward, in units of
the rank's local experts of one block: `GroupedExperts.compute` indexes the stacked w1, w2, w3 per
expert, so each expert's backward yields a zero-filled gradient of a whole stacked weight, which
autograd adds in place into the sum of the experts before: the three sums (1) and the new term of
one of them (1/3). (Under MemTracker autograd sums out of place, one more term: see
tests/plan/test_memory_categories.py.) With one local expert nothing is summed: 1."""


def moe_block_working_set(step: StepShape, net: bool = False) -> float:
    """`block_working_set` of a MoE block (`dtorch.models.moe.MoE` run by `dtorch.parallel.expert`):
    its fullest moment is inside the routed experts' backward, in the second local expert's (the
    only one's end where the rank holds one). Held then: the gradient of the experts' output rows
    in expert order (the rows the rank computes: its tokens x top_k, times `load_imbalance` under
    EP), the residual stream's and the MoE input's gradients (h wide: the shared experts' or the
    balance loss's backward ran first), the local experts' weight gradients (`EXPERT_GRAD_BUFFERS`;
    in param dtype where FSDP gathered the weights, else the float32 masters') and the first
    expert's input gradient (its share of the rows, h wide) while the others' run. `net`: less
    what the backward has freed of the block's saved tensors by then: the combine's output and
    the gate-weighted output (h wide per assignment), the shared experts' four f-wide tensors, and
    the first expert's four fe-wide ones. Measured with MemTracker
    (tests/plan/test_memory_categories.py)."""
    from dtorch.plan.strategies.expert import EXPERT, expert_params_per_block

    plan, prof = step.plan, step.profile
    h, act, tokens = step.h, step.act_b, step.rows
    assignments = tokens * prof.experts_per_token
    rows = assignments * (EXPERT.load_imbalance if plan.ep > 1 else 1.0)
    local_experts = prof.num_experts / plan.ep
    first = rows / local_experts if local_experts > 1 else 0.0  # the rows of the expert done
    sums = EXPERT_GRAD_BUFFERS if local_experts > 1 else 1.0
    grad_b = step.param_b if (step.fs > 1 or plan.ep > 1) and plan.offload != "params" else 4.0
    held = (rows * h + 2.0 * tokens * h + first * h) * act
    held += sums * expert_params_per_block(prof) / plan.ep / plan.tp * grad_b
    if not net:
        return held
    shared_f = prof.num_shared_experts * prof.expert_hidden / plan.tp
    freed = (2.0 * assignments * h + 4.0 * shared_f * tokens + 4.0 * first * prof.expert_hidden / plan.tp) * act
    return held - freed


def recomputed_block_bytes(step: StepShape) -> float:
    """Bytes of one block's activations re-made by full AC's recompute for its backward (its re-run
    gathers keep the whole input while the block's backward runs)."""
    return (tp_rank_bytes(step, "none") + sp_gathered_bytes(step, "none")
            + autocast_block_bytes(step, "none")) * step.rows


def block_moment_applies(step: StepShape) -> bool:
    """Whether full AC's peak is priced per moment of the backward (`full_ac_peak`): one pipeline
    stage, no ZeRO (a pipeline's in-flight micro-batches and ZeRO's held gradients are priced with
    the recomputed block beside everything else)."""
    return step.plan.ac == "full" and step.plan.pp == 1 and not getattr(step.plan, "zero", 0)


def full_ac_peak(step: StepShape, load: RankLoad, grads: float, acts: float,
                 held_grads: float = 0.0) -> tuple[float, float]:
    """(gradient bytes, activation bytes) at a full-AC rank's peak: the larger of `at_peak`'s
    (`grads`, `acts`: the loss's moment, with every block's input, the head's and the loss's working
    set, or the backward's end, with every gradient) and the moment
    inside the feed-forward's backward of a recomputed block late in the backward, where the
    gradients of the blocks done so far have accumulated. There the rank holds the inputs of the
    blocks not yet done, the recomputed block and its working set (`block_working_set`), the
    gradients of the done blocks (reduce-scattered: 4 B per parameter over the shard group; whole
    without sharding) and, under FSDP, the flat reduce-scatter input of the block before (reduce
    dtype) and the all-gather output of the block prefetched next (param dtype, resharding only);
    without sharding, the head's gradients and the block's own down-projection's
    (`block_moment_grads`).
    The last two blocks of the backward are the candidates (the last has one more block of
    gradients, no prefetch). `held_grads`: the gradients the strategies hold at every moment of the
    backward (FSDP's root unit's unsharded ones); with gradient accumulation every gradient is
    there already. Measured: tests/plan/test_memory_categories.py."""
    plan = step.plan
    n = load.blocks
    if not block_moment_applies(step) or n < 1:
        return grads, acts
    from dtorch.plan.strategies.expert import gathered_block_params

    p_block = gathered_block_params(step.profile, plan)
    saved_input = (tp_rank_bytes(step, "full") + autocast_block_bytes(step, "full")) * step.rows
    held = recomputed_block_bytes(step) + block_working_set(step, net=True)
    accumulating = plan.num_microbatches > 1
    base = grads if accumulating else held_grads + block_moment_grads(step, load)
    done_grad = 0.0 if accumulating else 4.0 * p_block / step.fs
    rs = p_block * step.red_b if step.fs > 1 and plan.offload != "params" else 0.0
    ag = prefetch_bytes(step)
    emb = sp_embedding_bytes(step, load)  # (the first block's input, done last)
    best = (grads, acts)
    for i in range(max(1, n - 1), n + 1):  # i-th block of the backward
        a = saved_input * (n - i + 1) + held + (rs if i > 1 else 0.0) + (ag if i < n else 0.0) + emb
        g = base + (i - 1) * done_grad
        if g + a > sum(best):
            best = (g, a)
    return best


def block_moment_grads(step: StepShape, load: RankLoad) -> float:
    """Gradient bytes a rank without sharding (no FSDP, no ZeRO) holds at its first block's moment
    of the backward, one micro-batch, no pipeline: the head's (output projection and final norm:
    made before any block's) and, inside a dense block's feed-forward backward, its down-projection's
    (the first weight gradient of the block), float32. FSDP's held ones are its own
    (`FSDP.rank_memory`)."""
    plan, prof = step.plan, step.profile
    if step.fs > 1 or getattr(plan, "zero", 0) or plan.offload == "params" or not load.blocks:
        return 0.0
    grads = prof.params_head * load.head
    if not (prof.num_experts and load.blocks > load.dense_blocks):
        grads += prof.hidden * prof.ffn_hidden
    return 4.0 * grads / plan.tp


def block_moment_peaks(step: StepShape, load: RankLoad) -> bool:
    """Whether the rank's peak is its first block's moment of the backward (`backward_working_set`)
    rather than the loss's (where no gradient exists yet) or the end of the forward."""
    if not load.blocks:
        return False
    block = block_moment_bytes(step, load)
    if not load.head:
        return block > 0.0
    head = head_freed_bytes(step, load)
    states = (block_moment_states(step, load) if step.profile.num_experts
              else dense_root_grads(step, load) + block_moment_grads(step, load))
    return loss_working_set(step, load) <= block - head + states and block > head


def at_peak(step: StepShape, grads: float, acts: float, in_flight: float = 1.0,
            load: RankLoad | None = None) -> tuple[float, float]:
    """(gradient bytes, activation bytes) that coexist at the rank's peak, `acts` being those of the
    `in_flight` micro-batches it holds at most. The optimizer leaves the gradients None
    (`zero_grad`), and a backward releases a micro-batch's activations as it makes the gradients.
    Where a backward runs before the rank holds its most micro-batches (accumulation without a
    pipeline; a pipeline rank with more micro-batches than it holds), every gradient is there at the
    peak. Else the peak is in the first backward, at its loss or, where that is fuller
    (`block_moment_peaks`), inside its first block (`block_moment_grads`: a pipeline's last stage
    under GPipe as well), or after the first backward (one micro-batch's activations fewer, every
    gradient), whichever is larger."""
    plan = step.plan
    m = plan.num_microbatches
    if (plan.pp == 1 and m > 1) or (plan.pp > 1 and m > in_flight):
        return grads, acts
    if (load is not None and not block_moment_applies(step) and block_moment_peaks(step, load)
            and acts >= grads):
        return block_moment_grads(step, load), acts
    after = acts * (in_flight - 1.0) / in_flight
    return (0.0, acts) if acts >= after + grads else (grads, after)


def model_buffer_bytes(profile: Any) -> float:
    """Bytes of the model's own buffers in one copy of it (every pipeline stage module keeps its
    own): the RoPE cosine and sine tables of the RMSNorm/RoPE families (float32, max_seq_len x
    head_dim / 2 each), replicated by every strategy."""
    if profile.family not in RMSNORM_FAMILIES or not profile.num_heads:
        return 0.0
    seq = profile.max_seq_len or profile.seq_len
    return 2.0 * seq * (profile.hidden / profile.num_heads) / 2.0 * 4.0


def every_second_matmul_params(profile: Any) -> float:
    """Weights per block of the matmuls an op-level policy that saves every matmul output except
    every second one (torchtitan's 'op' selective AC, counting per block in call order) recomputes.
    Llama calls q, k, v, o, w1, w3, w2: k, o and w3 are re-run. A GPT block calls qkv, proj, fc1,
    fc2: proj and fc2."""
    h, f = float(profile.hidden), float(profile.ffn_hidden)
    if profile.family == "llama":
        return h * h * profile.num_kv_heads / profile.num_heads + h * h + h * f
    return h * h + f * h


def rowwise_matmul_params(profile: Any) -> float:
    """Weights per block of the row-wise linear DTorch's selective policy re-runs under TP: the
    attention out-projection. The policy does not cache the down-projection's output either, but
    the re-run stops at the last tensor the backward needs (torch's early stop), which is the
    down-projection's input, so that matmul never runs twice."""
    h = float(profile.hidden)
    return h * h


class Memory(Strategy):
    name = "memory"
    executor = "dtorch.parallel.ac"
    fields = (
        Field("ac", "choice", AC_POLICIES, aliases=("recompute", "activation_checkpointing"),
              value_aliases=(("off", "none"), ("false", "none"))),
        Field("offload", "choice", OFFLOAD_POLICIES),
    )

    def rules(self, plan: Any, dims: Dims | None) -> Iterator[Violation]:
        if plan.ac not in AC_POLICIES:
            yield Violation("ac", plan.ac, choices(AC_POLICIES))
        if plan.offload not in OFFLOAD_POLICIES:
            yield Violation("offload", plan.offload, choices(OFFLOAD_POLICIES))

    def describe(self, plan: Any):
        if plan.ac != "none":
            yield 30, f"ac={plan.ac}"
        if plan.offload != "none":
            yield 40, f"offload={plan.offload}"

    # ---- search candidates ---------------------------------------------------------------------
    def offloads(self, dp_shard: int, fixed: dict[str, Any]) -> list[str]:
        """Offload levels to try, in order (each only where the one before fits nothing)."""
        out = [fixed["offload"]] if "offload" in fixed else list(OFFLOAD_POLICIES)
        if dp_shard == 1 and "offload" not in fixed:
            out.remove("params")  # CPU offload of parameters is an FSDP feature
        return out

    def rungs(self, dp_shard: int, fixed: dict[str, Any]) -> list[tuple[str, bool]]:
        """The checkpointing/resharding ladder for a mesh, cheapest first."""
        out = []
        for ac, reshard in LADDER:
            if "ac" in fixed and fixed["ac"] != ac:
                continue
            if dp_shard == 1 or fixed.get("zero"):
                if reshard:
                    continue  # nothing to reshard without FSDP; ZeRO-1/2 never reshard within a step
            elif "reshard_after_forward" in fixed and fixed["reshard_after_forward"] != reshard:
                continue
            out.append((ac, reshard))
        return out

    # ---- time and memory -----------------------------------------------------------------------
    def work(self, step: StepShape, load: RankLoad, r: RankShare, flops_mb: float) -> None:
        if step.plan.ac != "none":
            self.recompute(step, load, r, flops_mb)

    def recompute(self, step: StepShape, load: RankLoad, r: RankShare, flops_mb: float) -> None:
        """Seconds of recomputation per micro-batch (after `r.compute` is known)."""
        plan = step.plan
        div = plan.tp * plan.cp
        # the blocks' element-wise forward: a third of their forward + backward element-wise work
        elem_fwd = step.tokens_mb * load.blocks * step.a_none / div * step.elem_s_per_byte / 3.0
        if plan.ac == "full":
            rec_flops = step.tokens_mb * load.blocks * step.block_flops / 3.0 / div
            r.recompute = r.compute * (rec_flops / flops_mb) if flops_mb else 0.0
        elif step.selective == "matmuls_saved":
            # DTorch's policy (dtorch/parallel/ac.py): matmul and attention outputs come from the
            # cache, every element-wise op of the block is re-run; under TP the out-projection too
            r.recompute = elem_fwd
            if plan.tp > 1:
                rec_mm = 2.0 * step.tokens_mb * load.blocks * rowwise_matmul_params(step.profile) / div
                r.recompute += rec_mm / step.linear
        elif step.selective == "every_second_mm":
            # torchtitan's op-level policy: every second matmul of a block re-run, and the block's
            # element-wise forward
            rec_mm = 2.0 * step.tokens_mb * load.blocks * every_second_matmul_params(step.profile) / div
            r.recompute = rec_mm / step.linear + elem_fwd
        else:  # attention_core (Korthikanti et al. 2022)
            r.recompute = step.tokens_mb * load.blocks * step.attn_fwd / div / step.attn_speed

    def prepare(self, step: StepShape) -> bool:
        return step.plan.offload != "none"

    def rank_time(self, step: StepShape, load: RankLoad, r: RankShare, counts: Any) -> None:
        plan, c = step.plan, step.c
        p_local = r.p_stage / step.fs
        m, pb, rb = plan.num_microbatches, step.param_b, step.red_b
        if plan.offload in OPTIMIZER_TIERS:
            r.offload = self.offload_time(step, load, p_local, r)
            return
        r.offload = p_local * c.optimizer_bytes_per_param / c.cpu_adam_bytes_per_s
        r.offload += p_local * (rb + pb) / c.host_link_bandwidth  # grads down, params up
        if plan.offload == "params":
            n_ag = m * (2 if plan.reshard_after_forward else 1) if plan.pp == 1 else m * plan.virtual_stages * 2
            r.offload += n_ag * p_local * pb / c.host_link_bandwidth
            r.offload += m * p_local * rb / c.host_link_bandwidth

    def offload_time(self, step: StepShape, load: RankLoad, p_local: float, r: RankShare | None = None,
                     disk_bytes_per_param: float = STATE_BYTES) -> float:
        """Exposed seconds per step of an optimizer tier (`dtorch.train.offload`), from measured rates:
        `tier_terms` (copies, the CPU kernel, the disk), then what the backward hides of them where
        the executor steps blocks during the backward (`step_overlaps_backward`)."""
        t = self.tier_terms(step, load, p_local, disk_bytes_per_param)
        total = t["total_s"]
        if r is None or not step_overlaps_backward(step.plan, step.c.grad_clipping):
            return total
        # the blocks are stepped as the backward of the last micro-batch releases them
        window = r.compute * 2.0 / 3.0 + r.recompute
        if step.cpu:
            # a CPU rank's backward and the worker share the cores: measured on the quiet 2-core
            # development machine, the backward grew by what the worker did (whole step 1.02x), so
            # the copies and the kernel hide nothing; the disk is a device of its own and works
            # during the backward (the worker reads the first block released, the last one, at once)
            compute = t["copies_s"] + t["kernel_s"]
            return max(compute, t["disk_s"] - window) + t["last_write_s"]
        # the block released last (the embedding's) is stepped after it, whatever the backward's length
        last = total * min(1.0, self.block_bytes(step, load) / max(1.0, STATE_BYTES * p_local))
        return max(last, total - window)

    def tier_terms(self, step: StepShape, load: RankLoad, p_local: float,
                   disk_bytes_per_param: float = STATE_BYTES) -> dict[str, float]:
        """Seconds per step of an optimizer tier's parts, not overlapped with the backward:
        `copies_s` float32 gradients down and float32 weights up (8 B/param over the host link,
        measured pinned copies by `dtorch probe` else nominal; a CPU cluster makes two host copies of
        4N bytes at the probe's copy rate, else at its memory bandwidth, each byte read and written); `kernel_s` torch's CPU AdamW at the
        probe's measured parameters/s (`host_adam_rate`); for the NVMe tier `disk_s`, the state
        (`disk_bytes_per_param`, 8 B, 12 with the masters on disk) read and written on the node's
        disk at the bandwidths `dtorch probe --disk` measured with the tier's own I/O calls
        (`dtorch.cluster.disk.TierFile`), shared by its ranks, reads and write-backs in flight
        together as the tier runs them (`disk_cycle_seconds`: the probe's cycle rate, else the
        read and write bandwidths one after the other: they share the device).
        The executor's reader and writer threads work while its stepping thread copies and steps
        the block in between, so the disk overlaps the copies and the kernel, except for the first
        block's read (nothing to step before it) and the last one's write (the step waits for it).
        `total_s` = max(copies + kernel, disk) + first read + last write."""
        c, dev, g = step.c, step.dev, step.g
        kernel = p_local / host_adam_rate(step)
        if step.cpu:  # two host copies of 4N bytes, at the probe's tensor-copy rate
            copies = p_local * 2.0 * 4.0 / (g.host_link_bytes_per_s or dev.memory_bandwidth / 2.0)
        else:
            copies = p_local * (4.0 + 4.0) / (g.host_link_bytes_per_s or c.host_link_bandwidth)
        out = {"copies_s": copies, "kernel_s": kernel, "disk_s": 0.0, "first_read_s": 0.0, "last_write_s": 0.0}
        if step.plan.offload == "optimizer_nvme":
            read_bw, write_bw = disk_bandwidth(g, c)
            ranks = g.devices_per_node
            out["disk_s"] = disk_cycle_seconds(g, c, ranks * p_local * disk_bytes_per_param)
            block = self.block_bytes(step, load) * disk_bytes_per_param / STATE_BYTES
            out["first_read_s"] = block / read_bw
            out["last_write_s"] = block / write_bw
        out["total_s"] = max(copies + kernel, out["disk_s"]) + out["first_read_s"] + out["last_write_s"]
        return out

    def block_bytes(self, step: StepShape, load: RankLoad) -> float:
        """State bytes of the tiers' largest block: `offload_block_bytes`, or the largest parameter
        the rank holds (an embedding or head matrix is a block of its own), sharded; at most the
        rank's whole state."""
        prof = step.profile
        big = max(prof.params_embedding * load.embedding, prof.params_head * load.head) / (step.plan.tp * step.fs)
        whole = STATE_BYTES * step.p_stage(load) / step.fs  # no block is larger than the rank's state
        return min(whole, max(step.c.offload_block_bytes, STATE_BYTES * big))

    def host_bytes(self, plan: Any, p_local: float, step: StepShape | None = None, load: RankLoad | None = None) -> float:
        """Host memory of one rank's offloaded states. Host tier: fp32 masters + AdamW moments (12 B
        per parameter) and two gradient staging buffers (half a block each); NVMe tier: the masters
        (4 B) and `offload_buffers` block buffers with their gradient staging; FSDP's CPU offload: fp32
        params, grads and moments (16 B)."""
        if plan.offload == "params":
            return 16.0 * p_local
        if plan.offload not in OPTIMIZER_TIERS:
            return 0.0
        block = self.block_bytes(step, load) if step is not None else DEFAULT_BLOCK_BYTES
        if plan.offload == "optimizer":
            return (MASTER_BYTES + STATE_BYTES) * p_local + 2 * block / 2
        buffers = step.c.offload_buffers if step is not None else 3
        return MASTER_BYTES * p_local + buffers * 1.5 * block

    def rank_memory(self, step: StepShape, load: RankLoad, m: RankMemory) -> None:
        """Host and disk bytes of the offloaded states (the rank's shard of its stage)."""
        if step.plan.offload != "none":
            m.host_bytes = self.host_bytes(step.plan, m.p_stage / step.fs, step, load)
            m.disk_bytes = self.disk_bytes(step.plan, m.p_stage / step.fs)

    def disk_bytes(self, plan: Any, p_local: float) -> float:
        """Bytes of one rank's NVMe-tier files (the AdamW moments; `dtorch.train.offload.bytes_needed`)."""
        return STATE_BYTES * p_local if plan.offload == "optimizer_nvme" else 0.0

    def offload_summary(self, plan: Any, est: Any, group: Any, c: Any) -> str:
        """What the plan moved where and what it costs (for `dtorch.plan.explain`)."""
        t = est.time_breakdown.get("offload", 0.0)
        hidden = ("partly hidden behind the backward" if step_overlaps_backward(plan, c.grad_clipping)
                  and group.device.kind != "cpu" else "not overlapped with compute")
        cost = f"{t:.2f} s per step ({t / est.step_time_s:.0%}), {hidden}"
        host = f"{est.host_bytes_per_rank / 2**30:.1f} GiB of host memory per rank"
        if plan.offload == "params":
            return (f"parameters, gradients and optimizer states in host memory (FSDP CPU offload), {host}; "
                    f"the step on the CPU and every gather and reduction over the host link: {cost}")
        where = "host memory" if plan.offload == "optimizer" else "files on the node's local disk"
        # the executor keeps the device's float32 parameters (and gradients): the host masters are a
        # second copy, not a move (counted so on both sides; dtorch.train.offload.OffloadedOptimizer)
        line = (f"AdamW states (8 B/param) in {where}, a copy of the fp32 master weights in host memory (the "
                f"device keeps its fp32 parameters and gradients), the step on the CPU: {host}")
        if plan.offload == "optimizer_nvme":
            read_bw, write_bw = disk_bandwidth(group, c)
            src = "measured" if group.disk_read_bytes_per_s > 0 else "nominal, run `dtorch probe --disk DIR`"
            rw = group.disk_read_write_bytes_per_s
            rate = (f"{rw / 1e9:.2f} GB/s each way with both in flight" if rw > 0
                    else f"{read_bw / 1e9:.2f} / {write_bw / 1e9:.2f} GB/s")
            line += (f", {est.disk_bytes_per_rank / 2**30:.1f} GiB on disk per rank read and written each step at "
                     f"{rate} ({src})")
        return line + f"; costs {cost}"


def host_adam_rate(step: StepShape) -> float:
    """Parameters per second per rank of the CPU AdamW the optimizer tiers run: torch's fused
    kernel beside an accelerator (and on a CPU with `CostConstants.cpu_adam_fused`, i.e.
    AdamW(fused=True)), else torch's default CPU kernel, the per-tensor loop (the in-memory
    optimizer's on a CPU: the tier keeps its arithmetic). Measured by `dtorch probe`
    (`NodeGroup.host_adam_*`); unmeasured: the nominal `cpu_adam_bytes_per_s`, and on a CPU the
    old rule, 28 B/param at 80 % of the memory bandwidth."""
    g, c = step.g, step.c
    if step.cpu and not c.cpu_adam_fused:
        return g.host_adam_loop_params_per_s or step.dev.memory_bandwidth * 0.8 / c.optimizer_bytes_per_param
    return g.host_adam_params_per_s or c.cpu_adam_bytes_per_s / c.optimizer_bytes_per_param


def step_overlaps_backward(plan: Any, grad_clipping: bool, tier: str | None = None) -> bool:
    """Whether `dtorch.train.offload` steps the optimizer tier's blocks during the backward (on a
    worker thread, as the gradient hooks release them): only where each gradient is final when it
    lands. Not with gradient clipping (the step needs the norm of all of them), DDP (its all-reduce
    lands after), a pipeline, tensor or context parallelism (Partial gradients reduced after the
    backward), expert parallelism or torch.compile (not verified). The executor asks this too, with
    `tier` the one it applies (a Trainer's `offload=` may choose one the plan does not say)."""
    ddp = plan.dp_replicate > 1 and plan.dp_shard == 1
    return ((tier or plan.offload) in OPTIMIZER_TIERS and not grad_clipping and not ddp and plan.pp == 1
            and plan.tp == 1 and plan.cp == 1 and getattr(plan, "ep", 1) == 1 and not getattr(plan, "compile", False))


DEFAULT_BLOCK_BYTES = 64 * 2**20
"""`OptimizerOffload.block_bytes`' default (state bytes moved at a time)."""


def disk_cycle_seconds(group: Any, c: Any, nbytes: float) -> float:
    """Seconds for the node's disk to read `nbytes` and write as many back the way the NVMe tier does
    (one block read while the one before is written): at `dtorch probe --disk`'s measured cycle rate
    (`disk_read_write_bytes_per_s`), else the read and the write bandwidth one after the other."""
    rw = getattr(group, "disk_read_write_bytes_per_s", 0.0)
    if rw > 0:
        return nbytes / rw
    read_bw, write_bw = disk_bandwidth(group, c)
    return nbytes * (1.0 / read_bw + 1.0 / write_bw)


def disk_bandwidth(group: Any, c: Any) -> tuple[float, float]:
    """(read, write) bytes/s of a node group's local disk: the cluster's (file or `dtorch probe --disk`
    calibration), else the constants' conservative nominal figures."""
    return (group.disk_read_bytes_per_s or c.disk_read_bytes_per_s,
            group.disk_write_bytes_per_s or c.disk_write_bytes_per_s)


MEMORY = Memory()
