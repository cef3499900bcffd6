"""Random streams of a plan's ranks: the one rule dropout follows under every parallelism.

The rule: **a rank's masks depend on what it holds, never on how the model was split to get it
there.** Concretely:

1. Every rank seeds its generators with `rank_seed(seed, coordinates)`: the plan's seed, offset by
   the rank's position on the axes that hold *different data or different layers* (pp,
   dp_replicate, dp_shard, cp), and NOT by its tensor-parallel position. Position 0 (rank 0 and
   its TP peers) gets `seed` itself, so a one-rank plan draws exactly what a plain single-device
   run seeded with `seed` draws.
2. Tensor-parallel ranks therefore share one stream, so an activation that TP *replicates* (GPT's
   embedding dropout, the residual dropouts after a row-wise all-reduce without sequence
   parallelism) gets the same mask on every TP rank - it must, or the replicas stop being copies.
3. Inside a sequence-parallel block every random draw is on a TP-*sharded* tensor (sequence shards
   around the norms and residual dropouts, head shards in attention). There each TP rank draws from
   its own shard stream (`shard_streams`), seeded by one draw from the shared stream mixed with
   the TP rank, so different shards get independent masks, as they would on one device.
4. Activation checkpointing saves and restores the generator states around a recomputed block
   (ac.py), and the shard stream is re-derived from the restored shared stream, so a recompute
   draws the forward's masks.

What this does not give (and cannot with torch's stock dropout on CPU): bit-identical masks to a
single-device run of the same global batch. torch's CPU generator (mt19937) is sequential, not
counter-based, so a rank that holds half the batch or a quarter of the layers cannot draw "its
part" of the single-device masks. The plans therefore agree with single-device training in
distribution (every element dropped independently with probability p), not bit for bit; tests pin
the properties above instead (tests/parallel/test_dropout_rng.py, test_loss_equivalence.py).
Without sequence parallelism a TP block mixes both kinds: its residual dropouts act on replicated
activations (shared stream) and attention-probability dropout, inside SDPA, on head shards. There
only the attention core runs on the shard stream (`shard_attention_streams`, through the models'
`core_attention` hook). Models without that hook (transformers models) keep the shared stream for
attention dropout under TP without SP: the TP ranks' head groups then get equal patterns.
On CUDA, torch's DTensor RNG tracker (`torch.distributed.tensor._random`) offsets the Philox
counter of random ops on DTensors so that each shard draws its slice of the full tensor's
numbers; it only covers random ops on DTensors (the models' dropouts see local tensors) and torch
2.13 refuses to build it on CPU, so it is seeded for completeness only.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dtorch.plan.plan import Plan

STREAM_AXES = ("pp", "dp_replicate", "dp_shard", "cp")
"""Mesh axes whose ranks hold different data or layers: they draw from different streams."""
_STRIDE = 1_000_003
_GOLDEN = 0x9E3779B97F4A7C15


def stream_index(plan: Plan, coordinate: dict[str, int]) -> int:
    """Mixed-radix index of a rank's coordinates (axis -> index) over STREAM_AXES; tp ignored."""
    k = 0
    for axis in STREAM_AXES:
        k = k * getattr(plan, axis) + coordinate.get(axis, 0)
    return k


def rank_seed(seed: int, plan: Plan, coordinate: dict[str, int]) -> int:
    """The seed of a rank's generators: `seed` for stream index 0, distinct for every other."""
    return (seed + _STRIDE * stream_index(plan, coordinate)) % 2**63


def seed_rank_streams(plan: Plan, mesh: DeviceMesh | None, seed: int, device: torch.device) -> int:
    """Seed this rank's CPU and accelerator generators by the rule; returns the seed used."""
    coordinate: dict[str, int] = {}
    if mesh is not None and mesh.mesh_dim_names:
        coordinate = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate() or ()))
    s = rank_seed(seed, plan, coordinate)
    torch.manual_seed(s)
    if device.type == "cuda" and plan.tp > 1 and mesh is not None:
        # DTensor random ops (none in the reference models) then agree across the TP ranks too.
        from torch.distributed.tensor._random import manual_seed as dtensor_manual_seed

        dtensor_manual_seed(s, mesh["tp"])
    return s


