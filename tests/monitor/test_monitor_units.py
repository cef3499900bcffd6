"""The monitor's parts in one process: step terms, the per-rank record, communication timing,
the Prometheus endpoint, the token and the loopback-only default."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import socket
import struct
import urllib.error
import urllib.request

import pytest
import torch

from dtorch.errors import ConfigError
from dtorch.monitor.live import MonitorConfig
from dtorch.monitor.metrics import format_eta
from dtorch.monitor.ranks import FIELDS, TERMS, RankCollector, predicted_terms, ranks_record
from dtorch.monitor.server import MonitorServer, MonitorState, is_loopback


def _row(**kw) -> dict[str, float]:
    row = dict.fromkeys(FIELDS, 0.0) | {"steps": 10.0, "mem_reserved_bytes": float("nan")}
    row.update(kw)
    row["step"] = sum(row[t] for t in TERMS)
    return row


def test_step_terms_add_up_to_the_step_and_comm_is_taken_out_of_compute():
    c = RankCollector(rank=0, world=1, device=torch.device("cpu"), every=2, tokens_per_step=100)
    for _ in range(2):
        c.step(step_s=0.100, data_s=0.010, fb_s=0.060, opt_s=0.020, comm_fb={"tp": 0.015, "other": 0.0},
               comm_all={"tp": 0.015, "other": 0.005})
    rows = c.maybe_gather(2)
    assert rows is not None and len(rows) == 1
    r = rows[0]
    assert r["compute"] == pytest.approx(0.045)
    assert r["comm_tp"] == pytest.approx(0.015) and r["comm_other"] == pytest.approx(0.005)
    assert r["other"] == pytest.approx(0.100 - 0.010 - 0.045 - 0.020 - 0.020)
    assert sum(r[t] for t in TERMS) == pytest.approx(r["step"])
    assert r["tokens_per_s"] == pytest.approx(1000.0)
    assert r["mem_current_bytes"] > 0 and r["steps"] == 2
    assert c.maybe_gather(3) is None  # not due


def test_ranks_record_names_the_slowest_rank_and_stragglers():
    rows = [_row(compute=0.05, comm_dp_replicate=0.06), _row(compute=0.11, comm_dp_replicate=0.0),
            _row(compute=0.05, comm_dp_replicate=0.06)]
    pred = {"step_time_s": 0.1, "time_breakdown": {"compute": 0.07, "recompute": 0.01, "dp": 0.02, "tp": 0.0}}
    rec = ranks_record(rows, step=20, predicted=pred)
    assert rec["slowest_rank"] == 1 and rec["slowest_ratio"] == pytest.approx(2.2)
    assert rec["stragglers"] == [1]
    assert rec["predicted"]["compute"] == pytest.approx(0.08) and rec["predicted"]["comm_dp_replicate"] == 0.02
    assert "comm_tp" not in rec["predicted"]  # not predicted for this plan
    assert rec["ranks"][0]["mem_reserved_bytes"] is None  # NaN (not measured) becomes null
    json.dumps(rec, allow_nan=False)
    assert predicted_terms(None) == {}


def test_comm_timer_attributes_blocking_and_async_collectives_and_uninstalls(tmp_path):
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from dtorch.monitor.comms import CommTimer

    originals = (dist.all_reduce, c10d.Work.wait)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        t = CommTimer().install()
        x = torch.ones(1000)
        dist.all_reduce(x)
        work = dist.all_reduce(x, async_op=True)
        work.wait()
        assert t.calls == 3  # two launches and one wait
        assert t.seconds["other"] > 0  # the default group is no mesh axis here
        t.uninstall()
        assert (dist.all_reduce, c10d.Work.wait) == originals
        dist.all_reduce(x)
        assert t.calls == 3
    finally:
        dist.destroy_process_group()


def _get(url: str, headers: dict | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _state() -> MonitorState:
    st = MonitorState()
    st.feed({"event": "plan", "plan": "dp_replicate=2", "family": "DDP"})
    for s in (1, 2):
        st.feed({"step": s, "loss": 3.0 / s, "grad_norm": 1.0, "lr": 1e-3, "step_time_s": 0.1, "tokens_per_s": 5e3,
                 "mfu": 0.1, "peak_memory_bytes": 1, "world_size": 2, "epoch": 0})
    st.feed({"event": "ranks", **ranks_record([_row(compute=0.05), _row(compute=0.06)], step=2)})
    return st


def test_prometheus_endpoint_parses_and_has_every_rank():
    from prometheus_client.parser import text_string_to_metric_families

    srv = MonitorServer(_state(), port=0)
    try:
        assert srv.host == "127.0.0.1"
        code, body = _get(srv.url + "metrics")
        assert code == 200
        fams = {f.name: f for f in text_string_to_metric_families(body.decode())}
        assert fams["dtorch_loss"].samples[0].value == pytest.approx(1.5)
        ranks = {s.labels["rank"] for s in fams["dtorch_rank_step_seconds"].samples}
        assert ranks == {"0", "1"}
        terms = {s.labels["term"] for s in fams["dtorch_rank_step_term_seconds"].samples}
        assert {"compute", "comm_tp", "optimizer"} <= terms
        code, body = _get(srv.url + "api/data")
        full = json.loads(body)
        assert code == 200 and [s["step"] for s in full["steps"]] == [1, 2] and full["since"] is None
        # the page's poll: only the steps after the one it holds, while the session is the same
        part = json.loads(_get(srv.url + f"api/data?since=1&session={full['session']}")[1])
        assert [s["step"] for s in part["steps"]] == [2] and part["since"] == 1
        other = json.loads(_get(srv.url + "api/data?since=1&session=another")[1])
        assert [s["step"] for s in other["steps"]] == [1, 2] and other["since"] is None
        code, body = _get(srv.url)
        assert code == 200 and b"DTorch monitor" in body
    finally:
        srv.close()


def test_a_token_is_required_on_every_request_when_set():
    srv = MonitorServer(_state(), port=0, token="s3cret")
    try:
        for path in ("metrics", "api/data", ""):
            assert _get(srv.url + path)[0] == 401
            assert _get(srv.url + path + "?token=wrong")[0] == 401
            assert _get(srv.url + path, {"Authorization": "Bearer s3cret"})[0] == 200
            assert _get(srv.url + path + "?token=s3cret")[0] == 200
    finally:
        srv.close()


def _local_non_loopback_ipv4() -> list[str]:
    """This machine's own IPv4 addresses other than loopback (ioctl SIOCGIFADDR; nothing is sent)."""
    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            addr = socket.inet_ntoa(raw[20:24])
            if not is_loopback(addr):
                out.append(addr)
    return out


