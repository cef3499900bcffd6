"""Measure a local disk: the bandwidth the NVMe optimizer tier can count on.

    from dtorch.cluster.disk import measure_disk
    measure_disk("/local/nvme/tmp")   # {"write_bytes_per_s": ..., "read_bytes_per_s": ..., "free_bytes": ...}

`dtorch probe --disk DIR` prints it. Writes are timed to fdatasync (on the device, not in the page
cache); the file's cached pages are then dropped (posix_fadvise DONTNEED) so the reads come from
the device where the kernel honours that, and `read_cached_bytes_per_s` times a second read (the
page cache's speed, what a tier smaller than the free host memory mostly sees).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from dtorch.errors import ConfigError


def measure_disk(directory: str | os.PathLike, nbytes: int = 256 * 2**20, chunk: int = 8 * 2**20) -> dict:
    """Write then read `nbytes` in `chunk`-sized pieces in a private temporary file of `directory`
    (removed afterwards). Bytes per second; ConfigError if the directory cannot take the file."""
    path = Path(directory).expanduser()
    if not path.is_dir() or not os.access(path, os.W_OK):
        raise ConfigError("disk", str(path), "give an existing directory you can write, on the disk to measure")
    free = shutil.disk_usage(path).free
    nbytes = int(min(nbytes, max(chunk, free // 4)))
    buf = os.urandom(chunk)
    fd, name = tempfile.mkstemp(prefix="dtorch-disk-probe-", dir=path)  # 0600
    try:
        t = time.perf_counter()
        done = 0
        while done < nbytes:
            done += os.pwrite(fd, buf, done)
        os.fdatasync(fd)
        write_s = time.perf_counter() - t
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        out = bytearray(chunk)
        view = memoryview(out)

        def read_all() -> float:
            t = time.perf_counter()
            off = 0
            while off < nbytes:
                got = os.preadv(fd, [view], off)
                if got <= 0:
                    break
                off += got
            return time.perf_counter() - t

        read_s = read_all()
        cached_s = read_all()
    finally:
        os.close(fd)
        os.unlink(name)
    return {"directory": str(path), "bytes": nbytes, "write_bytes_per_s": nbytes / write_s,
            "read_bytes_per_s": nbytes / read_s, "read_cached_bytes_per_s": nbytes / cached_s, "free_bytes": free}


def summary(doc: dict) -> str:
    g = 2**30
    return (f"disk {doc['directory']}: write {doc['write_bytes_per_s'] / g:.2f} GiB/s (to fdatasync), read "
            f"{doc['read_bytes_per_s'] / g:.2f} GiB/s (cache dropped), {doc['read_cached_bytes_per_s'] / g:.2f} GiB/s "
            f"(cached), {doc['free_bytes'] / g:,.1f} GiB free; {doc['bytes'] / 2**20:.0f} MiB measured")
