"""Pieces of training state that need care: per-rank RNG streams, and staging copies for async save.

A top-level state entry whose object has ``rank_local = True`` (and ``state_dict`` /
``load_state_dict``) is *rank-local*: every rank saves its own copy (DCP would keep only one of
several same-named replicated values). `RNGState` is the built-in one.
"""

from __future__ import annotations

import copy
import ctypes
import random
import sys
from typing import Any

import numpy as np
import torch


def is_stateful(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def is_rank_local(obj: object) -> bool:
    return is_stateful(obj) and bool(getattr(obj, "rank_local", False))


class RNGState:
    """This rank's random number generators: torch CPU, every CUDA device (which is also the state
    the DTensor RNG tracker offsets from), Python's `random` and NumPy's legacy global generator.

    Restoring them makes a resumed run draw the same dropout masks and shuffles as an
    uninterrupted one. Saved per rank (`rank_local`); the values are plain tensors, ints and
    tuples, so they load with ``torch.load(weights_only=True)``.
    """

    rank_local = True

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {
            "torch_cpu": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": _NUMPY.state(),
        }
        if torch.cuda.is_initialized() and torch.cuda.is_available():
            sd["torch_cuda"] = torch.cuda.get_rng_state_all()
        tracker = _dtensor_tracker()
        if tracker is not None:
            sd["dtensor_distribute_region_enabled"] = bool(tracker.distribute_region_enabled)
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        torch.set_rng_state(sd["torch_cpu"])
        random.setstate(_as_tuple(sd["python"]))
        n = sd["numpy"]
        np.random.set_state(
            ("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
        )
        cuda = sd.get("torch_cuda")
        if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        tracker = _dtensor_tracker()
        if tracker is not None and "dtensor_distribute_region_enabled" in sd:
            tracker.distribute_region_enabled = sd["dtensor_distribute_region_enabled"]


class _NumpyGlobal:
    """NumPy's legacy global generator's state, read cheaply while it has not moved.

    `np.random.get_state()` copies the 624-word key one element at a time (tens of µs, most
    of what capturing the RNG streams costs a snapshot at every step), and training rarely
    draws from this generator. Its raw Mersenne Twister state (key and position) is read
    through NumPy's documented ctypes interface instead (one 2.5 KB copy): while those bytes
    equal the last full read and that read held no cached Gaussian, the state is that read
    (drawing a Gaussian either moves them or hands out a held one, and none is held). Otherwise,
    and where the raw layout does not match a full read (checked once per generator), it is read
    in full. One change goes unseen: `np.random.set_state` of a state with this very key and
    position but a Gaussian held (a state saved at this position before a held Gaussian was
    drawn); `np.random.seed` and every draw are seen."""

    _RAW = 624 * 4 + 4  # mt19937_state: uint32 key[624]; int pos

    def __init__(self) -> None:
        self._gen: Any = None
        self._fast = False
        self._raw: bytes | None = None
        self._last: dict[str, Any] | None = None

    def _read_raw(self, gen: Any) -> bytes:
        return bytes((ctypes.c_char * self._RAW).from_address(gen.ctypes.state_address))

    def state(self) -> dict[str, Any]:
        rs = np.random.mtrand._rand
        gen = getattr(rs, "_bit_generator", None)
        raw = None
        if gen is not None and gen is self._gen and self._fast:
            raw = self._read_raw(gen)
            if raw == self._raw and self._last is not None and not self._last["has_gauss"]:
                return dict(self._last)
        st = np.random.get_state(legacy=True)
        out = {"keys": torch.from_numpy(np.asarray(st[1], dtype=np.int64)), "pos": int(st[2]),
               "has_gauss": int(st[3]), "cached_gaussian": float(st[4])}
        if gen is not self._gen:  # a new generator (np.random.set_bit_generator): check the layout once
            self._gen, self._fast = gen, False
            try:
                probe = self._read_raw(gen)
                self._fast = (st[0] == "MT19937" and probe[:-4] == np.asarray(st[1], dtype=np.uint32).tobytes()
                              and int.from_bytes(probe[-4:], sys.byteorder, signed=True) == int(st[2]))
            except (AttributeError, TypeError, ValueError, OSError):
                self._fast = False
        if self._fast:
            self._raw = raw if raw is not None else self._read_raw(gen)
            self._last = out
        return dict(out)


_NUMPY = _NumpyGlobal()


def _as_tuple(x: Any) -> Any:
    # random.setstate wants tuples all the way down; serialisation may hand back lists.
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def _dtensor_tracker() -> Any:
    # the tracker lives in that module; not imported yet means there is none (and no import here)
    mod = sys.modules.get("torch.distributed.tensor._random")
    return getattr(mod, "_rng_tracker", None) if mod is not None else None


def materialize(state: dict[str, Any]) -> dict[str, Any]:
    """A shallow copy of `state` with each top-level Stateful replaced by its state_dict()."""
    return {k: (v.state_dict() if is_stateful(v) else v) for k, v in state.items()}


def stage(obj: Any) -> Any:
    """A copy of a state tree that training can no longer change: every tensor (DTensor
    included, which keeps its mesh and placements) is copied to CPU memory, other leaves are
    deep-copied. This copy is the blocking part of an async save."""
    return Stager().stage(obj)


class Stager:
    """`stage` with CPU buffers kept between saves (the next save copies into them).

    Fresh multi-hundred-MB allocations cost page faults and zeroing on every save; reusing the
    buffers leaves only the memory copy in the training stall. Buffers are reused only when the
    name, shape, dtype and (for DTensors) placements match; reuse is safe because the manager
    joins the previous save before staging the next.
    """

    def __init__(self) -> None:
        self._cache: dict[str, Any] = {}

    def stage(self, obj: Any, path: str = "") -> Any:
        # one no_grad for the whole tree: entering it per node cost as much as the copies
        with torch.no_grad():
            return self._stage(obj, path)

    def _stage(self, obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, path)
        if isinstance(obj, dict):
            return {k: self._stage(v, f"{path}/{k}") for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._stage(v, f"{path}/{i}") for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return tuple(self._stage(v, f"{path}/{i}") for i, v in enumerate(obj))
        if isinstance(obj, (int, float, str, bool, type(None))):
            return obj  # immutable
        return copy.deepcopy(obj)

    def _tensor(self, t: torch.Tensor, path: str) -> torch.Tensor:
        t = t.detach()
        local = getattr(t, "_local_tensor", None)  # a DTensor: copy its shard, keep its spec
        old = self._cache.get(path)
        if old is not None and old.shape == t.shape and old.dtype == t.dtype:
            if local is None and type(old) is torch.Tensor and type(t) is torch.Tensor:
                old.copy_(t)
                return old
            if (
                local is not None
                and getattr(old, "placements", None) == t.placements
                and old.device_mesh == t.device_mesh
                and old._local_tensor.shape == local.shape
            ):
                old._local_tensor.copy_(local)
                return old
        new = t.to("cpu", copy=True)
        self._cache[path] = new
        return new

    def clear(self) -> None:
        self._cache.clear()


class ModelState:
    """A model and (optionally) its optimizer as one Stateful, through
    `torch.distributed.checkpoint.state_dict` so that FSDP2/TP-sharded parameters and their
    optimizer states are saved as DTensors (resharded on load) and optimizer state is keyed by
    parameter name, not by position."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None):
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if self.optimizer is None:
            return {"model": get_model_state_dict(self.model)}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        if self.optimizer is None:
            set_model_state_dict(self.model, sd["model"])
        else:
            set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
