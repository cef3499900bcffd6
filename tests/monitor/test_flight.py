"""Collective sequences that differ between ranks are named with both ranks: from torch's
flight-recorder dumps (NCCL's pickle format, a sample built from torch's documented fields; and
real gloo dumps) and from DTorch's own --trace-comms files, on a real 2-process gloo job where
rank 1 deliberately calls another collective than rank 0. About 8 s (a 3 s collective timeout)."""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path

import pytest

from dtorch.monitor import flight
from dtorch.monitor.comms import describe_mismatch, find_mismatch


def _entry(seq: int, op: str, sizes, *, pg=("0", "default_pg"), state="completed", rid=None) -> dict:
    # the fields torch documents for a flight-recorder entry (NCCL; gloo writes the same keys)
    return {"record_id": rid if rid is not None else seq - 1, "pg_id": 0, "process_group": pg,
            "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq, "profiling_name": f"nccl:{op}",
            "time_created_ns": 1_700_000_000_000_000_000 + seq, "duration_ms": 0.5, "input_sizes": sizes,
            "input_dtypes": ["BFloat16"], "output_sizes": sizes, "output_dtypes": ["BFloat16"], "state": state,
            "time_discovered_started_ns": 1, "time_discovered_completed_ns": 2 if state == "completed" else None,
            "retired": state == "completed", "timeout_ms": 600000, "is_p2p": False,
            "frames": [{"name": "all_reduce", "filename": "distributed_c10d.py", "line": 2800}]}


def _nccl_dump(entries: list[dict]) -> bytes:
    return pickle.dumps({"version": "2.10", "comm_lib_version": "2.27.3",
                         "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"}},
                         "pg_status": {"0": {"last_enqueued_collective": len(entries)}},
                         "nccl_comm_state": {}, "entries": entries})


def test_nccl_style_dumps_name_the_rank_with_another_collective_and_the_rank_behind(tmp_path):
    same = [_entry(1, "all_reduce", [[1024]]), _entry(2, "all_gather", [[512]])]
    for r in (0, 1, 3):
        (tmp_path / f"rank_{r}").write_bytes(_nccl_dump([*same, _entry(3, "reduce_scatter", [[4096]], state="started")]))
    # rank 2 called all_reduce where its peers called reduce_scatter: a mismatch
    (tmp_path / "rank_2").write_bytes(_nccl_dump([*same, _entry(3, "all_reduce", [[4096]], state="started")]))
    assert set(flight.dump_files(tmp_path)) == {0, 1, 2, 3}
    m = flight.find_divergence_in(tmp_path)
    assert m["kind"] == "mismatch" and (m["pg"], m["seq"]) == ("0", 3)
    assert {m["rank_a"], m["rank_b"]} == {0, 2} and "reduce_scatter" in str(m["call_a"]) + str(m["call_b"])
    text = flight.describe(m)
    assert "rank 0 issued reduce_scatter [[4096]]" in text and "rank 2 issued all_reduce [[4096]]" in text

    # rank 2 stuck before its third collective: the ranks that issued it wait for rank 2
    (tmp_path / "rank_2").write_bytes(_nccl_dump(same))
    m = flight.find_divergence_in(tmp_path)
    assert m["kind"] == "behind" and m["rank_b"] == 2 and m["rank_a"] == 0 and m["seq"] == 3
    assert "rank 2 never did (it issued 2 on that group" in flight.describe(m)

    for r in (0, 1, 2, 3):
        (tmp_path / f"rank_{r}").write_bytes(_nccl_dump(same))
    assert flight.find_divergence_in(tmp_path) is None


def test_a_dump_that_is_not_plain_data_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    (tmp_path / "rank_0").write_bytes(pickle.dumps({"entries": [Evil()]}))
    try:
        flight.load(tmp_path / "rank_0")
    except pickle.UnpicklingError as e:
        assert "posix.system" in str(e) or "os.system" in str(e)
    else:
        raise AssertionError("a pickle naming a callable was loaded")


