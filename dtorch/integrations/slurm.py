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

from dtorch.errors import ConfigError, choices
from dtorch.integrations.request import Request

# Slurm feature (constraint) names sites commonly give each device preset.
CONSTRAINTS = {"a100-80gb": "a100", "h100-sxm": "h100", "h100-96gb": "h100", "h200": "h200", "b200": "b200",
               "mi300x": "mi300x"}


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


def partitions() -> dict[str, float | None] | None:
    """Partition -> max time (seconds, None = unlimited) from `sinfo`; None when no Slurm
    controller can be asked from here."""
    exe = shutil.which("sinfo")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "-h", "-o", "%R %l"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    parts: dict[str, float | None] = {}
    for line in out.stdout.splitlines():
        name, _, limit = line.strip().partition(" ")
        if name:
            parts[name] = parse_slurm_time(limit)
    return parts


def check_partition(name: str | None) -> float | None:
    """The max time of partition `name` (None if unknown or unlimited). Raises ConfigError when a
    reachable Slurm has no such partition."""
    if name is None:
        return None
    known = partitions()
    if known is None:
        return None  # no controller to ask: sbatch will say
    if name not in known:
        raise ConfigError("partition", name, f"this Slurm cluster has no such partition; {choices(sorted(known))}")
    return known[name]


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
                  env: dict[str, str] | None = None) -> str:
    """The sbatch script for `req` (see module doc). Raises ConfigError for a value that would not
    stay on its `#SBATCH` line (`check_sbatch_value`) or an environment name that is not one."""
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
        c = constraint or CONSTRAINTS.get(req.device)
        if c:
            h.append(f"#SBATCH --constraint={c}")
    elif constraint:
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
