"""Kubernetes manifests: valid against the kept CRD and core/v1 schemas, and the pod command, run
here with the environment Kubeflow's torch runtime injects (2 nodes x 1 process), trains."""

import copy
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

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
def test_pod_command_with_kubeflow_env_forms_a_two_rank_job(tmp_path):
    (tj,) = _docs("--model", MODEL, "--device-type", "cpu", "--nodes", "2", "--steps", "6", "--global-batch", "4",
                  "--seq-len", "32", "--pvc", "ckpt", "--kind", "trainjob", "--grace", "20",
                  "--train-arg=--sample-tokens=0", "--train-arg=--no-progress", "--train-arg=--checkpoint-every=3")
    cmd = tj["spec"]["trainer"]["command"]
    # the checkpoint volume, mounted at /ckpt in the pod, is tmp_path here
    cmd = [c.replace("/ckpt", str(tmp_path)) for c in cmd]
    cmd[0] = str(Path(sys.executable).with_name("dtorch"))
    port = _free_port()
    procs = []
    for node_rank in range(2):
        # exactly what Kubeflow Trainer's torch plugin sets for numNodes=2, numProcPerNode=1
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "SLURM_", "RANK", "WORLD_SIZE",
                                                                          "MASTER_", "LOCAL_RANK"))}
        env.update({"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": str(node_rank),
                    "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port)})
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    run = tmp_path / "dtorch-gpt"
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "loss" in m and "event" not in m]
    assert [m["step"] for m in steps] == list(range(1, 7)) and {m["world_size"] for m in steps} == {2}
    assert json.loads((run / "status.json").read_text())["state"] == "finished"
