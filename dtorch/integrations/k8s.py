"""Kubernetes: a Kubeflow Trainer v2 TrainJob, a JobSet and a Volcano Job from a `Request`.

Every pod runs the same command, `dtorch run ... -m dtorch.train.job ...`, one pod per node:
`dtorch run` reads nodes, this pod's node rank and the rendezvous from the PET_* variables
(`dtorch.integrations.env`), so there is no per-pod flag:
- TrainJob: Kubeflow's torch runtime injects PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK,
  PET_MASTER_ADDR, PET_MASTER_PORT;
- JobSet: the manifest sets them (node rank from the Indexed Job's completion index, master
  address from JobSet's DNS name of pod 0, `<jobset>-node-0-0.<jobset>`);
- Volcano: the manifest sets them too (master `<job>-node-0.<job>` from the svc plugin), the env
  plugin's VC_TASK_INDEX is the node rank; `minAvailable` = nodes for gang scheduling.

Preemption: Kubernetes sends SIGTERM to the container's first process (the agent), which stops
the workers with SIGTERM; they checkpoint (terminationGracePeriodSeconds = grace) and exit; the
restart policies (JobSet failurePolicy, Volcano policies) bring the job back and it resumes.
Kueue: `--queue` sets the `kueue.x-k8s.io/queue-name` label, `--topology LEVEL` the pod-set
topology annotation (preferred, or required with `required:LEVEL`).
"""

from __future__ import annotations

import re
import shlex
from typing import Any

import yaml

from dtorch.errors import ConfigError, choices
from dtorch.integrations.request import Request
from dtorch.integrations.status import TERMINATION_LOG

KINDS = ("trainjob", "jobset", "vcjob")
MASTER_PORT = 29400
CKPT_MOUNT = "/ckpt"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# Node labels GPU feature discovery puts on nodes, and the extended resource each device uses.
GPU_PRODUCT = {
    "a100-80gb": ("nvidia.com/gpu.product", "NVIDIA-A100-SXM4-80GB", "nvidia.com/gpu"),
    "h100-sxm": ("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu"),
    "h100-96gb": ("nvidia.com/gpu.product", "NVIDIA-H100-96GB-HBM3", "nvidia.com/gpu"),
    "h200": ("nvidia.com/gpu.product", "NVIDIA-H200", "nvidia.com/gpu"),
    "b200": ("nvidia.com/gpu.product", "NVIDIA-B200", "nvidia.com/gpu"),
    "mi300x": ("amd.com/gpu.product-name", "AMD_Instinct_MI300X", "amd.com/gpu"),
}


_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")
# distribution/reference's grammar: [host[:port]/]path[:tag][@digest]
_IMAGE = re.compile(
    r"(?:(?P<domain>(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])(?:\.(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*"
    r"[a-zA-Z0-9]))*(?::[0-9]+)?|\[[0-9a-fA-F:]+\](?::[0-9]+)?)/)?"
    r"(?P<path>[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*)"
    r"(?::(?P<tag>[\w][\w.-]{0,127}))?"
    r"(?:@(?P<digest>[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}))?")


def check_dns_label(field: str, value: str, max_len: int = 63) -> None:
    """A DNS-1123 label (lower-case letters, digits and '-', starting and ending alphanumeric, at
    most `max_len` characters): what Kubernetes requires of namespaces and of names that become
    host names. ConfigError naming the value otherwise."""
    if not _DNS_LABEL.fullmatch(value) or len(value) > max_len:
        raise ConfigError(field, value, f"use a DNS-1123 label: lower-case letters, digits and '-', starting and "
                          f"ending with a letter or digit, at most {max_len} characters")


def check_dns_subdomain(field: str, value: str) -> None:
    """A DNS-1123 subdomain (labels joined by '.', at most 253 characters): object names such as
    a PersistentVolumeClaim or a ClusterTrainingRuntime."""
    if len(value) > 253 or not all(_DNS_LABEL.fullmatch(part) for part in value.split(".")):
        raise ConfigError(field, value, "use a DNS-1123 subdomain: lower-case letters, digits, '-' and '.', "
                          "each part starting and ending with a letter or digit, at most 253 characters")