def _worker(rank: int, d: str, env: dict) -> None:
    """One of the two ranks, forked from the suite's forkserver (torch imported once per session,
    tests/parallel/_harness.py) with the test's environment. Rank 1 calls another collective than
    rank 0; the 3 s collective timeout ends the wait."""
    import datetime

    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import _dump_fr_trace

    from dtorch.monitor.comms import CommTimer

    os.environ.clear()
    os.environ.update(env)  # TORCH_FR_BUFFER_SIZE is read when the group is made, not at import
    fd = os.open(os.path.join(d, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    dist.init_process_group("gloo", init_method=f"file://{d}/rdzv", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=3))
    t = CommTimer().install()
    t.trace_to(os.path.join(d, f"comms-rank{rank}.jsonl"))
    t.begin_step(1)
    x = torch.ones(256)
    dist.all_reduce(x)
    try:
        if rank == 0:
            dist.all_reduce(x)  # rank 1 does not join this one: it broadcasts
        else:
            dist.broadcast(x, src=0)
    except Exception as e:  # the timeout: what a hang becomes with a bounded collective timeout
        print("timed out:", type(e).__name__, flush=True)
    os.makedirs(os.path.join(d, "fr"), exist_ok=True)
    with open(os.path.join(d, "fr", f"rank_{rank}"), "wb") as f:  # as the NCCL watchdog names them
        f.write(_dump_fr_trace())
    os._exit(0)


@pytest.mark.slow
def test_a_real_mismatch_between_two_gloo_ranks_is_named_with_both_ranks(tmp_path):
    import multiprocessing

    sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))
    from _harness import PRELOAD

    multiprocessing.set_forkserver_preload(PRELOAD)  # takes effect when the server first starts
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "100"}
    ctx = multiprocessing.get_context("forkserver")
    procs = [ctx.Process(target=_worker, args=(r, str(tmp_path), env)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    logs = [(tmp_path / f"rank{r}.log").read_text() if (tmp_path / f"rank{r}.log").exists() else "" for r in (0, 1)]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert all(p.exitcode == 0 for p in procs), ([p.exitcode for p in procs], logs)
    # DTorch's own trace (gloo): written before each collective ran
    m = find_mismatch(tmp_path)
    assert m is not None and (m["rank_a"], m["rank_b"], m["index"]) == (0, 1, 1)
    text = describe_mismatch(m)
    assert "rank 0 launched all_reduce" in text and "rank 1 launched broadcast" in text
    # torch's flight recorder on the same ranks: the same place, both ranks named
    m = flight.find_divergence_in(tmp_path / "fr")
    assert m is not None and m["kind"] == "mismatch" and m["seq"] == 2, m
    assert (m["rank_a"], m["rank_b"]) == (0, 1)
    assert m["call_a"][0] == "all_reduce" and m["call_b"][0] == "broadcast"


def test_an_nccl_worker_keeps_the_flight_recorder_and_dumps_where_the_hang_report_reads(tmp_path, monkeypatch):
    from dtorch.elastic import heartbeat, worker

    for k in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
              "TORCH_FR_DUMP_TEMP_FILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "500")  # the user's (older) name is kept
    w = worker.WorkerInfo(rank=3, local_rank=3, world_size=4, local_world_size=4, node_rank=0, epoch=2,
                          restart_count=0, run_id="t", run_dir=str(tmp_path))
    d = worker.nccl_flight_recorder(w)
    assert d == os.path.join(heartbeat.dump_dir(str(tmp_path), 2), "nccl") and os.path.isdir(d)
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "500" and os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == os.path.join(d, "rank_")
    # what the watchdog would write there (torch appends the rank) is what the report reads
    open(os.environ["TORCH_FR_DUMP_TEMP_FILE"] + "3", "wb").close()
    assert flight.dump_files(d) == {3: os.path.join(d, "rank_3")}
