"""`dtorch.process_group.leave`: the exit of an entry point after its work is done."""

import subprocess
import sys

SCRIPT = """
import atexit, os, sys
import torch.distributed as dist
from dtorch import process_group as pg

out = sys.argv[1]
atexit.register(lambda: open(out, "a").write("atexit ran\\n"))
dist.init_process_group("gloo", init_method="file://" + out + ".rdzv", rank=0, world_size=1)
if sys.argv[2] == "hosted":
    pg.hosted()
try:
    pg.leave(3)
except SystemExit as e:
    open(out, "a").write(f"SystemExit {e.code}, group {'up' if dist.is_initialized() else 'destroyed'}\\n")
    raise
open(out, "a").write("after leave\\n")  # never reached
"""


def _run(tmp_path, mode):
    out = tmp_path / f"{mode}.txt"
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(out), mode], capture_output=True, text=True, timeout=60)
    return p.returncode, out.read_text() if out.exists() else ""


def test_leave_runs_the_atexit_handlers_and_exits_with_the_code(tmp_path):
    code, text = _run(tmp_path, "main")
    assert code == 3 and text == "atexit ran\n"


def test_a_hosted_entry_point_returns_through_system_exit_with_the_group_destroyed(tmp_path):
    code, text = _run(tmp_path, "hosted")
    assert code == 3 and text == "SystemExit 3, group destroyed\natexit ran\n"
