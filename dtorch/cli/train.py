"""`dtorch train`: the main job. With no arguments it trains a small GPT on this machine's default
corpus, on all local GPUs or else 2 CPU worker processes, auto-planned and checkpointed, and
prints generated text at the end. Run it again and it resumes."""

from __future__ import annotations

import argparse
import os


def add_parser(sub, help_text: str) -> None:
    from dtorch.train.job import add_arguments

    p = sub.add_parser("train", help=help_text, description=__doc__)
    add_arguments(p)
    p.add_argument("--nproc", type=int, default=None,
                   help="worker processes (default: the number of local GPUs, else 2 on CPU)")
    p.add_argument("--max-restarts", type=int, default=3, help="restarts after a failure (default 3)")
    p.add_argument("--chaos", default="", help="fault-injection drill, e.g. kill:rank=1:step=40 (see docs)")
    p.set_defaults(func=run)


def _default_nproc() -> int:
    if os.path.exists("/dev/nvidia0"):
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
    return 2


def run(args: argparse.Namespace) -> int:
    from dtorch.errors import ConfigError

    nproc = args.nproc or _default_nproc()
    if nproc < 1:
        raise ConfigError("nproc", nproc, "use at least 1 worker process")
    if os.environ.get("RANK") is not None or (nproc == 1 and not args.chaos):
        from dtorch.train.job import run as run_job

        return run_job(args)
    from dtorch.elastic.launch import LaunchSpec, launch

    forwarded = []
    for action_dest, flag in (("model", "--model"), ("steps", "--steps"), ("global_batch", "--global-batch"),
                              ("seq_len", "--seq-len"), ("lr", "--lr"), ("warmup", "--warmup"),
                              ("checkpoint_dir", "--checkpoint-dir"), ("checkpoint_every", "--checkpoint-every"),
                              ("plan", "--plan"), ("seed", "--seed"), ("data", "--data"),
                              ("sample_tokens", "--sample-tokens"), ("monitor_port", "--monitor-port"),
                              ("metrics_every", "--metrics-every")):
        value = getattr(args, action_dest)
        if value is not None:
            forwarded += [flag, str(value)]
    if args.no_progress:
        forwarded.append("--no-progress")
    if getattr(args, "trace_comms", False):
        forwarded.append("--trace-comms")
    spec = LaunchSpec(nproc_per_node=nproc, max_restarts=args.max_restarts, chaos=args.chaos)
    return launch(spec, "dtorch.train.job", forwarded, module=True)
