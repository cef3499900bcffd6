"""`dtorch submit`: a scheduler request sized from the plan, for Slurm or Kubernetes.

    dtorch submit slurm --model llama3-70b --device-type h100 --tokens 1T --deadline 30d
    dtorch submit slurm --model gpt2 --device-type h100 --nodes 2 --steps 5000 \\
        --checkpoint-dir /shared/ckpt/gpt2 --partition gpu --now
    dtorch submit k8s --model llama3-8b --device-type h100 --nodes 4 --steps 10000 \\
        --pvc ckpt --image ghcr.io/me/dtorch:1 --kind trainjob,jobset --queue team-a --dry-run

Prints the plan, the request and the script/manifests; `slurm --now` submits with sbatch,
`--out` writes the script or the manifests (YAML) to a file. Never imports torch.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from dtorch.errors import ConfigError


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model preset or spec (llama3-70b, gpt:layers=...)")
    p.add_argument("--device-type", required=True, help="device preset: h100, a100, h200, b200, mi300x, cpu")
    p.add_argument("--nodes", type=int, default=None, help="nodes to use (default: sized from --tokens/--deadline)")
    p.add_argument("--plan", default=None,
                   help="a plan file (dtorch plan --out): its world size sets the nodes and the job runs it as is")
    p.add_argument("--recommend", action="store_true",
                   help="size the cluster from --tokens (and --deadline): the default when no --nodes/--plan")
    p.add_argument("--gpus-per-node", type=int, default=None, help="devices per node (default: the preset's)")
    p.add_argument("--tokens", default=None, help="training budget in tokens (2T, 5e11): sizes the cluster and the steps")
    p.add_argument("--deadline", default=None, help="wall-clock budget (30d, 12h): the smallest cluster that meets it")
    p.add_argument("--max-nodes", type=int, default=2048, help="largest cluster to consider (default 2048)")
    from dtorch.train.job import CLUSTER_GLOBAL_BATCH, CLUSTER_SEQ_LEN

    p.add_argument("--seq-len", type=int, default=CLUSTER_SEQ_LEN,
                   help=f"tokens per sample (default {CLUSTER_SEQ_LEN}, as dtorch plan; dtorch train's smaller default "
                        "is for its small default model)")
    p.add_argument("--global-batch", type=int, default=CLUSTER_GLOBAL_BATCH,
                   help=f"samples per step (default {CLUSTER_GLOBAL_BATCH}: --tokens becomes steps before any plan "
                        "exists, so a pre-training batch is assumed, where dtorch plan ranks plans at one per device)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: tokens / (batch x seq))")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32", "float8"])
    p.add_argument("--checkpoint-dir", default=None,
                   help="shared checkpoint directory every node mounts (default: ./dtorch-runs/NAME)")
    p.add_argument("--name", default=None, help="job name (default: dtorch-MODEL)")
    p.add_argument("--time", default=None, help="time limit (30d, 12h, 90min); default: predicted time +15%%")
    p.add_argument("--grace", type=int, default=120,
                   help="seconds between the warning signal and the kill: the checkpoint must fit (default 120)")
    p.add_argument("--cpus-per-task", type=int, default=None, help="CPU cores per task (default: node's / tasks)")
    p.add_argument("--mem", default=None, help="host memory per node (64G, 512M); default: 16 GiB per task + offload")
    p.add_argument("--tasks-per-node", type=int, default=None, help="ranks per node (default: one per device)")
    p.add_argument("--python", default=None, help="python on the nodes (default: this one)")
    p.add_argument("--train-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for the training job (repeatable), e.g. --train-arg=--checkpoint-every=100")
    p.add_argument("--out", default=None, help="write the script / manifests here")
    p.add_argument("--quiet", action="store_true", help="print only the script / manifests")


def add_parser(sub, help_text: str) -> None:
    p = sub.add_parser("submit", help=help_text, description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    s = p.add_subparsers(dest="scheduler", metavar="SCHEDULER", required=True)
    sl = s.add_parser("slurm", help="an sbatch script (and, with --now, the job)")
    _common(sl)
    sl.add_argument("--partition", default=None, help="Slurm partition (checked against sinfo when reachable)")
    sl.add_argument("--account", default=None)
    sl.add_argument("--qos", default=None)
    sl.add_argument("--constraint", default=None, help="node feature, e.g. h100 (default: none)")
    sl.add_argument("--exclusive", action=argparse.BooleanOptionalAction, default=None,
                    help="whole nodes (default: yes for GPU jobs, no on CPU)")
    sl.add_argument("--gres-name", default=None, help="GPU type in --gres=gpu:TYPE:N (default: none)")
    sl.add_argument("--now", action="store_true", help="submit with sbatch")
    k = s.add_parser("k8s", help="Kubeflow TrainJob / JobSet / Volcano Job manifests")
    _common(k)
    k.add_argument("--kind", default="trainjob,jobset,vcjob",
                   help="manifests to write: trainjob, jobset, vcjob, comma-separated (default all three)")
    k.add_argument("--image", default="ghcr.io/dtorch/dtorch:latest", help="container image with DTorch")
    k.add_argument("--namespace", default="default")
    k.add_argument("--pvc", default=None, help="PersistentVolumeClaim (ReadWriteMany) for checkpoints (required)")
    k.add_argument("--queue", default=None, help="Kueue LocalQueue: the kueue.x-k8s.io/queue-name label")
    k.add_argument("--topology", default=None,
                   help="Kueue topology-aware scheduling: node label of the level to pack into "
                        "(e.g. cloud.google.com/gce-topology-block); 'required:LABEL' to insist")
    k.add_argument("--runtime", default="torch-distributed", help="TrainJob ClusterTrainingRuntime (default torch-distributed)")
    k.add_argument("--rbac", action="store_true",
                   help="also write a ServiceAccount, Role (pods: get, patch; events: create) and RoleBinding, "
                        "and run the pods as it, so the job can put its status on its pod's annotations and events")
    k.add_argument("--dry-run", action="store_true", help="print the YAML (the default; nothing is applied)")
    p.set_defaults(func=run)


_NAME = re.compile(r"[^a-z0-9-]+")


def _job_name(args) -> str:
    if args.name:
        return args.name
    base = args.model.split(":")[0].lower()
    return ("dtorch-" + _NAME.sub("-", base))[:50].strip("-")


def _duration(text: str | None) -> float | None:
    if text is None:
        return None
    from dtorch.cli.plan import parse_duration

    return parse_duration(text)


def _bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]?)i?b?\s*", str(text).lower())
    if not m:
        raise ConfigError("mem", text, "give a size like 64G or 512M")
    return int(float(m.group(1)) * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}[m.group(2)])


def _checkpoint_dir(args, name: str) -> str:
    """The job's checkpoint directory, after checking every value that goes into the script or the
    manifests for its format (before anything is planned: a newline in an #SBATCH value would run
    the rest of it as a command)."""
    from dtorch.integrations import request as rq
    from dtorch.integrations.slurm import check_sbatch_values

    check_sbatch_values(name=name, checkpoint_dir=args.checkpoint_dir)
    if args.scheduler == "slurm":
        check_sbatch_values(partition=args.partition, account=args.account, qos=args.qos,
                            constraint=args.constraint, gres_name=args.gres_name)
    if args.scheduler == "k8s":
        if not args.pvc:
            raise ConfigError("pvc", None, "checkpoints need a volume every pod mounts: give --pvc CLAIM "
                              "(a ReadWriteMany PersistentVolumeClaim)")
        from dtorch.integrations.k8s import check_names

        # the node count is checked again against the job name once sizing has chosen it
        check_names(name=name, namespace=args.namespace, pvc=args.pvc, queue=args.queue, runtime=args.runtime,
                    image=args.image, nodes=args.nodes or 1)
        ckpt = args.checkpoint_dir or f"/ckpt/{name}"
        if not ckpt.startswith("/"):
            raise ConfigError("checkpoint-dir", ckpt, "give an absolute path inside the pod, under the --pvc mount /ckpt")
        return ckpt
    if args.checkpoint_dir is None:
        return os.path.abspath(os.path.join("dtorch-runs", name))
    return rq.check_checkpoint_dir(args.checkpoint_dir)


def _plan_file(args):
    """(the plan of --plan, or None; the --plan argument the job runs with)."""
    if args.plan and args.scheduler == "k8s":
        raise ConfigError("plan", args.plan, "the pods cannot read a local file: give --nodes (they plan at start, "
                          "as the plan file's planner did)")
    if not args.plan:
        return None, "auto"
    from dtorch.plan.plan import Plan

    if not os.path.exists(args.plan):
        raise ConfigError("plan", args.plan, "no such file; write one with dtorch plan ... --out plan.json")
    return Plan.load(args.plan), os.path.abspath(args.plan)  # on the shared file system, like the checkpoints


def _render(args, req) -> str:
    """The manifests (YAML) or the sbatch script of the request."""
    if args.scheduler == "k8s":
        from dtorch.integrations import k8s

        kinds = [k.strip() for k in args.kind.split(",") if k.strip()]
        docs = k8s.manifests(req, kinds=kinds, image=args.image, namespace=args.namespace, pvc=args.pvc,
                             queue=args.queue, topology=args.topology, runtime=args.runtime,
                             with_rbac=args.rbac)
        return k8s.to_yaml(docs)
    from dtorch.integrations import slurm

    req.python = args.python or sys.executable
    return slurm.sbatch_script(req, partition=args.partition, account=args.account, qos=args.qos,
                               constraint=args.constraint, gres_name=args.gres_name, exclusive=args.exclusive)


def _emit(args, text: str, ckpt: str, name: str) -> None:
    """Print and/or write the script or manifests; `slurm --now` submits the script."""
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        if not args.quiet:
            print(f"written to {args.out}")
    if args.quiet or not args.out:
        if not args.quiet:
            print(f"---- {'sbatch script' if args.scheduler == 'slurm' else 'manifests'} ----")
        print(text, end="" if text.endswith("\n") else "\n")
    if args.scheduler == "slurm" and args.now:
        from dtorch.integrations import slurm

        path = args.out or os.path.join(ckpt, f"{name}.sbatch")
        if not args.out:
            os.makedirs(ckpt, exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
        os.makedirs(ckpt, exist_ok=True)
        job = slurm.submit(path)
        state = slurm.job_state(job)
        told = f"; {state[0]}" + (f" ({state[1]})" if state[1] and state[1] != "None" else "") if state else ""
        print(f"submitted Slurm job {job}{told}; follow it with: dtorch status {ckpt}")


def run(args) -> int:
    from dtorch.cli.plan import parse_count
    from dtorch.integrations import request as rq
    from dtorch.plan.profiles import for_devices, get_profile

    if args.grace < 10:
        raise ConfigError("grace", args.grace, "give the checkpoint at least 10 seconds")
    tokens = parse_count(args.tokens) if args.tokens is not None else None
    deadline = _duration(args.deadline)
    if deadline is not None and deadline <= 0:
        raise ConfigError("deadline", args.deadline, "give a positive duration, e.g. 30d")
    name = _job_name(args)
    ckpt = _checkpoint_dir(args, name)
    max_time = limits = None
    if args.scheduler == "slurm":
        from dtorch.integrations import slurm

        limits = slurm.partition(args.partition)  # the default one without --partition; None: no Slurm here
        max_time = limits.max_time_s if limits is not None else None
        slurm.check_nodes(args.nodes, limits)  # before any planning
    # The device type first: an unknown one is the user's mistake, before any planning.
    group = rq.device_group(args.device_type, args.gpus_per_node)
    if args.recommend and (args.nodes is not None or args.plan):
        raise ConfigError("recommend", True, "--recommend sizes the cluster itself: drop --nodes/--plan")
    plan, plan_arg = _plan_file(args)
    profile = for_devices(get_profile(args.model, args.seq_len), args.model, args.seq_len, [group])
    sizing = rq.size_request(profile, args.device_type, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                             tokens=tokens, deadline_s=deadline, global_batch=args.global_batch,
                             max_nodes=args.max_nodes, dtype=args.dtype, plan=plan)
    steps = rq.steps_for(tokens, args.steps, args.global_batch, args.seq_len)
    req = rq.build_request(sizing, name=name, model=args.model, seq_len=args.seq_len,
                           global_batch=args.global_batch, steps=steps, checkpoint_dir=ckpt,
                           time_limit_s=_duration(args.time), grace_s=args.grace, max_time_s=max_time,
                           cpus_per_task=args.cpus_per_task, tasks_per_node=args.tasks_per_node,
                           extra_args=list(args.train_arg), python=args.python, plan_arg=plan_arg)
    if args.mem is not None:
        req.mem_per_node_bytes = _bytes(args.mem)
    if args.scheduler == "slurm":  # a request no node of the partition can hold would pend forever
        slurm.fit_to_partition(req, limits, cpus_given=args.cpus_per_task is not None, mem_given=args.mem is not None)
    text = _render(args, req)
    if not args.quiet:
        _print_plan(sizing, req)
    _emit(args, text, ckpt, name)
    return 0


def _print_plan(sizing, req) -> None:
    from dtorch.integrations.request import format_duration

    if sizing.recommendation is not None and sizing.recommendation.options:
        from dtorch.plan.recommend import format_recommendation

        print(format_recommendation(sizing.recommendation))
        print()
    elif sizing.plan is not None:
        pred = sizing.estimate.to_dict() if sizing.estimate is not None else (sizing.plan.predicted or {})
        t = f", time to train {format_duration(sizing.time_to_train_s)}" if sizing.time_to_train_s else ""
        perf = (f"predicted {pred['tokens_per_s']:,.0f} tokens/s, MFU {pred['mfu']:.1%}{t}"
                if pred.get("tokens_per_s") and pred.get("mfu") is not None else "no prediction in the plan")
        print(f"plan: {sizing.plan.describe()} ({perf})")
    print(req.describe())
