"""Deterministic, rank-local weight initialisation shared by the reference models.

Every element of a parameter is a pure function of (model seed, parameter name, the element's
flat index in the WHOLE tensor): a counter-based generator hashes the three (splitmix64) into two
32-bit uniforms and turns them into one N(0, 1) value (Box-Muller, computed in float64 on the
CPU, then rounded to float32). Nothing depends on the order in which tensors or elements are
drawn, so:

- the same seed gives bit-identical weights whether the module was built on CPU, on a GPU, or on
  the meta device and materialised with `to_empty`;
- a pipeline stage that holds only blocks 4..7 gets exactly the weights blocks 4..7 have in the
  whole model;
- a parameter that is a DTensor (after FSDP/TP) is filled on each rank with ONLY its own shard:
  the rank computes the global offset of its local block (`compute_local_shape_and_global_offset`)
  and generates just those indices, in chunks of `CHUNK_ELEMENTS`. No rank ever builds the full
  tensor, so start-up host memory is one shard plus one chunk.

Values are drawn in float32 and then cast and copied to the parameter's dtype and device.
Meta parameters are skipped (there is nothing to fill).
"""

from __future__ import annotations

import math
import zlib

import torch

# Wrapper prefixes that torch inserts into parameter names (compile, activation checkpointing,
# FSDP1); the seed must not depend on them.
_WRAPPER_PARTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")

CHUNK_ELEMENTS = 1 << 20
"""Elements generated at a time (about 40 MB of int64/float64 temporaries)."""

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


def _signed(x: int) -> int:
    """The int64 with the same 64 bits as unsigned `x` (torch has no wrapping uint64 multiply)."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def param_seed(seed: int, name: str) -> int:
    """The generator key of parameter `name` (dotted path from the model root) for model seed `seed`."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix_(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on an int64 tensor, in place (multiplication wraps modulo 2**64)."""
    t = torch.empty_like(x)
    for shift, mult in ((30, _M1), (27, _M2), (31, None)):
        torch.bitwise_right_shift(x, shift, out=t)
        t.bitwise_and_((1 << (64 - shift)) - 1)
        x.bitwise_xor_(t)
        if mult is not None:
            x.mul_(_signed(mult))
    return x


def standard_normal(key: int, flat_index: torch.Tensor) -> torch.Tensor:
    """N(0, 1) float32 values for int64 `flat_index` under generator key `key`."""
    k = _signed(_mix_(torch.tensor([key], dtype=torch.int64)).item())
    x = _mix_(flat_index.mul(_signed(_GAMMA)).add_(k))
    u1 = _srl(x, 32).double().add_(0.5).mul_(2.0**-32)  # (0, 1): log is finite
    u2 = x.bitwise_and_(0xFFFFFFFF).double().mul_(2.0 * math.pi * 2.0**-32)
    return u1.log_().mul_(-2.0).sqrt_().mul_(u2.cos_()).float()


def standard_normal_reference(key: int, index: int) -> float:
    """The same value as `standard_normal` for one index, in pure Python integers (tests)."""
    def mix(v: int) -> int:
        v &= _MASK64
        v = ((v ^ (v >> 30)) * _M1) & _MASK64
        v = ((v ^ (v >> 27)) * _M2) & _MASK64
        return v ^ (v >> 31)

    x = mix(index * _GAMMA + mix(key))
    u1 = ((x >> 32) + 0.5) * 2.0**-32
    u2 = (x & 0xFFFFFFFF) * 2.0**-32
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)


def local_box(param: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(the tensor this rank stores, its shape, its offset in the whole tensor). For a plain
    tensor that is the tensor itself at offset 0; for a DTensor its local shard."""
    if hasattr(param, "device_mesh") and hasattr(param, "placements"):  # a DTensor, without importing dist
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        return param.to_local(), tuple(shape), tuple(offset)
    return param, tuple(param.shape), (0,) * param.dim()


def box_chunks(shape: tuple[int, ...], max_elements: int = CHUNK_ELEMENTS):
    """Ranges [a, b) of the leading dimension such that each chunk holds <= max_elements (>= 1 row)."""
    if not shape:
        yield 0, 1
        return
    row = math.prod(shape[1:]) or 1
    step = max(1, max_elements // row)
    for a in range(0, shape[0], step):
        yield a, min(shape[0], a + step)


def flat_indices(global_shape: tuple[int, ...], offset: tuple[int, ...], shape: tuple[int, ...],
                 rows: tuple[int, int]) -> torch.Tensor:
    """int64 flat indices (in the whole tensor) of rows [a, b) of the box `offset`+`shape`."""
    if not global_shape:
        return torch.zeros((), dtype=torch.int64)
    strides = [math.prod(global_shape[d + 1:]) for d in range(len(global_shape))]
    a, b = rows
    idx = (torch.arange(offset[0] + a, offset[0] + b, dtype=torch.int64) * strides[0])
    for d in range(1, len(global_shape)):
        axis = torch.arange(offset[d], offset[d] + shape[d], dtype=torch.int64) * strides[d]
        idx = idx.unsqueeze(-1) + axis
    return idx


@torch.no_grad()
def normal_(param: torch.Tensor, std: float, seed: int, name: str) -> None:
    """Fill `param` (this rank's part of it) with N(0, std^2) values of (seed, name, index)."""
    if param.is_meta:
        return
    key = param_seed(seed, name)
    local, shape, offset = local_box(param)
    if local.numel() == 0:
        return
    view = local.view(shape) if local.is_contiguous() else local
    for a, b in box_chunks(shape):
        values = standard_normal(key, flat_indices(tuple(param.shape), offset, shape, (a, b)))
        if std != 1.0:
            values.mul_(std)
        if shape:
            view[a:b].copy_(values.to(dtype=local.dtype))
        else:
            view.copy_(values.to(dtype=local.dtype))


@torch.no_grad()
def constant_(param: torch.Tensor, value: float) -> None:
    """Fill `param` with `value` (norm weights 1, biases 0)."""
    if param.is_meta:
        return
    param.fill_(value)  # DTensor fill_ is a local op on every shard: no full tensor needed
