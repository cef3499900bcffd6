"""Worker bootstrap: `python -m dtorch.elastic.bootstrap [-m] TARGET ARGS...`.

The launcher starts every worker through this module so that any script (not only DTorch's
trainer) gets the worker setup before its first line runs: parent-death signal (no orphans when the
agent is SIGKILLed), faulthandler on SIGUSR1 (stack dumps of a hung rank) and the heartbeat thread.
Then it runs TARGET as `__main__` (a path, or a module with `-m`), with `sys.argv` as the script
would see it under torchrun. Imports nothing heavy: the script pays for torch itself.
"""

from __future__ import annotations

import os
import runpy
import sys


def main(argv: list[str]) -> None:
    from dtorch.elastic import worker

    worker.setup()
    if argv and argv[0] == "-m":
        mod, rest = argv[1], argv[2:]
        sys.argv = [mod, *rest]
        runpy.run_module(mod, run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))  # as `python script.py` does
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