def check_image(value: str) -> None:
    """A container image reference ([registry[:port]/]repository[:tag][@sha256:digest], repository
    lower-case), as the container runtime parses it."""
    m = _IMAGE.fullmatch(value)
    if m is None or len(m.group("domain") or "") + 1 + len(m.group("path")) > 255:
        raise ConfigError("image", value, "use an image reference like registry.example.com:5000/team/dtorch:1.2 "
                          "(repository in lower case, optional :tag and @sha256:digest)")


def check_names(*, name: str, namespace: str, pvc: str, queue: str | None = None, runtime: str | None = None,
                image: str | None = None, nodes: int = 1) -> None:
    """Every name `manifests` writes, checked against its Kubernetes format before anything is
    planned; ConfigError naming the first bad value. The job name becomes host names
    (`<name>-node-0-<index>` under JobSet, `<name>-node-<index>` under Volcano), which must stay
    one DNS label, and the service account `<name>-status`."""
    check_dns_label("name", name, max_len=63 - len(f"-node-0-{max(0, nodes - 1)}"))
    check_dns_label("namespace", namespace)
    check_dns_subdomain("pvc", pvc)
    if runtime is not None:
        check_dns_subdomain("runtime", runtime)
    if queue and (not _LABEL_VALUE.fullmatch(queue) or len(queue) > 63):
        raise ConfigError("queue", queue, "use a label value: letters, digits, '-', '_' and '.', starting and ending "
                          "with a letter or digit, at most 63 characters")
    if image is not None:
        check_image(image)


def pod_command(req: Request) -> list[str]:
    """The container command: the agent per pod, workers per device, nodes from the environment."""
    return ["dtorch", "run", "--shutdown-timeout", str(max(5, req.grace_s - 5)),
            "--run-dir", f"{req.checkpoint_dir}/agent", "-m", "dtorch.train.job", *req.train_args]


def pet_env(req: Request, master: str, node_rank: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The variables Kubeflow's torch runtime injects, for manifests that must set them."""
    env: list[dict[str, Any]] = [
        {"name": "PET_NNODES", "value": str(req.nodes)},
        {"name": "PET_NPROC_PER_NODE", "value": str(max(1, req.tasks_per_node))},
        {"name": "PET_MASTER_ADDR", "value": master},
        {"name": "PET_MASTER_PORT", "value": str(MASTER_PORT)},
    ]
    if node_rank is not None:
        env.insert(2, {"name": "PET_NODE_RANK", "valueFrom": node_rank})
    return env


# The pod's identity from the downward API: the job annotates its own pod and posts events about it
# (dtorch.integrations.k8s_api), where its service account is permitted.
DOWNWARD_ENV = [{"name": n, "valueFrom": {"fieldRef": {"fieldPath": f}}}
                for n, f in (("POD_NAME", "metadata.name"), ("POD_NAMESPACE", "metadata.namespace"),
                             ("POD_UID", "metadata.uid"), ("NODE_NAME", "spec.nodeName"))]


def status_account(req: Request) -> str:
    return f"{req.name}-status"


def rbac(req: Request, namespace: str) -> list[dict[str, Any]]:
    """A ServiceAccount the pods run as, a Role that permits what the job reports (get and patch
    pods: its annotations; create events) and the RoleBinding between them (`--rbac`)."""
    sa = status_account(req)
    labels = {"app.kubernetes.io/name": "dtorch", "app.kubernetes.io/instance": req.name}
    meta = {"name": sa, "namespace": namespace, "labels": labels}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": dict(meta)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": dict(meta),
         "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "patch"]},
                   {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": dict(meta),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": sa},
         "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": namespace}]},
    ]


