"""Where this process runs: the allocation a scheduler gave it, read from the environment.

    alloc = detect()          # None outside any scheduler
    alloc.scheduler           # "slurm" | "kubeflow" | "volcano" | "skypilot" | "torchrun"
    alloc.nnodes, alloc.node_rank, alloc.master_addr, alloc.master_port, alloc.nproc_per_node

Read by `dtorch run` (nodes, rendezvous endpoint and id when no flag names them) and by the
trainer (a process started once per rank, e.g. `srun -n 8 python -m dtorch.train.job`, gets
RANK/WORLD_SIZE/MASTER_ADDR from the scheduler's variables). Standard library and the floor: the
trainer and the launcher import it, so it imports nothing of DTorch but `dtorch.env` (the process
environment: these variables are read from `dtorch.env.environ()`, exported with `dtorch.env.export`).

What each scheduler sets (and we read):
- Slurm: SLURM_JOB_ID, SLURM_JOB_NODELIST (compressed hostlist), SLURM_NNODES, SLURM_NODEID;
  inside an `srun` step also SLURM_STEP_ID, SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
  SLURM_STEP_TASKS_PER_NODE; GPUs as SLURM_GPUS_ON_NODE. The first node of the list hosts the
  rendezvous; its address is Slurm's NodeAddr for that node (`scontrol show node`), else its name.
- Kubeflow Trainer v2 / PyTorchJob: PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK,
  PET_MASTER_ADDR, PET_MASTER_PORT (torchrun reads the same variables as its flag defaults).
- Volcano: VC_TASK_INDEX (the pod's index in its task), with the PET_* variables set in the
  manifest (`dtorch submit k8s --kind vcjob` writes them).
- SkyPilot: SKYPILOT_NODE_RANK, SKYPILOT_NODE_IPS (one per line), SKYPILOT_NUM_NODES,
  SKYPILOT_NUM_GPUS_PER_NODE.
- torchrun / any launcher of one process per rank: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
  MASTER_PORT (nothing to configure: torch reads them itself).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field

from dtorch import env as _env

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class Allocation:
    """The machines a scheduler gave this job, and this process's place in them."""

    scheduler: str
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    job_id: str | None = None
    nproc_per_node: int | None = None
    """Processes per node the allocation implies (GPUs per node), None when it does not say."""
    nodes: list[str] = field(default_factory=list)
    """Node names (Slurm, SkyPilot); empty when the scheduler does not list them."""
    gpus_per_node: int | None = None
    # Set when the scheduler started this process as one rank (an srun task): the rank variables
    # torch expects are then derived from these.
    rank: int | None = None
    world_size: int | None = None
    local_rank: int | None = None
    local_world_size: int | None = None

    @property
    def rdzv_endpoint(self) -> str:
        return f"{self.master_addr}:{self.master_port}"

    def describe(self) -> str:
        where = f"{self.nnodes} node{'s' if self.nnodes != 1 else ''}"
        if self.nodes:
            where += f" ({', '.join(self.nodes[:4])}{', ...' if len(self.nodes) > 4 else ''})"
        job = f" job {self.job_id}" if self.job_id else ""
        return f"{self.scheduler}{job}: {where}, this is node {self.node_rank}, rendezvous at {self.rdzv_endpoint}"


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list -> names: ``gpu[01-03,07],login1`` -> gpu01 gpu02 gpu03 gpu07
    login1. Zero padding is kept; several bracket groups in one name expand as a product."""
    out: list[str] = []
    for part in _split_top(text):
        names = [""]
        for literal, rng in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", part):
            names = [n + literal for n in names]
            if rng:
                items = []
                for piece in rng.split(","):
                    lo, _, hi = piece.partition("-")
                    if hi:
                        width = len(lo)
                        items += [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
                    else:
                        items.append(lo)
                names = [n + i for n in names for i in items]
        out += [n for n in names if n]
    return out


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur:
        parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def tasks_per_node(text: str) -> list[int]:
    """SLURM_TASKS_PER_NODE ``2(x3),1`` -> [2, 2, 2, 1]."""
    out: list[int] = []
    for piece in filter(None, text.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", piece.strip())
        if m:
            out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def slurm_node_addr(node: str) -> str:
    """The address Slurm reaches `node` at (its NodeAddr), or the name when scontrol cannot say."""
    exe = shutil.which("scontrol")
    if exe:
        try:
            out = subprocess.run([exe, "show", "node", node], capture_output=True, text=True, timeout=10).stdout
            m = re.search(r"NodeAddr=(\S+)", out)
            if m:
                return m.group(1)
        except (OSError, subprocess.SubprocessError):
            pass
    return node


def _int(env: Mapping[str, str], *names: str) -> int | None:
    for n in names:
        v = env.get(n)
        if v:
            m = re.match(r"\d+", v)
            if m:
                return int(m.group(0))
    return None


def port_for_job(job_id: str | None) -> int:
    """A rendezvous port every node of the job derives alike: DTORCH_MASTER_PORT, else one
    spread by job id over 20000-29999 so that two jobs sharing a node rarely collide."""
    override = _env.current().master_port_override
    if override is not None:
        return override
    digits = re.sub(r"\D", "", job_id or "")
    return 20000 + int(digits) % 10000 if digits else DEFAULT_PORT


def _slurm(env: Mapping[str, str]) -> Allocation:
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    nodes = expand_hostlist(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "")
    nnodes = _int(env, "SLURM_JOB_NUM_NODES", "SLURM_NNODES") or max(1, len(nodes))
    gpus = _int(env, "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE")
    addr = env.get("MASTER_ADDR") or (slurm_node_addr(nodes[0]) if nodes else "127.0.0.1")
    port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else port_for_job(job)
    fields: dict = {}
    if env.get("SLURM_STEP_ID") is not None and env.get("SLURM_PROCID") is not None:
        per_node = tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "")
        node_id = _int(env, "SLURM_NODEID") or 0
        fields = dict(rank=_int(env, "SLURM_PROCID"), world_size=_int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"),
                      local_rank=_int(env, "SLURM_LOCALID"),
                      local_world_size=per_node[node_id] if node_id < len(per_node) else 1)
    return Allocation("slurm", nnodes, _int(env, "SLURM_NODEID") or 0, addr, port, job_id=job,
                      nproc_per_node=gpus or None, nodes=nodes, gpus_per_node=gpus, **fields)


def _pet(env: Mapping[str, str], scheduler: str) -> Allocation:
    node_rank = _int(env, "PET_NODE_RANK", "VC_TASK_INDEX", "JOB_COMPLETION_INDEX") or 0
    nproc = env.get("PET_NPROC_PER_NODE", "")
    return Allocation(scheduler, _int(env, "PET_NNODES") or 1, node_rank,
                      env.get("PET_MASTER_ADDR") or env.get("MASTER_ADDR") or "127.0.0.1",
                      _int(env, "PET_MASTER_PORT", "MASTER_PORT") or DEFAULT_PORT,
                      job_id=env.get("PET_RUN_ID") or env.get("JOBSET_NAME") or env.get("TRAINJOB_NAME"),
                      nproc_per_node=int(nproc) if nproc.isdigit() else None)


def _skypilot(env: Mapping[str, str]) -> Allocation:
    ips = [ip.strip() for ip in env.get("SKYPILOT_NODE_IPS", "").splitlines() if ip.strip()]
    gpus = _int(env, "SKYPILOT_NUM_GPUS_PER_NODE")
    job = env.get("SKYPILOT_TASK_ID")
    return Allocation("skypilot", _int(env, "SKYPILOT_NUM_NODES") or max(1, len(ips)),
                      _int(env, "SKYPILOT_NODE_RANK") or 0, ips[0] if ips else "127.0.0.1",
                      _int(env, "MASTER_PORT") or DEFAULT_PORT, job_id=job, nproc_per_node=gpus or None,
                      nodes=ips, gpus_per_node=gpus)


def slurm_job_id(env: Mapping[str, str] | None = None) -> str | None:
    """The Slurm job this process runs in (SLURM_JOB_ID), or None outside Slurm."""
    return (_env.environ() if env is None else env).get("SLURM_JOB_ID")


def detect(env: Mapping[str, str] | None = None) -> Allocation | None:
    """The allocation this process runs in, or None outside any scheduler. Precedence: Kubeflow /
    Volcano (PET_*) over SkyPilot over Slurm over plain torchrun variables, so a container started
    by an operator inside a Slurm-managed node reads the operator's variables."""
    env = _env.environ() if env is None else env
    if env.get("PET_NNODES") or env.get("PET_MASTER_ADDR"):
        return _pet(env, "volcano" if env.get("VC_TASK_INDEX") is not None else "kubeflow")
    if env.get("SKYPILOT_NODE_RANK") is not None and env.get("SKYPILOT_NODE_IPS"):
        return _skypilot(env)
    if env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID"):
        return _slurm(env)
    if env.get("MASTER_ADDR") and env.get("WORLD_SIZE"):
        return Allocation("torchrun", _int(env, "GROUP_WORLD_SIZE") or 1, _int(env, "GROUP_RANK") or 0,
                          env["MASTER_ADDR"], _int(env, "MASTER_PORT") or DEFAULT_PORT,
                          job_id=env.get("TORCHELASTIC_RUN_ID"), rank=_int(env, "RANK"),
                          world_size=_int(env, "WORLD_SIZE"), local_rank=_int(env, "LOCAL_RANK"),
                          local_world_size=_int(env, "LOCAL_WORLD_SIZE"))
    return None


