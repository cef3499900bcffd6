"""Fast checks of the pieces, without processes: chaos specs, the event log's recovery record,
hang judgement and culprit naming, the launcher's validation, straggler scoring."""

import json
import os
import time
from types import SimpleNamespace

import pytest

from dtorch.elastic import chaos, events, heartbeat
from dtorch.elastic.launch import LaunchSpec, parse_nnodes
from dtorch.errors import ConfigError
from dtorch.monitor.straggler import StragglerDetector


def test_chaos_spec_parses_every_documented_form():
    fs = chaos.parse("kill:rank=1:step=5; kill:rank=1:phase=allreduce:step=5;hang:rank=2:step=7;"
                     "slow:rank=0:factor=3;every=20:kill")
    assert [f.kind for f in fs] == ["kill", "kill", "hang", "slow", "kill"]
    assert fs[1].phase == "allreduce" and fs[2].mode == "stop" and fs[3].factor == 3.0
    assert fs[4].every == 20 and fs[4].rank is None


@pytest.mark.parametrize("bad", ["explode:rank=1", "kill:rank=x", "kill:colour=red", "rank=1", "hang:mode=nap",
                                 "slow:factor=0.5"])
def test_chaos_spec_mistakes_raise_config_error_naming_the_fault(bad):
    with pytest.raises(ConfigError) as e:
        chaos.parse(bad)
    assert e.value.field == "chaos" and e.value.value == bad


def test_fault_fires_once_per_run_even_across_restarts(tmp_path):
    f = chaos.parse("kill:rank=1:step=5")[0]
    first = chaos.Injector([f], rank=1, world_size=4, run_dir=str(tmp_path))
    restarted = chaos.Injector([f], rank=1, world_size=4, run_dir=str(tmp_path))
    assert first._claim(f, 5) and not restarted._claim(f, 5)


def test_periodic_fault_strikes_one_seeded_rank_per_period(tmp_path, monkeypatch):
    fired = []
    f = chaos.parse("every=20:kill:seed=3")[0]
    victims = {s: f.victim(s, 4) for s in (20, 40, 60)}
    assert victims == {s: chaos.parse("every=20:kill:seed=3")[0].victim(s, 4) for s in (20, 40, 60)}
    for rank in range(4):
        inj = chaos.Injector([f], rank=rank, world_size=4, run_dir=str(tmp_path))
        monkeypatch.setattr(inj, "_fire", lambda f, step, phase, rank=rank: fired.append((step, rank)))
        for step in range(0, 61):
            inj.maybe_inject(step, "forward")
    assert sorted(fired) == sorted((s, v) for s, v in victims.items())


def _write(path, *evs):
    with open(path, "a") as f:
        for e in evs:
            f.write(json.dumps(e) + "\n")


def test_recovery_record_times_every_phase_on_one_time_line(tmp_path):
    p = str(tmp_path / "events.jsonl")
    _write(p, {"kind": "rendezvous", "t": 0, "start": 0, "end": 1, "epoch": 0, "world_size": 2},
           {"kind": "detected", "t": 10.5, "epoch": 0, "fault_t": 10.0, "cause": "exit", "ranks": [1]},
           {"kind": "rendezvous", "t": 12, "start": 11, "end": 12, "epoch": 1, "world_size": 2},
           {"kind": "workers_started", "t": 12.5, "epoch": 1},
           {"kind": "worker_started", "t": 12.25, "epoch": 1, "rank": 0},
           {"kind": "phase", "t": 14, "name": "pg_init", "start": 14, "seconds": 0.25, "epoch": 1, "rank": 1},
           {"kind": "phase", "t": 15, "name": "replan", "start": 14.25, "seconds": 0.5, "epoch": 1, "rank": 0},
           {"kind": "phase", "t": 16, "name": "load", "start": 15, "seconds": 2.0, "epoch": 1, "rank": 1},
           {"kind": "first_step", "t": 18, "start": 17, "seconds": 1.0, "epoch": 1, "rank": 0})
    assert events.recoveries(p) == []  # rank 1 has not finished its first step yet
    _write(p, {"kind": "first_step", "t": 18.5, "start": 17, "seconds": 1.5, "epoch": 1, "rank": 1})
    (r,) = events.recoveries(p)
    assert (r["detect"], r["stop"], r["rendezvous"], r["start"], r["replan"], r["load"], r["first_step"]) == \
        (0.5, 0.5, 1.0, 1.5, 0.5, 2.0, 1.5)
    assert (r["fork"], r["pg_init"], r["build"]) == (0.25, 0.25, None)  # fork: rendezvous end -> first worker
    assert r["total"] == 8.5 and "recovered from exit" in events.format_recovery(r)


