"""From meta to real tensors: each rank allocates and fills only what its placement owns.

`materialize(parts, ...)` runs after TP/FSDP/PP have turned the meta model into this rank's
stages of DTensors. It `to_empty`s every part on the device (allocating only local shards) and
then fills them in one of three ways, in this order of preference:

1. **Pretrained or seed weights** (`weights=`, e.g. `dtorch.checkpoint.hf_weights.HFWeights`):
   an object with `fill_(name, param)` that copies into `param` (a DTensor or a tensor) the part
   this rank owns, reading only those slices from disk.
2. **Rank-local initialisation** (DTorch reference models, any module whose
   `init_weights(seed)` uses `dtorch.models.init`): every element is a function of (seed,
   parameter name, global index), so each rank generates just its shard and the weights equal
   single-device initialisation for every plan. Peak host memory: one shard plus one chunk.
3. **Seed path** (arbitrary modules, transformers models): the whole single-device model is built
   once on CPU (`reference_state`) and each rank keeps its slice. This costs one full CPU copy
   per rank during start-up; for a large model of this kind write a seed checkpoint once
   (`dtorch.checkpoint.hf_weights.write_seed_checkpoint`) and start with it as `weights=`.

Whatever the path, `startup_stats()` reports the process's peak host RSS and the bytes read from
a checkpoint.
"""

from __future__ import annotations

import copy
import inspect
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
# DistributedDataParallel prefixes "module." to the names of the model it wraps
DDP_PREFIX = "module."


def clean_name(name: str) -> str:
    name = name.removeprefix(DDP_PREFIX)
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def tied_groups(model: nn.Module) -> list[list[str]]:
    """Names (as `named_parameters` spells them) of the parameters that are one Parameter
    registered under several names, e.g. a head tied to the token embedding (`lm_head.weight =
    wte.weight`): one list per shared Parameter, in registration order, the first being the name
    `named_parameters()` keeps."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def retie(model: nn.Module, groups: list[list[str]]) -> None:
    """Register each group's first Parameter under the group's other names again, where `model`
    still has them (a pipeline stage may hold one end of a tie only). `nn.Module.to_empty` and
    `.to("meta")` give every module its own new Parameter, which silently unties them."""
    for names in groups:
        present = [n for n in names if _has_param(model, n)]
        if len(present) < 2:
            continue
        keep = model.get_parameter(present[0])
        for name in present[1:]:
            owner, _, attr = name.rpartition(".")
            model.get_submodule(owner)._parameters[attr] = keep


def _has_param(model: nn.Module, name: str) -> bool:
    try:
        model.get_parameter(name)
    except AttributeError:
        return False
    return True


def has_seeded_init(model: nn.Module) -> bool:
    init = getattr(model, "init_weights", None)
    return callable(init) and bool(inspect.signature(init).parameters)


def rank_local_init(model: nn.Module) -> bool:
    """Can `model` initialise each rank's shard on its own? True for modules whose seeded
    `init_weights` draws through `dtorch.models.init` (the reference models); other modules
    take the seed path (see the module docstring)."""
    if not has_seeded_init(model):
        return False
    default = any(c.__module__.startswith("dtorch.models.") for c in type(model).__mro__)
    return bool(getattr(model, "rank_local_init", default))


def init_model(model: nn.Module, seed: int) -> None:
    """Deterministic initialisation: `init_weights(seed)` of DTorch reference models; otherwise
    seed torch's RNG and call `init_weights()` (Hugging Face) or every `reset_parameters()`."""
    if has_seeded_init(model):
        model.init_weights(seed)
        return
    torch.manual_seed(seed)
    init = getattr(model, "init_weights", None)
    if callable(init):
        init()
        return
    for mod in model.modules():
        if hasattr(mod, "reset_parameters"):
            mod.reset_parameters()


