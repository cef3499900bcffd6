"""Durable file operations and the checkpoint manifest.

A checkpoint directory is committed in this order, so that a crash at any instant leaves either
the previous state or the new complete one, never a mix:

1. every file is written into a fresh ``step-XXXXXXXX.tmp-<nonce>`` directory and fsynced;
2. ``manifest.json`` (step, world size, per-file SHA-256 and size, plan, user metadata, a
   SHA-256 of its own body, and an HMAC of it keyed with the user's secret, `dtorch.trust`) is
   written and fsynced, then the directory itself is fsynced;
3. the directory is renamed to ``step-XXXXXXXX`` and the parent directory is fsynced;
4. ``LATEST`` is replaced atomically (temp file + fsync + rename + fsync of the parent); a
   ``LATEST`` that is not a regular file (a directory, a FIFO, a link) is moved aside first.

Everything written is private (directories 0700, files 0600) and never through a planted link.

Only directories named ``step-XXXXXXXX`` with a manifest whose hashes match are ever loaded.
The plain SHA-256 finds corruption; the HMAC finds forgery: whoever can write the directory can
recompute a hash, but not the HMAC without the key.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtorch import trust

FORMAT = "dtorch-checkpoint/1"
MANIFEST = "manifest.json"
LATEST = "LATEST"
STEP_RE = re.compile(r"^step-(\d{8,})$")
_HMAC_PURPOSE = "dtorch-checkpoint-manifest/1"
TRUST_FIX = ("if you trust this checkpoint, re-sign it with `dtorch ckpt trust DIR`; if it was written "
             "with another key, point DTORCH_KEY_FILE at that key")
_CHUNK = 1 << 22


def step_dirname(step: int) -> str:
    """The committed directory name of `step`: ``step-00000042``."""
    return f"step-{int(step):08d}"


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a directory's entries (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Replace `path` with `data` atomically (`trust.replace_file`: a private O_EXCL temp file,
    fsync, rename, fsync the directory). Readers see the old content or the new, never a prefix."""
    trust.replace_file(path, data)


def create_private(path: Path) -> int:
    """A new file for writing, 0600, that did not exist (O_EXCL) and is not reached through a link."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def make_private(path: Path) -> None:
    """Mode 0600 on a file another writer (DCP) created with the default mode; a link is refused."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path.name} is not a regular file")
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def clear_latest(root: Path) -> Path | None:
    """Make room for a new ``LATEST``: anything there that is not a regular file (a directory, a
    FIFO, a socket, a link) is renamed to ``LATEST.aside-<random>`` and returned, so that the
    pointer can be replaced; None when there was nothing to move."""
    path = root / LATEST
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISREG(st.st_mode):
        return None
    aside = root / f"{LATEST}.aside-{os.urandom(4).hex()}"
    os.rename(path, aside)
    return aside


def sha256_file(path: str | os.PathLike) -> tuple[str, int]:
    """(hex SHA-256, size in bytes) of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


@dataclass
class Manifest:
    """What a committed checkpoint holds. `files` maps a file name (relative to the checkpoint
    directory) to ``{"sha256": hex, "size": bytes}``; `rank_files[r]` is rank r's local-state file."""

    step: int
    world_size: int
    files: dict[str, dict[str, Any]]
    rank_files: list[str] = field(default_factory=list)
    plan: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    created_unix: float = 0.0
    torch_version: str = ""
    format: str = FORMAT

    @property
    def total_bytes(self) -> int:
        return sum(int(f["size"]) for f in self.files.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "step": self.step,
            "world_size": self.world_size,
            "files": self.files,
            "rank_files": self.rank_files,
            "plan": self.plan,
            "extra": self.extra,
            "created_unix": self.created_unix,
            "torch_version": self.torch_version,
        }


class ManifestError(Exception):
    """A manifest that is missing, unreadable, or whose own hash does not match."""


