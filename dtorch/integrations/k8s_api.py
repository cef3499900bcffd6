"""The job's state on its own pod, where the pod's service account is permitted to write it.

Inside a pod (KUBERNETES_SERVICE_HOST/PORT set, the service-account token mounted, POD_NAME from
the downward API: `dtorch submit k8s` manifests set POD_NAME, POD_NAMESPACE, POD_UID, NODE_NAME),
rank 0 tells the API server, with the standard library only (urllib, ssl with the mounted CA):

- pod annotations, a JSON merge patch (`PATCH /api/v1/namespaces/NS/pods/POD`,
  `Content-Type: application/merge-patch+json`): `dtorch.io/state`, `dtorch.io/step`,
  `dtorch.io/total-steps`, `dtorch.io/tokens-per-s`, `dtorch.io/checkpoint-step`,
  `dtorch.io/from-step`, `dtorch.io/why`, `dtorch.io/status` (the one-line summary),
  `dtorch.io/updated`; a key the new state lacks is removed (null in the patch). At every change
  of state, otherwise at most once per `interval` seconds. `kubectl get pod POD -o yaml` shows them.
- a core/v1 Event about the pod (`POST /api/v1/namespaces/NS/events`) at every change of state
  (reason `Running`, `Checkpointed`, `Preempted`, `Failed`, ...; type Warning for preempted and
  failed): `kubectl describe pod POD` and `kubectl get events` show them.

Never fails the job: a request runs in a background thread with a 3 s timeout; a 401/403/404
switches that channel off with one logged line naming the RBAC that permits it (`dtorch submit
k8s --rbac` writes it: pods get/patch, events create); other errors are logged once and retried
at the next report, and after 5 in a row the channel is switched off too.

Environment: DTORCH_K8S_STATUS=annotations,events (default both; "off" for neither),
DTORCH_K8S_STATUS_INTERVAL (seconds, default 30), DTORCH_K8S_SA_DIR (default the mounted
service-account directory), DTORCH_K8S_API (an `http(s)://host:port` that replaces the in-cluster
address; for tests and `kubectl proxy`).
"""

from __future__ import annotations

import datetime
import json
import queue
import ssl
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from dtorch.env import environ

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
CHANNELS = ("annotations", "events")
PREFIX = "dtorch.io/"
# status.json fields -> annotation keys (values are strings: annotations are map[string]string)
FIELDS = {"state": "state", "step": "step", "total_steps": "total-steps", "tokens_per_s": "tokens-per-s",
          "checkpoint_step": "checkpoint-step", "from_step": "from-step", "after": "after",
          "signal": "signal", "why": "why"}
KEYS = [PREFIX + k for k in FIELDS.values()] + [PREFIX + "status", PREFIX + "updated"]
WARNING_STATES = ("preempted", "failed")
TIMEOUT_S = 3.0
MAX_ERRORS = 5


def _log(msg: str) -> None:
    print(f"dtorch status: {msg}", file=sys.stderr, flush=True)


def _now_rfc3339(t: float | None = None) -> str:
    return datetime.datetime.fromtimestamp(time.time() if t is None else t, datetime.timezone.utc) \
        .strftime("%Y-%m-%dT%H:%M:%SZ")


def annotation_patch(doc: dict, summary: str) -> dict:
    """The merge patch that puts `doc` on the pod and removes the dtorch.io/ keys it lacks."""
    ann: dict[str, str | None] = {k: None for k in KEYS}
    for field, key in FIELDS.items():
        if doc.get(field) is not None:
            ann[PREFIX + key] = str(doc[field])[:1000]
    ann[PREFIX + "status"] = summary[:1000]
    ann[PREFIX + "updated"] = _now_rfc3339(doc.get("t"))
    return {"metadata": {"annotations": ann}}


def event_body(doc: dict, summary: str, *, pod: str, namespace: str, uid: str | None, node: str | None) -> dict:
    """A core/v1 Event about the pod, for one change of state."""
    state = str(doc.get("state", "unknown"))
    ts = _now_rfc3339(doc.get("t"))
    involved: dict[str, str] = {"apiVersion": "v1", "kind": "Pod", "name": pod, "namespace": namespace}
    if uid:
        involved["uid"] = uid
    source: dict[str, str] = {"component": "dtorch"}
    if node:
        source["host"] = node
    return {"apiVersion": "v1", "kind": "Event",
            # client-go's recorder names events <object>.<unique hex>; the same here
            "metadata": {"name": f"{pod}.{time.time_ns():x}", "namespace": namespace},
            "involvedObject": involved, "reason": state.capitalize(), "message": summary[:1024],
            "type": "Warning" if state in WARNING_STATES else "Normal", "source": source,
            "firstTimestamp": ts, "lastTimestamp": ts, "count": 1,
            "reportingComponent": "dtorch.io/trainer", "reportingInstance": pod}