def test_by_default_the_server_binds_loopback_and_refuses_other_interfaces():
    with pytest.raises(ConfigError, match="127.0.0.1 unless asked"):
        MonitorServer(MonitorState(), host="0.0.0.0", port=0)
    with pytest.raises(ConfigError, match="needs a token"):
        MonitorServer(MonitorState(), host="0.0.0.0", port=0, allow_remote=True)
    srv = MonitorServer(MonitorState(), port=0)
    try:
        assert srv.httpd.socket.getsockname()[0] == "127.0.0.1"
        addrs = _local_non_loopback_ipv4()
        if not addrs:
            pytest.skip("this machine has no non-loopback IPv4 address to try")
        for addr in addrs:  # the machine's own address: the connection must be refused
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((addr, srv.port), timeout=5).close()
    finally:
        srv.close()


def test_config_reads_the_environment_and_rejects_bad_values(monkeypatch):
    monkeypatch.setenv("DTORCH_MONITOR_PORT", "0")
    monkeypatch.setenv("DTORCH_METRICS_EVERY", "5")
    cfg = MonitorConfig.resolve()
    assert (cfg.port, cfg.metrics_every, cfg.host, cfg.token) == (0, 5, "127.0.0.1", None)
    assert MonitorConfig.resolve(metrics_every=0).metrics_every == 0
    with pytest.raises(ConfigError):
        MonitorConfig.resolve(metrics_every=-1)
    monkeypatch.setenv("DTORCH_MONITOR_PORT", "x")
    with pytest.raises(ConfigError):
        MonitorConfig.resolve()


def test_format_eta():
    assert (format_eta(42), format_eta(185), format_eta(7620)) == ("42s", "3m05s", "2h07m")


