"""A real 2-worker run with the monitor on: Prometheus scrape, the live page in headless Chromium,
and `dtorch report` of the run after it was stopped (killed mid-run, so it never finished)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

MODEL = "gpt:layers=2,hidden=64,heads=2,vocab=256,seq=64"


def _jsonl(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def _fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=20) as r:
        return r.read()


@pytest.fixture(scope="module")
def live_run(tmp_path_factory):
    """A 2-worker `dtorch train` with the monitor on a free port, whose rank 1 is killed at step 6
    and recovered; yields once the restarted rank 0's page has a per-rank window and the recovery;
    stopped (SIGTERM to its own process group) at teardown."""
    tmp = tmp_path_factory.mktemp("monitor")
    run_dir = tmp / "run"
    cmd = [sys.executable, "-m", "dtorch.cli", "train", "--nproc", "2", "--model", MODEL, "--seq-len", "64",
           "--global-batch", "4", "--steps", "100000", "--checkpoint-dir", str(run_dir), "--checkpoint-every",
           "100000", "--sample-tokens", "0", "--monitor-port", "0", "--metrics-every", "3", "--no-progress",
           "--chaos", "kill:rank=1:step=6", "--max-restarts", "1", "--run-dir", str(tmp / "events")]
    log = open(tmp / "log.txt", "w")  # noqa: SIM115 - closed at teardown
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        info = run_dir / "monitor.json"
        deadline = time.time() + 240
        while True:
            assert proc.poll() is None, (tmp / "log.txt").read_text()[-3000:]
            assert time.time() < deadline, "no recovered run with a per-rank window within the deadline"
            try:  # the restarted rank 0 serves on a port of its own and writes monitor.json again
                url = json.loads(info.read_text())["url"]
                data = json.loads(_fetch(url + "api/data"))
            except (OSError, ValueError, KeyError):
                data = None
            if (data is not None and data["ranks"] is not None and len(data["steps"]) >= 8
                    and any(e.get("kind") == "recovery" for e in data["run_events"])):
                break
            time.sleep(1.0)
        yield {"url": url, "run_dir": run_dir, "proc": proc, "tmp": tmp}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


def test_prometheus_scrape_during_a_two_worker_run_has_every_rank(live_run):
    from prometheus_client.parser import text_string_to_metric_families

    text = _fetch(live_run["url"] + "metrics").decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert fams["dtorch_steps"].samples[0].value >= 8
    assert fams["dtorch_tokens"].type == "counter" and fams["dtorch_tokens"].samples[0].value > 0
    assert 0 < fams["dtorch_mfu_ratio"].samples[0].value <= 1
    for name in ("dtorch_rank_step_seconds", "dtorch_rank_tokens_per_second", "dtorch_rank_own_time_ratio"):
        assert {s.labels["rank"] for s in fams[name].samples} == {"0", "1"}, name
    mem = {(s.labels["rank"], s.labels["kind"]) for s in fams["dtorch_rank_memory_bytes"].samples}
    assert {("0", "current"), ("1", "current"), ("0", "peak"), ("1", "peak")} <= mem
    mem_v = {(s.labels["rank"], s.labels["kind"]): s.value for s in fams["dtorch_rank_memory_bytes"].samples}
    assert all(mem_v[(r, "peak")] >= mem_v[(r, "current")] for r in ("0", "1")), mem_v
    per_term = {(s.labels["rank"], s.labels["term"]): s.value for s in fams["dtorch_rank_step_term_seconds"].samples}
    assert per_term[("0", "compute")] > 0 and per_term[("1", "compute")] > 0
    assert all(v >= 0 for v in per_term.values())


DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _metric_names(expr: str) -> set[str]:
    """The dtorch_* series a PromQL expression reads (a counter's `_total` name as exposed)."""
    import re

    return set(re.findall(r"\bdtorch_[a-z_]+", expr))


def test_a_real_prometheus_scrapes_both_ranks_and_answers_promql(live_run, tmp_path):
    """Debian's `prometheus` server scrapes the job with the shipped alert rules loaded; PromQL
    answers for both ranks' step time and the job's tokens; every series the Grafana dashboard and
    the rules name is one the job exposes."""
    import socket
    from urllib.parse import quote, urlparse

    from prometheus_client.parser import text_string_to_metric_families

    prom = shutil.which("prometheus")
    if prom is None:
        pytest.skip("Debian's prometheus is not installed (.ci/run installs it when run as root)")
    target = urlparse(live_run["url"]).netloc
    rules = DEPLOY / "prometheus" / "alerts.yml"
    if shutil.which("promtool"):
        check = subprocess.run(["promtool", "check", "rules", str(rules)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                   f"rule_files:\n  - {rules}\n"
                   f"scrape_configs:\n  - job_name: dtorch\n    static_configs:\n      - targets: ['{target}']\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "prometheus.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([prom, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    api = f"http://127.0.0.1:{port}/api/v1/"

    def query(q: str) -> list[dict]:
        doc = json.loads(_fetch(api + "query?query=" + quote(q)))
        assert doc["status"] == "success", doc
        return doc["data"]["result"]

    try:
        deadline = time.time() + 90
        while True:
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
            try:
                step = query("dtorch_rank_step_seconds")
                rate = query("rate(dtorch_tokens_total[10s])")
                if len(step) == 2 and rate and float(rate[0]["value"][1]) > 0:
                    break
            except OSError:
                pass  # not listening yet
            assert time.time() < deadline, "prometheus never had both ranks and a token rate"
            time.sleep(1)
        assert {r["metric"]["rank"] for r in step} == {"0", "1"}
        assert all(float(r["value"][1]) > 0 for r in step)
        by_rank = query("sum by (rank) (dtorch_rank_tokens_per_second)")
        assert {r["metric"]["rank"] for r in by_rank} == {"0", "1"}
        assert [r["value"][1] for r in query('up{job="dtorch"}')] == ["1"]
        assert 0 < float(query("dtorch_mfu_ratio")[0]["value"][1]) <= 1
        groups = json.loads(_fetch(api + "rules"))["data"]["groups"]
        loaded = [r for g in groups for r in g["rules"]]
        assert len(loaded) >= 5 and all(r["health"] == "ok" for r in loaded), loaded
        assert not [r for r in loaded if r["name"] == "DTorchTargetDown" and r["state"] != "inactive"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
    # every series the dashboard and the rules read is exposed (a renamed metric breaks them silently)
    text = _fetch(live_run["url"] + "metrics").decode()
    exposed = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    dashboard = json.loads((DEPLOY / "grafana" / "dtorch.json").read_text())
    wanted = {n for p in dashboard["panels"] for t in p["targets"] for n in _metric_names(t["expr"])}
    wanted |= _metric_names(rules.read_text())
    gpu_only = {n for n in wanted if n.startswith("dtorch_rank_gpu_")}  # NVML readings: GPU ranks only
    assert wanted - gpu_only <= exposed, sorted(wanted - gpu_only - exposed)
    assert gpu_only and all(n.endswith(("_ratio", "_celsius", "_hertz", "_watts")) for n in gpu_only)


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _browser(args: list[str], profile: Path) -> subprocess.CompletedProcess:
    base = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-default-apps",
            f"--user-data-dir={profile}", "--virtual-time-budget=8000"]
    return subprocess.run(base + args, capture_output=True, text=True, timeout=120)


def test_live_page_in_headless_chromium_shows_this_runs_data(live_run):
    if _chromium() is None:
        msg = "chromium is not installed (apt-get install chromium; .ci/run installs it as root)"
        print("SKIP: " + msg)
        pytest.skip(msg)
    tmp = live_run["tmp"]
    url = live_run["url"]
    dom = _browser(["--dump-dom", url], tmp / "profile-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    start = dom.stdout.index('<pre id="page-data"')
    text = dom.stdout[dom.stdout.index(">", start) + 1: dom.stdout.index("</pre>", start)]
    page = json.loads(text)
    records = _jsonl(live_run["run_dir"] / "metrics.jsonl")
    by_step = {r["step"]: r for r in records if "event" not in r}
    assert len(page["steps"]) >= 8
    # polled several times in its virtual 8 s, each poll adding only the new steps: none lost or twice
    assert page["steps"] == list(range(page["steps"][0], page["steps"][-1] + 1)) and page["partial_polls"] >= 1
    for step, loss, tps in zip(page["steps"], page["loss"], page["tokens_per_s"]):
        assert by_step[step]["loss"] == loss and by_step[step]["tokens_per_s"] == tps
    assert page["heat_rows"] == 2 and len(page["ranks"]) == 2
    # the plan the run trains, the killed rank's failure and its recovery, placed on the charts
    plan = next(r for r in records if r.get("event") == "plan")
    assert page["plan_line"].startswith(f"plan: {plan['plan']} ({plan['family']}")
    kinds = {e["cls"] for e in page["events"]}
    assert {"failure", "recovery", "plan"} <= kinds, page["events"]
    failure = next(e for e in page["events"] if e["cls"] == "failure")
    assert failure["step"] is not None and failure["step"] <= 7 and page["markers"] >= 3
    assert [e["t"] for e in page["events"] if e["t"]] == sorted(e["t"] for e in page["events"] if e["t"])
    assert page["charts"] == 3 and page["axes_ticks"] >= 6  # three uPlot charts, each with two axes
    # steps from before the restart are kept (replayed from the run's metrics.jsonl)
    assert page["steps"][0] <= 6
    window = next(r for r in records if r.get("event") == "ranks" and r["step"] == page["ranks_step"])
    for drawn, logged in zip(page["ranks"], window["ranks"]):
        assert drawn["rank"] == logged["rank"] and drawn["compute"] == logged["compute"]
    shot = tmp / "monitor-page.png"
    res = _browser(["--hide-scrollbars", "--window-size=1360,1100", f"--screenshot={shot}", url],
                   tmp / "profile-shot")
    assert res.returncode == 0 and shot.stat().st_size > 20_000, res.stderr[-2000:]
    if os.environ.get("DTORCH_SAVE_SCREENSHOT"):
        shutil.copy(shot, os.environ["DTORCH_SAVE_SCREENSHOT"])


def test_report_of_the_stopped_run(live_run, capsys):
    from dtorch.monitor.report import load_run, summarize, write_report

    proc = live_run["proc"]
    os.killpg(proc.pid, signal.SIGKILL)  # a crash: nothing gets to finish
    proc.wait(timeout=60)
    run_dir = live_run["run_dir"]
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 99999, "loss": 1.0, "tok')  # a torn last line, as a killed writer leaves
    from dtorch.cli import main  # `dtorch report`, in this process: no new interpreter importing torch

    capsys.readouterr()
    code, out = main(["report", str(run_dir)]), capsys.readouterr()
    assert code == 0, out.err
    assert "not finished" in out.out
    s = summarize(load_run(run_dir))
    assert s["finished"] is False and s["world"] == 2 and s["last_step"] >= 8
    index = write_report(run_dir)
    for png in ("loss.png", "throughput.png", "ranks.png", "timeline.png"):
        assert (index.parent / png).stat().st_size > 5000, png
    text = index.read_text()
    assert "slowest rank" in text
    # the killed rank's failure and its recovery, listed in words (the event log found by itself)
    assert s["failures"] and s["recoveries"], (s["failures"], s["recoveries"])
    assert "Failures and recoveries" in text and "recovered from exit of rank(s) 1" in text
    assert "1 recovery(ies)" in text and "failure: exit of rank(s) 1" in text
    if _chromium() is not None:  # what a reader sees: the report rendered, plan and failure included
        shot = live_run["tmp"] / "report.png"
        res = _browser(["--hide-scrollbars", "--window-size=1100,900", f"--screenshot={shot}", index.as_uri()],
                       live_run["tmp"] / "profile-report")
        assert res.returncode == 0 and shot.stat().st_size > 30_000, res.stderr[-2000:]
        dom = _browser(["--dump-dom", index.as_uri()], live_run["tmp"] / "profile-report-dom").stdout
        assert s["plan"] in dom and "<tr class=\"failure\">" in dom.replace("'", '"') and "timeline.png" in dom
        if os.environ.get("DTORCH_SAVE_SCREENSHOT"):
            saved = Path(os.environ["DTORCH_SAVE_SCREENSHOT"])
            shutil.copy(shot, saved.with_name(saved.stem + "-report.png"))
