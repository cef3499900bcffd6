"""`dtorch run`: elastic, fault-tolerant launch of a training script (torchrun-compatible flags).

    dtorch run --nnodes 1:4 --nproc-per-node 8 --rdzv-endpoint head:29400 --rdzv-id job7 train.py --lr 3e-4
    dtorch run --nproc-per-node 4 --chaos "kill:rank=1:step=5" train.py      # a chaos drill
    dtorch run --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 train.py  # torchrun's static launch

torchrun's rendezvous rule holds: `--node-rank`, `--master-addr` or `--master-port` without
`--rdzv-backend` choose the static rendezvous (fixed nodes, given ranks; on one node without a
port, the c10d one on a free port, as torchrun does). A combination that cannot be honoured is a
ConfigError, never ignored.

See `dtorch.elastic.launch` for what is added to torchrun's agent, `dtorch.elastic.chaos` for the
drill syntax.
"""

from __future__ import annotations

import argparse
import sys

from dtorch.errors import ConfigError


def _conf(text: str) -> dict[str, str]:
    out = {}
    for kv in filter(None, text.split(",")):
        k, sep, v = kv.partition("=")
        if not sep:
            raise ConfigError("rdzv_conf", text, "use KEY=VALUE[,KEY=VALUE...], e.g. last_call_timeout=1")
        out[k.strip()] = v.strip()
    return out