def test_torn_last_line_of_event_log_is_skipped(tmp_path):
    p = tmp_path / "events.jsonl"
    p.write_text('{"kind": "a", "t": 1}\n{"kind": "b", "t"')
    assert [e["kind"] for e in events.read(str(p))] == ["a"]


def _beat(run_dir, rank, **kw):
    os.makedirs(os.path.join(run_dir, heartbeat.HB_DIR), exist_ok=True)
    rec = {"rank": rank, "epoch": 0, "pid": 1000 + rank, "step": 5, "phase": "allreduce", "beats": 9,
           "steps_done": 5, "progress_t": time.time()}
    rec.update(kw)
    with open(heartbeat.hb_path(run_dir, rank), "w") as f:
        json.dump(rec, f)


def test_hang_watch_judges_progress_not_liveness_after_the_first_step(tmp_path):
    d = str(tmp_path)
    w = heartbeat.HangWatch(d, timeout=3.0, startup_timeout=100.0, period=0, load=lambda: 1.0)
    w.reset(0, {0: 1000, 1: 1001})
    _beat(d, 0)
    _beat(d, 1, progress_t=time.time() - 5)  # its thread may still write; its loop made no progress
    hang = w.check()
    assert hang is not None and list(hang.ranks) == [1]


def test_hang_watch_tells_a_slow_job_from_a_hang_and_a_stopped_rank_from_a_slow_one(tmp_path):
    """Steps of 4 s against a 3 s timeout: a running rank 5 s without progress is slow, not hung
    (its limit is 3 x the job's recent step time); 13 s is a hang. The machine's load stretches a
    running rank's limit the same way. A stopped rank (state T) is hung at the timeout itself,
    whatever the pace or the load. A new group starts with no step history."""
    d = str(tmp_path)
    load = [1.0]
    stopped: set[int] = set()
    w = heartbeat.HangWatch(d, timeout=3.0, startup_timeout=100.0, period=0, load=lambda: load[0],
                            stopped=lambda pid: pid in stopped)
    w.reset(0, {0: 1000, 1: 1001})
    now = time.time()
    for n, t in ((1, now - 8), (2, now - 4)):  # the workers report step 2 took 4 s
        for r in (0, 1):
            _beat(d, r, steps_done=n, step_done_t=t, progress_t=now)
        assert w.check() is None
    assert list(w.step_s) == [4.0, 4.0]
    _beat(d, 1, steps_done=2, step_done_t=now - 4, progress_t=now - 5)
    assert w.check() is None  # slow: 5 s < 3 x 4 s
    _beat(d, 1, steps_done=2, step_done_t=now - 4, progress_t=now - 13)
    hang = w.check()
    assert hang is not None and list(hang.ranks) == [1] and hang.limit == 12.0
    stopped.add(1001)
    _beat(d, 1, steps_done=2, step_done_t=now - 4, progress_t=now - 3.5)
    assert list(w.check().ranks) == [1]  # stopped: the timeout itself
    w.reset(1, {0: 1000, 1: 1001})  # the recovered group: a fresh window, no step history
    assert not w.step_s
    stopped.clear()
    load[0] = 3.0
    for r in (0, 1):
        _beat(d, r, epoch=1, steps_done=1, step_done_t=now, progress_t=now - 5)
    assert w.check() is None  # loaded machine: 5 s < 3 s x load 3
    _beat(d, 1, epoch=1, steps_done=1, step_done_t=now, progress_t=now - 10)
    assert list(w.check().ranks) == [1]


