"""A local disk as the NVMe optimizer tier uses it, and the probe that measures it that way.

    from dtorch.cluster.disk import measure_disk
    measure_disk("/local/nvme/tmp")   # {"write_bytes_per_s": ..., "read_bytes_per_s": ..., "free_bytes": ...}

`TierFile` is how the tier (`dtorch.train.offload.store`) reads and writes its block files, and
`measure_disk` (`dtorch probe --disk DIR`) times the same calls on a file of its own, so the
planner prices the I/O the tier does. The tier exists so that the optimizer state does not occupy
host memory, so its I/O must reach the disk and must not leave the state in the page cache:

- **direct I/O** (`O_DIRECT`) where the file system takes it: whole blocks moved between the disk
  and page-aligned buffers, offsets and lengths multiples of `ALIGN`; no page cache at all;
- else (tmpfs, some overlay file systems refuse `O_DIRECT` with EINVAL) **buffered I/O** made to
  behave alike: each write is followed by `fdatasync` (on the device, not in the cache) and each
  write and read by `posix_fadvise(DONTNEED)` (its pages dropped from the cache).

`mode` says which one a file got. Both move the bytes through buffers made by `aligned_buffer`
(huge pages where the kernel gives them: the size of the requests the disk sees depends on how
the buffer's memory lies, see there), the tier's and the probe's alike. Writes are timed without a cache to absorb them, reads with
nothing cached, as the tier sees them in a run whose files do not fit the free host memory (and
now also in one whose files would).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import shutil
import tempfile
import time
from pathlib import Path

from dtorch.errors import ConfigError

log = logging.getLogger("dtorch.cluster.disk")

ALIGN = 4096
"""Alignment of direct I/O's buffer addresses, file offsets and lengths: the page size, a multiple of
the logical block size of the disks in use (512 or 4096 bytes)."""


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to a multiple of ALIGN."""
    return -(-int(nbytes) // ALIGN) * ALIGN


HUGE_PAGE = 2 * 2**20
"""A transparent huge page on x86-64 and arm64 (4 KiB base pages): one physically contiguous run."""


def aligned_buffer(nbytes: int, huge: bool = True) -> mmap.mmap:
    """A zeroed, page-aligned anonymous buffer of aligned(nbytes) bytes (at least one page): what
    direct I/O reads into and writes from (`torch.frombuffer` makes a tensor of it).

    `huge` (buffers of a huge page or more): the kernel is asked to back it with transparent huge
    pages (`MADV_HUGEPAGE`; honoured where /sys/kernel/mm/transparent_hugepage/enabled is
    "always" or "madvise"). Why: a direct read or write of a block goes to the disk as requests of
    at most `max_segments` physically contiguous runs of the buffer's memory (and at most
    `max_sectors_kb`, /sys/block/DEV/queue/). With 4 KiB pages the runs are as long as the pages
    happen to lie side by side in physical memory, which changes from buffer to buffer and process
    to process (three sets of buffers in one process: requests of 0.66, 1.0 and 1.5 MiB); with
    huge pages every run is 2 MiB, so every request is as large as the device takes. A disk with a
    cost per request (here a VM's virtio disk: 254 segments, 4 MiB requests) moved 0.76, 0.95 and
    1.09 GiB/s each way in the tier's cycle with those small-page buffers and 2.1-2.2 with huge
    pages, so without this the same calls on the same disk ran at different rates in the tier
    (0.8-1.5 GiB/s) and in the probe (0.65-0.9). The tier's block buffers and the probe's are both
    made here."""
    mm = mmap.mmap(-1, max(ALIGN, aligned(nbytes)), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge and len(mm) >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages: 4 KiB pages, as before
            pass
    return mm


def huge_pages_mode() -> str:
    """The kernel's transparent huge page setting ("always", "madvise", "never"; "" where unknown):
    "never" leaves `aligned_buffer`'s request sizes to where the pages happen to lie."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return ""
    return next((w.strip("[]") for w in text.split() if w.startswith("[")), "")


def _device_stat(path: Path) -> Path | None:
    """/sys's I/O counters of the block device holding `path` (None: not a block device's file
    system, e.g. tmpfs or overlay)."""
    st = os.stat(path)
    p = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat")
    return p if p.is_file() else None


def _requests(stat: Path | None) -> tuple[int, int] | None:
    """(requests completed, bytes moved), reads and writes together, so far on that device."""
    if stat is None:
        return None
    try:
        v = [int(x) for x in stat.read_text().split()]
    except (OSError, ValueError):
        return None
    return v[0] + v[4], (v[2] + v[6]) * 512  # sectors are 512 bytes in this file, whatever the disk's


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class TierFile:
    """One file of the NVMe tier, created owner-only (0600) with `nbytes` (rounded up to ALIGN)
    reserved up front, read and written whole from offset 0 with `read`/`write`.

    Opened with O_DIRECT where the file system takes it (`mode` "direct"); where it refuses
    (EINVAL on open, or on the first read or write), buffered I/O with fdatasync after each write
    and the pages dropped from the page cache after each write and read (`mode` "buffered")."""

    def __init__(self, path: str | os.PathLike, nbytes: int, direct: bool = True):
        self.path = Path(path)
        self.nbytes = aligned(nbytes) if nbytes else 0
        # created without O_DIRECT first (O_EXCL: a file of our own), then reopened with it: a file
        # system that refuses O_DIRECT at open must not leave a half-made file behind
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.mode = "buffered"
        if direct and hasattr(os, "O_DIRECT"):
            try:
                dfd = os.open(self.path, os.O_RDWR | os.O_DIRECT)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    os.close(fd)
                    raise
            else:
                os.close(fd)
                fd, self.mode = dfd, "direct"
        self.fd = fd
        if self.nbytes:  # reserve the space now: a full disk fails here, not mid-run
            try:
                os.posix_fallocate(fd, 0, self.nbytes)
            except OSError:
                self.close()
                raise

    def write(self, buf: memoryview, nbytes: int) -> None:
        """Bytes [0, nbytes) of `buf` to the file (aligned(nbytes) bytes are written: `buf` must
        hold them; the pad is whatever the buffer holds past nbytes)."""
        n = aligned(nbytes)
        view = memoryview(buf).cast("B")[:n]
        if self._direct_ok(view):
            try:
                _pwrite_all(self.fd, view, n)
                return
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._to_buffered(e)
        _pwrite_all(self.fd, view, n)
        os.fdatasync(self.fd)
        self._drop(n)

    def read(self, buf: memoryview, nbytes: int) -> int:
        """The file's first aligned(nbytes) bytes into `buf`; returns the bytes read."""
        n = aligned(nbytes)
        view = memoryview(buf).cast("B")[:n]
        if self._direct_ok(view):
            try:
                return _pread_all(self.fd, view, n)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._to_buffered(e)
        got = _pread_all(self.fd, view, n)
        self._drop(n)
        return got

    def drop_cache(self) -> None:
        """Written back and dropped from the page cache (after the file was touched through a memory
        map: checkpoint save and load); pages still mapped somewhere stay."""
        os.fdatasync(self.fd)
        self._drop(0)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _direct_ok(self, view: memoryview) -> bool:
        if self.mode != "direct":
            return False
        if _address(view) % ALIGN:  # (a buffer the tier did not allocate page-aligned)
            self._to_buffered(None)
            return False
        return True

    def _to_buffered(self, err: OSError | None) -> None:
        flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        fcntl.fcntl(self.fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
        self.mode = "buffered"
        log.info("%s: direct I/O refused (%s); buffered I/O with fdatasync and the cache dropped",
                 self.path, err.strerror if err is not None else "buffer not page-aligned")

    def _drop(self, n: int) -> None:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, 0, n, os.POSIX_FADV_DONTNEED)


def _pwrite_all(fd: int, view: memoryview, n: int) -> None:
    done = 0
    while done < n:
        done += os.pwritev(fd, [view[done:n]], done)


def _pread_all(fd: int, view: memoryview, n: int) -> int:
    done = 0
    while done < n:
        got = os.preadv(fd, [view[done:n]], done)
        if got == 0:
            break
        done += got
    return done


DEFAULT_CHUNK = 64 * 2**20
"""The bytes the probe moves per call: the NVMe tier's default block (`OptimizerOffload.block_bytes`)."""


def cycle(files: list[TierFile], bufs: list, nbytes: int) -> None:
    """The NVMe tier's step without its CPU work: each file read into one of three buffers by a
    reader thread while a writer thread writes the one before back, a buffer reused once its
    write-back is done (`dtorch.train.offload.store.Pipeline`: one block read ahead, one stepped,
    one written back)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as reader, ThreadPoolExecutor(1) as writer:
        writes = []
        ahead = reader.submit(files[0].read, bufs[0], nbytes)
        for k, f in enumerate(files):
            nxt = None
            if k + 1 < len(files):  # the next read is queued before this one is waited for, as the tier does
                if k >= 2:
                    writes[k - 2].result()  # the buffer block k+1 is read into held block k-2
                nxt = reader.submit(files[k + 1].read, bufs[(k + 1) % 3], nbytes)
            ahead.result()
            writes.append(writer.submit(f.write, bufs[k % 3], nbytes))
            ahead = nxt
        for w in writes:
            w.result()


def measure_disk(directory: str | os.PathLike, nbytes: int = 1024 * 2**20, chunk: int = DEFAULT_CHUNK) -> dict:
    """Write then read `nbytes` in `chunk`-sized pieces of a private temporary directory of
    `directory` (removed afterwards) with the NVMe tier's `TierFile` calls: one file per chunk, as
    the tier keeps one per block, written once to leave the reserved space (the tier rewrites files
    it has written: the first write of reserved extents is slower), then timed rewriting all of
    them, reading all of them, and the tier's own pattern (`cycle`: each read while the one before
    is written back). Bytes per second: `write_bytes_per_s`, `read_bytes_per_s` (alone) and
    `read_write_bytes_per_s` (bytes read, and as many written back, per second in the cycle's
    steady part, its first read and last write taken off: what the planner prices a step's I/O
    with); `mode` is the tier's I/O there (direct or buffered). The buffers are the tier's
    (`aligned_buffer`: huge pages where the kernel gives them), so the requests reaching the disk
    are the tier's size too: `request_bytes` is their mean size in the cycle (the device's /sys
    counters, None where the directory is not on a block device), `huge_pages` the kernel's setting.
    ConfigError if the directory cannot take the files."""
    path = Path(directory).expanduser()
    if not path.is_dir() or not os.access(path, os.W_OK):
        raise ConfigError("disk", str(path), "give an existing directory you can write, on the disk to measure")
    free = shutil.disk_usage(path).free
    chunk = aligned(max(1, min(chunk, nbytes)))
    count = max(1, int(min(nbytes, max(chunk, free // 4))) // chunk)
    nbytes = count * chunk
    buf = aligned_buffer(chunk)
    buf[:] = os.urandom(chunk)
    bufs = [buf, aligned_buffer(chunk), aligned_buffer(chunk)]
    for b in bufs[1:]:  # faulted in before the timing, as the tier's slots are after its first block
        b[:] = buf
    work = Path(tempfile.mkdtemp(prefix="dtorch-disk-probe-", dir=path))  # 0700
    files: list[TierFile] = []
    try:
        for k in range(count):
            files.append(TierFile(work / f"chunk{k:05d}", chunk))
        for f in files:
            f.write(buf, chunk)
        t = time.perf_counter()
        for f in files:
            f.write(buf, chunk)
        write_s = time.perf_counter() - t
        t = time.perf_counter()
        for f in files:
            if f.read(buf, chunk) != chunk:
                raise OSError(f"short read of {f.path}")
        read_s = time.perf_counter() - t
        dev = _device_stat(work)
        before = _requests(dev)
        t = time.perf_counter()
        cycle(files, bufs, chunk)
        cycle_s = time.perf_counter() - t
        after = _requests(dev)
        mode = files[0].mode
    finally:
        for f in files:
            f.close()
        shutil.rmtree(work, ignore_errors=True)
        for b in bufs:
            b.close()
    # the cycle's steady rate: without its first read (nothing to write yet) and last write (nothing
    # left to read), which the planner prices apart (`first_read_s`, `last_write_s`)
    ends = chunk * (read_s + write_s) / nbytes
    steady = (count - 1) * chunk / (cycle_s - ends) if count > 1 and cycle_s > 2 * ends else nbytes / cycle_s
    # the size of the requests the cycle's direct I/O reached the disk as (the device's counters:
    # other processes' I/O on it in those seconds is counted too)
    request = None
    if before is not None and after is not None and after[0] > before[0]:
        request = (after[1] - before[1]) / (after[0] - before[0])
    return {"directory": str(path), "bytes": nbytes, "chunk_bytes": chunk, "mode": mode,
            "write_bytes_per_s": nbytes / write_s, "read_bytes_per_s": nbytes / read_s,
            "read_write_bytes_per_s": steady, "free_bytes": free,
            "request_bytes": request, "huge_pages": huge_pages_mode()}


def summary(doc: dict) -> str:
    g = 2**30
    how = ("direct I/O" if doc.get("mode") == "direct"
           else "buffered, fdatasync and the cache dropped: the file system refuses direct I/O")
    both = (f", read and written back at once {doc['read_write_bytes_per_s'] / g:.2f} GiB/s each way"
            if doc.get("read_write_bytes_per_s") else "")
    req = (f"; requests of {doc['request_bytes'] / 2**20:.1f} MiB, huge pages {doc.get('huge_pages') or '?'}"
           if doc.get("request_bytes") else "")
    return (f"disk {doc['directory']}: write {doc['write_bytes_per_s'] / g:.2f} GiB/s, read "
            f"{doc['read_bytes_per_s'] / g:.2f} GiB/s{both} ({how}, as the NVMe tier does it{req}), "
            f"{doc['free_bytes'] / g:,.1f} GiB free; {doc['bytes'] / 2**20:.0f} MiB measured")