def test_a_throttling_gpu_is_named_in_the_record():
    from dtorch.monitor import nvml

    assert nvml.throttle_names(0x4 | 0x20) == ["sw_power_cap", "sw_thermal"]
    rows = [_row(compute=0.05), _row(compute=0.05, gpu_throttle_mask=float(0x40), gpu_temp_c=91.0)]
    rec = ranks_record(rows, step=10)
    assert rec["throttling"] == [1] and rec["ranks"][1]["gpu_throttle"] == ["hw_thermal"]
    assert "gpu_throttle" not in rec["ranks"][0]
    if nvml.sample(0) is None:  # no NVML here (CPU machine, or nvidia-ml-py not installed): nothing breaks
        assert nvml.sample(1) is None


def test_oom_budget_is_below_the_failed_plan_and_the_lowest_holds(tmp_path):
    from dtorch.monitor import oom
    from dtorch.plan.plan import Plan

    plan = Plan(dp_replicate=2, microbatch_size=4, num_microbatches=1, global_batch=8, seq_len=16)
    plan.predicted = {"memory_bytes_per_rank": 1000 * 2**20,
                      "memory_breakdown": {"params": 100 * 2**20, "activations": 400 * 2**20, "margin": 500 * 2**20}}
    err = torch.OutOfMemoryError("test")
    for cap_mb in (400, 300):
        cap = oom.MemoryCap.__new__(oom.MemoryCap)
        cap.limit, cap.from_step = (200 + cap_mb) * 2**20, 1
        rec = oom.describe(err, rank=1, phase="forward_backward", step=3, stages=[0], plan=plan,
                           device=torch.device("cpu"), base_bytes=200 * 2**20, cap=cap)
        assert rec["rank"] == 1 and rec["measured"]["cap"] == cap.limit
        assert rec["budget_bytes"] < plan.predicted["memory_bytes_per_rank"]
        oom.record(rec, tmp_path)
    budget, failed = oom.memory_budget(tmp_path, world_size=2)
    recs = oom.read(tmp_path)
    assert budget == min(r["budget_bytes"] for r in recs) and failed == [plan.describe()] * 2
    assert oom.memory_budget(tmp_path, world_size=4) == (None, [])
    assert "OUT OF MEMORY on rank 1 in forward_backward at step 3" in oom.message(recs[0])


