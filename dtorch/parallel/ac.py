"""Activation checkpointing per block.

`full` keeps only each block's input and recomputes the block in backward. `selective` is op-level
selective checkpointing: the outputs of matrix multiplications (the expensive ops) are saved, the
cheap element-wise ops (norms, activations, RoPE, softmax pieces) are recomputed - most of the
memory of full checkpointing for a small part of its recompute. Under tensor parallelism the
row-wise linears' outputs (attention out-projection, down-projection) are not kept: each is the
rank's partial sum over the whole sequence, before the all-reduce or reduce-scatter (under
sequence parallelism tp times the shard that follows). The out-projection runs again in the
backward's re-run; the down-projection does not (the re-run stops at its input, the last tensor
the backward needs).

Recomputation runs with the RNG state of the forward (`preserve_rng_state=True`: the wrapper saves
the CPU and the current accelerator's generator states before the block and restores them for the
recompute), so dropout draws the same masks twice and the gradients are those of the model without
checkpointing. Without it, a recomputed block draws fresh masks and its gradients belong to another
forward than the one whose loss was taken (measured: 36-50% relative error at dropout 0.1).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.tensor import DTensor, Shard
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from dtorch.model.profiler import SELECTIVE_SAVE_OPS
from dtorch.model.structure import block_items, find_blocks
from dtorch.parallel.halves import Half

_SAVE_OPS = frozenset(SELECTIVE_SAVE_OPS)
"""The ops whose outputs selective checkpointing keeps: matrix multiplications and every fused
attention kernel torch has, the CPU one (`_scaled_dot_product_flash_attention_for_cpu`, what SDPA
runs on CPU without dropout) included, so that CPU and GPU runs keep the same tensors. The same list
the model profiler counts (`dtorch.model.profiler.SELECTIVE_SAVE_OPS`) and the cost model prices
(`dtorch.plan.cost.matmuls_saved_act_bytes`)."""


_BIAS_FIRST = frozenset((torch.ops.aten.addmm.default, torch.ops.aten.baddbmm.default))


def _partial_sum(op, args) -> bool:
    """Whether a matmul is a row-wise linear under tensor parallelism: its input is a DTensor split
    on the contracted (last) dimension, so its output is each rank's partial sum over the whole
    sequence before the all-reduce or reduce-scatter (under SP, tp times the shard kept after it).
    Cached, it would cost that much memory; it is re-run instead. Only the attention out-projection
    runs twice: the re-run stops at the last tensor the backward needs (torch's early stop), which is
    the down-projection's input."""
    x = args[1] if op in _BIAS_FIRST and len(args) > 1 else (args[0] if args else None)
    if not isinstance(x, DTensor):
        return False
    return any(isinstance(p, Shard) and p.dim in (-1, x.ndim - 1) for p in x.placements)


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if op in _SAVE_OPS and not _partial_sum(op, args):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_save_matmuls)


def apply_ac(model: nn.Module, policy: str) -> None:
    """Wrap every block of `model` (a pipeline stage or the whole model) in place.

    The wrapper adds `_checkpoint_wrapped_module` to parameter paths; its state-dict hooks remove
    it again, so checkpoints keep the plain names.
    """
    if policy == "none":
        return
    assert policy in ("full", "selective"), policy
    _, blocks = find_blocks(model)
    for name, block in block_items(blocks):
        if policy == "full":
            wrapped = checkpoint_wrapper(block, preserve_rng_state=True)
        else:
            wrapped = checkpoint_wrapper(block, preserve_rng_state=True, context_fn=partial(_selective_context))
        if isinstance(blocks, nn.ModuleDict):
            blocks[name] = wrapped
        else:
            blocks[int(name)] = wrapped


HALVES = (Half(40, apply=lambda part, meshes, plan: apply_ac(part, plan.ac)),)
"""The executor half (dtorch.parallel.halves): every block checkpointed as the plan's `ac` says."""
