"""The monitor tests that need a real server program (Debian's `prometheus`, headless `chromium`)
start it themselves and skip, with the reason, where it is not installed (`.ci/run` installs both
as root). The session's summary says how many of them ran."""

import os

_SERVICES = {"prometheus": "test_a_real_prometheus", "chromium": "headless_chromium"}
_counts = {name: {"passed": 0, "failed": 0, "skipped": 0} for name in _SERVICES}


def pytest_runtest_logreport(report):
    nodeid = report.nodeid.replace(os.sep, "/")
    for name, key in _SERVICES.items():
        if key not in nodeid:
            continue
        c = _counts[name]
        if report.when == "call":
            c["passed" if report.passed else "skipped" if report.skipped else "failed"] += 1
        elif report.when == "setup" and report.skipped:
            c["skipped"] += 1
        elif report.when == "setup" and report.failed:
            c["failed"] += 1


def pytest_terminal_summary(terminalreporter):
    for name, c in _counts.items():
        if sum(c.values()):
            terminalreporter.write_line(f"{name} tests: {c['passed'] + c['failed']} ran, {c['passed']} passed, "
                                        f"{c['failed']} failed, {c['skipped']} skipped")
