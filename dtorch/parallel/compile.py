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
(dtorch.parallel.rng) switch generator states eagerly around the block; activation checkpointing
with tensor parallelism (torch 2.13's AOT autograd fails on the checkpointed DTensor block:
"expected all tensors_saved_with_vc_check to be Tensors, got ... DeviceMesh"); and a machine
without the compiler Inductor needs (a C++ compiler on CPU, Triton on CUDA).

Measured to run at world 2 on gloo (4 AdamW steps, tests/parallel/test_compile.py pins the first
three against eager): FSDP, TP, TP+SP, DDP, CP, PP (1F1B), FSDP with selective AC, transformers
Llama (graph breaks allowed) and GPT-2 (adapter blocks, fullgraph) under FSDP and TP+SP. Dropout
without TP compiles, but Inductor draws its own random numbers: the masks follow the same
distribution, not eager's bits.

Compile time is paid at the first step (forward and backward graphs) and reported by the trainer as
a `compile` event (`first_step_cost`); `record_measurement` stores a side-by-side measurement of
eager and compiled steps (benchmarks/bench_compile.py) in the cluster's calibration, where the
planner reads the gain and the compile time.
"""

from __future__ import annotations

import shutil

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from dtorch import env
from dtorch.errors import ConfigError
from dtorch.model.structure import block_items, find_blocks
from dtorch.parallel.halves import Half, Meshes
from dtorch.parallel.rng import has_random_ops

FULLGRAPH_MODULES = ("dtorch.models.", "dtorch.model.hf")
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
    cxx = env.current().cxx or next((c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)
    if cxx is None or shutil.which(cxx.split()[0]) is None:
        return "Inductor needs a C++ compiler on CPU (g++ or clang++ on PATH, or $CXX)"
    return None


def check_compile(plan, model: nn.Module, device_type: str | None = "cpu") -> None:
    """Raise ConfigError if `plan` compiles and this model or machine cannot (see the module doc).
    `device_type` None checks the plan and model only, not this machine's compiler (the dry run)."""
    if not compile_enabled(plan):
        return
    missing = _compiler_missing(device_type) if device_type is not None else None
    if missing:
        raise ConfigError("compile", True, f"{missing}; or set compile=false")
    if plan.tp > 1 and plan.ac != "none":
        raise ConfigError(
            "compile", True,
            f"torch {torch.__version__.split('+')[0]} cannot compile an activation-checkpointed block whose "
            "layers are tensor-parallel (AOT autograd fails saving the DTensor's mesh for the recompute); "
            "use ac=none, or compile=false, or tp=1",
        )
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


# ---- what compiling cost and gained -----------------------------------------------------------------
def _apply(part: nn.Module, meshes: Meshes, plan) -> None:
    if compile_enabled(plan):  # after TP and AC, before FSDP (module doc)
        apply_compile(part)


HALVES = (Half(50, apply=_apply, check=lambda model, plan, device_type: check_compile(plan, model, device_type)),)
"""The executor half (dtorch.parallel.halves): every block compiled when the plan says `compile`."""


def first_step_cost(step_times: list[float]) -> dict:
    """What compilation added to a run, from its step times (seconds, first step first): `seconds`
    = first step - median of the later ones (the first step traces and generates code for the
    block's forward and backward graphs; an eager first step's own warm-up, a few ms on CPU, is
    included), or the whole first step when there is no later one."""
    first = float(step_times[0])
    later = sorted(step_times[1:])
    steady = later[len(later) // 2] if later else None
    return {"seconds": max(0.0, first - steady) if steady is not None else first,
            "first_step_s": first, "steady_step_s": steady, "steps_measured": len(step_times)}


RECORD_KEY = "compile"
RECORD_VERSION = 1
HISTORY = 20


def record_measurement(cluster_name: str, measurement: dict, *, save: bool = True) -> dict:
    """Store one side-by-side measurement of eager and compiled steps under ``compile`` in the
    calibration of `cluster_name` (dtorch.cluster.probe: the same file as the probe's and the
    runtime feedback's numbers; $DTORCH_CALIBRATION_DIR). Returns the section as written.

    `measurement` (one plan, one model, one machine): ``family``, ``plan``, ``model``,
    ``world_size``, ``eager_step_s``, ``compiled_step_s`` (medians), ``compile_s`` and any context
    (seq_len, param_dtype, torch, host, source). ``speedup`` = eager / compiled is added. The section
    keeps the last HISTORY measurements and, per plan family and over all of them, the median
    ``speedup`` and ``compile_s`` - what a planner reads (see docs/design.md, "torch.compile")."""
    from dtorch.cluster.probe import (
        CALIBRATION_VERSION,
        calibration_path,
        stored_calibration,
        write_calibration,
    )

    for key in ("family", "eager_step_s", "compiled_step_s", "compile_s"):
        if key not in measurement:
            raise ConfigError(f"measurement.{key}", None, "a compile measurement needs family, eager_step_s, "
                              "compiled_step_s and compile_s")
    for key in ("eager_step_s", "compiled_step_s"):
        v = measurement[key]
        if not (isinstance(v, (int, float)) and v > 0):
            raise ConfigError(f"measurement.{key}", v, "a positive number of seconds per step")
    m = {**measurement, "speedup": measurement["eager_step_s"] / measurement["compiled_step_s"]}
    doc = stored_calibration(cluster_name) or {
        "version": CALIBRATION_VERSION, "cluster": cluster_name, "device": {}, "links": {},
    }
    old = doc.get(RECORD_KEY) or {}
    history = [*(old.get("measurements") or []), m][-HISTORY:]

    def summary(rows: list[dict]) -> dict:
        return {"speedup": _median([r["speedup"] for r in rows]), "compile_s": _median([r["compile_s"] for r in rows]),
                "samples": len(rows)}

    section = {"version": RECORD_VERSION, **summary(history),
               "by_family": {f: summary([r for r in history if r["family"] == f])
                             for f in sorted({r["family"] for r in history})},
               "measurements": history}
    if save:
        write_calibration({**doc, RECORD_KEY: section}, calibration_path(cluster_name))
    return section


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
