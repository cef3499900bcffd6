"""The calibration store: where `dtorch probe` keeps what it measured, one JSON document per cluster
name, and how a Cluster takes it. Torch-free, below the planner: `load_cluster` applies a stored
calibration before the planner sees the cluster, and `dtorch.monitor.feedback` adds its corrections.

Where: $DTORCH_CALIBRATION_DIR, else ~/.cache/dtorch/calibration; $DTORCH_NO_CALIBRATION ignores
every stored calibration. The document's fields: `dtorch.cluster.probe`.

This store is shared by every job of the user: it changes only by `dtorch probe` or an explicit
request (`adopt_feedback`). A run's own runtime feedback goes to its job directory
(`dtorch.monitor.feedback`), so a chaos drill or a throttled run never moves the next plan.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from dtorch import env
from dtorch.cluster.spec import Cluster, Link
from dtorch.docio import read_document
from dtorch.errors import ConfigError

CALIBRATION_VERSION = 1
ENV_DIR = "DTORCH_CALIBRATION_DIR"
ENV_DISABLE = "DTORCH_NO_CALIBRATION"


def calibration_dir() -> Path:
    """Where calibrations live: $DTORCH_CALIBRATION_DIR, else ~/.cache/dtorch/calibration."""
    where = env.current().calibration_dir
    return Path(where) if where else Path.home() / ".cache" / "dtorch" / "calibration"


def calibration_path(cluster_name: str) -> Path:
    """The file for a cluster name (``local:1x4`` -> ``local_1x4.json``)."""
    safe = re.sub(r"[^A-Za-z0-9_.+-]+", "_", cluster_name).strip("_") or "cluster"
    return calibration_dir() / f"{safe}.json"


def validate_calibration(doc: Any, source: str = "calibration") -> dict:
    """Check the fields the planner reads; raise ConfigError naming the field. Returns `doc`."""
    if not isinstance(doc, dict):
        raise ConfigError(source, type(doc).__name__, "a calibration is a JSON mapping written by `dtorch probe`")
    if doc.get("version") != CALIBRATION_VERSION:
        raise ConfigError(f"{source}.version", doc.get("version"),
                          f"this DTorch reads calibration version {CALIBRATION_VERSION}; run `dtorch probe` again")
    dev = doc.get("device", {})
    if not isinstance(dev, dict):
        raise ConfigError(f"{source}.device", dev, "must be a mapping")
    for dtype, v in (dev.get("peak_flops") or {}).items():
        if not (isinstance(v, (int, float)) and v > 0):
            raise ConfigError(f"{source}.device.peak_flops.{dtype}", v, "must be a positive FLOP/s")
    eff = dev.get("matmul_efficiency")
    if eff is not None and not (isinstance(eff, (int, float)) and 0 < eff <= 1):
        raise ConfigError(f"{source}.device.matmul_efficiency", eff, "a fraction in (0, 1]")
    bw = dev.get("memory_bandwidth")
    if bw is not None and not (isinstance(bw, (int, float)) and bw > 0):
        raise ConfigError(f"{source}.device.memory_bandwidth", bw, "must be positive bytes/s")
    for i, r in enumerate(doc.get("attention") or []):
        ok = isinstance(r, dict) and all(isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)
                                          and r.get(k) > 0 for k in ("head_dim", "seq", "flops"))
        if not ok or not isinstance(r.get("dtype"), str):
            raise ConfigError(f"{source}.attention[{i}]", r, "a {dtype, head_dim, seq, flops} row with positive "
                              "numbers, as `dtorch probe` writes it; run `dtorch probe` again")
    for cls, link in (doc.get("links") or {}).items():
        if cls not in ("intra", "inter") or not isinstance(link, dict):
            raise ConfigError(f"{source}.links.{cls}", link, "link classes are intra and inter, each a mapping")
        for key in ("bandwidth", "latency"):
            v = link.get(key)
            if not (isinstance(v, (int, float)) and v >= 0 and (key == "latency" or v > 0)):
                raise ConfigError(f"{source}.links.{cls}.{key}", v, "must be a positive number")
        skew = link.get("sync_skew")
        if skew is not None and not (isinstance(skew, list) and all(
                isinstance(r, list) and len(r) in (2, 3) and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                            and x >= 0 for x in r) for r in skew)):
            raise ConfigError(f"{source}.links.{cls}.sync_skew", skew,
                              "a list of [segment s, skew s, group size] rows of non-negative numbers; "
                              "run `dtorch probe` again")
        for key in ("a2a_bandwidth", "a2a_latency"):  # optional: the all-to-all fit (older probes lack it)
            v = link.get(key)
            if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
                                      and (key == "a2a_latency" or v > 0)):
                raise ConfigError(f"{source}.links.{cls}.{key}", v,
                                  "must be a positive number; run `dtorch probe` again")
    host = doc.get("host_optimizer")
    if host is not None:
        if not isinstance(host, dict):
            raise ConfigError(f"{source}.host_optimizer", host, "a mapping written by `dtorch probe`")
        for key, v in host.items():
            if key.endswith("_per_s") and not (isinstance(v, (int, float)) and v > 0):
                raise ConfigError(f"{source}.host_optimizer.{key}", v, "must be positive per second")
    disk = doc.get("disk")
    if disk is not None:
        if not isinstance(disk, dict):
            raise ConfigError(f"{source}.disk", disk, "a mapping written by `dtorch probe --disk DIR`")
        for key in ("read_bytes_per_s", "write_bytes_per_s", "read_write_bytes_per_s", "free_bytes"):
            v = disk.get(key)
            if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0):
                raise ConfigError(f"{source}.disk.{key}", v, "must be a positive number; run `dtorch probe --disk DIR` again")
    return doc


def record_disk(disk: dict, path: str | Path) -> Path:
    """Merge a `measure_disk` result into the calibration file at `path` as its `disk` entry (a file
    holding only that entry is made if none exists): the planner then prices the NVMe optimizer
    tier with this disk's bandwidth and checks its free bytes (`apply_calibration`)."""
    p = Path(path).expanduser()
    doc = read_calibration(p) if p.exists() else {"version": CALIBRATION_VERSION}
    doc["disk"] = {k: disk[k] for k in ("directory", "bytes", "read_bytes_per_s", "write_bytes_per_s",
                                       "read_write_bytes_per_s", "free_bytes", "mode", "chunk_bytes") if k in disk}
    return write_calibration(doc, p)


