"""Deterministic weight initialisation shared by the reference models.

Every parameter draws its values from its own CPU generator seeded by (seed, parameter name). So
the same seed gives bit-identical weights whether the module was built on CPU, on a GPU, or on
the meta device and materialised with `to_empty`; and a pipeline stage that holds only blocks
4..7 gets exactly the weights blocks 4..7 have in the whole model. Values are drawn in float32
on the CPU and then cast and copied to the parameter's dtype and device.

A parameter that is a DTensor (after FSDP/TP) receives its shard of the same full tensor: each
rank draws the full tensor (cheap next to training) and keeps its own piece, with no
communication. Meta parameters are skipped (there is nothing to fill).
"""

from __future__ import annotations

import zlib

import torch

# Wrapper prefixes that torch inserts into parameter names (compile, activation checkpointing,
# FSDP1); the seed must not depend on them.
_WRAPPER_PARTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def param_seed(seed: int, name: str) -> int:
    """The generator seed of parameter `name` (dotted path from the model root) for model seed `seed`."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


@torch.no_grad()
def normal_(param: torch.Tensor, std: float, seed: int, name: str) -> None:
    """Fill `param` with N(0, std^2) drawn from the generator of (seed, name)."""
    if param.is_meta:
        return
    gen = torch.Generator(device="cpu").manual_seed(param_seed(seed, name))
    full = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
    _copy_full_(param, full)


@torch.no_grad()
def constant_(param: torch.Tensor, value: float) -> None:
    """Fill `param` with `value` (norm weights 1, biases 0)."""
    if param.is_meta:
        return
    param.fill_(value)  # DTensor fill_ is a local op on every shard: no full tensor needed


def _copy_full_(param: torch.Tensor, full: torch.Tensor) -> None:
    if hasattr(param, "device_mesh") and hasattr(param, "placements"):  # a DTensor, without importing dist
        from torch.distributed.tensor import distribute_tensor

        # src_data_rank=None: every rank holds the same full tensor, so each keeps its shard locally.
        full = distribute_tensor(full.to(param.to_local().device, param.dtype), param.device_mesh,
                                 param.placements, src_data_rank=None)
        param.to_local().copy_(full.to_local())
        return
    param.copy_(full.to(device=param.device, dtype=param.dtype))
