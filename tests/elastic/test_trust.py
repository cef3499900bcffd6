"""Nothing from the rendezvous store or the run directory is trusted unverified: a pickle set
under the rendezvous key by another process runs nothing, planted run directories, symlinked
event logs and forged heartbeats are refused. Real TCPStores, real torch rendezvous handler."""

from __future__ import annotations

import base64
import json
import os
import pickle
import socket
import subprocess
import sys
import time

import pytest

from dtorch.elastic import events, heartbeat
from dtorch.elastic import store as rdzv_store
from dtorch.errors import ConfigError

CLI = [sys.executable, "-m", "dtorch.cli", "run"]

pytestmark = [pytest.mark.slow]


class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _forked(target, *args, timeout: float = 60) -> tuple[int | None, str]:
    """Run `target(*args)` in another process, forked from the suite's forkserver (torch imported once
    per session, tests/parallel/_harness.py) with this process's environment; (exit code, its output)."""
    import multiprocessing
    import tempfile
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))
    from _harness import PRELOAD

    multiprocessing.set_forkserver_preload(PRELOAD)  # takes effect when the server first starts
    with tempfile.NamedTemporaryFile("r", suffix=".log") as log:
        p = multiprocessing.get_context("forkserver").Process(target=_in_env, args=(dict(os.environ), log.name,
                                                                                     target, *args))
        p.start()
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join()
        return p.exitcode, log.read()


def _in_env(env: dict, log: str, target, *args) -> None:
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    target(*args)


