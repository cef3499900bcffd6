"""A real Slurm cluster for the scheduler tests, started once per session by
`scripts/slurm_local.sh` (munged, slurmctld and two slurmd from Debian's slurm-wlm and munge,
installed with apt when missing and this runs as root). Where it cannot be installed or started,
the Slurm tests skip with the reason, and the session's summary says how many ran."""

import json
import os
import ssl
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from dtorch.integrations.validate import _errors, _validator

ROOT = Path(__file__).resolve().parents[2]
_state = {"reason": None, "ran": 0, "skipped": 0, "failed": 0}


@pytest.fixture(scope="session")
def slurm():
    """SLURM_CONF of the local cluster (the environment of the test process gets it too)."""
    if _state["reason"] is not None:
        pytest.skip(_state["reason"])
    script = ROOT / "scripts" / "slurm_local.sh"
    try:
        out = subprocess.run(["bash", str(script), "start"], capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        _state["reason"] = "slurm unavailable: scripts/slurm_local.sh start timed out"
        pytest.skip(_state["reason"])
    if out.returncode != 0:
        lines = (out.stdout + out.stderr).strip().splitlines()
        _state["reason"] = lines[-1] if lines else f"scripts/slurm_local.sh exited {out.returncode}"
        pytest.skip(_state["reason"])
    conf = os.path.join(os.environ.get("DTORCH_SLURM_DIR", "/tmp/dtorch-slurm"), "slurm.conf")
    os.environ["SLURM_CONF"] = conf
    return conf


def pytest_runtest_logreport(report):
    if "tests/integrations/test_slurm" not in report.nodeid.replace(os.sep, "/"):
        return
    if report.when == "call":
        _state["ran" if report.passed else "failed"] += 1
    elif report.when == "setup" and report.skipped:
        _state["skipped"] += 1
    elif report.when == "setup" and report.failed:
        _state["failed"] += 1


def pytest_terminal_summary(terminalreporter):
    s = _state
    if s["ran"] + s["skipped"] + s["failed"] == 0:
        return
    line = f"slurm tests: {s['ran'] + s['failed']} ran, {s['ran']} passed, {s['failed']} failed, {s['skipped']} skipped"
    if s["reason"]:
        line += f" ({s['reason']})"
    terminalreporter.write_line(line)


# ---- a stand-in for the Kubernetes API server (the job's pod annotations and events) ----

def _merge(target, patch):
    """RFC 7386 JSON merge patch, as the API server applies application/merge-patch+json."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = _merge(out.get(k), v)
    return out


def make_cert(d, name):
    key, crt = d / f"{name}.key", d / f"{name}.crt"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(crt), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return key, crt


class FakeAPIServer:
    """A stand-in for the Kubernetes API server on 127.0.0.1 over HTTPS (self-signed certificate
    `self.ca`): PATCH of one pod (merge patch applied, the pod's metadata validated against core/v1
    ObjectMeta), POST of Events (validated against core/v1 Event), 401 without the bearer token,
    403 for the resources in `forbid`; anything else is recorded in `errors`."""

    TOKEN = "test-token-0123456789"

    def __init__(self, tmp, pod, namespace, forbid=()):
        TOKEN, POD, NS = self.TOKEN, pod, namespace
        self.pod_name, self.namespace = pod, namespace
        self.requests = []  # (method, path, headers, body)
        self.errors = []    # what an API server would have rejected
        self.pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": POD, "namespace": NS}}
        self.events = []
        self.forbid = set(forbid)
        key, self.ca = make_cert(tmp, "server")
        srv = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _reply(self, code, obj):
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self):
                n = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(n)) if n else None
                srv.requests.append((self.command, self.path, dict(self.headers), body))
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    return self._reply(401, {"kind": "Status", "code": 401, "reason": "Unauthorized"})
                resource = "pods" if "/pods/" in self.path else "events"
                if resource in srv.forbid:
                    return self._reply(403, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                             "reason": "Forbidden", "code": 403, "message":
                                             f'{resource} is forbidden: User "system:serviceaccount:{NS}:default" '
                                             f'cannot {"patch" if resource == "pods" else "create"} resource'})
                if self.command == "PATCH" and self.path == f"/api/v1/namespaces/{NS}/pods/{POD}":
                    if self.headers.get("Content-Type") != "application/merge-patch+json":
                        srv.errors.append(f"patch content type {self.headers.get('Content-Type')}")
                        return self._reply(415, {"kind": "Status", "code": 415})
                    srv.pod = _merge(srv.pod, body)
                    meta = _validator("core-v1.json", "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta")
                    srv.errors += _errors(meta, srv.pod["metadata"], "Pod.metadata")
                    return self._reply(200, srv.pod)
                if self.command == "POST" and self.path == f"/api/v1/namespaces/{NS}/events":
                    srv.errors += _errors(_validator("core-v1.json", "io.k8s.api.core.v1.Event"), body, "Event")
                    if self.headers.get("Content-Type") != "application/json":
                        srv.errors.append(f"event content type {self.headers.get('Content-Type')}")
                    srv.events.append(body)
                    return self._reply(201, body)
                srv.errors.append(f"unexpected {self.command} {self.path}")
                return self._reply(404, {"kind": "Status", "code": 404})

            do_PATCH = do_POST = do_GET = _handle

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.ca, key)
        self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()

    def pod_env(self, sa_dir, ca=None) -> dict:
        """The environment of a pod whose service account directory is `sa_dir` (written here)."""
        sa_dir.mkdir(parents=True, exist_ok=True)
        (sa_dir / "token").write_text(self.TOKEN + "\n")
        (sa_dir / "namespace").write_text(self.namespace)
        (sa_dir / "ca.crt").write_bytes((ca or self.ca).read_bytes())
        return {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(self.port),
                "DTORCH_K8S_SA_DIR": str(sa_dir), "POD_NAME": self.pod_name}

    def count(self, method):
        return sum(r[0] == method for r in self.requests)


@pytest.fixture
def k8s_cert():
    """make_cert(dir, name) -> (key, certificate) of a self-signed certificate for 127.0.0.1."""
    return make_cert


@pytest.fixture
def k8s_api(tmp_path):
    """start(pod, namespace, forbid=()) -> a running FakeAPIServer, closed after the test."""
    servers = []

    def start(pod, namespace, forbid=()):
        s = FakeAPIServer(tmp_path, pod, namespace, forbid)
        servers.append(s)
        return s
    yield start
    for s in servers:
        s.close()
