"""`dtorch plan`: rank parallelism plans for a model on a cluster and explain the choice.

    dtorch plan --model llama3-70b --cluster h100:8x8 --seq-len 8192 --global-batch 512
    dtorch plan ... --fix tp=8,pp=2,microbatch=1,ac=full      # what-if: pin fields, search the rest
    dtorch plan ... --json --out plan.json                    # the Plan document with `predicted`
    dtorch plan ... --steps 2000                              # rank with one-off compile seconds amortised
    dtorch plan --model llama3-405b --recommend --device-type h100 --tokens 15T --deadline 60d

Never imports torch for preset models and clusters (the planner is pure arithmetic).
"""

from __future__ import annotations

import argparse
import json
import re

from dtorch.errors import ConfigError

_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12, "p": 1e15}
_TIME = {"s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_count(text: str, field: str = "tokens") -> float:
    """``2e12``, ``2T``, ``500B``, ``1.5t`` -> a number."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?\d+)?)\s*([kmbgtp]?)\s*", str(text).lower())
    if not m:
        raise ConfigError(field, text, "give a number like 2e12, 2T or 500B")
    try:
        return float(m.group(1)) * _SUFFIX.get(m.group(2), 1.0)
    except ValueError:
        raise ConfigError(field, text, "give a number like 2e12, 2T or 500B") from None


def parse_duration(text: str) -> float:
    """``30d``, ``12h``, ``90min``, ``3600`` (seconds) -> seconds."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*(s|min|m|h|d|w)?\s*", str(text).lower())
    if not m:
        raise ConfigError("deadline", text, "give a duration like 30d, 12h, 90min or seconds")
    return float(m.group(1)) * _TIME[m.group(2) or "s"]


def add_parser(sub, help_text: str) -> None:
    p = sub.add_parser("plan", help=help_text, description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="preset (llama3-70b, gpt2-xl, ...), llama:/gpt: spec, factory or HF config")
    p.add_argument("--cluster", default=None,
                   help="preset shorthand (h100:8x8, h100:4x8+a100:2x8), cluster YAML/JSON, or 'detect' (default)")
    from dtorch.train.job import CLUSTER_SEQ_LEN, DEFAULT_GLOBAL_BATCH, DEFAULT_SEQ_LEN, JobConfig

    p.add_argument("--seq-len", type=int, default=CLUSTER_SEQ_LEN,
                   help=f"tokens per sequence (default {CLUSTER_SEQ_LEN}, a cluster-scale model's, as dtorch submit; "
                        f"dtorch train's default is {DEFAULT_SEQ_LEN}, for its small default model: pass its "
                        "--seq-len to plan a train job)")
    p.add_argument("--global-batch", type=int, default=None,
                   help="sequences per optimizer step (default: one per device, the smallest batch every plan can "
                        f"run; dtorch train's default is {DEFAULT_GLOBAL_BATCH}: pass its --global-batch to plan a "
                        "train job)")
    p.add_argument("--fix", default=None, help="pin plan fields, e.g. tp=8,pp=2,microbatch=1,ac=full")
    p.add_argument("--top", type=int, default=5, help="plans to rank (default 5)")
    p.add_argument("--steps", type=int, default=None,
                   help="the run's length in optimizer steps: one-off seconds (torch.compile's) are amortised over "
                        "it, (step x steps + once) / steps, in the ranking; default: unknown, ranked by step time")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="pin the compute dtype (param_dtype); default: searched, like --fix param_dtype=...")
    p.add_argument("--max-grad-norm", type=float, default=JobConfig.max_grad_norm,
                   help=f"the gradient clipping `dtorch train` will run with (default {JobConfig.max_grad_norm}, as "
                        "there; 0 = none, "
                        "which lets the optimizer offload tiers step during the backward): priced the same way")
    p.add_argument("--json", action="store_true", help="print the chosen Plan as JSON (with `predicted`)")
    p.add_argument("--progress", action="store_true",
                   help="progress lines on stderr during a long search (default: only on a terminal; "
                        "DTORCH_PROGRESS=1/0 forces)")
    p.add_argument("--out", default=None, help="write the chosen Plan to this .json/.yaml file")
    p.add_argument("--recommend", action="store_true", help="size a cluster: GPUs/nodes, plan, time to train")
    p.add_argument("--device-type", default=None, help="--recommend: device preset (h100, a100, h200, b200, mi300x)")
    p.add_argument("--tokens", default=None, help="--recommend: training budget in tokens (2e12, 2T)")
    p.add_argument("--deadline", default=None, help="--recommend: wall-clock budget (30d, 12h)")
    p.add_argument("--max-nodes", type=int, default=2048, help="--recommend: largest cluster to consider")
    p.add_argument("--max-batch-tokens", default=None,
                   help="--recommend: most tokens per optimizer step (16M, 4e6); chosen per cluster size up to "
                        "this bound (default: ~1M steps for --tokens, within [4M, 16M]); --global-batch fixes it")
    p.add_argument("--verify", action="store_true",
                   help="dry-run the chosen plan at full world size on a fake process group and compare memory")
    p.set_defaults(func=run)


