"""In-memory snapshots of training state between durable checkpoints, surviving a worker's death.

A durable checkpoint every N steps means a failure redoes up to N steps. `Snapshotter` keeps
the last steps' state of this rank in shared memory instead: a directory on a RAM filesystem
(`/dev/shm`) that the elastic agent creates private (0700) and removes when the job ends, so a
snapshot outlives the worker process that wrote it but never the machine, and costs no disk I/O.

Each rank snapshots what it holds: its own shards under FSDP or tensor parallelism (the local
tensor of each DTensor, with its mesh and placements written down so that it is rebuilt as the
same DTensor), its own stages under pipeline parallelism, everything under DDP. Nothing is
gathered and no collective runs while a snapshot is taken.

`take(step, state)` has two halves (the split CheckFreq, FAST'21, calls snapshot and persist):

1. On the training thread, at the step boundary (this is the stall): the state dicts are built
   (the model's and the optimizer's per-parameter state reused while their tensors stay the
   same, `LiveModules`, `LiveOptimizers`) and their tensors listed (a reused part's list and
   header references kept per slot, `_LiveDict`). This must be done between steps: FSDP
   registers unsharded parameters during forward and backward.
2. On a side thread, overlapping the next step's data loading: each tensor is matched to its
   buffer (preallocated, shared memory: tensors mapped on files in that directory,
   `torch.from_file(shared=True)`), copied (one `_foreach_copy_`), then a small header (step,
   world size, plan tag, the non-tensor values; a pickle of builtin containers only, read back
   with an unpickler that admits no class at all) is written atomically. `wait()` joins it; the
   trainer's snapshot callback (`dtorch.train.callbacks.Snapshots`) calls it before the next
   step's forward/backward and before a checkpoint save (nothing changes the state before the
   optimizer step, but joining there means a failure anywhere in a step finds the previous step
   complete; one during the next step's data loading may not), and before the next take. `background=False` does the whole take on the training thread.

Two slots alternate (``rank<R>-slot<step % 2>``), and a slot's header is removed before its
buffers are overwritten, so a rank that dies mid-copy leaves the other slot intact.
`restore(state, durable_step)` is collective: the ranks agree on the newest step that every rank
holds complete for the same world size and plan, and restore it when it is newer than the
durable checkpoint just loaded; the snapshot holds everything a checkpoint holds (model,
optimizer, schedule, RNG streams, step), so the continuation is bit-identical. A snapshot of
another world size or plan is never restored: the durable checkpoint (which reshards) is.

Buffers are reserved with `posix_fallocate`, so a full /dev/shm turns snapshots off (with a
warning) instead of crashing.

Every snapshot is signed like a durable checkpoint: its header file holds an HMAC-SHA256, keyed
with the job's secret (`snapshot_key`), of the pickled header and every byte of its tensors in
buffer order, computed on the side thread after the copy. Shared memory is writable by every
process of the user, and memory can go bad: `restore` verifies each copy it reads or receives
before loading anything, skips one that fails (`rejected`) and takes the next source.

A lost node loses its own snapshots, so on more than one node each is also replicated to a peer
node (`peer_ranks`: rank r's goes to the same local rank on the next node, wrapping). A third
thread sends it there after its copy, over a gloo group of its own (`group`; the training
thread's collectives never interleave with it), as its header plus one flat byte buffer; the
peer keeps it as `peer<r>-slot<S>.bin` with its header written last. The next take joins that
round first, so the replica is at most one take behind the rank's own snapshot: a lost node
costs at most one step more than a lost worker, and nothing when the round finished. Every rank
runs one round per take (an empty one for a dropped take), so rounds pair up. `restore` finds,
for each rank, the node that holds its newest step (its own, else its peer's replica) and the
holder sends it over the group.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import itertools
import logging
import operator
import os
import pickle
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dtorch.checkpoint.state import is_stateful

log = logging.getLogger("dtorch.checkpoint")
_SLOTS = 2
_MAGIC = b"DTSNAP1\n"
_MAC_LEN = 32
"""A header file is `_MAGIC`, the snapshot's HMAC-SHA256 (`_MAC_LEN` bytes), then the pickled header."""


class SnapshotRejected(ValueError):
    """A snapshot whose content does not match its HMAC: edited, damaged or written with another key."""


def snapshot_key(secret: bytes | None = None) -> bytes:
    """The key snapshots are signed with, derived from the job's secret (`dtorch.trust.secret`, the
    one durable checkpoints are signed with) for this purpose only."""
    from dtorch import trust

    return hmac.new(secret if secret is not None else trust.secret(), b"dtorch-snapshot", hashlib.sha256).digest()


def _tensor_bytes(t: torch.Tensor) -> Any:
    """The bytes of a CPU tensor without a copy (any dtype, bfloat16 included)."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else b""


def _mac(key: bytes, blob: bytes, chunks: Any) -> bytes:
    """HMAC-SHA256 of a snapshot: its pickled header, then every tensor's bytes (`chunks`, from
    `_tensor_bytes`) in buffer order (`_refs`), so that the same snapshot has the same MAC in its
    own files, in a replica's flat buffer and on the wire. hashlib drops the GIL while hashing
    large buffers."""
    h = hmac.new(key, len(blob).to_bytes(8, "little"), hashlib.sha256)
    h.update(blob)
    for c in chunks:
        h.update(c)
    return h.digest()


def _parse_header(raw: bytes) -> tuple[dict[str, Any], bytes, bytes]:
    """(header, its MAC, the pickled header) from a header file's bytes; ValueError when it is not one."""
    if not raw.startswith(_MAGIC) or len(raw) <= len(_MAGIC) + _MAC_LEN:
        raise ValueError("not a signed snapshot header")
    mac, blob = raw[len(_MAGIC):len(_MAGIC) + _MAC_LEN], raw[len(_MAGIC) + _MAC_LEN:]
    doc = _BuiltinsOnly(io.BytesIO(blob)).load()
    if not isinstance(doc, dict) or "tree" not in doc or "step" not in doc:
        raise ValueError("malformed snapshot header")
    return doc, mac, blob


def _verify(key: bytes, raw: bytes, tensors: list[torch.Tensor]) -> None:
    """Raise SnapshotRejected unless `tensors` (in buffer order) and the header in `raw` are what
    was signed."""
    _, mac, blob = _parse_header(raw)
    if not hmac.compare_digest(mac, _mac(key, blob, map(_tensor_bytes, tensors))):
        raise SnapshotRejected("its HMAC does not match its content (edited in memory, damaged, or signed "
                               "with another key)")


