"""Imported by the workers' forkserver only (first in its preload list): the server ends without the
interpreter's teardown.

The forkserver leaves when its agent does, and it holds the agent's stdout and stderr: a caller
reading the command's output (a test, a pipe, a scheduler's log) waits for it. Tearing down torch,
torch._dynamo and the trainer's modules took 1-4 s on a 2-core machine; the server has nothing to
flush, so after the atexit handlers of the modules it imported (registered later, so run
earlier) it exits at once. Bound to the importing process: the workers
it forks inherit the handler and skip it.
"""

from __future__ import annotations

import atexit
import os

_SERVER = os.getpid()


def _exit_now() -> None:
    if os.getpid() == _SERVER:
        os._exit(0)


atexit.register(_exit_now)