def _resources(req: Request) -> dict[str, Any]:
    cpu = str(req.cpus_per_task * max(1, req.tasks_per_node))
    # a memory-backed emptyDir (/dev/shm) counts against the container's memory limit
    mem = f"{max(1, (req.mem_per_node_bytes + shm_bytes(req)) // 2**20)}Mi"
    res: dict[str, Any] = {"requests": {"cpu": cpu, "memory": mem}, "limits": {"memory": mem}}
    if req.gpus_per_node:
        _, _, resource = GPU_PRODUCT.get(req.device, ("", "", "nvidia.com/gpu"))
        res["requests"][resource] = str(req.gpus_per_node)
        res["limits"][resource] = str(req.gpus_per_node)
    return res


def _node_selector(req: Request) -> dict[str, str]:
    if not req.gpus_per_node or req.device not in GPU_PRODUCT:
        return {}
    label, value, _ = GPU_PRODUCT[req.device]
    return {label: value}


def _topology(topology: str | None) -> dict[str, str]:
    if not topology:
        return {}
    required, _, level = topology.partition(":") if topology.startswith("required:") else ("", "", topology)
    if not level:
        raise ConfigError("topology", topology, "give a node label, e.g. cloud.google.com/gce-topology-block")
    key = "kueue.x-k8s.io/podset-required-topology" if required else "kueue.x-k8s.io/podset-preferred-topology"
    return {key: level}


SHM_BASE_BYTES = 2 * 2**30
"""/dev/shm besides the snapshots: NCCL's shared-memory transport and data-loader workers."""


def shm_bytes(req: Request) -> int:
    """The pod's /dev/shm: DTorch's in-memory snapshots live there (each rank's parameters and
    optimizer state, as the plan predicts them; twice on more than one node, where a node also
    holds its peer node's replica) plus SHM_BASE_BYTES. A container runtime's default is 64 MiB."""
    per_rank = 0
    if req.estimate is not None:
        br = req.estimate.memory_breakdown
        per_rank = int(br.get("params", 0)) + int(br.get("optimizer", 0))
    copies = 2 if req.nodes > 1 else 1
    return SHM_BASE_BYTES + copies * max(1, req.tasks_per_node) * per_rank


def _volumes(req: Request, pvc: str) -> tuple[list[dict], list[dict]]:
    shm = {"medium": "Memory", "sizeLimit": f"{-(-shm_bytes(req) // 2**20)}Mi"}
    return ([{"name": "ckpt", "persistentVolumeClaim": {"claimName": pvc}}, {"name": "dshm", "emptyDir": shm}],
            [{"name": "ckpt", "mountPath": CKPT_MOUNT}, {"name": "dshm", "mountPath": "/dev/shm"}])


def _tolerations(req: Request) -> list[dict[str, str]]:
    """GPU nodes are commonly tainted with their device resource (NoSchedule): tolerate it."""
    if not req.gpus_per_node:
        return []
    _, _, resource = GPU_PRODUCT.get(req.device, ("", "", "nvidia.com/gpu"))
    return [{"key": resource, "operator": "Exists", "effect": "NoSchedule"}]


def _pod_placement(req: Request, pod: dict[str, Any]) -> dict[str, Any]:
    """The pod spec with the GPU node selector and tolerations where the job has GPUs."""
    if _node_selector(req):
        pod["nodeSelector"] = _node_selector(req)
    if _tolerations(req):
        pod["tolerations"] = _tolerations(req)
    return pod


def _container(req: Request, image: str, env: list[dict], mounts: list[dict]) -> dict[str, Any]:
    return {"name": "node", "image": image, "command": pod_command(req), "env": env,
            "resources": _resources(req), "volumeMounts": mounts,
            "ports": [{"name": "rendezvous", "containerPort": MASTER_PORT, "protocol": "TCP"}],
            "terminationMessagePath": TERMINATION_LOG, "terminationMessagePolicy": "FallbackToLogsOnError"}