def _format_verify(result: dict) -> str:
    """The dry run's measured model-state bytes beside the estimate (see dtorch.parallel.dryrun)."""
    gib = 2**30
    meas = result["measured"]["max"]
    est = result.get("estimated") or {}
    lines = [f"verify (fake process group, world size {result.get('world_size')}, "
             f"{result.get('seconds', 0):.1f} s): model-state bytes on the fullest rank",
             f"  {'':10s} {'measured GiB':>13s} {'estimated GiB':>14s}"]
    for key in ("params", "grads", "optimizer", "total"):
        m, e = meas.get(key), est.get(key)
        lines.append(f"  {key:10s} {m / gib if m is not None else float('nan'):13.2f} "
                     f"{e / gib if e is not None else float('nan'):14.2f}")
    if result.get("relative_error") is not None:
        lines.append(f"  estimate vs measurement: {result['relative_error']:+.2%}")
    st = result.get("startup_max")
    if st:
        lines.append(f"  start-up per rank: reads {st['checkpoint_read_bytes'] / gib:.2f} GiB of a bf16 checkpoint; "
                     f"host memory beyond the process itself {st['host_bytes_rank_local_init'] / gib:.2f} GiB "
                     f"(rank-local init) / {st['host_bytes_checkpoint_load'] / gib:.2f} GiB (checkpoint load) "
                     f"with parameters on the host, {st['transient_bytes_rank_local_init'] / gib:.2f} / "
                     f"{st['transient_bytes_checkpoint_load'] / gib:.2f} GiB with them on a GPU")
    if result.get("executable") is False:
        lines.append(f"  note: this DTorch cannot run the plan yet: {result.get('not_executable_because')}")
    return "\n".join(lines)


def _plan_constants(max_grad_norm: float | None):
    """The cost model's constants for a `dtorch train` run with this clipping (None: none), the way
    its trainer sets them (`PlanResolver._cost_constants`: `dtorch train`'s AdamW is the default
    kernel)."""
    from dtorch.plan.cost import DEFAULT_CONSTANTS, with_constants

    clip = bool(max_grad_norm)
    return DEFAULT_CONSTANTS if clip == DEFAULT_CONSTANTS.grad_clipping else with_constants(grad_clipping=clip)


def run(args) -> int:
    from dtorch.plan.profiles import for_devices, get_profile

    if args.seq_len is None or args.seq_len < 1:
        raise ConfigError("seq-len", args.seq_len, "must be a positive integer")
    if args.global_batch is not None and args.global_batch < 1:
        raise ConfigError("global-batch", args.global_batch, "must be a positive integer (sequences per step)")
    if args.top < 1:
        raise ConfigError("top", args.top, "must be a positive integer")
    if args.steps is not None and args.steps < 1:
        raise ConfigError("steps", args.steps, "must be a positive integer (optimizer steps of the run), or leave it out")
    from dtorch.train.job import _grad_norm

    constants = _plan_constants(_grad_norm(args.max_grad_norm))
    profile = get_profile(args.model, args.seq_len)

    if args.recommend:
        from dtorch.cluster.load import preset_group
        from dtorch.plan.recommend import format_recommendation, recommend

        if not args.device_type:
            raise ConfigError("device-type", None, "--recommend needs --device-type (h100, a100, h200, b200, mi300x)")
        profile = for_devices(profile, args.model, args.seq_len, [preset_group(args.device_type)])
        if args.tokens is None:
            raise ConfigError("tokens", None, "--recommend needs --tokens (the training budget, e.g. 2T)")
        rec = recommend(
            profile, args.device_type, global_batch=args.global_batch,
            tokens=parse_count(args.tokens), deadline_s=parse_duration(args.deadline) if args.deadline else None,
            max_nodes=args.max_nodes, dtype=args.dtype or "bfloat16",
            max_batch_tokens=parse_count(args.max_batch_tokens, "max-batch-tokens") if args.max_batch_tokens else None,
        )
        if args.json:
            print(json.dumps(rec.to_dict(), indent=2))
        else:
            print(format_recommendation(rec))
        return 0 if rec.chosen else 1

    from dtorch.cluster.load import load_cluster
    from dtorch.plan.explain import explain
    from dtorch.plan.search import parse_fix, search

    cluster = load_cluster(args.cluster or "detect", workload=(profile.hidden, profile.num_heads, profile.seq_len))
    profile = for_devices(profile, args.model, args.seq_len, cluster.groups)
    gb = args.global_batch or cluster.world_size
    from dtorch.progress import search_progress

    cb, shown = search_progress(f"planning {args.model} on {cluster.world_size:,} devices",
                                enabled=True if args.progress else None)
    result = search(profile, cluster, global_batch=gb, fixed=parse_fix(args.fix), top_k=args.top, dtype=args.dtype,
                    progress=cb, steps=args.steps, constants=constants)
    shown.close(f"searched {result.meshes:,} meshes, {result.evaluated:,} plans estimated")
    if not result.ranked:
        if args.json:
            print(json.dumps({"error": "no plan fits in memory", "suggestions": result.suggestions,
                              "rejected": result.rejected, "not_offered": result.refused}, indent=2))
        else:
            print(explain(result))
        return 1
    plan, est = result.ranked[0]
    plan.model = args.model
    plan.cluster = args.cluster or cluster.name
    plan.predicted = est.to_dict()
    verify_result = None
    if args.verify:
        from dtorch.parallel.dryrun import verify  # imports torch: only when asked

        verify_result = verify(plan, args.model, args.seq_len, cluster=cluster)
    if args.out:
        plan.save(args.out)
    if args.json:
        doc = plan.to_dict()
        if verify_result is not None:
            doc["verify"] = verify_result
        print(json.dumps(doc, indent=2))
    else:
        from dtorch.cluster.calibration_store import describe_calibration

        print(explain(result))
        print(describe_calibration(cluster))
        if verify_result is not None:
            print()
            print(_format_verify(verify_result))
        if args.out:
            print(f"\nplan written to {args.out}")
    return 0