def test_hang_watch_gives_a_starting_group_the_startup_timeout(tmp_path):
    d = str(tmp_path)
    w = heartbeat.HangWatch(d, timeout=3.0, startup_timeout=100.0, period=0)
    w.reset(0, {0: 1000, 1: 1001})
    _beat(d, 0, progress_t=time.time() - 50)  # waits in its first all-reduce for rank 1, still importing
    _beat(d, 1, beats=0, steps_done=0, phase="start", step=-1)
    assert w.check() is None


def test_script_that_never_beats_is_never_judged(tmp_path):
    d = str(tmp_path)
    w = heartbeat.HangWatch(d, timeout=0.1, startup_timeout=0.1, period=0)
    w.reset(0, {0: 1000})
    _beat(d, 0, beats=0, steps_done=0, progress_t=time.time() - 60)
    assert w.check() is None


def test_diagnosis_names_the_stopped_rank_not_the_ones_waiting_for_it(tmp_path):
    d = str(tmp_path)
    now = time.time()
    _beat(d, 0, progress_t=now - 9)  # entered the all-reduce early, waits longest
    _beat(d, 1, progress_t=now - 4)
    _beat(d, 2, phase="forward", progress_t=now - 5)
    line, f = heartbeat.diagnose(heartbeat.Hang({0: 9, 1: 4, 2: 5}, 0), heartbeat.read_beats(d, 0),
                                 {0: 1000, 1: 1001, 2: 1002}, {0: "S", 1: "S", 2: "T"}, None)
    assert f["rank"] == 2 and line.startswith("dtorch: HANG: rank 2 ") and "SIGSTOP" in line
    assert "ranks 0,1 in 'allreduce' at step 5" in line and "\n" not in line


def test_diagnosis_without_process_state_names_the_rank_outside_the_collective(tmp_path):
    d = str(tmp_path)
    now = time.time()
    _beat(d, 0, progress_t=now - 9)
    _beat(d, 1, phase="forward", progress_t=now - 5)  # a busy loop in forward
    _, f = heartbeat.diagnose(heartbeat.Hang({0: 9}, 0), heartbeat.read_beats(d, 0), {0: 1000}, {0: "S"}, None)
    assert f["rank"] == 1 and f["phase"] == "forward"


@pytest.mark.parametrize("kw,field", [({"min_nodes": 2, "max_nodes": 1}, "nnodes"),
                                      ({"nproc_per_node": 0}, "nproc_per_node"),
                                      ({"max_nodes": 2}, "rdzv_endpoint"),
                                      ({"rdzv_endpoint": "host:http"}, "rdzv_endpoint"),
                                      ({"chaos": "kill:rank=one"}, "chaos")])
def test_launch_spec_mistakes_raise_config_error(kw, field):
    with pytest.raises(ConfigError) as e:
        LaunchSpec(**kw)
    assert e.value.field == field


def test_launch_defaults_stay_on_loopback_and_get_a_fresh_run():
    a, b = LaunchSpec(), LaunchSpec()
    assert a.rdzv_endpoint.startswith("127.0.0.1") and a.local_addr == "127.0.0.1"
    assert a.rdzv_id != b.rdzv_id and a.run_dir != b.run_dir
    assert parse_nnodes("1:4") == (1, 4) and parse_nnodes("2") == (2, 2)