def _headers(directory: str | os.PathLike, kind: str, rank: int | None = None):
    """(rank, slot, path) of every `<kind><R>-slot<S>.hdr` in `directory` (kind "rank": own
    snapshots, "peer": replicas held for a rank on another node), of `rank` only if given."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if not (name.startswith(kind) and name.endswith(".hdr")):
            continue
        head = name[len(kind):-len(".hdr")]
        r, sep, slot = head.partition("-slot")
        if not (sep and r.isdigit() and slot.isdigit()) or (rank is not None and int(r) != rank):
            continue
        yield int(r), int(slot), Path(directory) / name


def _read_header(path: Path) -> dict[str, Any] | None:
    """The header in `path` (its file bytes under "_raw", for verification and replication), or
    None when it is not a snapshot header. Its MAC is checked with the tensors, at a restore."""
    try:
        raw = path.read_bytes()
        doc, _, _ = _parse_header(raw)
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError):
        return None
    doc["_raw"] = raw
    return doc


def available(directory: str | os.PathLike, rank: int, world_size: int) -> dict[int, dict[str, Any]]:
    """Complete snapshots of `rank` in `directory` for `world_size`: step -> header (own
    snapshots first; a replica received from the rank's node is used for a step it lacks)."""
    out: dict[int, dict[str, Any]] = {}
    for kind in ("peer", "rank"):  # own snapshots win over replicas of the same step
        for r, _, path in _headers(directory, kind, rank):
            doc = _read_header(path)
            if doc is not None and doc.get("world_size") == world_size and doc.get("rank") == r:
                out[int(doc["step"])] = {**doc, "_kind": kind}
    return out


def inventory(directory: str | os.PathLike | None, world_size: int, tag: str | None = None) -> list[list[Any]]:
    """[rank, step] of every complete snapshot in `directory` (this node's: its ranks' own and
    the replicas it holds for ranks on another node) for `world_size` (and `tag` if given)."""
    out = set()
    if directory:
        for kind in ("rank", "peer"):
            for r, _, path in _headers(directory, kind):
                doc = _read_header(path)
                if (doc is not None and doc.get("world_size") == world_size and doc.get("rank") == r
                        and (tag is None or doc.get("tag") == tag)):
                    out.add((r, int(doc["step"])))
    return sorted([r, s] for r, s in out)


def common_steps(inventories: list[list[list[Any]]], world_size: int) -> dict[int, dict[int, list[int]]]:
    """From every rank's `inventory`: step -> {rank: [ranks whose node holds that rank's snapshot
    of that step]}, for the steps of which every rank's snapshot is held somewhere."""
    held: dict[int, dict[int, list[int]]] = {}
    for holder, inv in enumerate(inventories):
        for r, s in inv:
            held.setdefault(int(s), {}).setdefault(int(r), []).append(holder)
    return {s: h for s, h in held.items() if all(r in h for r in range(world_size))}


class _BuiltinsOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused {module}.{name}: a snapshot header holds builtin values only")


_SCALARS = {int, float, bool, str, type(None)}
_CHECK_LATER = 64
"""Tuples longer than this are checked for scalars-only on the side thread (`Snapshotter._pack`)."""


class _NotSnapshottable(Exception):
    """The state holds something a snapshot cannot describe with builtins (see `_placements`)."""


def _flat(obj: list | tuple) -> bool:
    """A sequence of scalars only (Python's RNG state: 625 ints): kept whole, not walked."""
    return set(map(type, obj)) <= _SCALARS


# ---- DTensors: the local shard plus what rebuilds the same DTensor around it ----------------------
def _placement_types() -> dict[str, Any]:
    from torch.distributed.tensor import placement_types as pt

    return {"Shard": pt.Shard, "Replicate": pt.Replicate, "Partial": pt.Partial, "_StridedShard": pt._StridedShard}


def _placements(placements: tuple[Any, ...]) -> list[list[Any]]:
    """DTensor placements as builtins: ["Shard", dim], ["_StridedShard", dim, split_factor],
    ["Replicate"], ["Partial", reduce_op]."""
    out = []
    for p in placements:
        name = type(p).__name__
        if name == "_StridedShard":
            out.append([name, int(p.dim), int(p.split_factor)])
        elif name == "Shard":
            out.append([name, int(p.dim)])
        elif name == "Replicate":
            out.append([name])
        elif name == "Partial":
            out.append([name, str(p.reduce_op)])
        else:
            raise _NotSnapshottable(f"DTensor placement {p!r}")
    return out


def _unplacements(doc: list[list[Any]]) -> tuple[Any, ...]:
    types = _placement_types()
    out = []
    for p in doc:
        cls = types[str(p[0])]
        if p[0] == "_StridedShard":
            out.append(cls(int(p[1]), split_factor=int(p[2])))
        elif p[0] == "Shard":
            out.append(cls(int(p[1])))
        elif p[0] == "Partial":
            out.append(cls(str(p[1])))
        else:
            out.append(cls())
    return tuple(out)


def _mesh_key(mesh: Any) -> str:
    """A device mesh by what identifies it: device type, axis names, shape and ranks."""
    return f"{mesh.device_type}|{mesh.mesh_dim_names}|{list(mesh.mesh.shape)}|{mesh.mesh.flatten().tolist()}"


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "_local_tensor") and hasattr(t, "device_mesh")


def _meshes(obj: Any, out: dict[str, Any]) -> dict[str, Any]:
    """Every device mesh of the DTensors in a state tree, by `_mesh_key`."""
    if isinstance(obj, torch.Tensor):
        if _is_dtensor(obj):
            out.setdefault(_mesh_key(obj.device_mesh), obj.device_mesh)
    elif isinstance(obj, dict):
        for v in obj.values():
            _meshes(v, out)
    elif isinstance(obj, (list, tuple)) and not _flat(obj):
        for v in obj:
            _meshes(v, out)
    return out


class _LiveDict(dict):
    """A state-dict subtree that its owner hands out again, the very same object, only while every
    leaf is still the live tensor it was (values change in place, nothing else does). A snapshot
    packs it once per slot and reuses the packing while the owner returns the same object
    (`Snapshotter._pack`); it is never changed after it is made."""


def _storage_ptr(t: torch.Tensor) -> int:
    return (t._local_tensor if _is_dtensor(t) else t).data_ptr()


