"""Where offloaded optimizer blocks live: host memory, or files on a local disk.

A *block* is a run of whole parameters (in model order) holding about `block_bytes` of state. Its
fields (e.g. exp_avg, exp_avg_sq, optionally the fp32 master) are laid out parameter by parameter
in one flat float32 buffer. `HostBlocks` keeps every block resident; `DiskBlocks` keeps one file
per block and moves it through a small pool of buffers (`Slot`s): read ahead by one thread,
written back by another, so the disk works while the CPU steps the block in between. The files are
`dtorch.cluster.disk.TierFile`s: direct I/O into page-aligned buffers where the file system takes
it, else buffered I/O synced and dropped from the page cache, so the state lives on the disk and
not in host memory, and `dtorch probe --disk` measures the same calls.
"""

from __future__ import annotations

import atexit
import contextlib
import mmap
import os
import queue
import shutil
import tempfile
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dtorch.cluster.disk import TierFile, aligned, aligned_buffer
from dtorch.errors import ConfigError

FLOAT = 4  # bytes of a float32 element
PREFIX = "dtorch-offload-"


@dataclass
class Block:
    """Parameters `params` (indices into the optimizer's flat parameter list) and where each
    (parameter, field) sits in the block's flat buffer."""

    params: list[int]
    numels: list[int]
    fields: tuple[str, ...]
    offsets: dict[tuple[int, str], int] = field(default_factory=dict)
    numel: int = 0
    """float32 elements of the block's stored fields."""
    param_numel: int = 0
    """float32 elements of one field (the gradient staging a block needs)."""

    def __post_init__(self) -> None:
        off = 0
        for j, n in enumerate(self.numels):
            for f in self.fields:
                self.offsets[(j, f)] = off
                off += n
        self.numel, self.param_numel = off, sum(self.numels)


def make_blocks(numels: list[int], fields: tuple[str, ...], block_bytes: int) -> list[Block]:
    """Whole parameters in order, a new block whenever the next one would pass `block_bytes`."""
    blocks: list[Block] = []
    cur: list[int] = []
    size = 0
    per = FLOAT * max(1, len(fields))
    for i, n in enumerate(numels):
        if cur and size + n * per > block_bytes:
            blocks.append(Block(cur, [numels[k] for k in cur], fields))
            cur, size = [], 0
        cur.append(i)
        size += n * per
    if cur:
        blocks.append(Block(cur, [numels[k] for k in cur], fields))
    return blocks


def host_empty(numel: int, pin: bool) -> torch.Tensor:
    """A flat float32 host buffer (page-locked when copies to an accelerator use it)."""
    return torch.empty(numel, dtype=torch.float32, pin_memory=pin)


def io_buffer(numel: int, pin: bool, huge: bool = True) -> tuple[torch.Tensor, mmap.mmap | None]:
    """A flat float32 buffer for the NVMe tier's direct I/O and the gradient staging: page-aligned,
    its length rounded up to ALIGN bytes (an anonymous memory map, whose pages a `Slot` can hand
    back; on an accelerator host page-locked memory from torch's allocator, page-aligned too).
    `huge`: backed by transparent huge pages where the kernel gives them (`aligned_buffer`: the
    disk then sees requests of the size `dtorch probe --disk` measured; the gradient staging, which
    no disk I/O touches, is made without). (tensor, the map that owns its memory or None)."""
    n = aligned(numel * FLOAT) // FLOAT if numel else 0
    if pin or not n:
        return host_empty(n, pin), None
    mm = aligned_buffer(n * FLOAT, huge=huge)
    return torch.frombuffer(mm, dtype=torch.float32, count=n), mm


