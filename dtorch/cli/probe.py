"""`dtorch probe`: measure this machine (or the launched job's cluster) and store a calibration.

    dtorch probe                       # this machine, one process per GPU (one process on a CPU)
    dtorch probe --nproc 4             # 4 ranks at once: the numbers a 4-rank job gets per rank
    dtorch probe --nproc 2,4 --quick   # one calibration per job size, quick shapes
    dtorch run --nproc-per-node 8 -m dtorch.cli probe   # inside a launched job (all ranks probe)
    dtorch probe --disk /local/nvme/tmp   # only the disk: write/read bandwidth (the NVMe optimizer tier),
                                          # recorded in this host's stored calibrations (or --out FILE)

The calibration goes to ~/.cache/dtorch/calibration/<cluster>.json (or --out); `local_cluster()`
and `load_cluster("detect")` merge it over the nominal numbers, so the next plan uses it.
"""

from __future__ import annotations

import argparse
import json
import sys

from dtorch.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("probe", help=help_text, description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", default=None,
                   help="processes to spawn on this machine (comma list for several job sizes); "
                        "ignored inside a launched job")
    p.add_argument("--quick", action="store_true", help="fewer shapes and sizes (a few seconds)")
    p.add_argument("--out", default=None, help="calibration file (default: the cache path for the cluster name)")
    p.add_argument("--dtypes", default=None, help="GEMM dtypes, comma list (default float32,bfloat16)")
    p.add_argument("--json", action="store_true", help="print the calibration document")
    p.add_argument("--disk", default=None, metavar="DIR",
                   help="measure the disk holding DIR with the NVMe tier's own I/O (direct I/O, else synced and uncached), record it "
                        "in the calibration (--out FILE, else every calibration stored for this host) and stop")
    p.add_argument("--cluster-out", default=None, metavar="FILE",
                   help="also write the measured cluster (YAML/JSON by suffix) for --cluster: ranks whose measured "
                        "speed differs by more than --speed-threshold become node groups of their own, each with "
                        "its measured peak and memory (docs/heterogeneous.md)")
    p.add_argument("--speed-threshold", type=float, default=None,
                   help="fraction of speed that separates two groups (default 0.15)")
    p.add_argument("--disk-bytes", type=int, default=1024 * 2**20,
                   help="bytes written and read by --disk (default 1 GiB, 16 files of the tier's 64 MiB blocks)")
    p.set_defaults(func=run)


def _nprocs(text: str | None) -> list[int | None]:
    if text is None:
        return [None]
    try:
        out = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ConfigError("nproc", text, "give a process count or a comma list, e.g. 4 or 2,4") from None
    if not out or any(n < 1 for n in out):
        raise ConfigError("nproc", text, "process counts must be positive, e.g. 4 or 2,4")
    return out


def _record_disk(doc: dict, out: str | None) -> list:
    """Where `dtorch probe --disk` records its figures: `out`, else every stored calibration this
    host wrote (one per job size); none stored: say how to make one."""
    import socket

    from dtorch.cluster.calibration_store import calibration_dir, read_calibration, record_disk

    if out:
        return [record_disk(doc, out)]
    paths = []
    for p in sorted(calibration_dir().glob("*.json")) if calibration_dir().is_dir() else []:
        try:
            if read_calibration(p).get("host") == socket.gethostname():
                paths.append(record_disk(doc, p))
        except ConfigError:
            continue  # another version's or a damaged file: not ours to rewrite
    if not paths:
        print("no calibration stored for this host: run `dtorch probe` first, or give --out FILE to record the disk")
    return paths


def _write_cluster(doc: dict, out: str, threshold: float | None) -> None:
    """The measured cluster file: one node group per class of ranks that measured alike."""
    from dtorch.cluster.load import save_cluster
    from dtorch.cluster.probe import measured_groups

    cluster = measured_groups(doc, threshold)
    save_cluster(cluster, out)
    main = "float32" if cluster.groups[0].device.kind == "cpu" else "bfloat16"
    kinds = ", ".join(f"{g.num_devices} x {g.device.name} ({g.device.peak_flops.get(main, 0.0) / 1e9:.1f} GFLOP/s "
                      f"{main})" for g in cluster.groups)
    print(f"wrote {out}: {len(cluster.groups)} group{'s' if len(cluster.groups) > 1 else ''}: {kinds}")


def run(args: argparse.Namespace) -> int:
    from dtorch.cluster.probe import run_probe, summary

    if getattr(args, "disk", None):
        from dtorch.cluster.disk import measure_disk
        from dtorch.cluster.disk import summary as disk_summary

        doc = measure_disk(args.disk, nbytes=args.disk_bytes)
        print(json.dumps(doc, indent=1) if args.json else disk_summary(doc))
        for path in _record_disk(doc, args.out):
            print(f"recorded in {path}")
        return 0
    nprocs = _nprocs(args.nproc)
    if args.out and len(nprocs) > 1:
        raise ConfigError("out", args.out, "one --out file holds one calibration; give a single --nproc")
    if getattr(args, "cluster_out", None) and len(nprocs) > 1:
        raise ConfigError("cluster-out", args.cluster_out, "one cluster file holds one job size; give a single --nproc")
    if args.speed_threshold is not None and not 0 < args.speed_threshold < 1:
        raise ConfigError("speed-threshold", args.speed_threshold, "a fraction in (0, 1), e.g. 0.15")
    dtypes = [d.strip() for d in args.dtypes.split(",")] if args.dtypes else None
    for d in dtypes or []:
        if d not in ("float32", "bfloat16", "float16"):
            raise ConfigError("dtypes", d, "use float32, bfloat16 or float16")
    for n in nprocs:
        doc, path = run_probe(n, quick=args.quick, out=args.out, dtypes=dtypes)
        if path is None:
            continue  # not rank 0 of a launched job
        if args.json:
            print(json.dumps(doc, indent=1))
        else:
            print(summary(doc))
            print(f"wrote {path}")
        if getattr(args, "cluster_out", None):
            _write_cluster(doc, args.cluster_out, args.speed_threshold)
        sys.stdout.flush()
    return 0
