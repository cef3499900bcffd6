"""torch.compile per repeated block (the plan's `compile` field).

Each entry of the model's block container (structure.find_blocks) is replaced by
`torch.compile(block, fullgraph=..., dynamic=False)`. The blocks share one code object, so Dynamo
traces and Inductor compiles one graph (forward and backward) that every block then reuses with
its own parameters as inputs; embeddings, the final norm, the head and the loss stay eager.

Where in `parallelize` (torchtitan's order): after tensor/sequence parallelism, context-parallel
hooks and activation checkpointing, before FSDP / replicate.

- After TP: the compiled graph traces the DTensor layouts TP gave the block's layers (and its
  module-input hooks), so the compiled code is the sharded computation.
- After AC: the compiled module wraps the checkpoint wrapper, so the checkpointed region is one
  higher-order op inside the graph and the recompute (with the selective policy) is compiled too.
- Before FSDP: `fully_shard` then puts its pre-/post-forward hooks (all-gather, reshard, gradient
  reduce-scatter) on the compiled module, where they run eagerly around the graph instead of being
  traced into it; FSDP2's collectives are not graph-captured and the graph holds no graph breaks
  for them.

`dynamic=False`: every micro-batch of a plan has the same shape, so one static graph serves the
whole run (a changed shape recompiles once, it does not fall back to eager). `fullgraph=True` for
the blocks of DTorch's reference models and of the transformers adapters' rebuilt GPT-2 blocks,
whose code is known to trace without a break; other blocks (transformers decoder layers, user
models) compile with graph breaks allowed, so an untraceable line runs eagerly instead of failing.

What compile refuses (ConfigError, from `check_compile`, before any process group exists):
random ops (dropout p > 0) inside tensor-parallel blocks, whose per-shard random streams
(dtorch.parallel.rng) switch generator states eagerly around the block; and a machine without the
compiler Inductor needs (a C++ compiler on CPU, Triton on CUDA).

Compile time is paid at the first step (forward and backward graphs) and reported by the trainer as
a `compile` event; `dtorch.parallel.compile_record` stores it with the measured step-time gain.
"""

from __future__ import annotations

import os
import shutil

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from dtorch.errors import ConfigError
from dtorch.parallel.rng import has_random_ops
from dtorch.parallel.structure import block_items, find_blocks

FULLGRAPH_MODULES = ("dtorch.models.", "dtorch.parallel.hf")
"""Blocks whose class lives here trace without a graph break: compiled with fullgraph=True."""


def compile_enabled(plan) -> bool:
    """The plan asks for per-block compilation (`Plan.compile`; absent on older plans = off)."""
    return bool(getattr(plan, "compile", False))


def _inner(block: nn.Module) -> nn.Module:
    """The block under an activation-checkpoint wrapper."""
    return getattr(block, "_checkpoint_wrapped_module", block)


def fullgraph_for(block: nn.Module) -> bool:
    """Whether `block` compiles with fullgraph=True (see FULLGRAPH_MODULES)."""
    return type(_inner(block)).__module__.startswith(FULLGRAPH_MODULES)


def _compiler_missing(device_type: str) -> str | None:
    if device_type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "Inductor needs Triton on CUDA (pip install triton)"
        return None
    cxx = os.environ.get("CXX") or next((c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)
    if cxx is None or shutil.which(cxx.split()[0]) is None:
        return "Inductor needs a C++ compiler on CPU (g++ or clang++ on PATH, or $CXX)"
    return None


def check_compile(plan, model: nn.Module, device_type: str = "cpu") -> None:
    """Raise ConfigError if `plan` compiles and this model or machine cannot (see the module doc)."""
    if not compile_enabled(plan):
        return
    missing = _compiler_missing(device_type)
    if missing:
        raise ConfigError("compile", True, f"{missing}; or set compile=false")
    _, blocks = find_blocks(model)
    if plan.tp > 1 and any(has_random_ops(b) for _, b in block_items(blocks)):
        raise ConfigError(
            "compile", True,
            "dropout > 0 inside tensor-parallel blocks draws from per-shard random streams that are "
            "switched eagerly around each block (dtorch/parallel/rng.py) and cannot be compiled; "
            "set the model's dropout to 0, or compile=false, or tp=1",
        )


def _plain_inputs(module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook (eager, outside the graph): a block input still in flight from a functional
    collective (an AsyncCollectiveTensor: the all-reduced output of a tensor-parallel embedding) is
    waited for here. Compiled with it, the graph would be specialised on the wrapper type (a
    recompile for the first block) and its backward would hand the embedding's redistribute a plain
    gradient where a DTensor is expected (measured on torch 2.13). `clone` waits and keeps autograd."""
    if not any(isinstance(a, AsyncCollectiveTensor) for a in args):
        return None
    return tuple(a.clone() if isinstance(a, AsyncCollectiveTensor) else a for a in args), kwargs


def apply_compile(model: nn.Module) -> int:
    """Replace every block of `model` (a pipeline stage or the whole model) by its compiled module,
    in place. Returns the number of blocks compiled. Compilation itself happens at the first call."""
    _, blocks = find_blocks(model)
    items = block_items(blocks)
    for name, block in items:
        compiled = torch.compile(block, fullgraph=fullgraph_for(block), dynamic=False)
        compiled.register_forward_pre_hook(_plain_inputs, with_kwargs=True)
        if isinstance(blocks, nn.ModuleDict):
            blocks[name] = compiled
        else:
            blocks[int(name)] = compiled
    return len(items)
