"""In-memory snapshots of training state between durable checkpoints, surviving a worker's death.

A durable checkpoint every N steps means a failure redoes up to N steps. `Snapshotter` keeps
the last steps' state of this rank in shared memory instead: a directory on a RAM filesystem
(`/dev/shm`) that the elastic agent creates private (0700) and removes when the job ends, so a
snapshot outlives the worker process that wrote it but never the machine, and costs no disk I/O.

Each `take(step, state)` copies every tensor of the state into buffers that *are* shared
memory (tensors mapped on files in that directory, `torch.from_file(shared=True)`): the copy is
the snapshot, there is no write behind it, and its time is the whole stall. A small header
(step, world size, plan tag, the non-tensor values; a pickle of builtin containers only, read
back with an unpickler that admits no class at all) is written after the copy, atomically. Two
slots alternate (``rank<R>-slot<step % 2>``), and a slot's header is removed before its buffers
are overwritten, so a rank that dies mid-copy leaves the other slot intact. `restore(state, durable_step)` is collective: the ranks agree on
the newest step that every rank holds complete for the same world size and plan, and restore it
when it is newer than the durable checkpoint just loaded; the snapshot holds everything a
checkpoint holds (model, optimizer, schedule, RNG streams, step), so the continuation is
bit-identical.

Scope: plans whose state is plain tensors on every rank (DDP, one rank); sharded plans (DTensor
state) are not snapshotted and recover from the durable checkpoint. Buffers are reserved with
`posix_fallocate`, so a full /dev/shm turns snapshots off (with a warning) instead of crashing. A lost node loses its
snapshots (no copy to a peer node yet).
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dtorch.checkpoint.state import is_stateful

log = logging.getLogger("dtorch.checkpoint")
_SLOTS = 2


def available(directory: str | os.PathLike, rank: int, world_size: int) -> dict[int, dict[str, Any]]:
    """Complete snapshots of `rank` in `directory` for `world_size`: step -> header."""
    out = {}
    for slot in range(_SLOTS):
        try:
            doc = _BuiltinsOnly(io.BytesIO((Path(directory) / f"rank{rank}-slot{slot}.hdr").read_bytes())).load()
        except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError):
            continue
        if isinstance(doc, dict) and doc.get("world_size") == world_size and doc.get("rank") == rank:
            out[int(doc["step"])] = doc
    return out


class _BuiltinsOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused {module}.{name}: a snapshot header holds builtin values only")


_SCALARS = {int, float, bool, str, type(None)}


class _Sharded(Exception):
    """The state holds DTensors: not snapshotted (see the module docstring)."""


def _flat(obj: list | tuple) -> bool:
    """A sequence of scalars only (Python's RNG state: 625 ints): kept whole, not walked."""
    return set(map(type, obj)) <= _SCALARS


class Snapshotter:
    """Shared-memory snapshots of this rank's training state in `directory` (see module doc).
    `tag` identifies the configuration (plan): snapshots of another tag are never restored."""

    def __init__(self, directory: str | os.PathLike, rank: int, world_size: int, tag: str = ""):
        self.dir = Path(directory)
        self.rank, self.world_size, self.tag = rank, world_size, tag
        self._bufs: list[list[tuple[torch.Tensor, dict[str, Any]]]] = [[] for _ in range(_SLOTS)]
        self._next = 0
        self._dst: list[torch.Tensor] = []
        self._src: list[torch.Tensor] = []
        self.disabled: str | None = None
        """Why snapshots are off for this run (sharded state, no space), or None."""
        self.stall_s: list[float] = []
        """Seconds each `take` blocked the caller."""

    def _header(self, slot: int) -> Path:
        return self.dir / f"rank{self.rank}-slot{slot}.hdr"

    def _buffer(self, slot: int, t: torch.Tensor) -> dict[str, Any]:
        """The header reference of the next tensor in traversal order, its shared buffer filled."""
        i = self._next
        self._next += 1
        bufs = self._bufs[slot]
        if i < len(bufs) and bufs[i][0].shape == t.shape and bufs[i][0].dtype == t.dtype:
            buf, ref = bufs[i]
        else:
            name = f"rank{self.rank}-slot{slot}-{i}.bin"
            n = t.numel()
            # reserve the pages now: a shared mapping of a file on a full tmpfs would SIGBUS on write
            fd = os.open(self.dir / name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            try:
                os.posix_fallocate(fd, 0, max(1, n) * t.element_size())
            finally:
                os.close(fd)
            buf = torch.from_file(str(self.dir / name), shared=True, size=max(1, n), dtype=t.dtype)[:n].view(t.shape)
            ref = {"__shm__": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
            if i < len(bufs):
                bufs[i] = (buf, ref)
            else:
                bufs.append((buf, ref))
        self._dst.append(buf)
        self._src.append(t)
        return ref

    def _pack(self, obj: Any, slot: int) -> Any:
        """The tree with each tensor copied into its shared buffer and replaced by a reference."""
        if isinstance(obj, torch.Tensor):
            if hasattr(obj, "_local_tensor"):
                raise _Sharded
            return self._buffer(slot, obj)
        if isinstance(obj, dict):
            return {k: self._pack(v, slot) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            if _flat(obj):
                return obj  # pickled into the header in this same call: later changes do not matter
            out = [self._pack(v, slot) for v in obj]
            return out if isinstance(obj, list) else tuple(out)
        return obj

    def take(self, step: int, state: dict[str, Any]) -> None:
        """Snapshot `state` (name -> Stateful or tensors/plain values) as of the end of `step`."""
        if self.disabled:
            return
        t0 = time.perf_counter()
        tree = {k: (v.state_dict() if is_stateful(v) else v) for k, v in state.items()}
        slot = int(step) % _SLOTS
        header = self._header(slot)
        try:
            header.unlink(missing_ok=True)  # this slot is invalid until its copy is complete
            self._next, self._dst, self._src = 0, [], []
            with torch.no_grad():
                packed = self._pack(tree, slot)
                torch._foreach_copy_(self._dst, self._src)  # one call instead of one per tensor
            self._dst, self._src = [], []
            doc = {"step": int(step), "world_size": self.world_size, "rank": self.rank, "tag": self.tag,
                   "tree": packed}
            tmp = header.with_name(f".{header.name}.tmp")
            with open(tmp, "wb") as f:
                f.write(pickle.dumps(doc, protocol=pickle.HIGHEST_PROTOCOL))
            os.replace(tmp, header)
        except _Sharded:
            self.disabled = "sharded (DTensor) state"
            log.info("in-memory snapshots off for this plan: %s", self.disabled)
            return
        except (OSError, RuntimeError) as e:  # /dev/shm full: recover from the durable checkpoint
            self.disabled = f"cannot write snapshots ({e})"
            log.warning("in-memory snapshots off: %s", self.disabled)
            return
        self.stall_s.append(time.perf_counter() - t0)

    def _available(self) -> dict[int, dict[str, Any]]:
        return {s: d for s, d in available(self.dir, self.rank, self.world_size).items() if d.get("tag") == self.tag}

    def _unpack(self, obj: Any) -> Any:
        if isinstance(obj, dict) and "__shm__" in obj:
            name = str(obj["__shm__"])
            if "/" in name or not name.startswith(f"rank{self.rank}-slot"):
                raise ValueError(f"snapshot header names a foreign file {name!r}")
            shape = [int(x) for x in obj["shape"]]
            n = 1
            for x in shape:
                n *= x
            dtype = getattr(torch, str(obj["dtype"]))
            t = torch.from_file(str(self.dir / name), shared=False, size=max(1, n), dtype=dtype)
            return t[:n].view(shape).clone()
        if isinstance(obj, dict):
            return {k: self._unpack(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._unpack(v) for v in obj]
        if isinstance(obj, tuple):
            return tuple(self._unpack(v) for v in obj)
        return obj

    def restore(self, state: dict[str, Any], durable_step: int | None) -> int | None:
        """Collective. Load the newest snapshot that every rank holds, if newer than
        `durable_step`, into `state` (Statefuls via load_state_dict); returns its step or None."""
        mine = self._available()
        steps = set(mine)
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, sorted(steps))
            for g in gathered:
                steps &= set(g)
        best = max(steps, default=None)
        if best is None or (durable_step is not None and best <= durable_step):
            return None
        tree = self._unpack(mine[best]["tree"])
        for k, v in state.items():
            if k not in tree:
                continue
            if is_stateful(v):
                v.load_state_dict(tree[k])
            elif isinstance(v, dict):
                v.update(tree[k])
        return best

    def close(self) -> None:
        self._bufs = [[] for _ in range(_SLOTS)]