def _meta(req: Request, namespace: str, queue: str | None, kind: str) -> dict[str, Any]:
    labels = {"app.kubernetes.io/name": "dtorch", "app.kubernetes.io/instance": req.name}
    if queue and kind != "vcjob":
        labels[QUEUE_LABEL] = queue
    return {"name": req.name, "namespace": namespace, "labels": labels,
            "annotations": {"dtorch.io/plan": req.plan.describe() if req.plan else "auto",
                            "dtorch.io/command": shlex.join(pod_command(req))}}


def trainjob(req: Request, *, image: str, namespace: str, pvc: str, queue: str | None, topology: str | None,
             runtime: str) -> dict[str, Any]:
    volumes, mounts = _volumes(req, pvc)
    pod_spec: dict[str, Any] = _pod_placement(req, {
        "terminationGracePeriodSeconds": req.grace_s, "volumes": volumes,
        "containers": [{"name": "node", "volumeMounts": mounts, "env": DOWNWARD_ENV}]})
    pod_tmpl: dict[str, Any] = {"spec": pod_spec}
    if topology:
        pod_tmpl["metadata"] = {"annotations": _topology(topology)}
    trainer: dict[str, Any] = {"image": image, "command": pod_command(req), "numNodes": req.nodes,
                               "numProcPerNode": max(1, req.tasks_per_node), "resourcesPerNode": _resources(req)}
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
            "metadata": _meta(req, namespace, queue, "trainjob"),
            "spec": {"runtimeRef": {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                                    "name": runtime},
                     "trainer": trainer,
                     "runtimePatches": [{"manager": "dtorch.io/submit", "trainingRuntimeSpec": {"template": {"spec": {
                         "replicatedJobs": [{"name": "node", "template": {"spec": {"template": pod_tmpl}}}]}}}}]}}


def jobset(req: Request, *, image: str, namespace: str, pvc: str, queue: str | None,
           topology: str | None) -> dict[str, Any]:
    volumes, mounts = _volumes(req, pvc)
    rank = {"fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}
    env = pet_env(req, f"{req.name}-node-0-0.{req.name}", rank) + DOWNWARD_ENV
    pod: dict[str, Any] = _pod_placement(req, {"restartPolicy": "Never", "terminationGracePeriodSeconds": req.grace_s,
                                               "volumes": volumes, "containers": [_container(req, image, env, mounts)]})
    tmpl: dict[str, Any] = {"spec": pod}
    if topology:
        tmpl["metadata"] = {"annotations": _topology(topology)}
    job = {"parallelism": req.nodes, "completions": req.nodes, "completionMode": "Indexed", "backoffLimit": 0,
           # a pod stopped by a preemption (exit 75 from the workers, 143 from the agent) fails the Job
           # with reason PodFailurePolicy; the JobSet then restarts without using up maxRestarts
           "podFailurePolicy": {"rules": [{"action": "FailJob", "onExitCodes": {"operator": "In", "values": [75, 143]}}]},
           "template": tmpl}
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
            "metadata": _meta(req, namespace, queue, "jobset"),
            "spec": {"network": {"enableDNSHostnames": True},
                     "failurePolicy": {"maxRestarts": 10, "rules": [
                         {"name": "preempted", "action": "RestartJobSetAndIgnoreMaxRestarts",
                          "onJobFailureReasons": ["PodFailurePolicy"]}]},
                     "replicatedJobs": [{"name": "node", "replicas": 1, "template": {"spec": job}}]}}


