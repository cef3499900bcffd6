"""The job's status on its pod: annotations (JSON merge patch) and core/v1 Events, sent to a real
HTTPS server on 127.0.0.1 that stands in for the Kubernetes API server (none can run here). The
server checks what an API server would: method, path, bearer token, content type, the body
against the kept core/v1 schemas (the patched pod's ObjectMeta; the Event), and answers 403 where
told to. About 2 s in all."""

import re
import subprocess
import time

import pytest
import yaml

from dtorch.integrations import k8s_api, status
from dtorch.integrations.validate import _errors, _validator, validate

TOKEN = "test-token-0123456789"  # the fake API server accepts this one (conftest)
NS = "team-a"
POD = "dtorch-gpt-node-0-0-abcde"
MODEL = "gpt:layers=2,hidden=32,heads=2,vocab=256,seq=32"


@pytest.fixture
def api(k8s_api):
    return lambda forbid=(): k8s_api(POD, NS, forbid)


def _pod_env(monkeypatch, tmp_path, srv, ca=None, interval="3600"):
    env = srv.pod_env(tmp_path / "sa", ca)
    env.update({"POD_UID": "0b6c3f4e-1111-2222-3333-444455556666", "NODE_NAME": "gpu-node-7",
                "DTORCH_K8S_STATUS_INTERVAL": interval})
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("POD_NAMESPACE", raising=False)  # from the service account's namespace file
    monkeypatch.delenv("DTORCH_K8S_API", raising=False)
    monkeypatch.delenv("DTORCH_K8S_STATUS", raising=False)


def _run_job(tmp_path, steps=6):
    r = status.Reporter(tmp_path / "run", rank=0, file_interval=0.0)
    assert r.pod is not None
    r.report("planning", total_steps=steps)
    for s in range(1, steps + 1):
        r.report("running", step=s, total_steps=steps, tokens_per_s=5100.0)
    r.report("checkpointed", step=steps, checkpoint_step=steps, total_steps=steps)
    r.report("failed", step=steps, total_steps=steps, why="RuntimeError: NCCL timeout")
    return r


def test_annotations_and_events_over_https_validate_and_are_rate_limited(monkeypatch, tmp_path, api):
    srv = api()
    _pod_env(monkeypatch, tmp_path, srv)
    r = _run_job(tmp_path)
    assert r.pod.flush(5)
    assert srv.errors == []
    for method, path, headers, _ in srv.requests:
        assert headers["Authorization"] == f"Bearer {TOKEN}"
        assert (method, path) in {("PATCH", f"/api/v1/namespaces/{NS}/pods/{POD}"),
                                  ("POST", f"/api/v1/namespaces/{NS}/events")}
    # 4 states: a patch and an event each; the 5 'running' repeats within the interval send nothing
    assert srv.count("PATCH") == 4 and srv.count("POST") == 4
    ann = srv.pod["metadata"]["annotations"]
    assert ann["dtorch.io/state"] == "failed" and ann["dtorch.io/why"] == "RuntimeError: NCCL timeout"
    assert ann["dtorch.io/step"] == "6" and ann["dtorch.io/status"].startswith("dtorch: failed, step 6/6")
    assert "dtorch.io/tokens-per-s" not in ann and "dtorch.io/checkpoint-step" not in ann  # removed by null
    first_running = next(b for m, p, h, b in srv.requests if m == "PATCH"
                         and b["metadata"]["annotations"]["dtorch.io/state"] == "running")
    assert first_running["metadata"]["annotations"]["dtorch.io/step"] == "1"
    reasons = [(e["reason"], e["type"]) for e in srv.events]
    assert reasons == [("Planning", "Normal"), ("Running", "Normal"), ("Checkpointed", "Normal"),
                       ("Failed", "Warning")]
    ev = srv.events[-1]
    assert ev["involvedObject"] == {"apiVersion": "v1", "kind": "Pod", "name": POD, "namespace": NS,
                                    "uid": "0b6c3f4e-1111-2222-3333-444455556666"}
    assert ev["source"] == {"component": "dtorch", "host": "gpu-node-7"}
    assert len({e["metadata"]["name"] for e in srv.events}) == 4


def test_rate_limit_sends_at_most_once_per_interval(monkeypatch, tmp_path, api):
    srv = api()
    _pod_env(monkeypatch, tmp_path, srv, interval="0.25")
    r = status.Reporter(tmp_path / "run", rank=0, file_interval=0.0)
    t0 = time.monotonic()
    for s in range(40):  # 40 steps over ~0.8 s
        r.report("running", step=s)
        time.sleep(0.02)
    elapsed = time.monotonic() - t0
    assert r.pod.flush(5) and srv.errors == []
    patches = srv.count("PATCH")
    assert 2 <= patches <= 1 + elapsed / 0.25 + 1, (patches, elapsed)
    assert srv.count("POST") == 1  # one change of state, one event


