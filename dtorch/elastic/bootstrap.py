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
"""

from __future__ import annotations

import os
import runpy
import sys


def _run(target: str, args: list[str], module: bool) -> None:
    from dtorch.elastic import worker

    worker.setup()
    if module:
        sys.argv = [target, *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))  # as `python script.py` does
        runpy.run_path(target, run_name="__main__")


def run_target(env: dict[str, str], target: str, args: list[str], module: bool) -> None:
    """Entry point of a forked worker: `env` carries what changes per start (the epoch)."""
    os.environ.update(env)
    _run(target, list(args), module)


def main(argv: list[str]) -> None:
    if argv and argv[0] == "-m":
        _run(argv[1], argv[2:], True)
    else:
        _run(argv[0], argv[1:], False)


if __name__ == "__main__":
    main(sys.argv[1:])
