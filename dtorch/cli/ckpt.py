"""`dtorch ckpt ls | verify | export`: inspect the checkpoints of a run directory.

    dtorch ckpt ls runs/a                       committed steps, size, world size, LATEST
    dtorch ckpt verify runs/a [--step N]        hash every file (all steps unless --step); exit 1 if damaged
    dtorch ckpt export runs/a out.safetensors [--step N] [--key model]
    dtorch ckpt export runs/a OUT_DIR --hf [--model SPEC | --config HF_DIR] [--tokenizer DIR] [--dtype bfloat16]
                                                a Hugging Face directory transformers loads
    dtorch ckpt trust runs/a [--step N]         vouch for checkpoints: re-sign their manifests with your key
"""

from __future__ import annotations

import argparse
import time


def add_parser(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("ckpt", help=help_text, description=help_text)
    csub = p.add_subparsers(dest="ckpt_command", metavar="ACTION", required=True)
    ls = csub.add_parser("ls", help="list committed checkpoints")
    ls.add_argument("dir", help="checkpoint directory of a run")
    ver = csub.add_parser("verify", help="hash every file against the manifest; exit 1 if any is damaged")
    ver.add_argument("dir", help="checkpoint directory of a run")
    ver.add_argument("--step", type=int, default=None, help="only this step (default: every committed step)")
    ex = csub.add_parser("export", help="write one consolidated safetensors file")
    ex.add_argument("dir", help="checkpoint directory of a run")
    ex.add_argument("out", help="output .safetensors path")
    ex.add_argument("--step", type=int, default=None, help="step to export (default: the newest)")
    ex.add_argument("--key", action="append", default=None, help="top-level entry to export (repeatable), e.g. model")
    ex.add_argument("--hf", action="store_true",
                    help="write a Hugging Face directory (config.json, sharded safetensors + index) instead")
    ex.add_argument("--model", default=None, help="with --hf: the run's model spec (default: the Hugging Face "
                    "config the run started from, saved in its checkpoint directory)")
    ex.add_argument("--config", default=None, help="with --hf: a Hugging Face directory or config.json to "
                    "take the architecture and token ids from")
    ex.add_argument("--tokenizer", default=None, help="with --hf: a directory whose tokenizer files and "
                    "generation_config.json go beside the weights (default: --config's directory, else those "
                    "of the directory the run started from)")
    ex.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="with --hf: cast the weights (default: as trained)")
    ex.add_argument("--shard-mb", type=int, default=2000, help="with --hf: largest shard file (default 2000 MB)")
    tr = csub.add_parser("trust", help="re-sign manifests with your key (checkpoints you vouch for: copied from "
                                       "another user or written before signing)")
    tr.add_argument("dir", help="checkpoint directory of a run")
    tr.add_argument("--step", type=int, default=None, help="only this step (default: every committed step)")
    p.set_defaults(func=run)


def _plan_text(plan: dict | None) -> str:
    """The plan a checkpoint was written with, as `dtorch plan` names it ("-" when none was kept)."""
    if not plan:
        return "-"
    from dtorch.plan.plan import Plan

    try:
        return Plan.from_dict(plan).describe()
    except Exception:  # noqa: BLE001 - a plan of another DTorch version: show it raw
        return str(plan)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dtorch.checkpoint.manager import CheckpointManager
    from dtorch.errors import ConfigError

    if not Path(args.dir).is_dir():
        raise ConfigError("dir", args.dir, "no such directory; pass the checkpoint_dir of a run")
    if args.ckpt_command == "trust":
        return _trust(Path(args.dir), args.step)
    mgr = CheckpointManager(args.dir, keep_last=None)
    try:
        if args.ckpt_command == "ls":
            infos = mgr.list()
            if not infos:
                print(f"{args.dir}: no committed checkpoints")
                return 0
            print(f"{'step':>10}  {'MB':>9}  {'world':>5}  {'saved (UTC)':<19}  plan; extra")
            for i in infos:
                when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(i.created_unix)) if i.created_unix else "?"
                size = f"{i.bytes / 1e6:9.1f}" if i.bytes is not None else "        ?"
                mark = "  <- LATEST" if i.latest else ""
                detail = i.problem if not i.manifest_ok else "; ".join(
                    [_plan_text(i.plan), ", ".join(f"{k}={v}" for k, v in sorted(i.extra.items()))])
                print(f"{i.step:>10}  {size}  {i.world_size or '?':>5}  {when:<19}  {detail}{mark}")
            return 0
        if args.ckpt_command == "verify":
            targets = [args.step] if args.step is not None else [i.step for i in mgr.list()]
            if not targets:
                print(f"{args.dir}: no committed checkpoints")
                return 0
            bad = 0
            for step in targets:
                report = mgr.verify(step)
                print(report.describe())
                bad += not report.ok
            return 1 if bad else 0
        if args.ckpt_command == "export" and args.hf:
            from dtorch.checkpoint.export import export_hf_dir

            out = export_hf_dir(mgr, args.step, args.out, model=args.model, config=args.config, dtype=args.dtype,
                                shard_bytes=args.shard_mb * 10**6, tokenizer=args.tokenizer)
            print(f"wrote {out}")
            return 0
        if args.ckpt_command == "export":
            out = mgr.export_safetensors(args.step, args.out, keys=args.key)
            print(f"wrote {out}")
            return 0
    finally:
        mgr.close()
    return 2


def _trust(root, step: int | None) -> int:
    """Re-sign manifests (after checking every file's hash); `.metadata` is still read with the
    allow-list afterwards, so trusting a checkpoint never lets it run code."""
    from dtorch.checkpoint import files as F
    from dtorch.errors import ConfigError

    dirs = [(s, p) for s, p in F.committed_dirs(root) if step is None or s == step]
    if not dirs:
        raise ConfigError("step", step, f"no committed checkpoint under {root} to trust")
    bad = 0
    for _, path in dirs:
        try:
            F.resign_manifest(path)
            print(f"{path}: signed with this user's key")
        except (F.ManifestError, OSError) as e:
            print(f"{path}: NOT signed: {e}")
            bad += 1
    return 1 if bad else 0
