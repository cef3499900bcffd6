"""Slurm: an sbatch script from a `Request`, partition checks, submission.

The script starts one task per rank with `srun` (Slurm is the launcher: each task reads its rank
from SLURM_PROCID, see `dtorch.integrations.env`), asks Slurm for SIGUSR1 `grace` seconds before
the time limit (`--signal=USR1@grace`), and when the ranks stop because of such a signal (the
status file says `preempted`: a checkpoint was written) it requeues the job with
`scontrol requeue`; the requeued job resumes from that checkpoint. `--requeue` also lets Slurm
requeue it after a node failure or a preemption (SIGTERM, then SIGKILL after KillWait: the same
handler checkpoints on SIGTERM).
"""

from __future__ import annotations

import datetime
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass

from dtorch.errors import ConfigError, choices
from dtorch.integrations.request import Request


def slurm_time(seconds: float) -> str:
    """Seconds -> Slurm's D-HH:MM:SS (rounded up to a minute)."""
    m = max(1, int(-(-seconds // 60)))
    d, m = divmod(m, 1440)
    h, m = divmod(m, 60)
    return f"{d}-{h:02d}:{m:02d}:00" if d else f"{h:02d}:{m:02d}:00"


def parse_slurm_time(text: str) -> float | None:
    """Slurm's time formats (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS) -> seconds;
    None for UNLIMITED / INFINITE."""
    text = text.strip()
    if text.upper() in ("UNLIMITED", "INFINITE", "NONE", ""):
        return None
    days = 0
    if "-" in text:
        d, text = text.split("-", 1)
        days = int(d)
        parts = [int(x) for x in text.split(":")]
        parts += [0] * (3 - len(parts))
        h, m, s = parts
    else:
        parts = [int(x) for x in text.split(":")]
        if len(parts) == 1:
            h, m, s = 0, parts[0], 0
        elif len(parts) == 2:
            h, m, s = 0, parts[0], parts[1]
        else:
            h, m, s = parts
    return days * 86400 + h * 3600 + m * 60 + s


@dataclass(frozen=True)
class PartitionLimits:
    """What one node of a partition offers (the largest node where they differ), from `sinfo`."""

    name: str
    default: bool
    max_time_s: float | None
    nodes: int
    cpus_per_node: int
    mem_per_node_mb: int | None
    """None where the site did not configure RealMemory (sinfo says 1)."""
    gpus_per_node: int


def _gpus(gres: str) -> int:
    """GPUs per node from sinfo's GRES column (gpu:8, gpu:h100:8(S:0-1), (null))."""
    n = 0
    for part in gres.split(","):
        fields = part.split("(")[0].split(":")
        if fields[0] == "gpu" and fields[-1].isdigit():
            n += int(fields[-1])
    return n


def _query(*args: str) -> str | None:
    """stdout of a Slurm client command (sinfo, squeue); None when there is none here or no
    controller answers."""
    exe = shutil.which(args[0])
    if not exe:
        return None
    try:
        out = subprocess.run([exe, *args[1:]], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def partition_limits() -> dict[str, PartitionLimits] | None:
    """Partition -> `PartitionLimits` from `sinfo`; None when no Slurm controller answers here."""
    text = _query("sinfo", "-h", "-o", "%P|%l|%D|%c|%m|%G")
    if text is None:
        return None
    found: dict[str, PartitionLimits] = {}
    for line in text.splitlines():
        cols = line.strip().split("|")
        if len(cols) != 6 or not cols[0]:
            continue
        name, default = cols[0].rstrip("*"), cols[0].endswith("*")
        try:
            nodes, cpus = int(cols[2]), int(cols[3].rstrip("+"))
            mem = int(cols[4].rstrip("+"))
        except ValueError:
            continue
        prev = found.get(name)
        lim = PartitionLimits(name, default, parse_slurm_time(cols[1]), nodes, cpus, mem if mem > 1 else None,
                              _gpus(cols[5]))
        if prev is not None:  # node groups of one partition: nodes add up, a node offers the largest
            lim = PartitionLimits(name, default or prev.default, lim.max_time_s, prev.nodes + nodes,
                                  max(prev.cpus_per_node, cpus), max(prev.mem_per_node_mb or 0, lim.mem_per_node_mb or 0)
                                  or None, max(prev.gpus_per_node, lim.gpus_per_node))
        found[name] = lim
    return found


def partition(name: str | None) -> PartitionLimits | None:
    """The limits of partition `name`, or of the default partition when `name` is None (one `sinfo`
    call); None when no Slurm controller answers here (sbatch will judge). ConfigError when a
    reachable Slurm has no partition `name`."""
    known = partition_limits()
    if not known:
        return None
    if name is None:
        return next((p for p in known.values() if p.default), None)
    if name not in known:
        raise ConfigError("partition", name, f"this Slurm cluster has no such partition; {choices(sorted(known))}")
    return known[name]


def check_nodes(nodes: int | None, limits: PartitionLimits | None) -> None:
    """ConfigError when the partition has fewer than `nodes` nodes (nothing checked without limits)."""
    if nodes is not None and limits is not None and nodes > limits.nodes:
        raise ConfigError("nodes", nodes, f"partition {limits.name} has {limits.nodes} node(s); ask for at most "
                          f"{limits.nodes} (--nodes), or choose another --partition")


def fit_to_partition(req: Request, limits: PartitionLimits | None, *, cpus_given: bool, mem_given: bool) -> None:
    """Make the request one the partition can start, or refuse it naming the limit.

    Values the user did not give (CPUs per task, memory per node: the device preset's) are lowered
    to what a node has, with a note; a value the user gave, a node count or a GPU count that no node
    offers is a ConfigError naming the limit and the fix. Nothing is checked without `limits`."""
    if limits is None:
        return
    p = limits
    where = f"partition {p.name}"
    check_nodes(req.nodes, p)
    if req.gpus_per_node > p.gpus_per_node:
        raise ConfigError("gpus-per-node", req.gpus_per_node, f"{where}'s nodes have {p.gpus_per_node} GPU(s) "
                          "in their GRES; choose a GPU partition (--partition) or fewer --gpus-per-node")
    if req.tasks_per_node > p.cpus_per_node:
        raise ConfigError("tasks-per-node", req.tasks_per_node, f"{where}'s nodes have {p.cpus_per_node} CPUs, "
                          "one per task at least; give --tasks-per-node {p.cpus_per_node} or fewer")
    cpus = req.tasks_per_node * req.cpus_per_task
    if cpus > p.cpus_per_node:
        fit = max(1, p.cpus_per_node // req.tasks_per_node)
        if cpus_given:
            raise ConfigError("cpus-per-task", req.cpus_per_task, f"{req.tasks_per_node} task(s) per node x "
                              f"{req.cpus_per_task} CPUs = {cpus}, but {where}'s nodes have {p.cpus_per_node}; "
                              f"give --cpus-per-task {fit}")
        req.notes.append(f"{fit} CPUs per task: {where}'s nodes have {p.cpus_per_node} CPUs "
                         f"(the {req.device_name} preset's node has more)")
        req.cpus_per_task = fit
    if p.mem_per_node_mb is not None and req.mem_per_node_bytes > p.mem_per_node_mb * 2**20:
        if mem_given:
            raise ConfigError("mem", f"{req.mem_per_node_bytes // 2**20}M", f"{where}'s nodes have "
                              f"{p.mem_per_node_mb} MB; give --mem {p.mem_per_node_mb}M or less")
        req.notes.append(f"memory {p.mem_per_node_mb} MB per node: all that {where}'s nodes have")
        req.mem_per_node_bytes = p.mem_per_node_mb * 2**20


def job_state(job_id: str) -> tuple[str, str] | None:
    """(state, reason) of a job from `squeue`, e.g. ("PENDING", "Resources"); None if unknown."""
    line = (_query("squeue", "-h", "-j", str(job_id), "-o", "%T|%r") or "").strip().splitlines()[:1]
    if not line or "|" not in line[0]:
        return None
    state, reason = line[0].split("|", 1)
    return state, reason


def check_sbatch_value(field: str, value: object) -> None:
    """Raise ConfigError unless `value` is one line of printable characters. It is written into an
    `#SBATCH` line, which ends at a newline: the rest of the value would run as a shell command of
    the batch script (and `bash -n` would not notice)."""
    if value is None:
        return
    bad = next((c for c in str(value) if not c.isprintable()), None)
    if bad is not None:
        raise ConfigError(field, value, f"it holds the control character {bad!r}, which would end the #SBATCH "
                          "line and run the rest as a command; use printable characters only")


def check_sbatch_values(**values: object) -> None:
    """`check_sbatch_value` for each flag=value (underscores in a name are shown as dashes)."""
    for field, value in values.items():
        check_sbatch_value(field.replace("_", "-"), value)


def sbatch_script(req: Request, *, partition: str | None = None, account: str | None = None,
                  qos: str | None = None, constraint: str | None = None, gres_name: str | None = None,
                  env: dict[str, str] | None = None, exclusive: bool | None = None) -> str:
    """The sbatch script for `req` (see module doc). No node feature (`--constraint`) unless one is
    given; whole nodes (`--exclusive`) for GPU jobs unless `exclusive` is False. Raises ConfigError
    for a value that would not stay on its `#SBATCH` line (`check_sbatch_value`) or an environment
    name that is not one."""
    check_sbatch_values(name=req.name, checkpoint_dir=req.checkpoint_dir, partition=partition, account=account,
                        qos=qos, constraint=constraint, gres_name=gres_name)
    for k in env or {}:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            raise ConfigError("env", k, "use a shell variable name ([A-Za-z_][A-Za-z0-9_]*)")
    ck = req.checkpoint_dir
    status = f"{ck}/status.json"
    h = [f"#SBATCH --job-name={req.name}", f"#SBATCH --nodes={req.nodes}",
         f"#SBATCH --ntasks-per-node={req.tasks_per_node}", f"#SBATCH --cpus-per-task={req.cpus_per_task}",
         f"#SBATCH --mem={max(1, req.mem_per_node_bytes // 2**20)}M", f"#SBATCH --time={slurm_time(req.time_limit_s)}",
         f"#SBATCH --signal=USR1@{req.grace_s}", "#SBATCH --requeue", "#SBATCH --open-mode=append",
         f"#SBATCH --output={ck}/slurm-%j.out"]
    if req.gpus_per_node:
        h.append(f"#SBATCH --gres=gpu:{gres_name + ':' if gres_name else ''}{req.gpus_per_node}")
    if exclusive if exclusive is not None else bool(req.gpus_per_node):
        h.append("#SBATCH --exclusive")  # a GPU job's ranks share no node with another job's
    if constraint:
        h.append(f"#SBATCH --constraint={constraint}")
    for flag, value in (("partition", partition), ("account", account), ("qos", qos)):
        if value:
            h.append(f"#SBATCH --{flag}={value}")
    plan = req.plan.describe() if req.plan else "searched at start"
    pred = ""
    if req.estimate is not None:
        pred = f", predicted {req.estimate.tokens_per_s:,.0f} tokens/s, MFU {req.estimate.mfu:.1%}"
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in (env or {}).items())
    return f"""#!/bin/bash
# Written by `dtorch submit slurm` ({when}): {req.nodes} x {req.gpus_per_node or 'CPU'} {req.device_name}
# plan: {plan}{pred}
{chr(10).join(h)}
set -u
mkdir -p {shlex.quote(ck)}
{exports}# One task per rank; each reads its rank and the rendezvous from Slurm's variables.
srun --kill-on-bad-exit=1 {shlex.join(req.train_command())}
rc=$?
# Stopped on SIGUSR1/SIGTERM after writing a checkpoint: requeue (the job resumes from it).
if [ "$rc" -ne 0 ] && grep -q '"state": "preempted"' {shlex.quote(status)} 2>/dev/null; then
  echo "dtorch: checkpointed on a scheduler signal; requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
fi
exit $rc
"""


def submit(script_path: str) -> str:
    """`sbatch` the script; returns the job id."""
    exe = shutil.which("sbatch")
    if not exe:
        raise ConfigError("now", True, "sbatch is not on PATH here; submit the written script from a login node")
    out = subprocess.run([exe, "--parsable", script_path], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        msg = (out.stderr or out.stdout).strip().splitlines()
        raise ConfigError("sbatch", script_path, msg[-1] if msg else f"sbatch exited {out.returncode}")
    return re.split(r"[;\s]", out.stdout.strip())[0]