class PodStatus:
    """Annotations and events on this pod; `from_env()` is None outside a pod (or when switched off)."""

    def __init__(self, api: str, token: str, namespace: str, pod: str, *, ca_file: str | None = None,
                 uid: str | None = None, node: str | None = None, channels=CHANNELS, interval: float = 30.0):
        self.api = api.rstrip("/")
        self.token = token
        self.namespace = namespace
        self.pod = pod
        self.uid = uid
        self.node = node
        self.interval = interval
        self.enabled = {c: c in channels for c in CHANNELS}
        self._errors = {c: 0 for c in CHANNELS}
        self._ctx: ssl.SSLContext | None = None
        if self.api.startswith("https:"):
            self._ctx = ssl.create_default_context(cafile=ca_file) if ca_file else ssl.create_default_context()
        self._last_state: str | None = None
        self._last_patch = -1e18
        self._q: queue.Queue = queue.Queue(maxsize=16)
        self._thread: threading.Thread | None = None
        self.sent = {c: 0 for c in CHANNELS}  # successful requests, per channel
        self.dropped = 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PodStatus | None:
        env = environ() if env is None else env
        channels = [c.strip() for c in env.get("DTORCH_K8S_STATUS", ",".join(CHANNELS)).split(",")]
        channels = [c for c in channels if c in CHANNELS]
        host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
        api = env.get("DTORCH_K8S_API") or (f"https://{'[' + host + ']' if host and ':' in host else host}:{port}"
                                            if host and port else None)
        if not api or not channels:
            return None
        sa = Path(env.get("DTORCH_K8S_SA_DIR", SA_DIR))
        pod = env.get("POD_NAME")
        try:
            token = (sa / "token").read_text().strip()
        except OSError:
            _log(f"no service-account token at {sa}/token: pod annotations and events off "
                 "(set automountServiceAccountToken, or DTORCH_K8S_STATUS=off)")
            return None
        if not pod:
            _log("POD_NAME is not set: pod annotations and events off (set it from the downward API, "
                 "fieldRef metadata.name, as `dtorch submit k8s` manifests do)")
            return None
        namespace = env.get("POD_NAMESPACE")
        if not namespace:
            try:
                namespace = (sa / "namespace").read_text().strip()
            except OSError:
                namespace = "default"
        ca = sa / "ca.crt"
        try:
            interval = float(env.get("DTORCH_K8S_STATUS_INTERVAL", "30"))
        except ValueError:
            interval = 30.0
        return cls(api, token, namespace, pod, ca_file=str(ca) if ca.exists() else None, uid=env.get("POD_UID"),
                   node=env.get("NODE_NAME"), channels=channels, interval=interval)

    # -- reporting ---------------------------------------------------------------------------

    def report(self, doc: dict, summary: str, *, final: bool = False) -> None:
        """Queue what `doc` calls for; `final` waits (up to a few seconds) until it is sent."""
        state = doc.get("state")
        changed = state != self._last_state
        now = time.monotonic()
        self._last_state = state
        if self.enabled["annotations"] and (changed or final or now - self._last_patch >= self.interval):
            self._last_patch = now
            self._put(("annotations", annotation_patch(doc, summary)))
        if self.enabled["events"] and changed:
            self._put(("events", event_body(doc, summary, pod=self.pod, namespace=self.namespace,
                                             uid=self.uid, node=self.node)))
        if final:
            self.flush(2 * TIMEOUT_S)

    def flush(self, timeout: float) -> bool:
        """Wait until everything queued has been tried (True), or `timeout` passed (False)."""
        deadline = time.monotonic() + timeout
        while self._q.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._q.unfinished_tasks

    def _put(self, item) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._worker, name="dtorch-k8s-status", daemon=True)
            self._thread.start()
        try:
            self._q.put_nowait(item)
        except queue.Full:  # the API server is slower than the reports: drop this one
            self.dropped += 1

    def _worker(self) -> None:
        while True:
            channel, body = self._q.get()
            try:
                if self.enabled[channel]:
                    self._send(channel, body)
            except Exception as e:  # noqa: BLE001 - never let the status kill the thread
                _log(f"{channel}: {type(e).__name__}: {e}")
            finally:
                self._q.task_done()

    def _send(self, channel: str, body: dict) -> None:
        ns = self.namespace
        if channel == "annotations":
            url, method, ctype = f"{self.api}/api/v1/namespaces/{ns}/pods/{self.pod}", "PATCH", \
                "application/merge-patch+json"
        else:
            url, method, ctype = f"{self.api}/api/v1/namespaces/{ns}/events", "POST", "application/json"
        req = urllib.request.Request(url, data=json.dumps(body).encode(), method=method, headers={
            "Authorization": f"Bearer {self.token}", "Content-Type": ctype, "Accept": "application/json",
            "User-Agent": "dtorch-status"})
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT_S, context=self._ctx) as resp:
                resp.read()
            self.sent[channel] += 1
            self._errors[channel] = 0
        except urllib.error.HTTPError as e:
            if e.code in (401, 403, 404):
                self.enabled[channel] = False
                why = {401: "unauthorized (token rejected)", 403: "forbidden", 404: "pod not found"}[e.code]
                verb = "patch pods" if channel == "annotations" else "create events"
                _log(f"{channel} off: {method} {url} -> {e.code} {why}; permit `{verb}` to the pod's service "
                     f"account in namespace {ns} (dtorch submit k8s --rbac writes the Role and RoleBinding)")
                return
            self._error(channel, f"{method} {url} -> HTTP {e.code}")
        except (OSError, ValueError) as e:  # URLError, timeouts, TLS errors
            self._error(channel, f"{method} {url} -> {type(e).__name__}: {getattr(e, 'reason', e)}")

    def _error(self, channel: str, what: str) -> None:
        self._errors[channel] += 1
        n = self._errors[channel]
        if n == 1:
            _log(f"{channel}: {what} (retried at the next report)")
        if n >= MAX_ERRORS:
            self.enabled[channel] = False
            _log(f"{channel} off after {n} failed requests in a row: {what}")