def vcjob(req: Request, *, image: str, namespace: str, pvc: str, queue: str | None,
          topology: str | None) -> dict[str, Any]:
    volumes, mounts = _volumes(req, pvc)
    env = pet_env(req, f"{req.name}-node-0.{req.name}", None) + DOWNWARD_ENV  # node rank: VC_TASK_INDEX
    pod: dict[str, Any] = _pod_placement(req, {"restartPolicy": "Never", "terminationGracePeriodSeconds": req.grace_s,
                                               "volumes": volumes, "containers": [_container(req, image, env, mounts)]})
    spec: dict[str, Any] = {
        "schedulerName": "volcano", "minAvailable": req.nodes, "queue": queue or "default", "maxRetry": 10,
        "plugins": {"svc": [], "env": []},
        "policies": [{"event": "PodEvicted", "action": "RestartJob"},
                     {"exitCode": 75, "action": "RestartJob"}, {"exitCode": 143, "action": "RestartJob"}],
        "tasks": [{"name": "node", "replicas": req.nodes, "template": {"spec": pod}}]}
    if topology:
        required = topology.startswith("required:")
        spec["networkTopology"] = {"mode": "hard" if required else "soft", "highestTierAllowed": 1}
    return {"apiVersion": "batch.volcano.sh/v1alpha1", "kind": "Job",
            "metadata": _meta(req, namespace, queue, "vcjob"), "spec": spec}


def manifests(req: Request, *, kinds: list[str], image: str, namespace: str, pvc: str, queue: str | None = None,
              topology: str | None = None, runtime: str = "torch-distributed",
              with_rbac: bool = False) -> list[dict[str, Any]]:
    """The requested manifests, each validated against its schema (ConfigError if not); with
    `with_rbac`, first a ServiceAccount, Role and RoleBinding that permit the job's status
    annotations and events, and the pods run as that account."""
    from dtorch.integrations.validate import validate

    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise ConfigError("kind", ",".join(kinds), choices(KINDS))
    check_names(name=req.name, namespace=namespace, pvc=pvc, queue=queue, runtime=runtime, image=image, nodes=req.nodes)
    if not req.checkpoint_dir.startswith(CKPT_MOUNT + "/") and req.checkpoint_dir != CKPT_MOUNT:
        raise ConfigError("checkpoint-dir", req.checkpoint_dir, f"put it under the volume's mount {CKPT_MOUNT}/")
    try:
        import jsonschema  # noqa: F401
    except ImportError:
        import sys

        print("dtorch submit: jsonschema is not installed (pip install 'dtorch-os[k8s]'): manifests not validated",
              file=sys.stderr)
        validate = None  # type: ignore[assignment]
    docs = []
    for k in kinds:
        if k == "trainjob":
            d = trainjob(req, image=image, namespace=namespace, pvc=pvc, queue=queue, topology=topology,
                         runtime=runtime)
        elif k == "jobset":
            d = jobset(req, image=image, namespace=namespace, pvc=pvc, queue=queue, topology=topology)
        else:
            d = vcjob(req, image=image, namespace=namespace, pvc=pvc, queue=queue, topology=topology)
        if with_rbac:
            for spec in _pod_specs(d):
                spec["serviceAccountName"] = status_account(req)
        errors = validate(d) if validate is not None else []
        if errors:
            raise AssertionError(f"{k} manifest does not validate: {errors[0]}")  # our bug, not the user's
        docs.append(d)
    extra = rbac(req, namespace) if with_rbac else []
    for d in extra:
        errors = validate(d) if validate is not None else []
        if errors:
            raise AssertionError(f"{d['kind']} does not validate: {errors[0]}")  # our bug, not the user's
    return extra + docs


def _pod_specs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod specs a manifest carries (TrainJob: the one in its runtime patch)."""
    spec = doc["spec"]
    if doc["kind"] == "TrainJob":
        return [rj["template"]["spec"]["template"]["spec"] for p in spec["runtimePatches"]
                for rj in p["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]]
    if doc["kind"] == "JobSet":
        return [rj["template"]["spec"]["template"]["spec"] for rj in spec["replicatedJobs"]]
    return [task["template"]["spec"] for task in spec["tasks"]]


def to_yaml(docs: list[dict[str, Any]]) -> str:
    return "---\n".join(yaml.safe_dump(d, sort_keys=False, default_flow_style=False) for d in docs)