def test_forbidden_switches_a_channel_off_once_and_never_fails_the_job(monkeypatch, tmp_path, api, capfd):
    srv = api(forbid={"events"})
    _pod_env(monkeypatch, tmp_path, srv)
    r = _run_job(tmp_path)
    assert r.pod.flush(5)
    assert srv.count("POST") == 1  # the first 403 switched events off
    assert srv.count("PATCH") == 4 and srv.errors == []  # annotations are permitted and go on
    err = capfd.readouterr().err
    lines = [x for x in err.splitlines() if "events off" in x]
    assert len(lines) == 1 and "403 forbidden" in lines[0] and "create events" in lines[0] and "--rbac" in lines[0]
    assert status.read(tmp_path / "run")["state"] == "failed"  # the status file is unaffected


def test_wrong_ca_or_no_server_logs_once_and_does_not_block(monkeypatch, tmp_path, api, capfd, k8s_cert):
    srv = api()
    _, other = k8s_cert(tmp_path, "other")
    _pod_env(monkeypatch, tmp_path, srv, ca=other)  # the server's certificate is not signed by this CA
    t0 = time.monotonic()
    r = _run_job(tmp_path)
    assert time.monotonic() - t0 < 10
    assert r.pod.flush(10)
    assert srv.requests == []  # TLS verification failed before any request
    err = capfd.readouterr().err
    assert err.count("annotations: PATCH") == 1 and "CERTIFICATE_VERIFY_FAILED" in err
    # nothing listening: the reports return at once (the requests run in the background)
    srv.close()
    monkeypatch.setenv("DTORCH_K8S_API", f"http://127.0.0.1:{srv.port}")
    r = status.Reporter(tmp_path / "run2", rank=0, file_interval=0.0)
    t0 = time.monotonic()
    for s in range(20):
        r.report("running", step=s)
    assert time.monotonic() - t0 < 1.0
    assert r.pod.flush(10)


def test_outside_a_pod_or_switched_off_nothing_is_sent(monkeypatch, tmp_path):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("DTORCH_K8S_API", raising=False)
    assert k8s_api.PodStatus.from_env() is None
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443", "POD_NAME": POD,
           "DTORCH_K8S_SA_DIR": str(tmp_path)}
    (tmp_path / "token").write_text(TOKEN)
    assert k8s_api.PodStatus.from_env({**env, "DTORCH_K8S_STATUS": "off"}) is None
    p = k8s_api.PodStatus.from_env({**env, "DTORCH_K8S_STATUS": "annotations"})
    assert p is not None and p.enabled == {"annotations": True, "events": False}
    assert p.api == "https://10.0.0.1:443" and p.namespace == "default"
    assert k8s_api.PodStatus.from_env({k: v for k, v in env.items() if k != "POD_NAME"}) is None


def test_event_schema_rejects_what_the_api_server_would():
    good = k8s_api.event_body({"state": "running", "step": 3, "t": time.time()}, "dtorch: running, step 3",
                              pod=POD, namespace=NS, uid=None, node=None)
    ev = _validator("core-v1.json", "io.k8s.api.core.v1.Event")
    assert _errors(ev, good, "Event") == []
    assert _errors(ev, {**good, "involvedObject": POD}, "Event")
    assert _errors(ev, {**good, "count": "1"}, "Event")
    assert _errors(ev, {**good, "reasonn": "x"}, "Event")
    assert _errors(ev, {k: v for k, v in good.items() if k != "involvedObject"}, "Event")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", good["lastTimestamp"])


def _docs(*extra):
    out = subprocess.run([__import__("sys").executable, "-m", "dtorch.cli", "submit", "k8s", "--model", MODEL,
                          "--device-type", "cpu", "--nodes", "2", "--steps", "5", "--global-batch", "4",
                          "--seq-len", "32", "--pvc", "ckpt", "--namespace", NS, "--dry-run", "--quiet", *extra],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return list(yaml.safe_load_all(out.stdout))


def test_manifests_inject_the_pod_identity_and_rbac_on_request():
    plain = _docs()
    assert [d["kind"] for d in plain] == ["TrainJob", "JobSet", "Job"]
    docs = _docs("--rbac")
    assert [d["kind"] for d in docs] == ["ServiceAccount", "Role", "RoleBinding", "TrainJob", "JobSet", "Job"]
    sa, role, binding, tj, js, vc = docs
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "patch"]},
                             {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": NS}]
    tj_pod = tj["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0][
        "template"]["spec"]["template"]["spec"]
    pods = [tj_pod, js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"],
            vc["spec"]["tasks"][0]["template"]["spec"]]
    for pod in pods:
        assert pod["serviceAccountName"] == sa["metadata"]["name"]
        env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in pod["containers"][0]["env"]}
        assert env["POD_NAME"] == "metadata.name" and env["POD_NAMESPACE"] == "metadata.namespace"
        assert env["POD_UID"] == "metadata.uid" and env["NODE_NAME"] == "spec.nodeName"
    for d in docs:
        assert validate(d) == [], d["kind"]
    bad = {**binding, "roleRef": {"kind": "Role", "name": "x"}}  # apiGroup is required
    assert any("apiGroup" in e for e in validate(bad))
    bad = {**role, "rules": [{"resources": ["pods"], "verbz": ["patch"]}]}
    assert any("verbz" in e for e in validate(bad)) and any("verbs" in e for e in validate(bad))
