"""Worker bootstrap: how `dtorch run` starts every worker.

Two ways, same effect. With `--start-method forkserver` (the default) the agent's forkserver has
imported torch once and forks each worker from it, then calls `run_target` (a restart costs a
fork, not a Python start plus a torch import: ~10 s of a recovery on a small machine). With
`--start-method spawn` each worker is a fresh `python -m dtorch.elastic.bootstrap [-m] TARGET ARGS`
(torchrun's way).

Either way the worker setup runs before the script's first line, so any script (not only DTorch's
trainer) gets it: parent-death signal (no orphans when the agent is SIGKILLed), faulthandler on
SIGUSR1 (stack dumps of a hung rank), the heartbeat thread. Then TARGET runs as `__main__` (a path,
or a module with `-m`), with `sys.argv` as the script would see it under torchrun.

Errors that a restart would only meet again (`is_fatal`: a `ConfigError` such as a bad flag, plan,
data file or an incompatible checkpoint; no space, no permission, a read-only filesystem) are not
left to the elastic agent's retries: the worker logs one `fatal` event with the message and exits
with code 2 at once, and the agent ends the job with that one line (`dtorch.elastic.launch`).
Any other error is recorded before the worker dies of it (`worker_error` event, full traceback in
`<run_dir>/errors/`): the agent names it as the cause of a failed job, and stops the job when the
same error comes back at the same step after a restart.
"""

from __future__ import annotations

import contextlib
import errno
import os
import runpy
import sys
from collections.abc import Iterator

from dtorch.env import current, export

FATAL_EXIT = 2

# What the forkserver imports once, so that a worker (re)start is a fork instead of a torch import.
# torch._dynamo alone is ~4 s: it is imported lazily by the first optimizer a worker builds.
FORKSERVER_PRELOAD = ("dtorch.elastic.forkserver_exit", "torch", "torch._dynamo", "torch.distributed", "torch.distributed.checkpoint",
                      "torch.distributed.tensor", "torch.distributed.fsdp", "dtorch.elastic.bootstrap")
# What `dtorch train` adds to it: DTorch's trainer and what it imports on the way to its first step
# (~0.1-0.3 s of every worker start on a small, loaded machine). Import-time state of these modules
# is inherited by every fork, so they keep none that a worker must not share (checked: module
# constants, registries and caches only; threads start in `worker.setup`). Never the target
# module itself: runpy warns when the module it is to run as __main__ is imported already.
TRAINER_PRELOAD = ("dtorch.train.trainer", "dtorch.train.data", "dtorch.train.sampler",
                   "dtorch.parallel.parallelize", "dtorch.checkpoint.manager", "dtorch.checkpoint.snapshot",
                   "dtorch.monitor.live", "dtorch.monitor.straggler", "dtorch.elastic.worker", "dtorch.models",
                   "dtorch.model.profiler", "dtorch.integrations.status", "dtorch.integrations.env")


def start_forkserver(preload: tuple[str, ...] = ()) -> None:
    """Start multiprocessing's forkserver now, importing torch and `preload` (~3 s) while this
    process does its own work (its torch import, checks, planning, the rendezvous): the launcher
    forks the workers from it later. Call it before importing torch, with this process's
    environment as the workers' base: the launcher passes the variables it sets afterwards to
    `run_target`. Idempotent; a later preload list is ignored once the server runs."""
    import multiprocessing
    from multiprocessing import forkserver

    multiprocessing.set_forkserver_preload([*FORKSERVER_PRELOAD, *preload])
    forkserver.ensure_running()


@contextlib.contextmanager
def early_forkserver(start: bool, preload: tuple[str, ...] = ()) -> Iterator[None]:
    """Around a command that will start workers (`start`): the forkserver started on entry
    (`start_forkserver`), and killed if the command fails before using it (`stop_forkserver`)."""
    if start:
        start_forkserver(preload)
    try:
        yield
    except BaseException:
        if start:
            stop_forkserver()
        raise