def test_replan_corrects_each_family_by_its_measured_oom_and_excludes_a_repeat(tmp_path, monkeypatch):
    """Per family: its own measured over estimated plan-controlled memory, max(scale * c, c + offset);
    an unmeasured family gets the worst seen; a family with two OOMs is excluded; the search ranks by
    the corrected memory; when nothing fits, the error names the rank, the bytes and the fix."""
    from dtorch.cluster import load_cluster
    from dtorch.monitor import oom
    from dtorch.plan.plan import Plan
    from dtorch.plan.profiles import get_profile
    from dtorch.plan.search import search

    MiB = 2**20
    ddp = Plan(dp_replicate=2, microbatch_size=4, num_microbatches=1, global_batch=8, seq_len=16)
    fsdp = Plan(dp_shard=2, microbatch_size=4, num_microbatches=1, global_batch=8, seq_len=16)

    def oom_of(plan, controlled_mb, grown_mb):  # a CPU OOM under a cap of base 200 + 100 MiB
        plan.predicted = {"memory_bytes_per_rank": (controlled_mb + 500) * MiB,
                          "memory_breakdown": {"activations": controlled_mb * MiB, "margin": 500 * MiB}}
        monkeypatch.setattr(oom, "_status", lambda key: (200 + grown_mb) * MiB)  # the peak "measured"
        cap = oom.MemoryCap.__new__(oom.MemoryCap)
        cap.limit, cap.from_step = 300 * MiB, 1
        oom.record(oom.describe(torch.OutOfMemoryError("x"), rank=1, phase="forward_backward", step=3, stages=[0],
                                plan=plan, device=torch.device("cpu"), base_bytes=200 * MiB, cap=cap), tmp_path)

    assert oom.Replan.load(tmp_path, 2) is None
    oom_of(ddp, 120, 132)
    oom_of(fsdp, 60, 110)
    r = oom.Replan.load(tmp_path, 2)
    assert r.budget == int(500 * MiB + oom.SAFETY * 100 * MiB) and r.failed == [ddp.describe(), fsdp.describe()]
    assert r.corrections["DDP"] == (pytest.approx(1.1), 12 * MiB)
    assert r.corrections["FSDP"] == (pytest.approx(110 / 60), 50 * MiB)
    assert r.correction("PP") == (pytest.approx(110 / 60), 50 * MiB)  # not measured: the worst seen
    est = type("E", (), {"memory_bytes_per_rank": 540 * MiB, "memory_breakdown": {"margin": 500 * MiB}})
    assert r.correct(fsdp, est) == 500 * MiB + 90 * MiB  # 40 MiB estimated: +50 MiB beats x1.83
    assert r.correct(ddp, est) == 500 * MiB + 52 * MiB  # x1.1 = 44 MiB < 40 + 12 MiB
    assert not r.excluded and "FSDP x1.83 / +50 MiB" in r.describe()
    assert "the next start re-plans within 590.0 MiB" in oom.message(oom.read(tmp_path)[1])

    # on a real search: a family whose correction takes every plan over the budget is not ranked,
    # and what is ranked carries its correction in the breakdown
    prof, cl = get_profile("llama-tiny", 64), load_cluster("h100:1x2")
    plain = search(prof, cl, global_batch=8, seq_len=64, top_k=3, suggest=False)
    fam = plain.best[0].family()
    huge = oom.Replan(budget=0, failed=[], records=[], corrections={fam: (1e6, 0)})
    assert huge.correction("any other") == (1e6, 0)  # unmeasured families get the worst seen
    res = search(prof, cl, global_batch=8, seq_len=64, top_k=3, suggest=False, memory_correction=huge.correct)
    assert not res.ranked and res.closest[1].memory_breakdown["correction"] > 0
    res = search(prof, cl, global_batch=8, seq_len=64, top_k=3, suggest=False,
                 memory_correction=lambda p, e: huge.correct(p, e) if p.family() == fam else e.memory_bytes_per_rank + MiB)
    assert res.ranked and all(p.family() != fam for p, _ in res.ranked) and fam in res.rejected
    assert all(e.memory_breakdown["correction"] > 0 for _, e in res.ranked)

    oom_of(fsdp, 30, 104)  # FSDP again, with a smaller plan: the family is excluded
    r = oom.Replan.load(tmp_path, 2)
    assert r.excluded == {"FSDP"} and r.correct(fsdp, est) >= 2**60 and "excluded after 2 OOMs: FSDP" in r.describe()
    why = r.nothing_fits(None)
    assert "last on rank 1" in why and "needed 332 MiB with 300 MiB available" in why and "Fix:" in why

    # the trainer's re-plan: nothing fits under the measured budget -> one ConfigError (fatal for
    # `dtorch run`: no restart meets anything else), naming the rank, the bytes and the fix
    from dtorch.models import build_model
    from dtorch.train import Trainer

    t = Trainer(model=lambda: build_model("gpt-tiny"), global_batch=4, seq_len=16, console=False, log_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"last on rank 1 .*needed 332 MiB.*Fix: more memory per rank"):
        t._search(1, {}, replan=dataclasses.replace(r, budget=MiB))