class _Pages:
    """The pages of an anonymous buffer that a block may have touched: `fit(nbytes)` before a block
    of nbytes uses it hands back (MADV_DONTNEED) the pages past max(nbytes, `floor`) that a larger
    block touched before. So a slot holds at most a regular block (`floor`: `block_bytes`' worth)
    unless an oversized one (a parameter larger than a block: an embedding, a head) is in it, and
    the regular blocks never fault their pages in again (each fault costs a page zeroed)."""

    def __init__(self, mm: mmap.mmap | None, floor: int):
        self.mm, self.high, self.floor = mm, 0, floor

    def fit(self, nbytes: int) -> None:
        if self.mm is None:
            return
        page = mmap.PAGESIZE
        keep = min(len(self.mm), -(-aligned(max(nbytes, self.floor)) // page) * page)
        if self.high > keep and hasattr(self.mm, "madvise"):
            self.mm.madvise(mmap.MADV_DONTNEED, keep, self.high - keep)
        self.high = max(keep if self.high > keep else self.high, aligned(nbytes))


class Slot:
    """One block buffer: its stored fields (`data`) and the staging of its gradients (`grad`), sized
    for the largest block; `fit(block)` keeps no more than a regular block's pages resident past
    an oversized block (on a CPU host; `_Pages`). `keep`: the (data, grad) float32 elements of a
    regular block."""

    def __init__(self, data_numel: int, grad_numel: int, pin: bool, keep: tuple[int, int] = (0, 0)):
        self.data, mm = io_buffer(data_numel, pin)
        self.grad, gm = io_buffer(grad_numel, pin, huge=False)
        self._pages = (_Pages(mm, keep[0] * FLOAT), _Pages(gm, keep[1] * FLOAT))
        self.block: int | None = None
        self.event = None  # accelerator copies that still read this slot
        self.grad_event = None  # accelerator copies that still write its gradient staging

    def fit(self, block: Block, on_disk: bool) -> None:
        self._pages[0].fit(block.numel * FLOAT if on_disk else 0)
        self._pages[1].fit(block.param_numel * FLOAT)

    def release(self) -> None:
        """Hand back the pages an oversized block touched past a regular block's, once it is done
        with (written back): otherwise the last block of a step (the output head, or the embedding
        when the overlap steps in backward order) stays resident into the next step, whose first
        block is the other oversized one, and the step starts with two of them in host memory."""
        self._pages[0].fit(0)
        self._pages[1].fit(0)


class HostBlocks:
    """Every block resident in host memory, zero-initialised."""

    on_disk = False

    def __init__(self, blocks: list[Block], pin: bool):
        self.blocks = blocks
        self.flat = [torch.zeros(b.numel, dtype=torch.float32, pin_memory=pin) for b in blocks]

    def buffer(self, k: int, slot: Slot) -> torch.Tensor:
        return self.flat[k]

    def read(self, k: int, slot: Slot) -> None:  # resident: nothing to move
        pass

    def write(self, k: int, slot: Slot) -> None:
        pass

    @contextlib.contextmanager
    def mapped(self, k: int):
        yield self.flat[k]

    def close(self) -> None:
        pass

    @property
    def nbytes(self) -> int:
        return sum(b.numel for b in self.blocks) * FLOAT


class DiskBlocks:
    """One file per block in a private directory (0700; files 0600), space reserved up front,
    removed when the store closes or the process exits. Each file holds its block's numel float32
    values, padded to a multiple of ALIGN bytes (direct I/O moves whole aligned extents)."""

    on_disk = True

    def __init__(self, blocks: list[Block], directory: str | os.PathLike, tag: str):
        self.blocks = blocks
        root = Path(directory)
        _remove_stale(root)
        self.dir = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-{tag}-", dir=root))  # mode 0700
        os.chmod(self.dir, 0o700)
        self.paths: list[Path] = []
        self.files: list[TierFile] = []
        self.bytes_read = 0
        self.bytes_written = 0
        self.read_s = 0.0
        self.write_s = 0.0
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _cleanup, self.dir, self.files)
        try:
            for k, b in enumerate(blocks):
                path = self.dir / f"block{k:05d}.f32"
                self.files.append(TierFile(path, b.numel * FLOAT))
                self.paths.append(path)
        except OSError as e:
            self.close()
            raise ConfigError("offload.directory", str(root),
                              f"could not reserve {self.nbytes:,} bytes of optimizer state there ({e.strerror}); "
                              "free space or choose another local disk") from None

    @property
    def mode(self) -> str:
        """How the files are read and written: "direct" (O_DIRECT) or "buffered" (synced, the page
        cache dropped): `dtorch.cluster.disk.TierFile`."""
        return self.files[0].mode if self.files else "direct"

    def buffer(self, k: int, slot: Slot) -> torch.Tensor:
        return slot.data[: self.blocks[k].numel]

    def read(self, k: int, slot: Slot) -> None:
        import time

        n = self.blocks[k].numel * FLOAT
        if not n:
            return
        t = time.perf_counter()
        got = self.files[k].read(memoryview(slot.data.numpy()), n)
        if got < n:
            raise OSError(f"short read of {self.paths[k]}: {got} of {n} bytes")
        with self._lock:
            self.bytes_read += aligned(n)
            self.read_s += time.perf_counter() - t

    def write(self, k: int, slot: Slot) -> None:
        import time

        n = self.blocks[k].numel * FLOAT
        if not n:
            return
        t = time.perf_counter()
        self.files[k].write(memoryview(slot.data.numpy()), n)
        with self._lock:
            self.bytes_written += aligned(n)
            self.write_s += time.perf_counter() - t

    @contextlib.contextmanager
    def mapped(self, k: int):
        """The block's file as a shared memory map (checkpoint save/load read and write it in
        place; the pages leave this process's memory when the map is dropped, and the page cache
        when the context ends, unless a view of them is still held)."""
        n = self.blocks[k].numel
        if n == 0:
            yield torch.empty(0)
            return
        try:
            yield torch.from_file(str(self.paths[k]), shared=True, size=n, dtype=torch.float32)
        finally:
            self.files[k].drop_cache()

    def close(self) -> None:
        self._finalizer()

    @property
    def nbytes(self) -> int:
        """Bytes of the state (the files hold it padded to ALIGN each)."""
        return sum(b.numel for b in self.blocks) * FLOAT


def _cleanup(directory: Path, files: list[TierFile]) -> None:
    for f in files:
        with contextlib.suppress(OSError):
            f.close()
    files.clear()
    shutil.rmtree(directory, ignore_errors=True)


STALE_S = 600.0
"""A left-behind directory is removed only when no file in it changed for this long (a live run
writes every block each step; its pid may be invisible from another container's pid namespace)."""


def _remove_stale(root: Path) -> None:
    """Directories an earlier process of this user left behind (killed before its exit handler):
    removed when that process no longer exists and its files have not changed for STALE_S."""
    try:
        entries = list(root.iterdir())
    except OSError:
        return
    for d in entries:
        if not d.name.startswith(PREFIX) or not d.is_dir():
            continue
        try:
            pid = int(d.name[len(PREFIX):].split("-", 1)[0])
            if d.stat().st_uid != os.getuid() or pid == os.getpid():
                continue
            os.kill(pid, 0)
        except ProcessLookupError:
            import time

            newest = max((f.stat().st_mtime for f in d.iterdir()), default=d.stat().st_mtime)
            if time.time() - newest > STALE_S:
                shutil.rmtree(d, ignore_errors=True)
        except (ValueError, OSError):
            continue


class Pipeline:
    """The slot pool and the two I/O threads of a store: `start(k)` reads block k ahead into a free
    slot; `finish(k, slot)` writes it back and returns the slot to the pool."""

    def __init__(self, store, num_slots: int, data_numel: int, grad_numel: int, pin: bool,
                 keep: tuple[int, int] = (0, 0)):
        self.store = store
        self.free: queue.Queue[Slot] = queue.Queue()
        for _ in range(num_slots):
            self.free.put(Slot(data_numel if store.on_disk else 0, grad_numel, pin, keep))
        self.num_slots = num_slots
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="dtorch-offload-read") if store.on_disk else None
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="dtorch-offload-write") if store.on_disk else None
        self._writes: list[Future] = []
        atexit.register(self.close)

    def start(self, k: int, read: bool = True) -> tuple[Slot, Future | None]:
        slot = self.free.get()
        if slot.event is not None:  # accelerator copies out of this slot must end before reuse
            slot.event.synchronize()
            slot.event = None
        slot.block = k
        slot.fit(self.store.blocks[k], self.store.on_disk)
        fut = self._reader.submit(self.store.read, k, slot) if self._reader is not None and read else None
        return slot, fut

    def finish(self, k: int, slot: Slot) -> None:
        if self._writer is None:
            slot.release()
            self.free.put(slot)
            return

        def write_back():
            try:
                self.store.write(k, slot)
            finally:
                slot.release()
                self.free.put(slot)

        self._writes.append(self._writer.submit(write_back))

    def drain(self) -> None:
        """Wait for every write-back (the files hold the newest state afterwards)."""
        writes, self._writes = self._writes, []
        for f in writes:
            f.result()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.drain()
        for pool in (self._reader, self._writer):
            if pool is not None:
                pool.shutdown(wait=True)
        self._reader = self._writer = None