def _generator(args: tuple, kwargs: dict) -> torch.Generator:
    x = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    if x is not None and x.device.type == "cuda":
        return torch.cuda.default_generators[x.device.index if x.device.index is not None else torch.cuda.current_device()]
    return torch.random.default_generator


def _enter_shard_stream(module: nn.Module, args: tuple, kwargs: dict, *, tp_rank: int) -> None:
    # One draw from the shared CPU stream keeps the TP ranks' shared streams in step (and is
    # redrawn identically by a checkpointed block's recompute); mixed with the TP rank it seeds
    # this shard's stream, used for the block and then put back by the forward hook.
    base = int(torch.randint(0, 2**62, (), dtype=torch.int64))
    gen = _generator(args, kwargs)
    module._dtorch_saved_rng.append((gen, gen.get_state()))
    gen.manual_seed((base + _GOLDEN * (tp_rank + 1)) % 2**63)


def _leave_shard_stream(module: nn.Module, args: tuple, kwargs: dict, output) -> None:
    gen, state = module._dtorch_saved_rng.pop()
    gen.set_state(state)


def has_random_ops(module: nn.Module) -> bool:
    """`module` draws random numbers in training: a Dropout with p > 0, or a float attribute named
    like a dropout probability (GPT's attention dropout, transformers' `attention_dropout`) above 0."""
    for m in module.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        for name, value in vars(m).items():
            if "dropout" in name and isinstance(value, float) and value > 0:
                return True
    return False


def shard_streams(blocks: list[nn.Module], tp_mesh: DeviceMesh) -> None:
    """Run every block in `blocks` (sequence-parallel blocks: all their activations are TP-sharded)
    on this TP rank's own shard stream (rule 3 above)."""
    tp_rank = tp_mesh.get_local_rank()
    for block in blocks:
        block._dtorch_shard_stream = tp_rank
        block._dtorch_saved_rng = []
        block.register_forward_pre_hook(functools.partial(_enter_shard_stream, tp_rank=tp_rank), with_kwargs=True)
        block.register_forward_hook(_leave_shard_stream, with_kwargs=True, always_call=True)


def _attention_on_shard_stream(q, k, v, *, dropout_p: float = 0.0, enable_gqa: bool = False, inner=None,
                               holder: nn.Module, tp_rank: int):
    if dropout_p == 0.0:  # nothing random: no stream switch
        return _attend(inner, q, k, v, dropout_p, enable_gqa)
    _enter_shard_stream(holder, (q,), {}, tp_rank=tp_rank)
    try:
        return _attend(inner, q, k, v, dropout_p, enable_gqa)
    finally:
        _leave_shard_stream(holder, (), {}, None)


def _attend(inner, q, k, v, dropout_p, enable_gqa):
    if inner is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=enable_gqa)
    return inner(q, k, v, dropout_p=dropout_p, enable_gqa=enable_gqa)


def shard_attention_streams(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Run the attention core of every attention module that declares the `core_attention` hook on
    this TP rank's shard stream (TP without sequence parallelism: the heads are sharded, the
    block's other activations replicated). Wraps a core already installed (context parallelism)."""
    tp_rank = tp_mesh.get_local_rank()
    for mod in model.modules():
        if "core_attention" in dir(type(mod)):
            mod._dtorch_saved_rng = []
            mod._dtorch_shard_stream = tp_rank
            mod.core_attention = functools.partial(_attention_on_shard_stream, inner=mod.core_attention,
                                                   holder=mod, tp_rank=tp_rank)


def shard_stream_rank(block: nn.Module) -> int | None:
    """The TP rank whose shard stream `block` runs on, or None (the shared stream)."""
    return getattr(block, "_dtorch_shard_stream", None)