def reference_state(
    model_or_factory: nn.Module | Callable[[], nn.Module], meta_model: nn.Module, seed: int
) -> dict[str, torch.Tensor]:
    """The full single-device initial tensors (parameters and all buffers), by clean name.

    Which single-device model: the given module's own weights if it has real ones; else the
    model's `init_weights(seed)` (DTorch reference models); else the factory called on CPU after
    `torch.manual_seed(seed)` (what a user gets by seeding and constructing, e.g. transformers);
    else `init_model` of a meta module."""
    from dtorch.parallel.hf import adapt

    if isinstance(model_or_factory, nn.Module) and not any(t.is_meta for t in model_or_factory.parameters()):
        full = model_or_factory
    elif not has_seeded_init(meta_model) and not isinstance(model_or_factory, nn.Module):
        torch.manual_seed(seed)
        with torch.device("cpu"):
            full = adapt(model_or_factory())
    else:
        full = copy.deepcopy(meta_model)
        ties = tied_groups(full)
        full.to_empty(device="cpu")
        retie(full, ties)
        init_model(full, seed)
        if hasattr(full, "init_buffers"):
            full.init_buffers()
    # every name of a tied parameter: a pipeline stage may hold its second name only
    state = {clean_name(n): t.detach() for n, t in full.named_parameters(remove_duplicate=False)}
    state.update({clean_name(n): t.detach() for n, t in full.named_buffers()})
    return state


def _has_real_weights(model_or_factory: Any) -> bool:
    return isinstance(model_or_factory, nn.Module) and not any(t.is_meta for t in model_or_factory.parameters())


def startup_path(model_or_factory: Any, meta_model: nn.Module, weights: Any = None) -> str:
    """Which way `materialize` fills the weights: "weights", "rank-local" or "seed"."""
    if weights is not None:
        return "weights"
    if not _has_real_weights(model_or_factory) and rank_local_init(meta_model):
        return "rank-local"
    return "seed"


def peak_rss_bytes() -> int | None:
    """This process's peak resident set size so far (VmHWM), None where /proc is not available."""
    try:
        with open(f"/proc/{os.getpid()}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class Startup:
    """How `materialize` will fill the weights, decided on the meta model BEFORE it is sharded
    (FSDP modules cannot be copied): `path` is "weights", "rank-local" or "seed"; the seed path's
    full CPU state is built here."""

    def __init__(self, model_or_factory: Any, meta_model: nn.Module, seed: int, weights: Any = None):
        self.path = startup_path(model_or_factory, meta_model, weights)
        self.seed = seed
        self.weights = weights
        self.full_state = reference_state(model_or_factory, meta_model, seed) if self.path == "seed" else None


@torch.no_grad()
def materialize(parts: list[nn.Module], startup: Startup, device: torch.device) -> dict[str, Any]:
    """`to_empty` every model part on `device` and fill this rank's shards (see the module
    docstring); returns {"path", "bytes_read", "peak_rss_bytes"}."""
    path, weights, full_state = startup.path, startup.weights, startup.full_state
    bytes_before = getattr(weights, "bytes_read", 0) if weights is not None else 0
    for part in parts:
        groups = tied_groups(part)
        part.to_empty(device=device)
        retie(part, groups)
        if path == "rank-local":
            part.init_weights(startup.seed)  # reference models also recompute their buffers here
            continue
        if path == "weights":
            for name, t in part.named_parameters():
                weights.fill_(clean_name(name), t)
            if hasattr(part, "init_buffers"):
                part.init_buffers()  # derived buffers (RoPE tables)
            else:
                for name, t in part.named_buffers():
                    weights.fill_(clean_name(name), t)
            continue
        for name, t in [*part.named_parameters(), *part.named_buffers()]:
            src = full_state[clean_name(name)]
            if isinstance(t, DTensor):
                local = distribute_tensor(src.to(t.device), t.device_mesh, t.placements, src_data_rank=None)
                t.to_local().copy_(local.to_local())
            else:
                t.copy_(src)
    startup.full_state = None  # the seed path's full copy is not needed any more
    read = (getattr(weights, "bytes_read", 0) - bytes_before) if weights is not None else 0
    return {"path": path, "bytes_read": int(read), "peak_rss_bytes": peak_rss_bytes()}
