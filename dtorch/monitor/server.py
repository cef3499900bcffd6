"""The live monitor: one small HTTP server on rank 0 serving a Prometheus endpoint and a web page.

    GET /metrics    Prometheus text format (prometheus_client), one series per rank where per-rank
    GET /           the live page (dtorch/monitor/assets/page.html; it polls /api/data)
    GET /api/data   the JSON the page draws: step records, the latest per-rank view, plan, events

The server binds 127.0.0.1 by default. Any other address must be asked for (`allow_remote=True`:
DTORCH_MONITOR_HOST with DTORCH_MONITOR_ALLOW_REMOTE=1) and then needs a token
(DTORCH_MONITOR_TOKEN): every request must carry ``Authorization: Bearer TOKEN`` or
``?token=TOKEN`` (the page forwards the one in its own URL), or it gets 401. A request whose
``Host`` header names neither the bound address nor this machine (``localhost`` for a loopback
bind) gets 403 before anything else: a web page whose own name an attacker re-points at
127.0.0.1 (DNS rebinding) cannot read the monitor. Requests are answered from the in-memory
`MonitorState` the trainer's logger feeds; nothing waits on the training loop, and the training
loop never waits on a request.
"""

from __future__ import annotations

import bisect
import errno
import hmac
import ipaddress
import json
import os
import socket
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from dtorch.env import current
from dtorch.errors import ConfigError
from dtorch.trust import is_loopback

MAX_STEPS = 20000
"""Step records kept for the page (older ones are thinned to every other one)."""


class MonitorState:
    """What the page and the endpoint show, fed by `MetricsLogger` records (`feed`), thread-safe."""

    def __init__(self, events_path: str | None = None):
        self.lock = threading.Lock()
        self.steps: list[dict[str, Any]] = []
        self.ranks: dict[str, Any] | None = None
        self.rank_history: deque[dict[str, Any]] = deque(maxlen=200)
        self.events: deque[dict[str, Any]] = deque(maxlen=500)
        self.plan: dict[str, Any] | None = None
        self.last_eval: dict[str, Any] | None = None
        """The latest `eval` record (the eval loop's loss and perplexity)."""
        self.events_path = events_path
        self.started = time.time()
        self.session = os.urandom(6).hex()
        """Names this state: a page that polls with `since` gets only new steps while it is the same."""
        self._run_events: tuple[tuple[int, int], list[dict[str, Any]]] | None = None
        self.tokens_total = 0.0
        """Tokens trained since this state started (a counter: it restarts with the process)."""

    def feed(self, record: dict[str, Any]) -> None:
        kind = record.get("event")
        with self.lock:
            if kind is None:
                if self.steps and record.get("step", 0) <= self.steps[-1].get("step", 0):
                    # a resumed run trains these steps again: its records replace the lost ones
                    self.steps = [r for r in self.steps if r.get("step", 0) < record.get("step", 0)]
                self.steps.append(record)
                # tokens/s x seconds: this step's tokens, for a counter that rate() reads
                self.tokens_total += float(record.get("tokens_per_s") or 0.0) * float(record.get("step_time_s") or 0.0)
                if len(self.steps) > MAX_STEPS:
                    self.steps = self.steps[::2]
            elif kind == "ranks":
                self.ranks = record
                self.rank_history.append({k: record[k] for k in ("step", "mean", "slowest_rank", "slowest_ratio",
                                                                 "stragglers")})
            else:
                if kind == "plan":
                    self.plan = record
                elif kind == "eval":
                    self.last_eval = record
                self.events.append(record)

    def replay(self, path: str | os.PathLike | None) -> int:
        """Feed the records an earlier process of this run wrote to its metrics.jsonl (the steps
        before a restart, the plan chosen before the server started); a torn last line is skipped.
        Returns how many records were fed."""
        if path is None or not os.path.exists(path):
            return 0
        n = 0
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict):
                    self.feed(record)
                    n += 1
        return n

    def run_events(self) -> list[dict[str, Any]]:
        """The elastic event log's records (recoveries, failures), when the run has one."""
        if not self.events_path or not os.path.exists(self.events_path):
            return []
        from dtorch.eventlog import read

        st = os.stat(self.events_path)
        key = (st.st_size, st.st_mtime_ns)
        if self._run_events is not None and self._run_events[0] == key:  # not re-read on every poll
            return self._run_events[1]
        keep = ("failure", "recovery", "rendezvous", "workers_started", "oom", "hang", "straggler", "fault",
                "detected", "stopped")
        out = [e for e in read(self.events_path)[-2000:] if any(k in str(e.get("kind", "")) for k in keep)][-200:]
        self._run_events = (key, out)
        return out

    def data(self, since: int | None = None, session: str | None = None) -> dict[str, Any]:
        """What the page draws. With `since` (the last step the page holds) and this state's
        `session`, only the steps after it (``"since"`` in the answer says so): a poll of a long run
        then costs what is new, not a serialisation of every step so far under the GIL the
        training loop needs."""
        events = self.run_events()
        with self.lock:
            steps = self.steps
            part = since is not None and session == self.session
            if part:
                lo = bisect.bisect_right(steps, since, key=lambda r: r["step"])
                steps = steps[lo:]
            return {"steps": list(steps), "since": since if part else None, "session": self.session,
                    "ranks": self.ranks, "rank_history": list(self.rank_history),
                    "events": list(self.events), "plan": self.plan, "run_events": events,
                    "started": self.started, "now": time.time()}


