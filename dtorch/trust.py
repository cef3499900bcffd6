"""What DTorch trusts on disk and on the wire: a per-user secret key, and private directories.

Checkpoint manifests and the rendezvous store's payloads carry an HMAC-SHA256 made with a secret
only the job's user holds, so that whoever can write a run's files or reach its store cannot
forge them. The key is found in this order:

1. ``DTORCH_KEY``: the secret itself (any string of 16+ characters), e.g. handed to every node
   of a job by the scheduler;
2. ``DTORCH_KEY_FILE``: a file holding it (owned by this user, mode 0600), e.g. on a shared
   filesystem that every node mounts;
3. ``$XDG_CONFIG_HOME/dtorch/key`` (default ``~/.config/dtorch/key``), created with 32 random
   bytes and mode 0600 on first use. Nodes that share the home directory share it.

Every process that reads a checkpoint or joins the rendezvous must see the same key; a key file
readable by others is refused. Directories are checked with `check_dir`: a directory owned by
another user, writable by others, or reached through a symlink is refused unless it is listed in
``DTORCH_TRUST`` (paths separated by ``:``), which is how a person trusts one explicitly.

Files DTorch writes in a run or checkpoint directory are private (0600) and never written through
a planted link: appended logs are opened with `open_append` (O_NOFOLLOW, and refused unless the
file is a regular file of this user with one link), whole files are replaced with `replace_file`
(a fresh O_EXCL temp file renamed over the name, which replaces a link itself, never its target).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import ipaddress
import os
import secrets
import stat
from pathlib import Path

from dtorch import env as _env
from dtorch.errors import ConfigError

_MIN_KEY = 16
_cache: dict[str, bytes] = {}


def key_file() -> Path:
    """The key file in use (DTORCH_KEY_FILE, else the per-user default)."""
    e = _env.current()
    if e.key_file:
        return Path(e.key_file)
    base = e.config_home or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "dtorch" / "key"


def _read_key_file(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise ConfigError("DTORCH_KEY_FILE", str(path),
                              f"the key file must be owned by uid {os.geteuid()} with mode 0600 "
                              f"(it is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}); chmod 600 it")
        data = os.read(fd, 4096).strip()
    finally:
        os.close(fd)
    if len(data) < _MIN_KEY:
        raise ConfigError("DTORCH_KEY_FILE", str(path), f"the key file holds fewer than {_MIN_KEY} bytes")
    return data


def _create_key_file(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, os.urandom(32).hex().encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # atomic and never replaces: two first users agree on one key
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)


def secret() -> bytes:
    """This user's (or this job's) secret key, see the module docstring."""
    given = _env.current().key
    if given:
        if len(given) < _MIN_KEY:
            raise ConfigError("DTORCH_KEY", "<hidden>", f"use a secret of at least {_MIN_KEY} characters")
        return given.encode()
    path = key_file()
    cached = _cache.get(str(path))
    if cached is not None:
        return cached
    try:
        key = _read_key_file(path)
    except FileNotFoundError:
        if _env.current().key_file:
            raise ConfigError("DTORCH_KEY_FILE", str(path), "no such file; create it (mode 0600) on every node") from None
        try:
            _create_key_file(path)
        except OSError as e:
            raise ConfigError("DTORCH_KEY_FILE", str(path), f"cannot create the key ({e.strerror}); set DTORCH_KEY "
                              "or DTORCH_KEY_FILE to a secret only you can read") from None
        key = _read_key_file(path)
    except OSError as e:  # a symlink (ELOOP) or unreadable
        raise ConfigError("DTORCH_KEY_FILE", str(path), f"cannot read the key ({e.strerror}); use a regular 0600 file") from None
    _cache[str(path)] = key
    return key


def tag(purpose: str, data: bytes, key: bytes | None = None) -> str:
    """Hex HMAC-SHA256 of `data` for `purpose` (each purpose gets its own derived key)."""
    k = hmac.new(key if key is not None else secret(), purpose.encode(), hashlib.sha256).digest()
    return hmac.new(k, data, hashlib.sha256).hexdigest()


def check_tag(purpose: str, data: bytes, expected: str | bytes, key: bytes | None = None) -> bool:
    """Whether `expected` is the tag of `data` (constant time; any garbage is simply False)."""
    if isinstance(expected, str):
        expected = expected.encode("utf-8", "replace")
    return isinstance(expected, bytes) and hmac.compare_digest(tag(purpose, data, key).encode(), expected)


def trusted_dirs() -> list[Path]:
    return [p.resolve() for p in _env.current().trust]


def untrusted_reason(path: str | os.PathLike, *, private: bool = False) -> str | None:
    """Why `path` (a directory) is not to be trusted, or None. Refused: a symlink, a directory
    owned by another user, one writable by others (with `private`, writable by the group too)."""
    p = Path(path)
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        why = "is a symlink"
    elif not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    elif st.st_uid != os.geteuid():
        why = f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    elif private and st.st_mode & 0o022:
        why = f"is writable by its group or others (mode {stat.S_IMODE(st.st_mode):o}); make it 0700"
    elif st.st_mode & 0o002:
        why = f"is writable by every user (mode {stat.S_IMODE(st.st_mode):o})"
    else:
        return None
    if _is_trusted(p):
        return None
    return why


def check_dir(path: str | os.PathLike, field: str, *, private: bool = False) -> None:
    """Raise ConfigError when `path` is not to be trusted (see `untrusted_reason`)."""
    why = untrusted_reason(path, private=private)
    if why is not None:
        raise ConfigError(field, str(path),
                          f"refused: it {why}; fix its owner/mode (chmod o-w, chown), or trust it explicitly "
                          f"with DTORCH_TRUST={os.path.abspath(path)}")


def private_dir(path: str | os.PathLike, field: str) -> Path:
    """Create `path` as a private directory (0700), or check that the existing one is ours and
    writable by nobody else; never through a symlink."""
    p = Path(path)
    try:
        os.mkdir(p, 0o700)
    except FileExistsError:
        check_dir(p, field, private=True)
    except FileNotFoundError:
        p.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(p, 0o700)
    return p


def _is_trusted(directory: Path) -> bool:
    resolved = directory.resolve()
    return any(resolved == t or t in resolved.parents for t in trusted_dirs())


def open_append(path: str | os.PathLike, field: str) -> int:
    """A file descriptor appending to `path`, created 0600 if absent. Raises ConfigError naming
    `field` when the name is a symlink, not a regular file (a FIFO: never blocks), a hard link (a
    planted name must not redirect our writes to another file), or another user's file in a
    directory that DTORCH_TRUST does not list (the ownership rule of `check_dir`)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     0o600)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):  # a link; a FIFO without reader; a directory
            raise ConfigError(field, str(path), f"refused: it is {_kind(path)} (planted?); remove it") from None
        raise
    st = os.fstat(fd)
    why = None
    if not stat.S_ISREG(st.st_mode):
        why = f"it is {_kind(path)}"
    elif st.st_uid != os.geteuid() and not _is_trusted(Path(path).parent):
        why = (f"it is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}); trust its directory "
               f"with DTORCH_TRUST={os.path.abspath(Path(path).parent)} if that is intended")
    elif st.st_nlink > 1:
        why = f"it has {st.st_nlink} hard links"
    if why is not None:
        os.close(fd)
        raise ConfigError(field, str(path), f"refused: {why} (planted?); remove it")
    return fd


def _kind(path: str | os.PathLike) -> str:
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return "not a regular file"
    for test, name in ((stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def replace_file(path: str | os.PathLike, data: bytes, *, durable: bool = True) -> None:
    """Replace `path` with `data` atomically: a fresh private temp file beside it (O_EXCL,
    O_NOFOLLOW, 0600), renamed over the name (a link there is replaced, never followed). With
    `durable`, the file and then its directory are fsynced. Readers see the old content or the
    new; a failure (a full disk) leaves the old file and no temp file behind."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if durable:
        dfd = os.open(p.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and "localhost"; "" (every interface) is not loopback. What the
    unauthenticated servers (rendezvous store, monitor page) may bind to without an explicit opt-in."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
