"""The executor halves of the strategies, in the one order `parallelize` applies them.

A strategy's executor module (its registry entry's `Strategy.executor`, e.g. `dtorch.parallel.cp`)
declares `HALVES`: one or more `Half(order, apply=..., check=...)`. `parallelize` runs every
`check(model, plan, device_type)` in `order` before any process group exists, then, on every
pipeline part, every `apply(part, meshes, plan)` in `order`. A half decides from the plan whether it
has anything to do. The orders (torchtitan's): tensor parallel 10, context parallel 20 (its check
runs before tensor parallelism's, 22), TP's per-shard random streams 25 (they wrap context
parallelism's attention core), expert parallelism 30, activation checkpointing 40, torch.compile 50
(after TP and AC, before FSDP), FSDP2 / HSDP / DDP 60. Adding a strategy adds its module's `HALVES`
and its registry entry; this file and `parallelize` do not change.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dtorch.plan.plan import Plan
from dtorch.plan.strategies import REGISTRY


@dataclass
class Meshes:
    """What the halves apply a plan with, on this rank: the world mesh (pp, dp_replicate, dp_shard,
    cp, tp; None single-process), expert parallelism's ([pp,] edp, ep[, tp]) mesh when ep > 1, the tp
    mesh (the expert mesh's tp axis when ep > 1, so FSDP finds both under one root), whether the model
    has mixture-of-experts blocks, whether the part being applied is the last pipeline stage, and
    what a half hands to the `ParallelModel` (context parallelism's `ContextParallel`)."""

    mesh: DeviceMesh | None
    ep: DeviceMesh | None = None
    tp: DeviceMesh | None = None
    moe: bool = False
    last_stage: bool = True
    context: Any = None


@dataclass(frozen=True)
class Half:
    """One step of a strategy's executor half: `apply(part, meshes, plan)` on every pipeline part
    and/or `check(model, plan, device_type)` (ConfigError before any process group; `device_type`
    None: the plan and the model only, the dry run), at `order` (module doc)."""

    order: int
    apply: Callable[[nn.Module, Meshes, Plan], None] | None = None
    check: Callable[[nn.Module, Plan, str | None], None] | None = None


@cache
def halves() -> tuple[Half, ...]:
    """Every registered strategy's executor halves, in order."""
    modules = dict.fromkeys(s.executor for s in REGISTRY if s.executor)
    found = [h for name in modules for h in getattr(importlib.import_module(name), "HALVES", ())]
    return tuple(sorted(found, key=lambda h: h.order))


def check_all(model: nn.Module, plan: Plan, device_type: str | None) -> None:
    """Every half's check, in order."""
    for h in halves():
        if h.check is not None:
            h.check(model, plan, device_type)


def apply_all(part: nn.Module, meshes: Meshes, plan: Plan) -> None:
    """Every half's apply on one pipeline part, in order."""
    for h in halves():
        if h.apply is not None:
            h.apply(part, meshes, plan)