GPU_READINGS = (("gpu_util", "dtorch_rank_gpu_utilization_ratio", "GPU busy fraction (NVML), 0..1", 0.01),
                ("gpu_temp_c", "dtorch_rank_gpu_temperature_celsius", "GPU temperature (NVML)", 1.0),
                ("gpu_sm_clock_mhz", "dtorch_rank_gpu_sm_clock_hertz", "GPU SM clock (NVML)", 1e6),
                ("gpu_power_w", "dtorch_rank_gpu_power_watts", "GPU power draw (NVML)", 1.0))
"""(ranks-record field, metric name, help, factor to the metric's base unit): one unit per name."""


class _Collector:
    """prometheus_client custom collector: the series are built at scrape time from the state.
    Names follow Prometheus' conventions: base units (seconds, bytes, hertz, celsius, watts), `_ratio`
    for 0..1 fractions, `_total` for counters, one unit per name."""

    def __init__(self, state: MonitorState):
        self.state = state

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        st = self.state
        with st.lock:
            last = st.steps[-1] if st.steps else None
            ranks = st.ranks
            tokens = st.tokens_total
            ev = st.last_eval
        if ev is not None:
            yield GaugeMetricFamily("dtorch_eval_loss", "evaluation loss (global mean), latest evaluation",
                                    value=float(ev["loss"]))
            yield GaugeMetricFamily("dtorch_eval_perplexity", "evaluation perplexity, exp of the evaluation loss",
                                    value=float(ev["perplexity"]))
        if last is not None:
            yield CounterMetricFamily("dtorch_steps", "optimizer steps done", value=last["step"])
            yield CounterMetricFamily("dtorch_tokens", "tokens trained by the whole job since this process "
                                      "started (rate() gives tokens per second)", value=tokens)
            for key, name, help_text in (
                    ("loss", "dtorch_loss", "training loss (global mean)"),
                    ("grad_norm", "dtorch_grad_norm", "gradient norm"),
                    ("lr", "dtorch_learning_rate", "learning rate"),
                    ("step_time_s", "dtorch_step_seconds", "seconds per step (rank 0)"),
                    ("tokens_per_s", "dtorch_tokens_per_second", "tokens per second, whole job, last step"),
                    ("mfu", "dtorch_mfu_ratio", "model FLOPs utilisation, 0..1")):
                yield GaugeMetricFamily(name, help_text, value=float(last[key]))
        if ranks is None:
            return
        term = GaugeMetricFamily("dtorch_rank_step_term_seconds", "seconds per step by term, per rank "
                                 "(window mean)", labels=["rank", "term"])
        step = GaugeMetricFamily("dtorch_rank_step_seconds", "seconds per step, per rank (window mean)",
                                 labels=["rank"])
        tps = GaugeMetricFamily("dtorch_rank_tokens_per_second", "job tokens/s at this rank's step time",
                                labels=["rank"])
        mem = GaugeMetricFamily("dtorch_rank_memory_bytes", "memory per rank: current, peak, reserved",
                                labels=["rank", "kind"])
        gpu = {field: GaugeMetricFamily(name, help_text, labels=["rank"])
               for field, name, help_text, _ in GPU_READINGS}
        ratio = GaugeMetricFamily("dtorch_rank_own_time_ratio", "this rank's own work (data+compute+optimizer) "
                                  "over the fastest rank's", labels=["rank"])
        strag = GaugeMetricFamily("dtorch_rank_straggler", "1 when the rank is named a straggler", labels=["rank"])
        for r in ranks["ranks"]:
            lab = str(r["rank"])
            for t in ranks["terms"]:
                if r.get(t) is not None:
                    term.add_metric([lab, t], r[t])
            step.add_metric([lab], r["step"])
            tps.add_metric([lab], r["tokens_per_s"])
            for kind in ("current", "peak", "reserved"):
                v = r.get(f"mem_{kind}_bytes")
                if v is not None:
                    mem.add_metric([lab, kind], v)
            for field, _, _, factor in GPU_READINGS:
                if r.get(field) is not None:
                    gpu[field].add_metric([lab], r[field] * factor)
            ratio.add_metric([lab], r["own_ratio"])
            strag.add_metric([lab], 1.0 if r["rank"] in ranks["stragglers"] else 0.0)
        yield from (term, step, tps, mem, *(g for g in gpu.values() if g.samples), ratio, strag)
        pred = ranks.get("predicted") or {}
        if pred:
            p = GaugeMetricFamily("dtorch_predicted_step_term_seconds", "the plan's predicted seconds per step "
                                  "by term", labels=["term"])
            for k, v in pred.items():
                p.add_metric([k], v)
            yield p