def stop_forkserver() -> None:
    """End a forkserver this process started and no worker was forked from, at once (it holds this
    process's stdout and stderr until its imports finish): for a command that fails its checks."""
    import signal
    from multiprocessing import forkserver

    server = forkserver._forkserver  # the instance whose methods the module exports
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
    with server._lock:  # as `ensure_running` does for a server found dead: a later start begins anew
        if server._forkserver_alive_fd is not None:
            os.close(server._forkserver_alive_fd)
        server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None
_FATAL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS}


def is_fatal(e: BaseException) -> bool:
    """Whether a restart would meet `e` again: user mistakes and full/read-only/forbidden disks.
    A CheckpointError marked `retryable` (a peer died during a save) is not fatal."""
    from dtorch.errors import ConfigError

    if isinstance(e, ConfigError):
        return not getattr(e, "retryable", False)
    return isinstance(e, OSError) and e.errno in _FATAL_ERRNOS


def is_symptom(e: BaseException) -> bool:
    """Whether `e` is what a worker meets when a peer or the store went away (a collective or the
    store failing): the cause is elsewhere, so it says nothing about whether a restart helps."""
    dist = sys.modules.get("torch.distributed")
    kinds = tuple(k for k in (getattr(dist, "DistError", None),) if k is not None)
    return isinstance(e, kinds) or isinstance(e, (ConnectionError, TimeoutError))


def _record_error(e: BaseException) -> None:
    """Before the worker dies of `e`: its full traceback in `<run_dir>/errors/` and one
    `worker_error` event (exception, its first line, the step and phase the training loop was in,
    the traceback file), from which the agent names the cause of a failed job and finds an error
    that repeats at the same step after a restart (`dtorch.elastic.agent.ExitDetector`)."""
    import traceback

    from dtorch.elastic import events, heartbeat

    env = current()
    run_dir = env.run_dir
    if run_dir is None:  # `_run` records errors only under `dtorch run`
        return
    hb = heartbeat.snapshot()
    path = None
    try:
        d = os.path.join(run_dir, "errors")
        os.makedirs(d, mode=0o700, exist_ok=True)
        name = f"epoch{env.epoch or 0}-rank{env.rank or 0}-{os.getpid()}.txt"
        fd = os.open(os.path.join(d, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("".join(traceback.format_exception(e)))
        path = os.path.join(d, name)
    except OSError:
        pass  # a full disk: the event still names the error
    lines = str(e).strip().splitlines()
    events.log("worker_error", error=type(e).__name__, message=lines[0] if lines else "", step=hb.get("step"),
               phase=hb.get("phase"), symptom=is_symptom(e), log=path)


def _run(target: str, args: list[str], module: bool) -> None:
    try:
        _run_target(target, args, module)
    except Exception as e:
        if not current().run_dir:
            raise
        if not is_fatal(e):
            try:
                _record_error(e)
            except Exception:  # noqa: S110 - never hide the worker's own error behind this one
                pass
            raise
        from dtorch.elastic import events

        message = str(e) if not isinstance(e, OSError) or e.filename is None else f"{e.filename}: {e.strerror}"
        events.log("fatal", error=type(e).__name__, message=message.splitlines()[0] if message else type(e).__name__)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(FATAL_EXIT)  # no traceback, no atexit: the agent prints the one line


def _run_target(target: str, args: list[str], module: bool) -> None:
    from dtorch.elastic import worker
    from dtorch.process_group import hosted

    worker.setup()
    hosted()  # the agent reads this function's return: the entry point must not end the process
    if module:
        sys.argv = [target, *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))  # as `python script.py` does
        runpy.run_path(target, run_name="__main__")


def run_target(env: dict[str, str], target: str, args: list[str], module: bool) -> None:
    """Entry point of a forked worker: `env` carries the variables the agent set for its workers
    (the forkserver may have started before it set them) and the epoch of this start."""
    export(env)
    _run(target, list(args), module)


def main(argv: list[str]) -> None:
    if argv and argv[0] == "-m":
        _run(argv[1], argv[2:], True)
    else:
        _run(argv[0], argv[1:], False)


if __name__ == "__main__":
    main(sys.argv[1:])