def test_cli_user_mistake_exits_2_with_one_line(capsys):
    from dtorch.cli import main

    assert main(["run", "--nnodes", "4:1", "train.py"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nnodes" in err[0]


def test_straggler_named_relative_to_fastest_rank_after_patience():
    det = StragglerDetector(4, patience=3)
    lines = []
    for step in range(10):
        times = [0.10, 0.11, 0.10, 0.30 if step >= 4 else 0.105]
        rep = det.update(times)
        if rep.new:
            lines.append((step, rep.warning()))
    assert len(lines) == 1 and lines[0][0] == 6 and "rank 3 is 3.0x slower" in lines[0][1]


def test_straggler_sudden_slowdown_caught_by_own_history_before_it_is_extreme():
    det = StragglerDetector(2, ratio_threshold=2.0, patience=2)
    for _ in range(20):
        assert not det.update([0.100, 0.101]).stragglers
    det.update([0.100, 0.160])
    rep = det.update([0.100, 0.160])  # 1.6x: below the 2x bar, but far outside rank 1's history
    assert rep.stragglers == [1] and rep.zscore[1] > 4


def test_steady_jitter_is_not_a_straggler():
    det = StragglerDetector(3)
    import random

    rng = random.Random(0)
    flagged = [det.update([0.1 * (1 + 0.05 * rng.random()) for _ in range(3)]).stragglers for _ in range(200)]
    assert not any(flagged)


def test_diagnosis_names_the_rank_behind_in_the_flight_recorder(tmp_path):
    d = str(tmp_path)
    now = time.time()
    for r in range(3):  # all three say 'allreduce', rank 1's progress is even the newest
        _beat(d, r, progress_t=now - (1 if r == 1 else 5))
    dump = tmp_path / "dump"
    dump.mkdir()
    for r, seq in ((0, 12), (1, 11), (2, 12)):
        (dump / f"rank{r}.flight-recorder.json").write_text(json.dumps(
            {"entries": [{"profiling_name": "gloo:all_reduce", "collective_seq_id": seq}],
             "max_seq_by_pg": {"0": seq}}))
        (dump / f"rank{r}.py-stacks.txt").write_text("...")
    line, f = heartbeat.diagnose(heartbeat.Hang({0: 5}, 0), heartbeat.read_beats(d, 0), {0: 1000},
                                 {0: "S", 1: "S", 2: "S"}, str(dump))
    assert f["rank"] == 1 and "gloo:all_reduce #11" in line


def test_hang_report_names_both_ranks_whose_collective_sequences_differ(tmp_path):
    """Rank 2 issued all_gather as the 7th collective of group 0 where ranks 0 and 1 issued
    all_reduce (dumps as the heartbeat thread writes them): the line names ranks 0 and 2."""
    d = str(tmp_path)
    now = time.time()
    for r in range(3):
        _beat(d, r, progress_t=now - 5)
    dump = tmp_path / "dump"
    dump.mkdir()
    for r in range(3):
        op = "gloo:all_gather" if r == 2 else "gloo:all_reduce"
        entries = [{"process_group": ["0", "default_pg"], "collective_seq_id": s, "profiling_name": "gloo:all_reduce",
                    "input_sizes": [[8]], "is_p2p": False} for s in range(1, 7)]
        entries.append({"process_group": ["0", "default_pg"], "collective_seq_id": 7, "profiling_name": op,
                        "input_sizes": [[64]], "is_p2p": False})
        (dump / f"rank{r}.flight-recorder.json").write_text(json.dumps({"entries": entries,
                                                                         "max_seq_by_pg": {"0": 7}}))
        (dump / f"rank{r}.py-stacks.txt").write_text("...")
    line, f = heartbeat.diagnose(heartbeat.Hang({0: 5}, 0), heartbeat.read_beats(d, 0), {0: 1000},
                                 {0: "S", 1: "S", 2: "S"}, str(dump))
    assert f["divergence"]["kind"] == "mismatch" and (f["divergence"]["rank_a"], f["divergence"]["rank_b"]) == (0, 2)
    assert "rank 0 issued all_reduce [[64]], rank 2 issued all_gather [[64]]" in line


def test_trainer_hooks_time_load_report_commits_and_the_first_step(tmp_path, monkeypatch):
    from dtorch.elastic import worker
    from dtorch.train import hooks

    monkeypatch.setenv("DTORCH_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("DTORCH_EPOCH", "3")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(worker._state, "setup_done", True)  # no heartbeat thread / parent-death signal in pytest
    monkeypatch.setattr(worker._state, "hooks_installed", False)
    monkeypatch.setattr(worker._state, "first_step_logged", False)
    hooks.clear()
    try:
        worker.install_hooks()
        with hooks.phase("load"):  # the trainer loads before `hooks.started`
            time.sleep(0.01)
        trainer = SimpleNamespace(ckpt=SimpleNamespace(last_committed=None))
        hooks.started(trainer)  # installs again: must not double-register
        for step in (5, 6):
            hooks.before_step(step)
            with hooks.phase("forward_backward"):
                pass
            hooks.after_step(step, 1.0)
            with hooks.phase("checkpoint"):
                pass
            if step == 5:
                hooks.committed(5)  # the async save of step 5 commits during step 6
        hooks.before_step(7)
        # the save of step 6 has started but not committed: growing now would lose it
        assert heartbeat.snapshot()["committed_step"] == 5
        hooks.committed(6)
        hooks.after_step(7, 1.0)
    finally:
        hooks.clear()
    evs = events.read(str(tmp_path / events.EVENTS_FILE))
    (load,) = [e for e in evs if e["kind"] == "phase"]
    assert load["name"] == "load" and load["seconds"] >= 0.01 and load["epoch"] == 3
    (first,) = [e for e in evs if e["kind"] == "first_step"]
    assert first["step"] == 5
    assert heartbeat.snapshot()["committed_step"] == 6 and heartbeat.snapshot()["step"] == 7


def test_cli_output_into_a_closed_pipe_ends_quietly():
    """`dtorch plan ... | head`: no BrokenPipeError traceback when the reader has gone."""
    import subprocess
    import sys

    code = "import sys; from dtorch.cli import main; sys.exit(main(['plan', '--model', 'gpt2-small', '--seq-len', '1024']))"
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # the reader leaves before the first line
    err = p.stderr.read().decode()
    assert p.wait() == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_a_new_step_is_published_at_once_so_a_stopped_rank_reports_its_real_step(tmp_path, monkeypatch):
    """The writer thread publishes every interval; a rank stopped between two publishes used to
    be reported at a stale step. A new step is now written by the loop itself."""
    w = heartbeat._Writer(str(tmp_path), 0, 1, 3600.0, None)  # its thread never runs here
    monkeypatch.setattr(heartbeat, "_writer", w)
    for step in (41, 42):
        heartbeat.mark(step=step, phase="forward")
        assert heartbeat.read_beats(str(tmp_path), 1)[0]["step"] == step


def test_snapshot_directories_of_agents_that_are_gone_are_swept_and_live_ones_kept(tmp_path):
    import subprocess

    from dtorch.elastic.launch import SNAP_PREFIX, _process_tag, sweep_stale_snapshots

    dead = subprocess.Popen(["true"])
    dead.wait()
    live = tmp_path / f"{SNAP_PREFIX}{_process_tag(os.getpid())}.aa"
    gone = tmp_path / f"{SNAP_PREFIX}{dead.pid}.1.bb"  # its pid has exited
    reused = tmp_path / f"{SNAP_PREFIX}{os.getpid()}.1.cc"  # our pid, another process's start time
    old_form = tmp_path / f"{SNAP_PREFIX}0123456789abcdef"
    for d in (live, gone, reused, old_form):
        d.mkdir()
        (d / "rank0-slot0.bin").write_bytes(b"x")
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / f"{SNAP_PREFIX}{dead.pid}.1.dd").symlink_to(target)
    removed = sweep_stale_snapshots(str(tmp_path))
    assert sorted(removed) == sorted([str(gone), str(reused)])
    assert live.is_dir() and old_form.is_dir() and target.is_dir()
    assert sweep_stale_snapshots(str(tmp_path / "missing")) == []