PORT_FIX = "pass another --monitor-port (DTORCH_MONITOR_PORT for `dtorch run`), or 0 for any free port"


def _bind_error(host: str, port: int, e: OSError) -> ConfigError:
    if e.errno == errno.EADDRINUSE:
        return ConfigError("monitor_port", port, f"{host}:{port} is in use by another program; {PORT_FIX}")
    if e.errno == errno.EACCES:
        return ConfigError("monitor_port", port, f"binding {host}:{port} needs privileges (ports below 1024); "
                           f"{PORT_FIX}")
    return ConfigError("monitor_port", port, f"cannot bind {host}:{port} ({e.strerror}); {PORT_FIX}")


def check_port(port: int | None, host: str | None = None) -> None:
    """Before any worker starts: ConfigError naming the port and the fix when the monitor could not
    bind host:port now (another program listens there). `host` defaults to DTORCH_MONITOR_HOST or
    127.0.0.1; port None or 0 (any free port) is not checked."""
    if not port:
        return
    host = host or current().monitor_host or "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds (TIME_WAIT is no conflict)
        try:
            s.bind((host, int(port)))
            s.listen(1)
        except OSError as e:
            raise _bind_error(host, int(port), e) from None


def _host_name(header: str) -> str:
    """The host of a Host header, without its port, lower case, IPv6 brackets removed."""
    h = header.strip().lower()
    if h.startswith("["):
        return h[1:h.find("]")] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def host_allowed(header: str | None, bound: str) -> bool:
    """Whether a request's Host header names this server: the bound address, a loopback address or
    ``localhost`` when bound to loopback (an SSH tunnel), this machine's names when bound to
    another interface, any address literal when bound to all of them. A name an attacker controls
    (DNS rebinding) is none of these. No Host header (HTTP/1.0 tools; every browser sends one) is
    allowed."""
    if header is None:
        return True
    name = _host_name(header).rstrip(".")
    bound = bound.lower()
    if name == bound:
        return True
    if is_loopback(bound):
        return name == "localhost" or (_is_ip(name) and is_loopback(name))
    if _is_ip(name):
        return bound in ("0.0.0.0", "::")
    names = {socket.gethostname().lower(), socket.getfqdn().lower()}
    return name in names or (bound in ("0.0.0.0", "::") and name == "localhost")


ASSETS = {"uPlot.iife.min.js": "text/javascript; charset=utf-8", "uPlot.min.css": "text/css; charset=utf-8",
          "uPlot.LICENSE": "text/plain; charset=utf-8"}