def add_parser(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("run", help=help_text, description=help_text)
    g = p.add_argument_group("torchrun-compatible")
    g.add_argument("--nnodes", default=None,
                   help="N or MIN:MAX nodes (elastic between MIN and MAX); default 1, or the allocation's")
    g.add_argument("--nproc-per-node", "--nproc_per_node", default=None,
                   help="workers per node: a number, or 'auto' (one per GPU, else 1); default 1, or the allocation's")
    g.add_argument("--rdzv-backend", "--rdzv_backend", default=None,
                   help="c10d (elastic, the default) or static (fixed nodes; the default with --node-rank, "
                        "--master-addr or --master-port, as in torchrun)")
    g.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=None,
                   help="HOST:PORT of the rendezvous store; default loopback with a free port (one node), or "
                        "inside a Slurm/Kubeflow/SkyPilot allocation its first node. Its rendezvous state is "
                        "signed with DTORCH_KEY (or the key file); use a private address for many nodes")
    g.add_argument("--rdzv-id", "--rdzv_id", default=None, help="job id shared by every node")
    g.add_argument("--rdzv-conf", "--rdzv_conf", default="", type=_conf,
                   help="KEY=VALUE,... rendezvous settings (override DTorch's fast defaults)")
    g.add_argument("--standalone", action="store_true",
                   help="one node, rendezvous on a free local port (torchrun's --standalone; other "
                        "rendezvous flags with it are an error)")
    g.add_argument("--max-restarts", "--max_restarts", type=int, default=None,
                   help="restarts of the worker group before the job fails (default 3; 0 for a static "
                        "rendezvous of several nodes, which cannot restart one node alone)")
    g.add_argument("--monitor-interval", "--monitor_interval", type=float, default=0.1,
                   help="seconds between checks of the workers (default 0.1)")
    g.add_argument("--local-addr", "--local_addr", default=None, help="this node's address for the others")
    g.add_argument("--node-rank", "--node_rank", type=int, default=None,
                   help="this node's rank, static rendezvous (default 0)")
    g.add_argument("--master-addr", "--master_addr", default=None,
                   help="node 0's address for the static rendezvous (default 127.0.0.1)")
    g.add_argument("--master-port", "--master_port", type=int, default=None,
                   help="node 0's port for the static rendezvous (default 29500)")
    g.add_argument("--log-dir", "--log_dir", default=None,
                   help="base directory of the workers' log files; a job directory named after the rdzv id "
                        "is made in it (default RUN_DIR/logs)")
    g.add_argument("-r", "--redirects", default="0",
                   help="std streams to a log file only: 0 none, 1 stdout, 2 stderr, 3 both; for every local "
                        "rank (3) or per rank (0:3,1:2)")
    g.add_argument("-t", "--tee", default="0", help="std streams to a log file and the console (as --redirects)")
    g.add_argument("--local-ranks-filter", "--local_ranks_filter", default="",
                   help="show only these local ranks' output on the console, e.g. 0")
    g.add_argument("-m", "--module", action="store_true", help="run TARGET as a module (python -m)")
    g.add_argument("--no-python", "--no_python", action="store_true",
                   help="run TARGET as an executable (it should call dtorch.elastic.worker.setup())")
    d = p.add_argument_group("DTorch")
    d.add_argument("--heartbeat-timeout", type=float, default=30.0,
                   help="seconds without training-loop progress before a rank is declared hung (default 30; 0 = off)")
    d.add_argument("--startup-timeout", type=float, default=None,
                   help="seconds a rank may take to its first beat once others beat (default 10x heartbeat)")
    d.add_argument("--chaos", default="", help="fault-injection drill, e.g. 'kill:rank=1:step=5;every=20:kill'")
    d.add_argument("--run-dir", default=None, help="heartbeats, dumps and events.jsonl (default $TMPDIR/dtorch-ID)")
    d.add_argument("--start-method", default="forkserver", choices=("forkserver", "spawn"),
                   help="forkserver (default): workers fork from a server that imported torch once, so a "
                        "restart takes a fork; spawn: a fresh interpreter per worker, as torchrun")
    d.add_argument("--snapshot-every", type=int, default=1,
                   help="steps between in-memory snapshots of DTorch's trainer (default 1; 0 = off)")
    d.add_argument("--shutdown-timeout", type=int, default=5, help="seconds from SIGTERM to SIGKILL (default 5)")
    p.add_argument("target", help="training script (or module with -m, executable with --no-python)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=run)


def _nproc(text: str) -> int:
    if text in ("auto", "gpu"):
        import torch

        return max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1
    if text == "cpu":
        return 1
    try:
        return int(text)
    except ValueError:
        raise ConfigError("nproc_per_node", text, "use a number, 'auto', 'gpu' or 'cpu'") from None


def rendezvous(args: argparse.Namespace, max_nodes: int) -> tuple[str, str | None]:
    """(backend, endpoint) from the rendezvous flags, by torchrun's rule (`config_from_args`):
    `--node-rank`/`--master-addr`/`--master-port` without `--rdzv-backend` mean the static
    rendezvous at MASTER_ADDR:MASTER_PORT (127.0.0.1:29500 by default); on one node with neither a
    port nor an endpoint, the c10d rendezvous on a free port. Where torchrun would warn and ignore a
    flag, a ConfigError. Endpoint None: not given (the allocation's or the default applies)."""
    static_flags = {k: v for k, v in (("node_rank", args.node_rank), ("master_addr", args.master_addr),
                                      ("master_port", args.master_port)) if v is not None}
    if args.standalone:  # torchrun: a local c10d rendezvous on a free port, explicit values ignored
        given = {**static_flags, "rdzv_backend": args.rdzv_backend, "rdzv_endpoint": args.rdzv_endpoint}
        name, value = next(((k, v) for k, v in given.items() if v is not None), (None, None))
        if name is not None:
            raise ConfigError(name, value, "--standalone is one node on a free local port: drop "
                              f"--{name.replace('_', '-')} or --standalone")
        if max_nodes > 1:
            raise ConfigError("nnodes", args.nnodes, "--standalone is one node: drop --standalone or use --nnodes 1")
        return "c10d", "127.0.0.1:0"
    backend = args.rdzv_backend or ("static" if static_flags else "c10d")
    if backend != "static":
        if static_flags:
            name, value = next(iter(static_flags.items()))
            raise ConfigError(name, value, f"--{name.replace('_', '-')} is for the static rendezvous; with "
                              f"--rdzv-backend {backend} use --rdzv-endpoint HOST:PORT (nodes are ranked at "
                              "the rendezvous), or drop --rdzv-backend")
        return backend, args.rdzv_endpoint
    master = args.master_addr is not None or args.master_port is not None
    if args.rdzv_endpoint is not None and master:
        raise ConfigError("master_addr" if args.master_addr is not None else "master_port",
                          args.master_addr if args.master_addr is not None else args.master_port,
                          "give node 0's address either as --rdzv-endpoint HOST:PORT or as --master-addr/--master-port")
    if args.rdzv_endpoint is not None:
        return backend, args.rdzv_endpoint
    if max_nodes == 1 and args.master_port is None:
        return "c10d", (args.master_addr or "127.0.0.1") + ":0"
    return backend, f"{args.master_addr or '127.0.0.1'}:{args.master_port or 29500}"


def run(args: argparse.Namespace) -> int:
    from dtorch.elastic.bootstrap import early_forkserver

    # its torch import beside ours and the rendezvous
    with early_forkserver(args.start_method == "forkserver" and not args.no_python):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from dtorch.elastic.launch import LaunchSpec, launch, parse_nnodes
    from dtorch.integrations.env import launch_defaults

    # Inside a Slurm / Kubeflow / Volcano / SkyPilot allocation, flags not given come from it.
    alloc = launch_defaults()
    for name, fallback in (("nnodes", "1"), ("nproc_per_node", "1"), ("rdzv_id", None)):
        if getattr(args, name) is None:
            setattr(args, name, alloc.get(name, fallback))
    backend, endpoint = rendezvous(args, parse_nnodes(args.nnodes)[1])
    if endpoint is None:  # c10d without an endpoint: the allocation's first node, or loopback
        endpoint = alloc.get("rdzv_endpoint", "127.0.0.1:0")
    args.rdzv_backend, args.rdzv_endpoint = backend, endpoint
    if args.max_restarts is None:
        args.max_restarts = 0 if backend == "static" and parse_nnodes(args.nnodes)[1] > 1 else 3
    if alloc:
        print(f"dtorch run: inside a {alloc['scheduler']} allocation: nnodes={args.nnodes} "
              f"nproc_per_node={args.nproc_per_node} rendezvous {args.rdzv_endpoint} id {args.rdzv_id}",
              file=sys.stderr, flush=True)
    lo, hi = parse_nnodes(args.nnodes)
    spec = LaunchSpec(min_nodes=lo, max_nodes=hi, nproc_per_node=_nproc(args.nproc_per_node),
                      rdzv_backend=args.rdzv_backend, rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id,
                      rdzv_conf=args.rdzv_conf, max_restarts=args.max_restarts,
                      monitor_interval=args.monitor_interval, heartbeat_timeout=args.heartbeat_timeout,
                      startup_timeout=args.startup_timeout, chaos=args.chaos, run_dir=args.run_dir,
                      local_addr=args.local_addr, shutdown_timeout=args.shutdown_timeout,
                      start_method=args.start_method, snapshot_every=args.snapshot_every,
                      node_rank=args.node_rank if backend == "static" else None, log_dir=args.log_dir,
                      redirects=args.redirects, tee=args.tee, local_ranks_filter=args.local_ranks_filter)
    return launch(spec, args.target, list(args.args), module=args.module, no_python=args.no_python)