def write_manifest(directory: Path, manifest: Manifest) -> None:
    """Write ``manifest.json`` durably; the body carries its own SHA-256 so that a flipped byte
    in the manifest itself is detected too, and an HMAC so that a forged one is."""
    body = manifest.to_dict()
    canon = _canonical(body)
    doc = {"manifest": body, "sha256": hashlib.sha256(canon).hexdigest(), "hmac": trust.tag(_HMAC_PURPOSE, canon)}
    trust.replace_file(directory / MANIFEST, json.dumps(doc, indent=1, sort_keys=True).encode())


def read_manifest(directory: Path, *, check_key: bool = True) -> Manifest:
    """Read and self-check ``manifest.json`` (its SHA-256, then its HMAC unless `check_key` is
    False); raises ManifestError naming the problem."""
    path = directory / MANIFEST
    try:
        doc = json.loads(read_small(path, 64 << 20))
        body = doc["manifest"]
        digest = doc["sha256"]
    except FileNotFoundError:
        raise ManifestError(f"{MANIFEST}: missing") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ManifestError(f"{MANIFEST}: unreadable ({type(e).__name__}: {e})") from None
    canon = _canonical(body)
    if hashlib.sha256(canon).hexdigest() != digest:
        raise ManifestError(f"{MANIFEST}: its SHA-256 does not match its content (corrupted)")
    if check_key:
        if "hmac" not in doc:
            raise ManifestError(f"{MANIFEST}: not signed (written before signing existed, or edited); {TRUST_FIX}")
        if not trust.check_tag(_HMAC_PURPOSE, canon, doc["hmac"]):
            raise ManifestError(f"{MANIFEST}: its signature does not match this user's key (forged or "
                                f"signed with another key); {TRUST_FIX}")
    if body.get("format") != FORMAT:
        raise ManifestError(f"{MANIFEST}: format {body.get('format')!r}, expected {FORMAT!r}")
    return Manifest(**body)


def resign_manifest(directory: Path) -> Manifest:
    """Sign an (unsigned or foreign-signed) manifest with this user's key, after checking its
    plain SHA-256 and every file's hash. The person who calls this vouches for the checkpoint."""
    m = read_manifest(directory, check_key=False)
    problems = [p for n, exp in sorted(m.files.items()) if (p := check_file(directory, n, exp))]
    if problems:
        raise ManifestError("; ".join(problems))
    write_manifest(directory, m)
    fsync_dir(directory)
    return m


def read_small(path: Path, limit: int) -> bytes:
    """The bytes of a regular file of at most `limit` bytes, never through a symlink: LATEST and
    manifests are small, and a link to /dev/zero or a FIFO must not hang or exhaust memory."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path.name} is not a regular file")
        if st.st_size > limit:
            raise OSError(f"{path.name} is {st.st_size} bytes, more than {limit}")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_latest(root: Path) -> str | None:
    """The step directory name LATEST points to, or None when it is absent or is not a valid
    pointer (binary bytes, a directory, a link, a name that is not ``step-XXXXXXXX``). LATEST is
    for people and tools; load never depends on it."""
    try:
        text = read_small(root / LATEST, 4096).decode("utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text if STEP_RE.match(text) else None


def check_file(directory: Path, name: str, expected: dict[str, Any]) -> str | None:
    """None if `name` matches its manifest entry, else a one-line problem naming the file."""
    path = directory / name
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"{name}: missing"
    if size != int(expected["size"]):
        return f"{name}: size {size} bytes, manifest says {expected['size']} (truncated or overwritten)"
    digest, _ = sha256_file(path)
    if digest != expected["sha256"]:
        return f"{name}: SHA-256 mismatch (corrupted)"
    return None


def committed_dirs(root: Path) -> list[tuple[int, Path]]:
    """Committed checkpoint directories under `root`, newest step first (no verification)."""
    out = []
    if root.is_dir():
        for p in root.iterdir():
            m = STEP_RE.match(p.name)
            if m and p.is_dir() and not p.is_symlink():
                out.append((int(m.group(1)), p))
    return sorted(out, reverse=True)