class LiveModules:
    """Modules as one Stateful over their native state dicts, for snapshots of the same plan.

    Building a module's state dict walks every submodule in Python, which is most of what a
    snapshot costs the training thread at small scale. Its tensors are views of the parameters'
    and buffers' own storage, so the dict built at one step still reads the current values at
    the next, as long as no parameter, buffer or submodule was added, removed or replaced and no
    storage moved. `state_dict()` checks exactly that (one dictionary look-up, an identity test
    and a pointer per tensor, a length per submodule) and reuses the dict while it holds; any
    leaf that is not a parameter or buffer of these modules (a state-dict hook's own tensor, an
    extra state) means the dict is rebuilt every time."""

    def __init__(self, modules: list[torch.nn.Module]):
        self.modules = list(modules)
        self._cached: dict[str, Any] | None = None
        self._owners: list[tuple[dict, str]] = []
        self._objs: list[torch.Tensor] = []
        self._ptrs: list[int] = []
        self._dts: list[bool] = []
        self._dicts: list[dict] = []
        self._lens: list[int] = []

    def _structure(self) -> list[dict]:
        """Every submodule's children, parameters and buffers (a change in any count is a change)."""
        return [d for m in self.modules for sub in m.modules() for d in (sub._modules, sub._parameters, sub._buffers)]

    def _bind(self, sd: dict[str, Any]) -> bool:
        """Tie every leaf of `sd` to the live parameter or buffer whose storage it views."""
        owners: dict[int, tuple[dict, str, Any]] = {}
        for m in self.modules:
            for sub in m.modules():
                for d in (sub._parameters, sub._buffers):
                    for name, t in d.items():
                        if t is not None:
                            owners[_storage_ptr(t)] = (d, name, t)
        checks = []
        for part in sd.values():
            for v in part.values():
                if not isinstance(v, torch.Tensor):
                    return False
                owner = owners.get(_storage_ptr(v))
                if owner is None or owner[2].shape != v.shape:
                    return False
                checks.append(owner)
        self._owners = [(d, name) for d, name, _ in checks]
        self._objs = [t for _, _, t in checks]
        self._dts = [_is_dtensor(t) for t in self._objs]
        self._ptrs = self._storage_ptrs()
        self._dicts = self._structure()
        self._lens = [len(d) for d in self._dicts]
        return True

    def _holds(self) -> bool:
        return ([len(d) for d in self._dicts] == self._lens
                and all(d.get(name) is t for (d, name), t in zip(self._owners, self._objs))
                and self._storage_ptrs() == self._ptrs)

    def _storage_ptrs(self) -> list[int]:
        return [(t._local_tensor if dt else t).data_ptr() for t, dt in zip(self._objs, self._dts)]

    def state_dict(self) -> dict[str, Any]:
        if self._cached is not None and self._holds():
            return self._cached
        sd = _LiveDict({str(i): m.state_dict() for i, m in enumerate(self.modules)})
        if self._bind(sd):
            self._cached = sd
            return sd
        self._cached = None
        return dict(sd)  # not live: packed afresh at every take

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._cached = None
        for i, m in enumerate(self.modules):
            m.load_state_dict(sd[str(i)])


class LiveOptimizers:
    """Optimizers as one Stateful over their native state dicts, the per-parameter state reused.

    `torch.optim.Optimizer.state_dict()` already hands out its live per-parameter state dicts;
    in torch's optimizers (AdamW included: "step" is a 0-d tensor incremented in place, the
    moments updated in place) those dicts, their tensors and their storage stay the same from
    step to step once the first step has made them, and only the param groups' scalars change
    (the schedule writes "lr"). So the "state" part of each optimizer is built once, a
    `_LiveDict` reused while every parameter's state dict and every value in it is still the
    same object (identity tests in C loops; a replaced value, a new parameter or a
    `load_state_dict` rebuilds it); the param groups are copied afresh at every call. An
    optimizer with state-dict hooks (which may rewrite the dict), or with a `state_dict` of its
    own (its `state` need not hold its numbers: the NVMe offload tier keeps meta tensors there and
    the moments in files, `dtorch.train.offload`), is asked for its full state dict every time."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = list(optimizers)
        self._live: list[tuple[Any, ...] | None] = [None] * len(self.optimizers)

    @staticmethod
    def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        seen: dict[int, torch.Tensor] = {}
        for g in opt.param_groups:
            for q in g["params"]:
                seen.setdefault(id(q), q)
        return list(seen.values())

    def _build(self, opt: torch.optim.Optimizer) -> tuple[Any, ...] | None:
        params = self._params(opt)
        index = {id(q): i for i, q in enumerate(params)}
        if any(not isinstance(k, torch.Tensor) or id(k) not in index for k in opt.state):
            return None
        holders = [opt.state[q] for q in params if q in opt.state]
        keys = [q for q in params if q in opt.state]
        state = _LiveDict({index[id(q)]: d for q, d in zip(keys, holders)})
        dicts, names, values = [], [], []
        for d in holders:
            for k, v in d.items():
                dicts.append(d)
                names.append(k)
                values.append(v)
        return (params, keys, holders, [len(d) for d in holders], dicts, names, values, state, len(opt.state))

    @staticmethod
    def _holds(opt: torch.optim.Optimizer, live: tuple[Any, ...]) -> bool:
        params, keys, holders, lens, dicts, names, values, _, n = live
        groups = [q for g in opt.param_groups for q in g["params"]]
        return (len(opt.state) == n and len(groups) == len(params) and all(map(operator.is_, groups, params))
                and all(map(operator.is_, map(opt.state.get, keys), holders))
                and list(map(len, holders)) == lens
                and all(map(operator.is_, map(dict.__getitem__, dicts, names), values)))

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for i, opt in enumerate(self.optimizers):
            if (opt._optimizer_state_dict_pre_hooks or opt._optimizer_state_dict_post_hooks
                    or type(opt).state_dict is not torch.optim.Optimizer.state_dict):
                out[str(i)] = opt.state_dict()
                continue
            live = self._live[i]
            if live is None or not self._holds(opt, live):
                live = self._live[i] = self._build(opt)
                if live is None:
                    out[str(i)] = opt.state_dict()
                    continue
            index: dict[int, int] = {}
            groups = []
            for g in opt.param_groups:
                packed = {k: v for k, v in g.items() if k != "params"}
                packed["params"] = [index.setdefault(id(q), len(index)) for q in g["params"]]
                groups.append(packed)
            out[str(i)] = {"state": live[7], "param_groups": groups}
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._live = [None] * len(self.optimizers)
        for i, opt in enumerate(self.optimizers):
            opt.load_state_dict(sd[str(i)])


# ---- replication: helpers ------------------------------------------------------------------------
def peer_ranks(nodes: list[tuple[int, int]], rank: int) -> tuple[int | None, int | None]:
    """(peer, source) of `rank` given every rank's (node rank, local rank): the peer is the same
    local rank on the next node (in node-rank order, wrapping), which holds a replica of this
    rank's snapshots; the source the same local rank on the previous node, whose replica this
    rank holds. (None, None) on one node; None where that node has no such local rank."""
    ids = sorted({n for n, _ in nodes})
    if len(ids) < 2:
        return None, None
    node, local = nodes[rank]
    i = ids.index(node)

    def on(n: int) -> int | None:
        return next((r for r, (nn, ll) in enumerate(nodes) if nn == n and ll == local), None)

    return on(ids[(i + 1) % len(ids)]), on(ids[(i - 1) % len(ids)])


def _numel(shape: list[int]) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def _shape_dtype(ref: dict[str, Any]) -> tuple[list[int], torch.dtype]:
    shape = [int(x) for x in ref["shape"]]
    dtype = getattr(torch, str(ref["dtype"]), None)
    if not isinstance(dtype, torch.dtype) or any(x < 0 for x in shape):
        raise ValueError(f"snapshot header has a bad tensor description {ref!r}")
    return shape, dtype


def _mapped(path: Path, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A tensor mapped shared on a file of its size, its pages reserved now: a shared mapping of a
    file on a full tmpfs would SIGBUS on write; `posix_fallocate` fails cleanly instead."""
    n = _numel(shape)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        os.posix_fallocate(fd, 0, max(1, n) * torch.empty((), dtype=dtype).element_size())
    finally:
        os.close(fd)
    return torch.from_file(str(path), shared=True, size=max(1, n), dtype=dtype)[:n].view(shape)


