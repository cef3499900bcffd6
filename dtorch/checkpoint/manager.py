"""`CheckpointManager`: never-torn checkpoints on DCP, with verified load and fallback.

Layout under `root`::

    step-00000100/            committed (renamed into place only after its manifest is durable)
        __0_0.distcp ...      DCP shards, one or more per rank
        .metadata             DCP's index (a pickle: read only with an allow-list, after the manifest check)
        rank-00000.pt ...     rank-local state (RNG), weights_only-loadable
        manifest.json         step, world size, per-file SHA-256/size, plan, user metadata, HMAC
    step-00000200.tmp-1a2b3c  a save in progress (or a crashed one; removed by the next save)
    LATEST                    "step-00000100", moved atomically after each commit

Multi-rank saves: every rank writes its DCP shards (DCP coordinates and raises
CheckpointException on every rank if any failed), then hashes its own files; an all-gather on
a dedicated gloo group gives rank 0 every rank's outcome, and rank 0 commits only if all
succeeded, then tells everyone. The dedicated group keeps checkpoint traffic (which runs in a
background thread for async saves) apart from training collectives, and gives async DCP the CPU
backend it needs even when training runs on NCCL.

Trust: the root and every step directory must belong to this user and not be writable by others
(`dtorch.trust`), the manifest's HMAC must match the user's key, and `.metadata` is unpickled with
an allow-list (`dtorch.checkpoint.safe`). Faults that a restart cannot fix (no space, no
permission, an incompatible checkpoint) raise `CheckpointError` with `retryable = False`.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dtorch import trust
from dtorch.checkpoint import files as F
from dtorch.checkpoint import safe
from dtorch.checkpoint.state import Stager, is_rank_local, is_stateful, materialize, stage
from dtorch.errors import ConfigError

log = logging.getLogger("dtorch.checkpoint")

# DCP's failures derive from BaseException; catch them with ordinary errors, never KeyboardInterrupt.
_FAILURES = (Exception, CheckpointException)
# A single-process save/load is intended here (no_dist=True), not a mistake worth a warning.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


class CheckpointError(ConfigError):
    """No usable checkpoint, or a save that did not commit: names the directory and what to do."""

    def __init__(self, directory: str | os.PathLike, problem: str, fix: str, *, retryable: bool = False):
        self.directory = str(directory)
        self.problem = problem
        self.retryable = retryable
        """True when a restart can help (a peer died during a save); False for faults that would
        recur: no space, no permission, a damaged or incompatible checkpoint."""
        super().__init__("checkpoint_dir", self.directory, f"{problem}; {fix}")


_ITEM_OVERHEAD = 6 << 10  # bytes DCP adds per tensor written
_FULL_BELOW = 256 << 10  # a failed write with less free than this was a full disk

# Errors of the filesystem that a restart meets again.
FATAL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS}


def _is_fatal(e: BaseException) -> bool:
    if isinstance(e, CheckpointException):
        return any(_is_fatal(exc) for exc, _ in e.failures.values())
    return isinstance(e, OSError) and e.errno in FATAL_ERRNOS


class CheckpointWarning(UserWarning):
    """A damaged checkpoint was skipped in favour of an older intact one, or a LATEST that was
    not a regular file was moved aside."""


@dataclass
class SaveResult:
    """Outcome of `CheckpointManager.save`. For an async save, `persist_s`, `bytes` and
    `committed` are filled in when the background write finishes (see `CheckpointManager.wait`)."""

    step: int
    path: Path
    stall_s: float
    """Seconds the caller was blocked (staging copy for async saves, everything for sync ones)."""
    async_: bool = False
    persist_s: float | None = None
    """Seconds from the start of the save until the checkpoint was committed (LATEST moved)."""
    bytes: int | None = None
    committed: bool = False
    error: str | None = None
    fatal: bool = False
    """The failure would recur on a restart (no space, no permission)."""


@dataclass
class CheckpointInfo:
    """A committed checkpoint as listed (manifest read, files not hashed)."""

    step: int
    path: Path
    world_size: int | None
    bytes: int | None
    created_unix: float | None
    extra: dict[str, Any] = field(default_factory=dict)
    plan: dict[str, Any] | None = None
    latest: bool = False
    manifest_ok: bool = True
    problem: str | None = None


@dataclass
class VerifyReport:
    """Result of hashing every file of one checkpoint against its manifest."""

    path: Path
    step: int | None
    ok: bool
    problems: list[str]
    files_checked: int
    bytes: int

    def describe(self) -> str:
        head = f"{self.path}: " + ("OK" if self.ok else "DAMAGED")
        head += f" ({self.files_checked} files, {self.bytes / 1e6:.1f} MB)"
        return "\n".join([head] + [f"  {p}" for p in self.problems])


class CheckpointManager:
    """Save, list, verify, load and export the checkpoints of one run under `root`.

    Construct it on every rank (it creates a gloo process group when torch.distributed is
    initialized with more than one rank; pass `process_group` to use a group of your own, which
    must have a CPU backend). `keep_last` committed checkpoints are kept (None keeps all).
    `fault_hook(phase)` is called at each step of the commit protocol; tests use it to slow
    down or kill a save at a chosen point.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        keep_last: int | None = 3,
        *,
        process_group: Any = None,
        thread_count: int = 1,
        writer_factory: Callable[[Path], Any] | None = None,
        fault_hook: Callable[[str], None] | None = None,
    ):
        if keep_last is not None and int(keep_last) < 1:
            raise ConfigError("keep_last", keep_last, "keep at least 1 checkpoint, or None to keep all")
        if int(thread_count) < 1:
            raise ConfigError("thread_count", thread_count, "use at least 1 writer thread")
        self.root = Path(root)
        self.keep_last = None if keep_last is None else int(keep_last)
        self.thread_count = int(thread_count)
        self.writer_factory = writer_factory
        self.fault_hook = fault_hook
        self._distributed = dist.is_available() and dist.is_initialized()
        if self._distributed and process_group is None and dist.get_world_size() > 1:
            process_group = dist.new_group(backend="gloo")
        self._pg = process_group
        self._multi = self._distributed and dist.get_world_size(self._pg) > 1
        self.rank = dist.get_rank(self._pg) if self._distributed else 0
        self.world_size = dist.get_world_size(self._pg) if self._distributed else 1
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)  # private unless the user made it otherwise
        trust.check_dir(self.root, "checkpoint_dir")
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dtorch-ckpt")
        self._pending: tuple[Future, SaveResult] | None = None
        self._stager = Stager()
        self._lock = threading.Lock()
        self.loaded: CheckpointInfo | None = None
        """The checkpoint the last successful `load_latest`/`load` restored (its extra, plan)."""
        self._last_bytes: int | None = None
        self.last_committed: int | None = None
        """Step of the last save of this manager that committed (directory renamed, LATEST moved)."""
        self.on_commit: Callable[[int], None] | None = None
        """Called with the step on every rank as soon as a save has committed (for async saves:
        from the background thread). The elastic worker uses it to tell its agent at once."""

    # ---- collectives on the checkpoint group (no-ops in a single process) ----------------------
    def _broadcast(self, obj: Any) -> Any:
        if not self._multi:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self._pg, group_src=0)
        return box[0]

    def _all_gather(self, obj: Any) -> list[Any]:
        if not self._multi:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._pg)
        return out

    def _phase(self, name: str) -> None:
        if self.fault_hook is not None:
            self.fault_hook(name)

    # ---- save -----------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: dict[str, Any],
        *,
        async_: bool = False,
        extra: dict[str, Any] | None = None,
        plan: Any = None,
    ) -> SaveResult:
        """Checkpoint `state` as `step` (collective: call on every rank with the same arguments).

        `state` maps names to Stateful objects (model/optimizer wrappers, LR schedulers,
        `RNGState`) or to (nested) dicts of tensors, DTensors and plain values. `extra` is
        JSON-serialisable metadata kept in the manifest (metrics, data position); `plan` a Plan
        (or dict). With `async_`, tensors are copied to CPU and the write continues in a
        background thread: the returned `stall_s` is the blocking part; call `wait()` to join.
        A previous async save is always joined first. Raises CheckpointError if a sync save did
        not commit (the previous checkpoints are untouched).
        """
        if int(step) < 0:
            raise ConfigError("step", step, "checkpoint steps are non-negative")
        self.wait()
        t0 = time.perf_counter()
        dcp_state = {k: v for k, v in state.items() if not is_rank_local(v)}
        local = {k: v.state_dict() for k, v in state.items() if is_rank_local(v)}
        plan_dict = plan.to_dict() if hasattr(plan, "to_dict") else plan
        meta = {"extra": dict(extra or {}), "plan": plan_dict}
        try:
            json.dumps(meta)  # it goes into the JSON manifest: refuse now, not after the write
        except (TypeError, ValueError) as e:
            raise ConfigError("extra", extra, f"extra and plan must be JSON-serialisable ({e})") from None
        path = self.root / F.step_dirname(step)
        tree = materialize(dcp_state)
        need = self._check_space(int(step), tree, local)
        meta["expected_bytes"] = need
        if async_:
            staged = self._stager.stage(tree)
            local = stage(local)
            result = SaveResult(step=int(step), path=path, stall_s=time.perf_counter() - t0, async_=True)
            fut = self._executor.submit(self._write_and_commit, int(step), staged, local, meta, t0, result)
            self._pending = (fut, result)
            log.info("checkpoint step %d: async save started, stall %.3f s", step, result.stall_s)
            return result
        result = SaveResult(step=int(step), path=path, stall_s=0.0)
        self._write_and_commit(int(step), tree, stage(local), meta, t0, result)
        result.stall_s = time.perf_counter() - t0
        if result.error:
            raise self._save_error(result, "save")
        return result

    # ---- free space -------------------------------------------------------------------------------
    def _expected_bytes(self, tree: dict[str, Any], local: dict[str, Any]) -> int:
        """Bytes this rank will write: its DTensor shards (divided among their replicas), plain
        tensors on rank 0 only (DCP writes one copy of replicated values), its rank-local file,
        and DCP's framing of each tensor (~5 KB each on torch 2.13: a small archive per item)."""
        total = 0
        items = 0

        def walk(obj: Any, plain: bool) -> None:
            nonlocal total, items
            if isinstance(obj, torch.Tensor):
                lt = getattr(obj, "_local_tensor", None)
                if lt is not None:
                    reps = 1
                    for i, pl in enumerate(obj.placements):
                        if pl.is_replicate():
                            reps *= obj.device_mesh.size(i)
                    total += lt.numel() * lt.element_size() // reps
                    items += 1
                elif plain:
                    total += obj.numel() * obj.element_size()
                    items += 1
            elif isinstance(obj, dict):
                for v in obj.values():
                    walk(v, plain)
            elif isinstance(obj, (list, tuple)):
                for v in obj:
                    walk(v, plain)

        walk(tree, self.rank == 0)
        walk(local, True)  # every rank writes its rank-local file
        return total + items * _ITEM_OVERHEAD + (16 << 10)  # + manifest

    def _free_bytes(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def _disk_full(self) -> bool:
        try:
            return self._free_bytes() < _FULL_BELOW
        except OSError:
            return False

    def _check_space(self, step: int, tree: dict[str, Any], local: dict[str, Any]) -> int:
        """Before writing (collective): the checkpoint's expected size against the free space of
        the filesystem. Too little: first drop the checkpoints retention would drop after this
        commit anyway (never the newest good one), then, if still short, raise a CheckpointError
        naming the bytes needed and the last good checkpoint. Returns the expected bytes."""
        mine = self._expected_bytes(tree, local)
        for attempt in (0, 1):
            gathered = self._all_gather((mine, self._free_bytes()))
            # the last checkpoint's real size is the best estimate of the next one
            need = max(sum(b for b, _ in gathered), self._last_bytes or 0)
            free = gathered[0][1]
            short = need > free or any(b > f for b, f in gathered)  # shared or node-local disks
            if not short:
                return need
            if attempt == 0 and self.keep_last is not None and self.keep_last > 1:
                if self.rank == 0:
                    dropped = self._prune(self.keep_last - 1)
                    if dropped:
                        log.warning("checkpoint step %d: %d bytes needed, %d free; removed %s early",
                                    step, need, free, ", ".join(p.name for p in dropped))
                self._broadcast(None)  # everyone re-reads free space after rank 0 pruned
                continue
            break
        raise CheckpointError(
            self.root,
            f"not enough space for the checkpoint of step {step}: it needs {need:,} bytes, "
            f"{free:,} are free; last good checkpoint: {self._last_good()}",
            "free disk space or point --checkpoint-dir at a larger filesystem, then resume",
        )

    def _last_good(self) -> str:
        dirs = F.committed_dirs(self.root)
        return str(dirs[0][1]) if dirs else "none"

    def _save_error(self, result: SaveResult, what: str) -> CheckpointError:
        problem = f"{what} of step {result.step} did not commit: {result.error}"
        if result.fatal:
            return CheckpointError(self.root, f"{problem}; last good checkpoint: {self._last_good()}",
                                   "free disk space / fix permissions, then resume")
        return CheckpointError(self.root, problem, _SAVE_FIX, retryable=True)

    def raise_if_failed(self) -> None:
        """Cheap, not collective: if the pending async save has finished and failed, raise its
        CheckpointError now (call once per step, so a failed save is known at the next step)."""
        if self._pending is not None and self._pending[0].done():
            self.wait()

    def warm_up(self, state: dict[str, Any]) -> float:
        """Allocate the CPU staging buffers of async saves now (outside any training step), so
        that the first async save's stall is only the memory copy, like every later one. Local,
        not collective. Returns the seconds it took."""
        t0 = time.perf_counter()
        self._stager.stage(materialize({k: v for k, v in state.items() if not is_rank_local(v)}))
        return time.perf_counter() - t0

    def wait(self, raise_on_error: bool = True) -> SaveResult | None:
        """Join the pending async save (if any) and return its result; raises CheckpointError if
        it did not commit (unless `raise_on_error` is False)."""
        if self._pending is None:
            return None
        fut, result = self._pending
        self._pending = None
        fut.result()  # _write_and_commit records failures in result; it raises only on bugs
        if result.error and raise_on_error:
            raise self._save_error(result, "async save")
        return result

    def _write_and_commit(
        self, step: int, dcp_state: dict[str, Any], local: dict[str, Any], meta: dict[str, Any], t0: float, result: SaveResult
    ) -> None:
        name = F.step_dirname(step)
        nonce = self._broadcast(secrets.token_hex(4) if self.rank == 0 else None)
        tmp = self.root / f"{name}.tmp-{nonce}"
        self._phase("begin")
        error: str | None = None
        fatal = False
        mine: dict[str, dict[str, Any]] = {}
        try:
            if self.rank == 0:
                self._remove_debris(keep=tmp)
            tmp.mkdir(exist_ok=True, mode=0o700)  # nobody else reaches the files inside, whatever their mode
        except OSError as e:
            error = f"rank {self.rank}: cannot create {tmp}: {e}"
            fatal = e.errno in FATAL_ERRNOS
        # Every rank enters dcp.save even after a local error: it is collective, and a rank that
        # skipped it would leave the others waiting. DCP then fails everywhere together.
        try:
            writer = (
                self.writer_factory(tmp)
                if self.writer_factory is not None
                else dcp.FileSystemWriter(tmp, thread_count=self.thread_count, sync_files=True, overwrite=False)
            )
            dcp.save(dcp_state, storage_writer=writer, process_group=self._pg, no_dist=not self._multi)
            self._phase("dcp_saved")
            if error is None:
                rank_file = f"rank-{self.rank:05d}.pt"
                with os.fdopen(F.create_private(tmp / rank_file), "wb") as f:
                    torch.save(local, f)
                    f.flush()
                    os.fsync(f.fileno())
                self._phase("rank_file")
                # Each rank hashes the shards it wrote (DCP names them __<rank>_<n>); rank 0 also
                # hashes whatever no rank claimed (.metadata).
                for p in sorted(tmp.iterdir()):
                    if p.name.startswith(f"__{self.rank}_") or p.name == rank_file:
                        F.make_private(p)  # DCP creates its files with the default mode (0644)
                        F.fsync_file(p)  # DCP's writer fsyncs already; a custom writer might not
                        digest, size = F.sha256_file(p)
                        mine[p.name] = {"sha256": digest, "size": size}
        except _FAILURES as e:
            # DCP's CheckpointException already names the failing ranks.
            error = error or (_describe(e) if isinstance(e, CheckpointException) else f"rank {self.rank}: {_describe(e)}")
            fatal = fatal or _is_fatal(e)
            if not fatal and self._disk_full():
                # torch.save reports a full disk as RuntimeError("unexpected pos ..."), not ENOSPC
                fatal = True
                error += f" (the filesystem of {self.root} is full: {self._free_bytes():,} bytes free)"
        if fatal and error and "expected_bytes" in meta:
            error += f" (the checkpoint needs about {meta['expected_bytes']:,} bytes)"
        try:
            reports = self._all_gather((error, mine, fatal))
        except _FAILURES as e:  # a rank died or the group broke: no agreement, so no commit
            reports = None
            lost = f"lost the other ranks before the commit ({_describe(e)}); nothing was committed"
        outcome: tuple[bool, str | None, int, bool] = (False, None if reports else lost, 0, False)
        if self.rank == 0 and reports is not None:
            outcome = self._commit(step, tmp, reports, meta)
        if reports is not None:
            try:
                outcome = self._broadcast(outcome)
            except _FAILURES as e:
                if self.rank != 0:  # rank 0 knows what it did; the others cannot tell
                    outcome = (False, f"lost rank 0 during the commit ({_describe(e)}); outcome unknown", 0, False)
        committed, problem, nbytes, fatal = outcome
        result.committed, result.error, result.bytes, result.fatal = committed, problem, nbytes, fatal
        if committed:
            self.last_committed = step
            self._last_bytes = nbytes
            if self.on_commit is not None:
                try:
                    self.on_commit(step)
                except Exception as e:  # a watcher's problem must not fail a committed save
                    log.warning("checkpoint on_commit callback failed: %s", e)
        result.persist_s = time.perf_counter() - t0
        if committed:
            log.info(
                "checkpoint step %d committed: %.1f MB in %.3f s%s",
                step, nbytes / 1e6, result.persist_s,
                f" (training blocked {result.stall_s:.3f} s)" if result.async_ else "",
            )
        else:
            log.error("checkpoint step %d did not commit: %s", step, problem)

    def _commit(self, step: int, tmp: Path, reports: list[Any], meta: dict[str, Any]) -> tuple[bool, str | None, int, bool]:
        """Rank 0: manifest -> fsync -> rename -> fsync parent -> LATEST -> retention."""
        errors = list(dict.fromkeys(e for e, _, _ in reports if e))  # DCP reports one failure on every rank
        if errors:
            shutil.rmtree(tmp, ignore_errors=True)
            return False, "; ".join(errors), 0, any(f for _, _, f in reports)
        try:
            files: dict[str, dict[str, Any]] = {}
            for _, mine, _ in reports:
                files.update(mine)
            for p in sorted(tmp.iterdir()):
                if p.name not in files and p.name != F.MANIFEST:
                    F.make_private(p)
                    digest, size = F.sha256_file(p)
                    F.fsync_file(p)  # DCP fsyncs its shards and .metadata; this covers anything else
                    files[p.name] = {"sha256": digest, "size": size}
            manifest = F.Manifest(
                step=step,
                world_size=self.world_size,
                files=files,
                rank_files=[f"rank-{r:05d}.pt" for r in range(self.world_size)],
                plan=meta["plan"],
                extra=meta["extra"],
                created_unix=time.time(),
                torch_version=torch.__version__,
            )
            missing = [n for n in manifest.rank_files if n not in files]
            if missing:
                raise RuntimeError(f"rank files missing: {missing}")
            F.write_manifest(tmp, manifest)
            F.fsync_dir(tmp)
            self._phase("manifest")
            final = self.root / F.step_dirname(step)
            old = None
            if final.exists():  # a re-save of a step (e.g. after falling back past a damaged one)
                old = final.with_name(f"{final.name}.old-{tmp.name.rsplit('-', 1)[-1]}")
                os.rename(final, old)
            os.rename(tmp, final)
            F.fsync_dir(self.root)
            self._phase("renamed")
            self._move_latest(final.name)
            self._phase("latest")
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except _FAILURES as e:
            shutil.rmtree(tmp, ignore_errors=True)
            fatal = _is_fatal(e)
            why = _describe(e)
            if fatal:
                why += f" (the checkpoint needs about {meta.get('expected_bytes', 0):,} bytes)"
            return False, why, 0, fatal
        try:
            # The step just committed was hashed a moment ago: it is the newest good one and
            # retention counts it first, so it is never deleted here.
            self._prune(self.keep_last, known_good=step)
        except OSError as e:
            log.warning("checkpoint retention failed (checkpoints kept): %s", e)
        return True, None, manifest.total_bytes, False

    def _move_latest(self, name: str) -> None:
        """Point LATEST at `name`. The checkpoint is already committed (its directory renamed) and
        load never reads LATEST, so nothing here fails the save: a LATEST of another kind (a
        directory, a FIFO, a link) is moved aside with a warning, and a pointer that cannot be
        written (a full disk) is warned about and left stale."""
        try:
            aside = F.clear_latest(self.root)
            if aside is not None:
                warnings.warn(f"{self.root / F.LATEST} was not a regular file; moved aside to {aside.name} "
                              f"and pointed LATEST at {name}", CheckpointWarning, stacklevel=2)
            F.atomic_write(self.root / F.LATEST, (name + "\n").encode())
        except OSError as e:
            log.warning("checkpoint %s committed, but LATEST could not be updated (%s); load does not need it",
                        name, e)

    def _remove_debris(self, keep: Path) -> None:
        """Remove directories of crashed saves (``*.tmp-*``), replaced or pruned steps
        (``*.old-*``) and a LATEST temp file left by a crash mid-replace."""
        for p in self.root.iterdir():
            if p != keep and p.is_dir() and (".tmp-" in p.name or ".old-" in p.name):
                shutil.rmtree(p, ignore_errors=True)
            elif p.name.startswith(f".{F.LATEST}.tmp-") and p.is_file():
                p.unlink(missing_ok=True)

    # ---- retention -------------------------------------------------------------------------------
    def prune(self, keep_last: int | None = None) -> list[Path]:
        """Delete committed checkpoints beyond the newest `keep_last` (default: the manager's),
        but never the newest one that verifies; returns the deleted paths. Rank 0 only."""
        self.wait()
        if self.rank != 0:
            return []
        return self._prune(self.keep_last if keep_last is None else keep_last)

    def _prune(self, keep_last: int | None, known_good: int | None = None) -> list[Path]:
        if keep_last is None:
            return []
        dirs = F.committed_dirs(self.root)
        keep, drop = dirs[:keep_last], dirs[keep_last:]
        if known_good is None or known_good not in {s for s, _ in keep}:
            kept_ok = any(self.verify(p).ok for _, p in keep)
            if not kept_ok:
                # Keep the newest older checkpoint that verifies, so one good one always remains.
                for i, (_, p) in enumerate(drop):
                    if self.verify(p).ok:
                        drop.pop(i)
                        break
        for _, p in drop:
            # Rename first so that a crash mid-delete never leaves a half-deleted step-* directory.
            trash = p.with_name(f"{p.name}.old-{secrets.token_hex(4)}")
            os.rename(p, trash)
            shutil.rmtree(trash, ignore_errors=True)
            log.info("checkpoint retention: removed %s", p)
        if drop:
            F.fsync_dir(self.root)
        return [p for _, p in drop]

    # ---- inspect ---------------------------------------------------------------------------------
    def _resolve(self, step_or_path: int | str | os.PathLike | None) -> Path:
        if step_or_path is None:
            dirs = F.committed_dirs(self.root)
            if not dirs:
                raise CheckpointError(self.root, "no committed checkpoint", "save one first or pass another directory")
            return dirs[0][1]
        if isinstance(step_or_path, int):
            path = self.root / F.step_dirname(step_or_path)
        else:
            path = Path(step_or_path)
        if not path.is_dir():
            have = [s for s, _ in F.committed_dirs(self.root)]
            raise CheckpointError(path, "no such checkpoint", f"committed steps under {self.root}: {have}")
        return path

    def latest_pointer(self) -> str | None:
        """The directory name LATEST points to (None if absent or not a valid pointer: binary
        bytes, a directory, a symlink; load never depends on it)."""
        return F.read_latest(self.root)

    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints, newest first, from their manifests (files are not hashed)."""
        latest = self.latest_pointer()
        out = []
        for step, path in F.committed_dirs(self.root):
            try:
                m = F.read_manifest(path)
                out.append(
                    CheckpointInfo(step, path, m.world_size, m.total_bytes, m.created_unix, m.extra, m.plan, path.name == latest)
                )
            except F.ManifestError as e:
                out.append(CheckpointInfo(step, path, None, None, None, latest=path.name == latest, manifest_ok=False, problem=str(e)))
        return out

    def verify(self, step_or_path: int | str | os.PathLike | None = None) -> VerifyReport:
        """Hash every file of one checkpoint (default: the newest) against its manifest."""
        path = self._resolve(step_or_path)
        why = trust.untrusted_reason(path)
        if why is not None:
            return VerifyReport(path, None, False, [f"directory {why}; {_TRUST_DIR_FIX}"], 0, 0)
        try:
            m = F.read_manifest(path)
        except F.ManifestError as e:
            return VerifyReport(path, None, False, [str(e)], 0, 0)
        problems = [p for n, exp in sorted(m.files.items()) if (p := F.check_file(path, n, exp))]
        problems += [f"{n}: not in the manifest" for n in m.rank_files if n not in m.files]
        if not problems:
            problems += _metadata_problems(path)
        return VerifyReport(path, m.step, not problems, problems, len(m.files), m.total_bytes)

    def _verify_shared(self, path: Path) -> tuple[F.Manifest | None, list[str]]:
        """Verify with the hashing spread over the ranks; every rank gets the same answer."""
        why = trust.untrusted_reason(path)
        m = None
        if why is not None:
            problems = [f"directory {why}; {_TRUST_DIR_FIX}"]
        else:
            try:
                m = F.read_manifest(path)
            except F.ManifestError as e:
                problems = [str(e)]
            else:
                names = sorted(m.files)
                problems = [p for n in names[self.rank :: self.world_size] if (p := F.check_file(path, n, m.files[n]))]
                problems += [f"{n}: not in the manifest" for n in m.rank_files if n not in m.files]
                if self.rank == 0 and not problems:
                    problems += _metadata_problems(path)
        gathered = self._all_gather(problems)
        merged = sorted({p for ps in gathered for p in ps})
        return (m if not merged else None), merged

    # ---- load ------------------------------------------------------------------------------------
    def load_latest(self, state: dict[str, Any]) -> int | None:
        """Restore the newest checkpoint that verifies into `state`, in place; returns its step,
        or None when there is no checkpoint at all (a fresh run). Collective.

        Tensors and DTensors are filled in place, so loading under another world size or
        sharding reshards (DCP). Damaged checkpoints are skipped with a CheckpointWarning naming
        the bad file; if checkpoints exist but none verifies, raises CheckpointError.
        """
        self.wait()
        dirs = self._broadcast([(s, str(p)) for s, p in F.committed_dirs(self.root)] if self.rank == 0 else None)
        if not dirs:
            return None
        damaged = []
        for step, p in dirs:
            manifest, problems = self._verify_shared(Path(p))
            if manifest is None:
                damaged.append(f"{Path(p).name}: {problems[0]}")
                msg = f"checkpoint {p} is damaged ({'; '.join(problems[:3])}); falling back to an older one"
                if self.rank == 0:  # every rank reached the same verdict: say it once per job
                    warnings.warn(msg, CheckpointWarning, stacklevel=2)
                else:
                    log.info(msg)
                continue
            self._load_verified(Path(p), manifest, state)
            return step
        raise CheckpointError(
            self.root,
            "no intact checkpoint: " + "; ".join(damaged),
            "restore the damaged files from a copy, or move the step-* directories away to start from scratch",
        )

    def committed_steps(self) -> list[int]:
        """Collective: the steps of the committed checkpoints, newest first (rank 0's listing)."""
        return self._broadcast([s for s, _ in F.committed_dirs(self.root)] if self.rank == 0 else None)

    def load(self, step_or_path: int | str | os.PathLike, state: dict[str, Any]) -> int:
        """Restore one given checkpoint (verified first, no fallback); returns its step."""
        self.wait()
        path = self._resolve(step_or_path)
        manifest, problems = self._verify_shared(path)
        if manifest is None:
            raise CheckpointError(path, "damaged: " + "; ".join(problems), "load another step (dtorch ckpt ls)")
        self._load_verified(path, manifest, state)
        return manifest.step

    def _load_verified(self, path: Path, m: F.Manifest, state: dict[str, Any]) -> None:
        dcp_state = {k: v for k, v in state.items() if not is_rank_local(v)}
        local_keys = [k for k, v in state.items() if is_rank_local(v)]
        from dtorch.progress import phase

        try:
            with phase(f"loading checkpoint {path.name} ({m.total_bytes / 2**30:.2f} GiB)",
                       enabled=None if self.rank == 0 else False):
                dcp.load(dcp_state, storage_reader=safe.SafeFileSystemReader(path), process_group=self._pg,
                         no_dist=not self._multi)
        except _FAILURES as e:
            # e.g. a checkpoint of another model: DCP's "Size mismatch" on every rank, or missing keys
            raise CheckpointError(path, f"incompatible with this run: {_describe(e)}",
                                  "resume with the model and settings it was written with, or use another "
                                  "--checkpoint-dir") from None
        for k, v in dcp_state.items():
            if not is_stateful(v):
                state[k] = v  # DCP replaces non-tensor top-level leaves in our shallow copy
        if local_keys:
            src = self.rank if m.world_size == self.world_size else self.rank % m.world_size
            if src != self.rank:
                log.info("world size %d -> %d: rank %d takes rank-local state of rank %d", m.world_size, self.world_size, self.rank, src)
            with open(path / m.rank_files[src], "rb") as f:
                local = torch.load(f, weights_only=True)
            for k in local_keys:
                if k in local:
                    state[k].load_state_dict(local[k])
                else:
                    log.warning("checkpoint %s has no rank-local state %r; left as is", path, k)
        self._last_bytes = m.total_bytes  # the next save of this run will be about this size
        self.loaded = CheckpointInfo(
            m.step, path, m.world_size, m.total_bytes, m.created_unix, m.extra, m.plan, path.name == self.latest_pointer()
        )

    # ---- export ----------------------------------------------------------------------------------
    def export_safetensors(
        self, step: int | None, path: str | os.PathLike, *, keys: list[str] | None = None
    ) -> Path:
        """Write one consolidated safetensors file of checkpoint `step` (default: newest).

        Nested names are joined with "." (``model.layers.0.weight``); `keys` keeps only the
        top-level entries named (e.g. ``["model"]``). Non-tensor values and the manifest's
        step/extra go into the file's metadata as JSON. Runs in this process only.
        """
        from dtorch.checkpoint.export import export_safetensors

        return export_safetensors(self.verified(step), Path(path), keys=keys)

    def verified(self, step: int | None = None) -> Path:
        """The directory of checkpoint `step`, verified (CheckpointError if damaged); with no step,
        the newest one that verifies, as a resuming run chooses: each damaged newer one is skipped
        with a CheckpointWarning naming its problem. Runs in this process only."""
        if step is not None:
            src = self._resolve(step)
            report = self.verify(src)
            if not report.ok:
                raise CheckpointError(src, "damaged: " + "; ".join(report.problems), "export another step (dtorch ckpt ls)")
            return src
        damaged = []
        for _, p in F.committed_dirs(self.root):
            report = self.verify(p)
            if report.ok:
                return p
            damaged.append(f"{p.name}: {report.problems[0]}")
            warnings.warn(f"checkpoint {p} is damaged ({'; '.join(report.problems[:3])}); falling back to an older one",
                          CheckpointWarning, stacklevel=2)
        if not damaged:
            raise CheckpointError(self.root, "no committed checkpoint", "save one first or pass another directory")
        raise CheckpointError(self.root, "no intact checkpoint: " + "; ".join(damaged),
                              "restore the damaged files from a copy (dtorch ckpt verify names them)")

    def close(self) -> None:
        """Join any pending save, stop the background thread and free the staging buffers."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
            self._stager.clear()


def _describe(e: BaseException) -> str:
    """One line per failure: DCP's CheckpointException prints whole tracebacks of every rank;
    ranks failing with the same message are named together."""
    if isinstance(e, CheckpointException):
        by_msg: dict[str, list[int]] = {}
        for rank, (exc, _trace) in sorted(e.failures.items()):
            by_msg.setdefault(_one_line(exc), []).append(rank)
        parts = [f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}: {msg}" for msg, rs in by_msg.items()]
        return "; ".join(parts) or "CheckpointException"
    return _one_line(e)


def _one_line(e: BaseException) -> str:
    lines = [x.strip() for x in str(e).strip().splitlines() if x.strip()]
    return f"{type(e).__name__}: {' '.join(lines)[:400]}"


_TRUST_DIR_FIX = "fix its owner/mode, or trust it explicitly with DTORCH_TRUST=DIR"


def _metadata_problems(path: Path) -> list[str]:
    """Problems of DCP's `.metadata` read with the allow-list (it may only hold DCP metadata)."""
    try:
        safe.load_metadata(path / ".metadata")
    except FileNotFoundError:
        return [".metadata: missing"]
    except (OSError, safe.UnsafeMetadata) as e:
        return [f".metadata: {e}"]
    return []


_SAVE_FIX = "the previous checkpoints are untouched; check free disk space and permissions, then save again"