def read_calibration(path: str | Path) -> dict:
    """Read and validate a calibration file (JSON, or YAML by suffix)."""
    p = Path(path)
    doc = read_document(p, "calibration", "calibration file", "delete it or run `dtorch probe` again")
    return validate_calibration(doc, str(p))


def write_calibration(doc: dict, path: str | Path) -> Path:
    """Write `doc` atomically (temp file + rename) as JSON, or YAML by suffix. Returns the path.
    Concurrent writers never tear the file; the last one wins."""
    validate_calibration(doc)
    p = Path(path).expanduser()
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.suffix in (".yaml", ".yml"):
        import yaml

        text = yaml.safe_dump(doc, sort_keys=False)
    else:
        text = json.dumps(doc, indent=1) + "\n"
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.")
    os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide a cluster's calibration from its other users
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)  # a reader never sees a half-written calibration
    return p


def stored_calibration(cluster_name: str) -> dict | None:
    """The stored calibration for `cluster_name`, or None (none stored, disabled by
    $DTORCH_NO_CALIBRATION, or unreadable: a broken cache file must not stop a job, so it is ignored)."""
    if env.current().no_calibration:
        return None
    p = calibration_path(cluster_name)
    if not p.is_file():
        return None
    try:
        return read_calibration(p)
    except ConfigError:
        return None