def _refs(tree: Any) -> list[dict[str, Any]]:
    """The tensor references of a packed tree, by buffer index (the order buffers are sent in)."""
    out: dict[str, dict[str, Any]] = {}

    def walk(obj: Any) -> None:
        if isinstance(obj, dict) and "__shm__" in obj:
            out[str(obj["__shm__"])] = obj
        elif isinstance(obj, dict) and "__dtensor__" in obj:
            walk(obj["__dtensor__"])
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)

    walk(tree)
    return [out[k] for k in sorted(out, key=lambda n: int(n.rsplit("-", 1)[-1].removesuffix(".bin")))]


_ALIGN = 64
"""Byte alignment of each tensor in a replica's flat buffer (any dtype can view it)."""


def _layout(refs: list[dict[str, Any]]) -> tuple[list[tuple[int, int, list[int], torch.dtype]], int]:
    """Where each tensor of `refs` lies in a flat replica buffer: (offset, bytes, shape, dtype)
    each, and the total bytes."""
    out, off = [], 0
    for ref in refs:
        shape, dtype = _shape_dtype(ref)
        nb = _numel(shape) * dtype.itemsize
        out.append((off, nb, shape, dtype))
        off += -(-nb // _ALIGN) * _ALIGN
    return out, off


def _views(flat: torch.Tensor, layout: list[tuple[int, int, list[int], torch.dtype]]) -> list[torch.Tensor]:
    return [flat[o:o + nb].view(dtype).view(shape) for o, nb, shape, dtype in layout]


def _flatten(bufs: list[torch.Tensor], refs: list[dict[str, Any]], out: torch.Tensor | None = None) -> torch.Tensor:
    """The tensors `bufs` (described by `refs`) in one flat byte buffer (`out` reused if its size
    fits): one message instead of one per tensor, copied in one `_foreach_copy_`."""
    layout, total = _layout(refs)
    if out is None or out.numel() != total:
        out = torch.empty(total, dtype=torch.uint8)
    pairs = [(v, b) for v, b in zip(_views(out, layout), bufs) if b.numel()]
    if pairs:
        with torch.no_grad():
            torch._foreach_copy_([v for v, _ in pairs], [b for _, b in pairs])
    return out


def _fresh(doc: dict[str, Any], refs: list[dict[str, Any]], total: int) -> torch.Tensor:
    """A plain buffer to receive a snapshot into (at a restore: loaded, then dropped)."""
    return torch.empty(total, dtype=torch.uint8)


def _send_async(dst: int, blob: bytes | None, flat: torch.Tensor | None, group: Any, error: bool = False) -> list[Any]:
    """Post one snapshot message to `dst`: a meta tensor [header bytes, buffer bytes] (tag 0;
    [0, 0] for none this round, [-1, 0] for "cannot"), the header (tag 1), the flat buffer of
    every tensor (tag 2, `_flatten`)."""
    if blob is None or flat is None:
        return [dist.isend(torch.tensor([-1 if error else 0, 0], dtype=torch.int64), dst, group=group, tag=0)]
    works = [dist.isend(torch.tensor([len(blob), flat.numel()], dtype=torch.int64), dst, group=group, tag=0),
             dist.isend(torch.frombuffer(bytearray(blob), dtype=torch.uint8), dst, group=group, tag=1)]
    if flat.numel():
        works.append(dist.isend(flat, dst, group=group, tag=2))
    return works


def _recv(src: int, group: Any, alloc: Any) -> tuple[dict[str, Any], bytes, dict[str, torch.Tensor]] | None:
    """Receive one snapshot message from `src` (see `_send_async`): (header, its bytes, name ->
    tensor, views of the flat buffer `alloc(header, refs, bytes)`); None when `src` sent none."""
    meta = torch.zeros(2, dtype=torch.int64)
    dist.recv(meta, src, group=group, tag=0)
    n_hdr, n_bytes = (int(x) for x in meta.tolist())
    if n_hdr <= 0:
        return None
    raw_t = torch.empty(n_hdr, dtype=torch.uint8)
    dist.recv(raw_t, src, group=group, tag=1)
    raw = raw_t.numpy().tobytes()
    try:
        doc, _, _ = _parse_header(raw)
    except (ValueError, pickle.UnpicklingError, EOFError, TypeError, AttributeError) as e:
        raise ValueError(f"rank {src} sent a malformed snapshot header ({e})") from None
    refs = _refs(doc["tree"])
    layout, total = _layout(refs)
    if total != n_bytes:
        raise ValueError(f"rank {src} sent {n_bytes} bytes for a snapshot of {total}")
    flat = alloc(doc, refs, total)
    if total:
        dist.recv(flat, src, group=group, tag=2)
    return doc, raw, {str(ref["__shm__"]): v for ref, v in zip(refs, _views(flat, layout))}


class Snapshotter:
    """Shared-memory snapshots of this rank's training state in `directory` (see module doc).
    `tag` identifies the configuration (plan): snapshots of another tag are never restored."""

    def __init__(self, directory: str | os.PathLike, rank: int, world_size: int, tag: str = "",
                 background: bool = True, group: Any = None, peer: int | None = None, source: int | None = None,
                 key: bytes | None = None):
        self.dir = Path(directory)
        self.key = key if key is not None else snapshot_key()
        """What every snapshot is signed with (`snapshot_key`: the job's secret, as for durable
        checkpoints); a snapshot that does not verify is never restored."""
        self.rejected: list[dict[str, Any]] = []
        """The snapshots the last `restore` skipped because they did not verify: rank, step, where
        held ("own" node or a "peer" node's replica) and why."""
        self.group, self.peer, self.source = group, peer, source
        """Replication to a peer node (`peer_ranks`): every snapshot is also sent to rank `peer` (on
        the next node) over `group` (a gloo group of its own, so the side thread never interleaves
        with the training thread's collectives), and rank `source`'s snapshot is received and kept
        here as `peer<source>-slot<S>`. None: no replication (one node)."""
        self._repl_pool: ThreadPoolExecutor | None = None
        self._repl_pending: list[Future | None] = [None] * _SLOTS
        self._matched: list[tuple[Any, ...] | None] = [None] * _SLOTS
        """Per slot, the last copy's tensors, reference dicts and buffers (`_match`)."""
        self._peer_flat: list[torch.Tensor | None] = [None] * _SLOTS
        self._stage: list[torch.Tensor | None] = [None] * _SLOTS
        self.repl_off: str | None = None
        """Why replication stopped (a peer failed or timed out), or None."""
        self.repl_s: list[float] = []
        """Seconds of each replication round (sent and received) on the replication thread."""
        self.rank, self.world_size, self.tag = rank, world_size, tag
        self.background = background
        """Copy on the side thread (default); False: the whole take on the caller's thread, for
        comparison (`benchmarks/bench_failure_cost.py`) and where threads cost more than they save."""
        self._bufs: list[list[tuple[torch.Tensor, dict[str, Any]]]] = [[] for _ in range(_SLOTS)]
        self._views: list[list[Any]] = [[] for _ in range(_SLOTS)]
        """Per slot, each buffer's bytes (`_tensor_bytes`), for its MAC."""
        self._src: list[torch.Tensor] = []
        self._refs: list[dict[str, Any]] = []
        self._live_packs: list[dict[int, tuple[Any, ...]]] = [{} for _ in range(_SLOTS)]
        self._live_used: dict[int, tuple[Any, ...]] = {}
        self._deferred: list[tuple[Any, ...]] = []
        self._walk_tuples = False
        self._mesh_keys: dict[int, str] = {}
        self._placement_docs: dict[tuple[Any, ...], list[list[Any]]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._lock = threading.Lock()
        self.disabled: str | None = None
        """Why snapshots are off for this run (no space, a state it cannot describe), or None."""
        self.stall_s: list[float] = []
        """Seconds each take blocked the training thread: its first half plus any wait for its copy."""
        self.parts_s: dict[str, list[float]] = {"state_dicts": [], "match": [], "wait": [], "copy": []}
        """Where the time goes, per take (seconds): "state_dicts" building the state tree and "match"
        listing its tensors (both on the training thread), "wait" the training thread waiting for
        the side thread, "copy" the side thread's work (buffers matched, copy, header). With
        `background=False`, "match" is everything after the state dicts."""

    def _header(self, slot: int) -> Path:
        return self.dir / f"rank{self.rank}-slot{slot}.hdr"

    def _allocate(self, slot: int, i: int, t: torch.Tensor) -> None:
        """Buffer `i` of `slot`, shaped like `t`: a file in the snapshot directory mapped shared."""
        name = f"rank{self.rank}-slot{slot}-{i}.bin"
        buf = _mapped(self.dir / name, list(t.shape), t.dtype)
        ref = {"__shm__": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
        bufs, views = self._bufs[slot], self._views[slot]
        if i < len(bufs):
            bufs[i] = (buf, ref)
            views[i] = _tensor_bytes(buf)
        else:
            bufs.append((buf, ref))
            views.append(_tensor_bytes(buf))

    def _buffer(self, slot: int, t: torch.Tensor) -> dict[str, Any]:
        """The header reference of the next tensor in traversal order: an empty dict that the side
        thread fills once it has matched `t` to its buffer (`_match`), so the training thread
        spends no time on shapes and dtypes."""
        ref: dict[str, Any] = {}
        self._src.append(t)
        self._refs.append(ref)
        return ref

    def _match(self, slot: int, src: list[torch.Tensor], refs: list[dict[str, Any]]) -> list[torch.Tensor]:
        """Side thread: the buffer of each tensor (kept between takes; a new one where the shape
        or dtype differs from last time), its reference filled in."""
        bufs = self._bufs[slot]
        prev = self._matched[slot]
        if prev is not None and len(prev[0]) == len(src):
            # The same tensor and the same reference dict as this slot's last copy: a live packing
            # reused (`_pack_live`: its owner checked that every tensor is still the one it was,
            # `LiveModules`, `LiveOptimizers`), the same buffer. Found in C loops: a Python loop
            # over every tensor (even reading .shape) would hold the GIL against the training
            # thread for ~0.3 us a tensor. The others are matched one by one.
            psrc, prefs, dst = prev
            same = map(operator.and_, map(operator.is_, src, psrc), map(operator.is_, refs, prefs))
            todo: Any = list(itertools.compress(range(len(src)), map(operator.not_, same)))
            dst = list(dst)
        else:
            todo, dst = range(len(src)), [None] * len(src)
        for i in todo:
            t = src[i]
            if i >= len(bufs) or bufs[i][0].shape != t.shape or bufs[i][0].dtype != t.dtype:
                self._allocate(slot, i, t)
            buf, ref = bufs[i]
            refs[i].update(ref)
            dst[i] = buf
        self._matched[slot] = (src, refs, dst)
        return dst

    def _dtensor(self, slot: int, t: Any) -> dict[str, Any]:
        """A DTensor: its local shard in a buffer, with the mesh, placements, global shape and
        stride that rebuild it (`DTensor.from_local`)."""
        mesh = t.device_mesh
        key = self._mesh_keys.get(id(mesh))
        if key is None:
            key = self._mesh_keys[id(mesh)] = _mesh_key(mesh)
        placements = tuple(t.placements)
        pdoc = self._placement_docs.get(placements)
        if pdoc is None:
            pdoc = self._placement_docs[placements] = _placements(placements)
        return {"__dtensor__": self._buffer(slot, t._local_tensor), "mesh": key, "placements": pdoc,
                "shape": list(t.shape), "stride": list(t.stride())}

    def _pack(self, obj: Any, slot: int) -> Any:
        """The tree with each tensor queued for its shared buffer and replaced by a reference.
        (On the training thread at every step: one type test per node, plain tensors inline.)"""
        typ = type(obj)
        if typ is dict:
            return {k: self._pack(v, slot) for k, v in obj.items()}
        if typ is _LiveDict:
            return self._pack_live(obj, slot)
        if typ is torch.Tensor:
            ref: dict[str, Any] = {}
            self._src.append(obj)
            self._refs.append(ref)
            return ref
        if typ in _SCALARS:
            return obj
        if isinstance(obj, torch.Tensor):
            return self._dtensor(slot, obj) if _is_dtensor(obj) else self._buffer(slot, obj)
        if typ is tuple and len(obj) > _CHECK_LATER and not self._walk_tuples:
            # a long tuple (Python's RNG state: 625 ints) is almost surely scalars only, which
            # nothing can change: kept whole, and the side thread checks it before the header
            # is written (`_persist`: anything else in it, and this take is dropped and long
            # tuples are walked here from then on)
            self._deferred.append(obj)
            return obj
        if isinstance(obj, (list, tuple)):
            if _flat(obj):
                return obj  # scalars only: pickled (by the side thread) before the next step runs
            out = [self._pack(v, slot) for v in obj]
            return out if isinstance(obj, list) else tuple(out)
        if isinstance(obj, dict):
            return {k: self._pack(v, slot) for k, v in obj.items()}
        return obj

    def _pack_live(self, obj: _LiveDict, slot: int) -> Any:
        """A `_LiveDict`: packed the first time this slot meets it, then the same packing and the
        same tensors reused while its owner hands out the same object (the side thread refills
        the references of this slot's packing only, at this slot's copy)."""
        hit = self._live_packs[slot].get(id(obj))
        if hit is not None and hit[0] is obj:
            _, packed, src, refs = hit
            self._src.extend(src)
            self._refs.extend(refs)
        else:
            start = len(self._src)
            packed = {k: self._pack(v, slot) for k, v in obj.items()}
            hit = (obj, packed, self._src[start:], self._refs[start:])
        self._live_used[id(obj)] = hit
        return packed

    def take(self, step: int, state: dict[str, Any]) -> None:
        """Snapshot `state` (name -> Stateful or tensors/plain values) as of the end of `step`.
        Returns after the first half (see the module doc); the copy runs on until `wait()`.
        Nothing in `state` may change before `wait()` returns."""
        slot = int(step) % _SLOTS
        if not self.disabled:
            self.wait()
        for other in range(_SLOTS):
            # the last take's replica is complete before this one starts (a lost node then costs at
            # most one step more than a lost worker), and no round still reads this slot's buffers
            self._join_round(other)
        if self.disabled:
            self._submit_round(slot, None, [])  # the peer still pairs one round with this take
            return
        t0 = time.perf_counter()
        tree = {k: (v.state_dict() if is_stateful(v) else v) for k, v in state.items()}
        t1 = time.perf_counter()
        try:
            self._src, self._refs, self._live_used, self._deferred = [], [], {}, []
            packed = self._pack(tree, slot)
            self._live_packs[slot] = self._live_used  # what this take did not meet is dropped
        except _NotSnapshottable as e:
            self._turn_off(f"the state holds {e}", warn=False)
            self._submit_round(slot, None, [])  # the peer still pairs one round with this take
            return
        except (OSError, RuntimeError) as e:  # /dev/shm full: recover from the durable checkpoint
            self._turn_off(f"cannot write snapshots ({e})")
            self._submit_round(slot, None, [])
            return
        src, refs, deferred = self._src, self._refs, self._deferred
        self._src, self._refs, self._deferred = [], [], []
        doc = {"step": int(step), "world_size": self.world_size, "rank": self.rank, "tag": self.tag, "tree": packed}
        if not self.background:
            done: Future = Future()
            try:
                done.set_result(self._persist(slot, doc, src, refs, deferred))
            except (OSError, RuntimeError) as e:
                done.set_exception(e)
            self._pending = done
            t2 = time.perf_counter()
            self.parts_s["state_dicts"].append(t1 - t0)
            self.parts_s["match"].append(t2 - t1)  # here: everything after the state dicts
            self.stall_s.append(t2 - t0)
            self.wait()
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dtorch-snapshot")
        self._pending = self._pool.submit(self._persist, slot, doc, src, refs, deferred)
        t2 = time.perf_counter()
        self.parts_s["state_dicts"].append(t1 - t0)
        self.parts_s["match"].append(t2 - t1)
        self.stall_s.append(t2 - t0)

    def _persist(self, slot: int, doc: dict[str, Any], src: list[torch.Tensor], refs: list[dict[str, Any]],
                 deferred: list[tuple[Any, ...]] = ()) -> float:
        """The side thread's half: invalidate the slot, match buffers, copy, write its header.
        Returns seconds. A failed copy still runs this take's (empty) replication round."""
        queued = self._repl_pending[slot]
        try:
            return self._persist_local(slot, doc, src, refs, deferred)
        except BaseException:
            if self._repl_pending[slot] is queued:
                self._submit_round(slot, None, [])
            raise

    def _persist_local(self, slot: int, doc: dict[str, Any], src: list[torch.Tensor], refs: list[dict[str, Any]],
                       deferred: list[tuple[Any, ...]]) -> float:
        t0 = time.perf_counter()
        header = self._header(slot)
        header.unlink(missing_ok=True)  # this slot is invalid until its copy is complete
        if not all(map(_flat, deferred)):
            # a long tuple held more than scalars (a tensor would be pickled whole, a list read
            # after the boundary): this take stays invalid, and long tuples are walked from now on
            self._walk_tuples = True
            log.info("in-memory snapshot of step %s dropped: a long tuple in the state holds more than scalars; "
                     "long tuples are walked at the step boundary from now on", doc.get("step"))
            self._submit_round(slot, None, [])
            return time.perf_counter() - t0
        dst = self._match(slot, src, refs)
        with torch.no_grad():  # grad mode is per thread
            torch._foreach_copy_(dst, src)  # one call instead of one per tensor
        tmp = header.with_name(f".{header.name}.tmp")
        blob = pickle.dumps(doc, protocol=pickle.HIGHEST_PROTOCOL)
        # signed as written to shared memory: what a restore reads back must be this, byte for byte
        views = self._views[slot]  # the buffers' bytes, made once per buffer (per-take views cost the GIL)
        raw = _MAGIC + _mac(self.key, blob, (views[i] for i in range(len(dst)))) + blob
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        os.replace(tmp, header)
        self._submit_round(slot, raw, dst, refs)
        return time.perf_counter() - t0

    # ---- replication to a peer node ----------------------------------------------------------
    def _submit_round(self, slot: int, blob: bytes | None, bufs: list[torch.Tensor],
                      refs: list[dict[str, Any]] = ()) -> None:
        """Queue one replication round (this snapshot out to `peer`, `source`'s in) on the
        replication thread: it reads this slot's buffers, which the next take leaves alone (it
        writes the other slot) and the take after joins first (`_join_round`). Every rank runs
        one round per take, an empty one (blob None) for a dropped take, so rounds pair up."""
        if self.group is None or self.repl_off or (self.peer is None and self.source is None):
            return
        if self._repl_pool is None:
            self._repl_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dtorch-snapshot-peer")
        self._repl_pending[slot] = self._repl_pool.submit(self._round, slot, blob, list(bufs), list(refs))

    def _join_round(self, slot: int) -> None:
        pending, self._repl_pending[slot] = self._repl_pending[slot], None
        if pending is None:
            return
        try:
            self.repl_s.append(pending.result())
        except (OSError, RuntimeError, ValueError, pickle.UnpicklingError) as e:
            self.repl_off = str(e).splitlines()[0] if str(e) else type(e).__name__
            log.warning("in-memory snapshot replication to the peer node off: %s", self.repl_off)

    def _round(self, slot: int, blob: bytes | None, bufs: list[torch.Tensor], refs: list[dict[str, Any]]) -> float:
        """Replication thread: send this snapshot (its header and its tensors in one flat buffer,
        `_send_async`) to `peer`; receive `source`'s into this node's `peer<source>-slot<S>.bin`,
        its header written last (atomically)."""
        t0 = time.perf_counter()
        sends = []
        if self.peer is not None:
            flat = None
            if blob is not None:
                flat = self._stage[slot] = _flatten(bufs, refs, self._stage[slot])
            sends = _send_async(self.peer, blob, flat, self.group)
        if self.source is not None:
            got = _recv(self.source, self.group, self._peer_alloc)
            if got is not None:
                doc, raw, _ = got
                if doc.get("rank") != self.source or doc.get("world_size") != self.world_size:
                    raise ValueError(f"rank {self.source} sent a snapshot of rank {doc.get('rank')}")
                header = self.dir / f"peer{self.source}-slot{int(doc['step']) % _SLOTS}.hdr"
                tmp = header.with_name(f".{header.name}.tmp")
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(raw)  # signed by its rank: verified when it is restored
                os.replace(tmp, header)
        for w in sends:
            w.wait()
        return time.perf_counter() - t0

    def _peer_alloc(self, doc: dict[str, Any], refs: list[dict[str, Any]], total: int) -> torch.Tensor:
        """Where a received replica goes: one flat file `peer<R>-slot<S>.bin` in this node's
        directory, kept between rounds. The slot's header is removed first: a torn replica is
        never read."""
        slot = int(doc["step"]) % _SLOTS
        (self.dir / f"peer{self.source}-slot{slot}.hdr").unlink(missing_ok=True)
        for ref in refs:
            name = str(ref["__shm__"])
            if "/" in name or not name.startswith(f"rank{self.source}-slot{slot}-"):
                raise ValueError(f"rank {self.source} sent a snapshot naming a foreign file {name!r}")
        flat = self._peer_flat[slot]
        if flat is None or flat.numel() != total:
            flat = self._peer_flat[slot] = _mapped(self.dir / f"peer{self.source}-slot{slot}.bin", [total], torch.uint8)
        return flat

    def wait(self) -> None:
        """Block until the last take's copy and header are done (its time is added to that take's
        stall). A failed copy turns snapshots off with a warning."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        t0 = time.perf_counter()
        try:
            copy_s = pending.result()
        except (OSError, RuntimeError) as e:
            self._turn_off(f"cannot write snapshots ({e})")
            return
        waited = time.perf_counter() - t0
        self.parts_s["wait"].append(waited)
        self.parts_s["copy"].append(copy_s)
        if self.stall_s:
            self.stall_s[-1] += waited

    def _turn_off(self, why: str, warn: bool = True) -> None:
        self.disabled = why
        (log.warning if warn else log.info)("in-memory snapshots off: %s", why)
        for slot in range(_SLOTS):  # a half-described state must never be restored
            self._header(slot).unlink(missing_ok=True)

    def _reader(self, kind: str, rank: int, doc: dict[str, Any]):
        """Reads the tensors of header `doc` of `rank` held in this node's directory: "rank" its
        own (a file per tensor, each checked to be one of that rank's), "peer" a replica (one
        flat file, `peer<R>-slot<S>.bin`)."""
        if kind == "peer":
            refs = _refs(doc["tree"])
            layout, total = _layout(refs)
            path = self.dir / f"peer{rank}-slot{int(doc['step']) % _SLOTS}.bin"
            flat = torch.from_file(str(path), shared=False, size=max(1, total), dtype=torch.uint8)[:total]
            views = {str(ref["__shm__"]): v for ref, v in zip(refs, _views(flat, layout))}
            return lambda ref: views[str(ref["__shm__"])].clone()

        def read(ref: dict[str, Any]) -> torch.Tensor:
            name = str(ref["__shm__"])
            if "/" in name or not name.startswith(f"rank{rank}-slot"):
                raise ValueError(f"snapshot header names a foreign file {name!r}")
            shape, dtype = _shape_dtype(ref)
            n = _numel(shape)
            t = torch.from_file(str(self.dir / name), shared=False, size=max(1, n), dtype=dtype)
            return t[:n].view(shape).clone()
        return read

    def _unpack(self, obj: Any, meshes: dict[str, Any], read: Any) -> Any:
        if isinstance(obj, dict) and "__shm__" in obj:
            return read(obj)
        if isinstance(obj, dict) and "__dtensor__" in obj:
            from torch.distributed.tensor import DTensor

            mesh = meshes.get(str(obj["mesh"]))
            if mesh is None:
                raise ValueError(f"snapshot names a device mesh this run does not have ({obj['mesh']})")
            return DTensor.from_local(read(obj["__dtensor__"]), mesh, _unplacements(obj["placements"]),
                                      run_check=False, shape=torch.Size(obj["shape"]), stride=tuple(obj["stride"]))
        if isinstance(obj, dict):
            return {k: self._unpack(v, meshes, read) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._unpack(v, meshes, read) for v in obj]
        if isinstance(obj, tuple):
            return tuple(self._unpack(v, meshes, read) for v in obj)
        return obj

    def restore(self, state: dict[str, Any], durable_step: int | None) -> int | None:
        """Collective. Load the newest snapshot of which every rank's copy is held somewhere (by
        its own node, or as a replica by its peer node) and verifies, if newer than
        `durable_step`, into `state` (Statefuls via load_state_dict); returns its step or None. A
        rank whose node lost its snapshot receives the replica from a rank on the node that holds
        it. A copy that fails its HMAC (`SnapshotRejected`: edited in shared memory, damaged) is
        skipped, recorded in `rejected`, and the next source is tried: a replica of the same step
        on another node, then older steps, then none (the durable checkpoint). DTensors are
        rebuilt on the meshes of the DTensors `state` holds now."""
        self.wait()
        for slot in range(_SLOTS):
            self._join_round(slot)
        self.rejected, self.restored_from = [], []
        multi = dist.is_initialized() and dist.get_world_size() > 1
        mine = (str(self.dir), inventory(self.dir, self.world_size, self.tag))
        if multi:
            invs: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(invs, mine)
        else:
            invs = [mine]
        meshes: dict[str, Any] = {}
        for v in state.values():
            _meshes(v.state_dict() if is_stateful(v) else v, meshes)
        skip: set[tuple[str, int, int]] = set()  # (directory, rank, step): copies that did not verify
        while True:
            common = common_steps([[e for e in inv if (d, e[0], e[1]) not in skip] for d, inv in invs],
                                  self.world_size)
            best = max((s for s in common if durable_step is None or s > durable_step), default=None)
            if best is None:
                return None
            holders = common[best]
            # the ranks whose own node does not hold their snapshot: served by the lowest rank that does
            transfers = [(min(holders[r]), r) for r in range(self.world_size) if r not in holders[r]]
            if transfers and self.group is None:
                log.warning("in-memory snapshot of step %d is held on another node only and this run has no "
                            "replication group; using the durable checkpoint", best)
                return None
            tree, problem, bad = self._load(best, transfers, meshes, invs)
            if multi:  # every rank restores, or none does
                found: list[Any] = [None] * dist.get_world_size()
                dist.all_gather_object(found, (problem, bad))
            else:
                found = [(problem, bad)]
            rejected = [b for _, b in found if b]
            if rejected:
                for b in rejected:
                    skip.add((b["directory"], b["rank"], b["step"]))
                    self.rejected.append(b)
                    log.warning("in-memory snapshot of rank %d step %d (%s node) skipped: %s", b["rank"], b["step"],
                                b["held"], b["why"])
                continue
            problem = next((p for p, _ in found if p), None)
            if problem:
                log.warning("in-memory snapshot of step %d not restored (%s); using the durable checkpoint", best,
                            problem)
                return None
            break
        self.restored_from = [r for _, r in transfers]
        """The ranks whose snapshot came from a peer node at the last restore."""
        for k, v in state.items():
            if k not in tree:
                continue
            if is_stateful(v):
                v.load_state_dict(tree[k])
            elif isinstance(v, dict):
                v.update(tree[k])
        return best

    def _load(self, step: int, transfers: list[tuple[int, int]], meshes: dict[str, Any],
              invs: list[Any]) -> tuple[Any, str | None, dict[str, Any] | None]:
        """This rank's part of restoring `step`: serve the ranks it holds a snapshot for, read and
        verify its own (from its node, or sent by `transfers`' holder). Returns (its state tree,
        a problem that rules the step out, or a copy that did not verify: rank, step, held, where
        ("directory") and why)."""
        tree = None
        held, where = "own", str(self.dir)
        try:
            for holder, r in transfers:
                if self.rank == holder:
                    self._serve(r, step)
                elif self.rank == r:
                    held, where = "peer", invs[holder][0]
                    got = _recv(holder, self.group, _fresh)
                    if got is None:
                        raise ValueError(f"rank {holder} could not read the snapshot it holds for rank {r}")
                    doc, raw, tensors = got
                    # each tensor its own storage, as a read from a file gives (a view of the flat
                    # byte buffer would leave the optimizer holding byte storage)
                    read = {name: t.clone() for name, t in tensors.items()}
                    _verify(self.key, raw, [read[str(ref["__shm__"])] for ref in _refs(doc["tree"])])
                    tree = self._unpack(doc["tree"], meshes, lambda ref, got=read: got[str(ref["__shm__"])])
            if tree is None:
                doc = available(self.dir, self.rank, self.world_size)[step]
                reader = self._reader(doc["_kind"], self.rank, doc)
                refs = _refs(doc["tree"])
                read = {str(ref["__shm__"]): reader(ref) for ref in refs}
                _verify(self.key, doc["_raw"], [read[str(ref["__shm__"])] for ref in refs])
                tree = self._unpack(doc["tree"], meshes, lambda ref: read[str(ref["__shm__"])])
        except SnapshotRejected as e:
            return None, None, {"rank": self.rank, "step": step, "held": held, "directory": where, "why": str(e)}
        except (OSError, RuntimeError, ValueError, KeyError, TypeError, pickle.UnpicklingError) as e:
            return None, f"rank {self.rank}: {e}", None
        return tree, None, None

    def _serve(self, rank: int, step: int) -> None:
        """Send the snapshot of `rank` at `step` held in this node's directory to `rank` as signed
        (the receiver verifies it); an empty message if it cannot be read (the receiver then
        reports the problem)."""
        blob, flat = None, None
        try:
            doc = available(self.dir, rank, self.world_size)[step]
            refs = _refs(doc["tree"])
            read = self._reader(doc["_kind"], rank, doc)
            flat = _flatten([read(ref) for ref in refs], refs)
            blob = doc["_raw"]
        except (OSError, RuntimeError, ValueError, KeyError, TypeError) as e:
            log.warning("in-memory snapshot of rank %d step %d unreadable here: %s", rank, step, e)
            blob, flat = None, None
        for w in _send_async(rank, blob, flat, self.group, error=blob is None):
            w.wait()

    def close(self) -> None:
        """Finish the pending copy and replication, stop the side threads, drop the mappings."""
        self.wait()
        for slot in range(_SLOTS):
            self._join_round(slot)
        for pool in (self._pool, self._repl_pool):
            if pool is not None:
                pool.shutdown(wait=True)
        self._pool = self._repl_pool = None
        self._bufs = [[] for _ in range(_SLOTS)]
        self._views = [[] for _ in range(_SLOTS)]
        self._matched = [None] * _SLOTS
        self._peer_flat = [None] * _SLOTS
        self._stage = [None] * _SLOTS
