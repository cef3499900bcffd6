"""From meta to real tensors with exactly the single-device initial weights.

Every rank builds the whole model once on CPU with the same seed (the model's own
`init_weights(seed)`), and copies into its parameters the part that its placement owns
(`distribute_tensor(..., src_data_rank=None)` slices locally, no communication). Numerics then
equal single-device training by construction, whatever the plan. The cost is one full CPU copy of
the model per rank during start-up; for models that do not fit in host memory, load a seed
checkpoint with DCP instead (the trainer's job).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable

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


def has_seeded_init(model: nn.Module) -> bool:
    init = getattr(model, "init_weights", None)
    return callable(init) and bool(inspect.signature(init).parameters)


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
        full = copy.deepcopy(meta_model).to_empty(device="cpu")
        init_model(full, seed)
        if hasattr(full, "init_buffers"):
            full.init_buffers()
    state = {clean_name(n): t.detach() for n, t in full.named_parameters()}
    state.update({clean_name(n): t.detach() for n, t in full.named_buffers()})
    return state


@torch.no_grad()
def materialize(parts: list[nn.Module], full_state: dict[str, torch.Tensor], device: torch.device) -> None:
    """`to_empty` every model part on `device`, then copy this rank's slice of each full tensor."""
    for part in parts:
        part.to_empty(device=device)
        for name, t in [*part.named_parameters(), *part.named_buffers()]:
            src = full_state[clean_name(name)]
            if isinstance(t, DTensor):
                local = distribute_tensor(src.to(t.device), t.device_mesh, t.placements, src_data_rank=None)
                t.to_local().copy_(local.to_local())
            else:
                t.copy_(src)
