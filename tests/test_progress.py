"""Progress lines: at most one a second, only when someone watches (a terminal or
DTORCH_PROGRESS=1), quiet otherwise; the planner's callback reports meshes and plans."""

from __future__ import annotations

import io

from dtorch.progress import Progress, Ticker, search_progress, wanted


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_quiet_unless_a_terminal_or_asked(monkeypatch):
    monkeypatch.delenv("DTORCH_PROGRESS", raising=False)
    assert not wanted(io.StringIO()) and wanted(_Tty())
    monkeypatch.setenv("DTORCH_PROGRESS", "0")
    assert not wanted(_Tty())
    monkeypatch.setenv("DTORCH_PROGRESS", "1")
    assert wanted(io.StringIO())


def test_at_most_one_line_a_second_and_none_for_a_short_phase():
    out, clock = io.StringIO(), _Clock()
    p = Progress("planning", stream=out, enabled=True, clock=clock)
    for i in range(50):  # 5 s of updates every 0.1 s
        clock.t = 0.1 * i
        p.update(f"{i} of 50")
    p.close("done")
    lines = out.getvalue().splitlines()
    assert lines[0] == "planning: 10 of 50, 1.0 s" and len(lines) == 5 and lines[-1] == "planning: done, 4.9 s"
    short = io.StringIO()
    q = Progress("loading", stream=short, enabled=True, clock=_Clock())
    q.update("x")
    q.close()
    assert short.getvalue() == ""


def test_on_a_terminal_the_line_rewrites_itself():
    out, clock = _Tty(), _Clock()
    p = Progress("probing", stream=out, clock=clock)
    clock.t = 1.5
    p.update("GEMMs")
    p.close()
    assert out.getvalue() == "\r\x1b[2Kprobing: GEMMs, 1.5 s\r\x1b[2Kprobing: done, 1.5 s\n"


def test_a_ticker_prints_its_note_while_a_phase_runs():
    import time

    out = io.StringIO()
    t = Ticker("loading checkpoint step-00000004", stream=out, every=0.1, enabled=True).start()
    t.note = "reading shards"
    time.sleep(0.35)
    t.stop()
    lines = out.getvalue().splitlines()
    assert len(lines) >= 2 and lines[0].startswith("loading checkpoint step-00000004: reading shards, 0.")
    assert lines[-1].startswith("loading checkpoint step-00000004: done")


def test_the_search_reports_meshes_and_plans_through_its_callback():
    from dtorch.cluster.load import load_cluster
    from dtorch.plan.profiles import get_profile
    from dtorch.plan.search import search

    calls = []
    profile = get_profile("llama3-8b", 4096)
    r = search(profile, load_cluster("h100:2x8"), global_batch=64, top_k=1,
               progress=lambda *a: calls.append(a))
    assert len(calls) == r.meshes and calls[0] == (0, r.meshes, 0)
    assert [c[0] for c in calls] == list(range(r.meshes)) and calls[-1][2] <= r.evaluated
    out, clock = io.StringIO(), _Clock()
    cb, p = search_progress("planning", stream=out, enabled=True, clock=clock)
    clock.t = 1.2
    cb(12, 35, 12000)
    assert out.getvalue() == "planning: 12 of 35 meshes, 12,000 plans estimated, 1.2 s\n"