def test_functional_collectives_land_on_their_mesh_axis_launch_and_wait(tmp_path):
    """DTensor's collectives (funcol) are timed on the axis of their group: torch 2.13 resolves the
    group through `_resolve_group`, which used to leave every TP wait in ``other``."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh

    from dtorch.monitor.comms import CommTimer

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        t = CommTimer(mesh).install()
        out = funcol.all_reduce(torch.ones(1000), "sum", (mesh, 0))
        funcol.wait_tensor(out)
        t.uninstall()
        assert t.seconds["tp"] > 0 and t.seconds["other"] == 0
        assert t.calls >= 2  # the launch and the wait(s)
    finally:
        dist.destroy_process_group()


def test_comm_profile_summary_takes_unions_on_the_training_thread():
    from dtorch.monitor.commprofile import summarise

    evs = [("aten::mm", 1, 0, 10), ("aten::add", 1, 10, 5), ("aten::mm", 7, 0, 1),
           ("_c10d_functional::all_reduce", 1, 100, 50), ("c10d::allreduce_", 1, 110, 20),  # nested: once
           ("_c10d_functional::wait_tensor", 1, 300, 100),
           ("gloo:all_reduce", 7, 120, 200), ("gloo:all_gather", 8, 250, 100),  # overlapping flights
           ("_c10d_functional::wait_tensor", 7, 0, 1000)]  # not the training thread: ignored
    s = summarise(evs)
    assert s["exposed_s"] == pytest.approx(150e-6) and s["wait_s"] == pytest.approx(100e-6)
    assert s["flight_s"] == pytest.approx(230e-6)
    assert s["ops"]["gloo:all_reduce"] == {"count": 1, "seconds": 0.0002}


def test_console_line_shows_eta_and_the_slowest_rank(capsys):
    from dtorch.monitor.metrics import MetricsLogger, StepMetrics

    log = MetricsLogger(None, total_steps=30, console=True)  # a log file: a line every step of 30
    # what RunMonitor sets from each per-rank window (world > 1)
    rec = ranks_record([_row(compute=0.05), _row(compute=0.09)], step=10)
    log.note = f"slowest r{rec['slowest_rank']} {rec['slowest_ratio']:.2f}x"
    for s in (1, 2):
        log.log(StepMetrics(step=s, loss=3.0, grad_norm=1.0, lr=1e-3, step_time_s=0.5, tokens_per_s=1e3, mfu=0.1,
                            peak_memory_bytes=2**20, world_size=2, epoch=0))
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "step 2/30" in line and "ETA 14s" in line and line.endswith("slowest r1 1.80x")


def test_a_host_header_naming_another_site_is_refused_dns_rebinding():
    """A page on an attacker's domain re-pointed at 127.0.0.1 reaches the port, but its requests
    carry the attacker's name in Host: refused. The bound address, localhost (an SSH tunnel from
    any local port) and loopback literals are served."""
    srv = MonitorServer(_state(), port=0)
    try:
        for host in (f"attacker.example:{srv.port}", "attacker.example", f"127.0.0.1.nip.io:{srv.port}",
                     f"10.1.2.3:{srv.port}"):
            code, body = _get(srv.url + "api/data", {"Host": host})
            assert code == 403 and b"DNS rebinding" in body, (host, code)
        for host in (f"127.0.0.1:{srv.port}", f"localhost:{srv.port}", "localhost:9000", "LOCALHOST.",
                     f"[::1]:{srv.port}"):
            assert _get(srv.url + "api/data", {"Host": host})[0] == 200, host
    finally:
        srv.close()


def test_a_busy_monitor_port_is_named_with_the_fix_before_and_at_bind():
    from dtorch.monitor.server import check_port

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        for attempt in (lambda: check_port(port), lambda: MonitorServer(MonitorState(), port=port)):
            with pytest.raises(ConfigError) as e:
                attempt()
            msg = str(e.value)
            assert f"monitor_port={port}" in msg and f"127.0.0.1:{port} is in use" in msg and "--monitor-port" in msg
    check_port(port)  # free again
    check_port(0)


def test_the_monitors_refusals_name_knobs_that_exist():
    """Every flag a refusal names is an option of `dtorch train`, every variable one the monitor
    reads."""
    import argparse
    import re

    from dtorch.cli import train as train_cli
    from dtorch.monitor import live

    p = argparse.ArgumentParser()
    train_cli.add_parser(p.add_subparsers(), "")
    (sub,) = [a for a in p._subparsers._group_actions[0].choices.values()]
    flags = {o for a in sub._actions for o in a.option_strings}
    messages = []
    for kw in ({"host": "10.0.0.1"}, {"host": "10.0.0.1", "allow_remote": True}):
        with pytest.raises(ConfigError) as e:
            MonitorServer(MonitorState(), port=0, **kw)
        messages.append(str(e.value))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        with pytest.raises(ConfigError) as e:
            MonitorServer(MonitorState(), port=held.getsockname()[1])
        messages.append(str(e.value))
    named = {f for m in messages for f in re.findall(r"--[a-z][a-z-]+", m)}
    assert named and named <= flags, named - flags
    env = {v for m in messages for v in re.findall(r"DTORCH_[A-Z_]+", m)}
    assert env and all(v in live.__doc__ for v in env), env
