"""The `dtorch` command: the roof over every stage. Each subcommand lives in its own module
(`dtorch/cli/<name>.py`) exposing `add_parser(subparsers)` and `run(args) -> int`.

User mistakes (`ConfigError`) print one line naming the field, the value and the fix, and exit 2.
Subcommand modules are imported lazily so that `dtorch plan` does not pay for torch.distributed.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from dtorch.errors import ConfigError

SUBCOMMANDS = {
    "plan": "rank parallelism plans for a model on a cluster, and explain the choice",
    "train": "train a model (the main job: a small GPT on this machine with no arguments)",
    "run": "elastic, fault-tolerant launch of a training script (torchrun-compatible flags)",
    "probe": "measure this machine/cluster and write a calibration file for the planner",
    "ckpt": "list, verify and export checkpoints",
    "submit": "a Slurm script or Kubernetes manifests sized from the plan (and, with --now, the job)",
    "status": "what a run last reported: state, step, tokens/s, checkpoint, failure",
    "report": "an HTML report with plots of a run (metrics.jsonl + event log), also of a crashed run",
}


def _load(name: str):
    return importlib.import_module(f"dtorch.cli.{name}")


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dtorch", description="DTorch: an operating system for a GPU cluster.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, help_text in SUBCOMMANDS.items():
        if wanted in SUBCOMMANDS and name != wanted:
            sub.add_parser(name, help=help_text)  # keep help listing cheap: only load the one used
            continue
        try:
            mod = _load(name)
        except ModuleNotFoundError as e:
            if e.name != f"dtorch.cli.{name}":
                raise
            sub.add_parser(name, help=help_text + " (not available in this build)")
            continue
        mod.add_parser(sub, help_text)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if not hasattr(args, "func"):
        print(f"dtorch: '{args.command}' is not available in this build", file=sys.stderr)
        return 2
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe surfaces here, inside the handler, not at exit
        return code
    except ConfigError as e:
        print(f"dtorch {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return _broken_pipe()


def console() -> None:
    """The `dtorch` command (and `python -m dtorch.cli`): `main`, then the process ends through
    `dtorch.process_group.leave`, without the interpreter's teardown of torch (1-4 s on a 2-core
    machine, paid by every caller that waits for the command's exit or its output's end)."""
    code = main()
    from dtorch.process_group import leave

    leave(code)


def _broken_pipe() -> int:
    """`dtorch plan ... | head`: the reader left. Stop quietly, as Unix tools do, and keep Python
    from reporting the failed flush of stdout at exit."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 141  # 128 + SIGPIPE


if __name__ == "__main__":
    console()