def _attacker(port: int, key: str, payload: bytes, fake_tag: bool) -> None:
    """Another process of the machine: a plain TCPStore client sets a pickle under the rendezvous key."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10), multi_tenant=True)
    bits = (b"0" * 64 + payload) if fake_tag else payload
    store.set(key, base64.b64encode(bits).decode())


@pytest.mark.parametrize("fake_tag", [False, True])
def test_pickle_set_under_the_rendezvous_key_by_another_process_runs_nothing(tmp_path, fake_tag):
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    port = _free_port()
    params = RendezvousParameters(backend="c10d", endpoint=f"127.0.0.1:{port}", run_id="victim", min_nodes=1,
                                  max_nodes=2, local_addr="127.0.0.1", last_call_timeout=1, join_timeout=30)
    handler = rdzv_store.rendezvous_handler(params)
    try:
        handler.next_rendezvous()
        backend = handler._state_holder._backend
        assert isinstance(backend, rdzv_store.SignedBackend)
        assert rdzv_store.read_state(backend).participants  # the real, signed state reads back
        marker = tmp_path / "PWNED"
        payload = pickle.dumps(_Payload(str(marker)))
        code, out = _forked(_attacker, port, "torch.rendezvous.victim", payload, fake_tag)
        assert code == 0, out
        got = base64.b64decode(handler._store.get("torch.rendezvous.victim"))
        assert got.endswith(payload)  # the forgery is in the store
        assert handler.num_nodes_waiting() == 0  # torch's handler syncs the state: nothing runs
        assert rdzv_store.read_state(backend).participants == {}  # seen as empty, not unpickled
        assert backend.rejected >= 1
        time.sleep(0.5)
        assert not marker.exists()
    finally:
        handler.shutdown()


def _run(tmp_path, run_dir, timeout=120) -> subprocess.CompletedProcess:
    script = tmp_path / "ok.py"
    script.write_text("print('ran')\n")
    return subprocess.run([*CLI, "--nproc-per-node", "1", "--run-dir", str(run_dir), str(script)],
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_planted_world_writable_run_directory_is_refused(tmp_path):
    planted = tmp_path / "planted"
    planted.mkdir()
    planted.chmod(0o777)
    p = _run(tmp_path, planted)
    assert p.returncode == 2 and "writable by its group or others" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "ran" not in p.stdout
    if os.geteuid() == 0:
        planted.chmod(0o700)
        os.chown(planted, 65534, 65534)
        p = _run(tmp_path, planted)
        assert p.returncode == 2 and "owned by uid 65534" in p.stderr, p.stderr


def test_symlinked_event_log_is_refused_and_never_written_through(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    victim = tmp_path / "victim.txt"
    victim.write_text("untouched\n")
    (run_dir / events.EVENTS_FILE).symlink_to(victim)
    p = _run(tmp_path, run_dir)
    assert p.returncode == 2 and "events.jsonl in it is a symlink" in p.stderr, p.stderr
    with pytest.raises(ConfigError, match="symlink"):
        events.log("probe", str(run_dir / events.EVENTS_FILE))  # O_NOFOLLOW, for the workers too
    assert victim.read_text() == "untouched\n"


def test_default_run_directory_is_private_and_unpredictable(tmp_path):
    from dtorch.elastic.launch import LaunchSpec

    a, b = LaunchSpec(rdzv_id="job"), LaunchSpec(rdzv_id="job")
    assert a.run_dir != b.run_dir and os.path.basename(a.run_dir).startswith("dtorch-job-")
    from dtorch import trust

    d = trust.private_dir(tmp_path / "fresh", "run_dir")
    assert (os.stat(d).st_mode & 0o777) == 0o700


def test_planted_heartbeat_of_another_pid_is_ignored_by_the_hang_watch(tmp_path):
    run_dir = str(tmp_path)
    os.makedirs(os.path.join(run_dir, heartbeat.HB_DIR))
    now = time.time()
    real = {"rank": 0, "epoch": 3, "pid": os.getpid(), "step": 7, "progress_t": now, "beats": 5, "steps_done": 5}
    forged = {**real, "rank": 1, "pid": 1, "progress_t": now - 1000}  # pid 1 is not our worker
    for rec in (real, forged):
        with open(heartbeat.hb_path(run_dir, rec["rank"]), "w") as f:
            json.dump(rec, f)
    watch = heartbeat.HangWatch(run_dir, timeout=5, startup_timeout=50)
    watch.reset(3, {0: os.getpid(), 1: 999999})
    assert set(heartbeat.read_local_beats(run_dir, 3, watch.local)) == {0}
    watch.t_start = now  # rank 1 has published nothing of its own: it is still starting
    assert watch.check() is None


def test_workers_store_refuses_values_set_without_the_jobs_key_moved_or_replayed():
    """The process-group store (gloo's connection addresses): a value planted with a plain
    TCPStore client, a signed value copied to another key, or one signed for another round is
    refused by name; what the ranks set themselves reads back. Under a second."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    server = rdzv_store.tcp_store("127.0.0.1", 0, True, timedelta(seconds=5))
    raw = TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=5))
    key = b"k" * 32
    ours = rdzv_store.SignedStore(server, key, "run|3|1234")
    ours.set("0//cpu//0/0", b"addr-of-rank-0")
    assert ours.get("0//cpu//0/0") == b"addr-of-rank-0" and ours.multi_get(["0//cpu//0/0"]) == [b"addr-of-rank-0"]
    raw.set("0//cpu//0/1", pickle.dumps("an attacker's address"))
    with pytest.raises(rdzv_store.StoreForgery, match="'0//cpu//0/1' failed authentication"):
        ours.get("0//cpu//0/1")
    raw.set("0//cpu//0/1", raw.get("0//cpu//0/0"))  # a genuine value moved to another key
    with pytest.raises(rdzv_store.StoreForgery):
        ours.get("0//cpu//0/1")
    with pytest.raises(rdzv_store.StoreForgery):  # another round (epoch 2) or another job's key
        rdzv_store.SignedStore(server, key, "run|2|1234").get("0//cpu//0/0")
    with pytest.raises(rdzv_store.StoreForgery):
        rdzv_store.SignedStore(server, b"x" * 32, "run|3|1234").get("0//cpu//0/0")
    assert ours.add("count", 2) == 2 and ours.check(["0//cpu//0/0"])


def test_dtorch_workers_process_group_runs_over_the_signed_store(tmp_path):
    """A worker of `dtorch run` (its environment, world 1, gloo): the process group's store is the
    signed one, values land in the TCPStore sealed, and a collective works over it. ~5 s."""
    script = """
import os, socket, sys
from datetime import timedelta
import torch, torch.distributed as dist
from torch.distributed import TCPStore
from dtorch.elastic import store, worker
worker.init_process_group("gloo")
assert isinstance(worker._state.pg_store, store.SignedStore), type(worker._state.pg_store)
worker._state.pg_store.set("probe", b"value")
raw = TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), None, False, timedelta(seconds=5))
sealed = raw.get("probe")
assert sealed != b"value" and sealed.endswith(b"value") and len(sealed) == 32 + 5
t = torch.ones(2)
dist.all_reduce(t)
dist.destroy_process_group()
print("ok")
"""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "DTORCH_RUN_DIR": str(tmp_path / "run"), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "DTORCH_KEY": "k" * 32, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout[-2000:] + p.stderr[-2000:]