def apply_calibration(cluster: Cluster, doc: dict) -> Cluster:
    """A copy of `cluster` with the measured numbers of `doc` merged over the preset/nominal ones.

    Device: measured peak FLOP/s per dtype (unmeasured dtypes keep the preset's), matmul efficiency
    (times a runtime-feedback correction if one is stored), memory bandwidth; memory capacity is
    lowered when feedback found memory above prediction (the planner then keeps that headroom).
    The attention kernel's measured speed per dtype and shape (`DeviceType.attention_flops`).
    Links: the measured alpha-beta per link class. Disk (`dtorch probe --disk`): read and write
    bandwidth (cache dropped) and free bytes per node, unless the cluster file gives them. Host
    optimizer (`dtorch.cluster.host`): CPU AdamW parameters/s and pinned copy bandwidth, likewise. The device name gets a ``*`` so that the cost
    model's per-name efficiency table no longer overrides the measured efficiency. The whole
    document is kept in `cluster.calibration`."""
    dev_doc = doc.get("device") or {}
    fb = doc.get("feedback") or {}
    links = doc.get("links") or {}
    groups = []
    for g in cluster.groups:
        dev = g.device
        if dev_doc.get("device_kind", doc.get("device_kind", dev.kind)) != dev.kind:
            groups.append(g)  # a calibration of another device kind says nothing about this group
            continue
        peak = {**dev.peak_flops, **(dev_doc.get("peak_flops") or {})}
        eff = float(dev_doc.get("matmul_efficiency", dev.matmul_efficiency))
        eff = min(1.0, max(1e-4, eff * float(fb.get("compute_scale", 1.0))))
        mem = dev.memory_bytes
        mscale = float(fb.get("memory_scale", 1.0))
        if mscale > 1.0:
            mem = int(mem / mscale)
        dev = dataclasses.replace(
            dev,
            name=dev.name if dev.name.endswith("*") else dev.name + "*",
            peak_flops=peak,
            matmul_efficiency=eff,
            memory_bandwidth=float(dev_doc.get("memory_bandwidth", dev.memory_bandwidth)),
            memory_bytes=mem,
            # runtime feedback's compute_scale is one speed for the device: its arithmetic and its host
            op_overhead_s=float(doc.get("op_overhead_s", dev.op_overhead_s)) / float(fb.get("compute_scale", 1.0)),
            dtensor_op_overhead_s=float(doc.get("dtensor_op_overhead_s", dev.dtensor_op_overhead_s))
            / float(fb.get("compute_scale", 1.0)),
            attention_flops=_attention(doc.get("attention"), dev.attention_flops),
        )
        intra, inter = g.intra, g.inter
        if "intra" in links:
            intra = _link(links["intra"], intra)
        if "inter" in links:
            inter = _link(links["inter"], inter)
        disk = doc.get("disk") or {}
        groups.append(dataclasses.replace(
            g, device=dev, intra=intra, inter=inter,
            disk_bytes=g.disk_bytes or int(disk.get("free_bytes", 0)),
            disk_read_bytes_per_s=g.disk_read_bytes_per_s or float(disk.get("read_bytes_per_s", 0.0)),
            disk_write_bytes_per_s=g.disk_write_bytes_per_s or float(disk.get("write_bytes_per_s", 0.0)),
            disk_read_write_bytes_per_s=(g.disk_read_write_bytes_per_s
                                         or float(disk.get("read_write_bytes_per_s", 0.0))),
            **_host_fields(g, doc.get("host_optimizer") or {})))
    return Cluster(groups=groups, name=cluster.name, calibration={**cluster.calibration, **doc})


def _attention(rows, default: dict) -> dict:
    """`DeviceType.attention_flops` from the probe's ``attention`` rows (older probes: `default`)."""
    if not rows:
        return default
    out: dict[str, list] = {}
    for r in rows:
        out.setdefault(str(r["dtype"]), []).append((float(r["head_dim"]), float(r["seq"]), float(r["flops"])))
    return {dt: tuple(v) for dt, v in out.items()}