def launch_defaults(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """What `dtorch run` uses for the flags it was not given, inside an allocation: nnodes,
    nproc_per_node (GPUs per node when the scheduler says), rdzv_endpoint and rdzv_id. Empty
    outside any allocation, and for a process the scheduler started as a single rank."""
    a = detect(env)
    if a is None or a.scheduler == "torchrun":
        return {}
    if a.rank is not None and a.world_size and a.world_size > a.nnodes:
        return {}  # srun started one process per rank: there is nothing to launch per node
    out = {"nnodes": str(a.nnodes), "rdzv_endpoint": a.rdzv_endpoint, "scheduler": a.scheduler}
    if a.nproc_per_node:
        out["nproc_per_node"] = str(a.nproc_per_node)
    if a.job_id:
        out["rdzv_id"] = f"{a.scheduler}-{a.job_id}"
    return out


def export_rank_env(env: MutableMapping[str, str] | None = None) -> Allocation | None:
    """When a scheduler started this process as one rank (an srun task) and no launcher set the
    rank variables, derive RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT from its variables, so `init_process_group("env://")` works. Returns the
    allocation it used, or None when nothing was set. `env` (a test's mapping) is updated in place;
    by default this process's environment is read and exported to."""
    view = _env.environ() if env is None else env
    if view.get("RANK") is not None:
        return None
    a = detect(view)
    if a is None or a.rank is None or not a.world_size:
        return None
    (_env.export if env is None else env.update)({"RANK": str(a.rank), "WORLD_SIZE": str(a.world_size), "LOCAL_RANK": str(a.local_rank or 0),
                "LOCAL_WORLD_SIZE": str(a.local_world_size or 1), "MASTER_ADDR": a.master_addr,
                "MASTER_PORT": str(a.master_port), "GROUP_RANK": str(a.node_rank)})
    return a
