"""Kubernetes manifests: valid against the kept CRD and core/v1 schemas, and the pod command, run
here with the environment Kubeflow's torch runtime injects (2 nodes x 1 process), trains."""

import copy
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dtorch.integrations import status
from dtorch.integrations.validate import SCHEMAS, validate

MODEL = "gpt:layers=2,hidden=32,heads=2,vocab=256,seq=32"


def _submit(*extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dtorch.cli", "submit", "k8s", *extra],
                          capture_output=True, text=True, timeout=120)


def _docs(*extra: str) -> list[dict]:
    out = _submit(*extra, "--dry-run", "--quiet")
    assert out.returncode == 0, out.stderr
    return list(yaml.safe_load_all(out.stdout))


def test_schemas_record_version_and_source():
    src = json.loads((SCHEMAS / "sources.json").read_text())
    for e in src["schemas"]:
        assert (SCHEMAS / e["file"]).exists()
        assert e["repo"] and e["ref"] and len(e["commit"]) == 40 and e["path"]


def test_manifests_validate_and_carry_queue_topology_gang_and_gpu_selector():
    docs = _docs("--model", "llama3-8b", "--device-type", "h100", "--nodes", "4", "--steps", "100",
                 "--pvc", "ckpt", "--queue", "team-a", "--topology", "required:cloud.google.com/gce-topology-block")
    kinds = [d["kind"] for d in docs]
    assert kinds == ["TrainJob", "JobSet", "Job"]
    for d in docs:
        assert validate(d) == [], d["kind"]
    tj, js, vc = docs
    assert tj["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert tj["spec"]["trainer"]["numNodes"] == 4 and tj["spec"]["trainer"]["numProcPerNode"] == 8
    assert tj["spec"]["trainer"]["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == "8"
    pod = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    assert pod["metadata"]["annotations"] == {"kueue.x-k8s.io/podset-required-topology":
                                              "cloud.google.com/gce-topology-block"}
    assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    # GPU nodes' taint tolerated; /dev/shm a memory volume sized for the snapshots of 8 ranks and
    # their peer node's replica, counted in the memory limit
    for spec in (pod["spec"], vc["spec"]["tasks"][0]["template"]["spec"],
                 tj["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
                 ["template"]["spec"]["template"]["spec"]):
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        shm = next(v for v in spec["volumes"] if v["name"] == "dshm")["emptyDir"]
        assert shm["medium"] == "Memory" and {"name": "dshm", "mountPath": "/dev/shm"} in spec["containers"][0]["volumeMounts"]
    size = int(shm["sizeLimit"].removesuffix("Mi")) * 2**20
    assert size > 4 * 2**30  # the 2 GiB base and 8 ranks' share of an 8B model's states, twice
    limit = int(tj["spec"]["trainer"]["resourcesPerNode"]["limits"]["memory"].removesuffix("Mi")) * 2**20
    assert limit >= size
    assert js["spec"]["replicatedJobs"][0]["template"]["spec"]["parallelism"] == 4
    assert vc["spec"]["minAvailable"] == 4 and vc["spec"]["tasks"][0]["replicas"] == 4
    assert vc["spec"]["networkTopology"]["mode"] == "hard"
    # the pod command names no node count, rank or endpoint: they come from the environment
    cmd = tj["spec"]["trainer"]["command"]
    assert cmd[:2] == ["dtorch", "run"] and not {"--nnodes", "--rdzv-endpoint", "--node-rank"} & set(cmd)


def test_validation_rejects_unknown_fields_wrong_types_and_enums():
    tj, js, vc = _docs("--model", MODEL, "--device-type", "cpu", "--nodes", "2", "--steps", "5",
                       "--global-batch", "4", "--seq-len", "32", "--pvc", "ckpt")
    bad = copy.deepcopy(js)
    bad["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "x"
    errs = validate(bad)
    assert any("imagePullPolicyy" in e for e in errs) and any("core/v1" in e for e in errs)
    bad = copy.deepcopy(vc)
    bad["spec"]["minAvailable"] = "2"
    assert any("minAvailable" in e for e in validate(bad))
    bad = copy.deepcopy(tj)
    bad["spec"]["trainer"]["numNodess"] = 2
    assert validate(bad)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.drill
def test_pod_command_with_kubeflow_env_trains_two_ranks_and_survives_sigterm(tmp_path, k8s_api):
    """The TrainJob's command, with Kubeflow's env for 2 nodes x 1 process: a 2-rank job. SIGTERM to
    each pod's first process (what the kubelet sends on preemption) checkpoints within the grace
    period; the restarted pods resume from that step and finish. Each pod has the downward-API
    identity and a service account; the pod of rank 0 puts its state on its annotations and events
    (a stand-in API server on 127.0.0.1, see conftest)."""
    api = k8s_api("dtorch-gpt-node-0-0-x1", "default")
    steps = 20  # SIGTERM after step 3; the resumed pods finish the rest
    (tj,) = _docs("--model", MODEL, "--device-type", "cpu", "--nodes", "2", "--steps", str(steps),
                  "--global-batch", "4", "--seq-len", "32", "--pvc", "ckpt", "--kind", "trainjob", "--grace", "30",
                  "--train-arg=--sample-tokens=0", "--train-arg=--no-progress", "--train-arg=--checkpoint-every=100")
    cmd = tj["spec"]["trainer"]["command"]
    # the checkpoint volume, mounted at /ckpt in the pod, is tmp_path here
    cmd = [c.replace("/ckpt", str(tmp_path)) for c in cmd]
    cmd[0] = str(Path(sys.executable).with_name("dtorch"))
    run = tmp_path / "dtorch-gpt"

    def pods():
        port = _free_port()
        procs = []
        for node_rank in range(2):
            # exactly what Kubeflow Trainer's torch plugin sets for numNodes=2, numProcPerNode=1
            env = {k: v for k, v in os.environ.items()
                   if not k.startswith(("PET_", "SLURM_", "RANK", "WORLD_SIZE", "MASTER_", "LOCAL_RANK"))}
            env.update({"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": str(node_rank),
                        "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port)})
            env.update(api.pod_env(tmp_path / "sa"))  # what the kubelet mounts and the downward API sets
            env.update({"POD_NAME": f"dtorch-gpt-node-0-{node_rank}-x1", "POD_NAMESPACE": "default"})
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        return procs

    first = pods()
    t0 = time.time()
    while time.time() - t0 < 240:
        # metrics.jsonl gets a line per step (the status file at most one a second)
        m = run / "metrics.jsonl"
        done = m.exists() and sum('"loss"' in x for x in m.read_text().splitlines()) >= 3
        if done or any(p.poll() is not None for p in first):
            break
        time.sleep(0.05)
    for p in first:
        p.send_signal(signal.SIGTERM)
    outs = [p.communicate(timeout=120)[0] for p in first]
    assert [p.returncode for p in first] == [143, 143], "\n".join(o[-3000:] for o in outs)
    doc = status.read(run)
    assert doc["state"] == "preempted" and doc["signal"] == "SIGTERM", doc
    stop = doc["checkpoint_step"]
    assert 3 <= stop < steps and (run / f"step-{stop:08d}").is_dir()
    ann = api.pod["metadata"]["annotations"]
    assert ann["dtorch.io/state"] == "preempted" and ann["dtorch.io/checkpoint-step"] == str(stop), ann
    assert api.events[-1]["reason"] == "Preempted" and api.events[-1]["type"] == "Warning"

    again = pods()
    outs = [p.communicate(timeout=300)[0] for p in again]
    assert [p.returncode for p in again] == [0, 0], "\n".join(o[-3000:] for o in outs)
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    logged = [m for m in metrics if "loss" in m and "event" not in m]
    assert sorted({m["step"] for m in logged}) == list(range(1, steps + 1))
    assert {m["world_size"] for m in logged} == {2}
    hist = [h["state"] for h in status.history(run)]
    assert hist.index("preempted") < hist.index("recovering") < hist.index("finished")
    # only rank 0's pod was written to (any other path would be in errors), every body valid
    assert api.errors == [] and api.pod["metadata"]["annotations"]["dtorch.io/state"] == "finished"
    reasons = [e["reason"] for e in api.events]
    assert reasons.index("Preempted") < reasons.index("Recovering") < reasons.index("Finished"), reasons