def _host_fields(g, host: dict) -> dict:
    """The node group's host-optimizer figures from `dtorch probe` (`dtorch.cluster.host`), unless
    the cluster file gives them."""
    link = min((float(host[k]) for k in ("h2d_bytes_per_s", "d2h_bytes_per_s") if k in host), default=0.0)
    if not link and g.device.kind == "cpu" and "copy_bytes_per_s" in host:
        link = float(host["copy_bytes_per_s"]) / 2  # a CPU's "host link" is a copy: bytes moved per second
    return {"host_adam_params_per_s": g.host_adam_params_per_s or float(host.get("adam_fused_params_per_s", 0.0)),
            "host_adam_loop_params_per_s": g.host_adam_loop_params_per_s
            or float(host.get("adam_loop_params_per_s", 0.0)),
            "host_link_bytes_per_s": g.host_link_bytes_per_s or link}


def _link(d: dict, base: Link) -> Link:
    return Link(kind=d.get("kind", base.kind), bandwidth=float(d["bandwidth"]), latency=float(d["latency"]),
                efficiency=float(d.get("efficiency", 1.0)), p2p_latency=float(d.get("p2p_latency", 0.0)),
                unit_gather_s=float(d.get("unit_gather_s", 0.0)), unit_reduce_s=float(d.get("unit_reduce_s", 0.0)),
                unit_gather_s_per_byte=float(d.get("unit_gather_s_per_byte", 0.0)),
                unit_reduce_s_per_byte=float(d.get("unit_reduce_s_per_byte", 0.0)),
                func_latency_s=float(d.get("func_latency_s", 0.0)),
                a2a_bandwidth=float(d.get("a2a_bandwidth", 0.0)), a2a_latency=float(d.get("a2a_latency", 0.0)),
                sync_skew=tuple(tuple(float(x) for x in r) for r in d.get("sync_skew") or ()))


def with_stored_calibration(cluster: Cluster, name: str | None = None) -> Cluster:
    """`cluster` with the calibration stored for `name` (default: its own name) applied, if any;
    its file is kept as ``cluster.calibration["path"]`` (`describe_calibration`)."""
    doc = stored_calibration(name or cluster.name)
    if doc is None:
        return cluster
    return apply_calibration(cluster, {**doc, "path": str(calibration_path(name or cluster.name))})


def describe_calibration(cluster: Cluster) -> str:
    """One line naming the calibration a plan was made with: the stored file (and how many runs'
    feedback it holds), the cluster file's own section, or none (preset or detected figures)."""
    doc = cluster.calibration or {}
    if not doc:
        why = f"disabled by ${ENV_DISABLE}; " if env.current().no_calibration else ""
        return f"calibration: none ({why}preset or detected figures; `dtorch probe` measures this machine)"
    fb = doc.get("feedback") or {}
    extra = f", runtime feedback of {fb.get('samples', 0)} run(s)" if fb else ""
    return f"calibration: {doc.get('path', 'from the cluster file')}{extra}"


def adopt_feedback(job_calibration: str | Path, cluster_name: str) -> Path:
    """Copy the runtime feedback a clean run wrote into its job directory (``calibration.json``,
    `dtorch.monitor.feedback`) into the shared calibration of `cluster_name`: the explicit way a
    run's measurements move the next plans. Returns the shared file's path."""
    src = read_calibration(job_calibration)
    if not src.get("feedback"):
        raise ConfigError("job_calibration", str(job_calibration),
                          "holds no runtime feedback; give the calibration.json of a finished clean run")
    doc = stored_calibration(cluster_name) or {
        "version": CALIBRATION_VERSION, "cluster": cluster_name, "device": {}, "links": {},
    }
    return write_calibration({**doc, "feedback": src["feedback"]}, calibration_path(cluster_name))