"""The page's vendored chart library (uPlot, MIT licence): static, served without the token."""


def _asset(name: str) -> bytes:
    return resources.files("dtorch.monitor").joinpath("assets", name).read_bytes()


def _page() -> bytes:
    return _asset("page.html")


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format, *args):  # noqa: A002 - the stdlib's name
        pass  # no access log on the training console

    def _authorised(self, query: dict[str, list[str]]) -> bool:
        token = self.server.token
        if not token:
            return True
        given = ""
        auth = self.headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            given = auth[len("Bearer "):].strip()
        elif query.get("token"):
            given = query["token"][0]
        return hmac.compare_digest(given.encode(), token.encode())

    def _send(self, code: int, body: bytes, ctype: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        host = self.headers.get("Host")
        if not host_allowed(host, str(self.server.server_address[0])):
            self._send(403, f"Host {host!r} is not this monitor's address: refused (DNS rebinding defence); "
                       f"use http://{self.server.url_host}:{self.server.server_address[1]}/\n".encode(), "text/plain")
            return
        url = urlparse(self.path)
        name = url.path.removeprefix("/assets/")
        if url.path.startswith("/assets/") and name in ASSETS:  # public library code, no run data
            self._send(200, _asset(name), ASSETS[name])
            return
        if not self._authorised(parse_qs(url.query)):
            self._send(401, b"token required: Authorization: Bearer TOKEN or ?token=TOKEN\n", "text/plain")
            return
        if url.path == "/metrics":
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            self._send(200, generate_latest(self.server.registry), CONTENT_TYPE_LATEST)
        elif url.path == "/api/data":
            q = parse_qs(url.query)
            try:
                since = int(q["since"][0]) if "since" in q else None
            except ValueError:
                since = None  # not a step number: everything
            data = self.server.state.data(since=since, session=(q.get("session") or [None])[0])
            self._send(200, json.dumps(data, default=str).encode(), "application/json")
        elif url.path in ("/", "/index.html"):
            self._send(200, _page(), "text/html; charset=utf-8")
        else:
            self._send(404, b"not found\n", "text/plain")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    token: str | None
    state: MonitorState
    registry: Any
    url_host: str


class MonitorServer:
    """Serve `state` on host:port in a daemon thread (`port=0`: a free port; see `.url`).

    A host that is not a loopback address needs `allow_remote=True` and a `token`; both are
    checked here, before anything binds."""

    def __init__(self, state: MonitorState, *, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 allow_remote: bool = False):
        if not is_loopback(host):
            if not allow_remote:
                raise ConfigError("monitor_host", host, "the monitor binds 127.0.0.1 unless asked: set "
                                  "DTORCH_MONITOR_ALLOW_REMOTE=1 and a token (DTORCH_MONITOR_TOKEN) to serve "
                                  "another interface")
            if not token:
                raise ConfigError("monitor_token", None, f"serving on {host} needs a token: set DTORCH_MONITOR_TOKEN "
                                  "(e.g. to the output of: openssl rand -hex 16)")
        from prometheus_client import CollectorRegistry

        self.state = state
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(state))
        try:
            self.httpd = _Server((host, int(port)), _Handler)
        except OSError as e:  # a port another program holds: the user's to change, no restart helps
            raise _bind_error(host, int(port), e) from None
        self.httpd.token, self.httpd.state, self.httpd.registry = token, state, registry
        self.host, self.port = self.httpd.server_address[:2]
        self.httpd.url_host = f"[{self.host}]" if ":" in str(self.host) else str(self.host)
        self.token = token
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="dtorch-monitor", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in str(self.host) else self.host
        return f"http://{host}:{self.port}/"

    def write_info(self, log_dir: str | Path | None) -> None:
        """<log_dir>/monitor.json: where the server listens (the token is not written)."""
        if log_dir is None:
            return
        info = {"url": self.url, "host": self.host, "port": self.port, "token_required": bool(self.token),
                "pid": os.getpid()}
        from dtorch import trust

        # private (it names the port), replaced atomically: a planted link is replaced, not followed
        trust.replace_file(Path(log_dir, "monitor.json"), (json.dumps(info) + "\n").encode(), durable=False)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=5)
