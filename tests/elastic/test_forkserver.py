"""The workers' forkserver started early by a command, and ended by it: a failed command kills the
server it started, a later start makes a new one, and the server skips the interpreter's teardown
while the processes it forks exit as they would."""

import os
import subprocess
import sys
import textwrap

from dtorch.elastic.bootstrap import start_forkserver, stop_forkserver


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_stopped_forkserver_is_gone_and_a_later_start_makes_a_new_one():
    from multiprocessing import forkserver

    start_forkserver()
    first = forkserver._forkserver._forkserver_pid
    assert first is not None and _alive(first)
    stop_forkserver()
    assert not _alive(first)
    start_forkserver()  # reaped: `ensure_running` would fail on a pid it cannot wait for
    second = forkserver._forkserver._forkserver_pid
    assert second not in (None, first) and _alive(second)
    stop_forkserver()
    assert not _alive(second)
    stop_forkserver()  # nothing left to stop: a no-op


def test_the_server_exits_at_once_and_its_forks_keep_their_exit_codes():
    code = textwrap.dedent("""
        import atexit, os, sys
        import dtorch.elastic.forkserver_exit
        atexit.register(print, "flushed by a later handler", flush=True)
        pid = os.fork()
        if pid == 0:
            sys.exit(3)  # a forked process: its own exit, not the server's
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status), flush=True)
        sys.exit(5)  # the server ends on SystemExit when its agent goes: it leaves with 0
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    # each process runs the atexit handlers registered after the module (the fork first)
    assert out.stdout.splitlines() == ["flushed by a later handler", "child 3", "flushed by a later handler"]
