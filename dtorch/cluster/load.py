"""Build a Cluster from a preset, a shorthand, a YAML/JSON file, or this machine.

Shorthand: ``h100:8x8`` is 8 nodes x 8 GPUs, ``h100:8`` one node of 8, ``h100`` one node of the
preset's default size; node groups of different types join with ``+``: ``h100:4x8+a100:2x8``.

File format (YAML or JSON; `save_cluster` writes it, `load_cluster` reads it back)::

    name: my-cluster
    groups:
      - device: h100            # a preset name, or a mapping: name, peak_flops, memory_bytes, ...
        num_nodes: 4
        devices_per_node: 8
        intra: {kind: nvlink, bandwidth: 4.5e+11, latency: 2.0e-06, efficiency: 0.8}   # optional
        inter: {kind: ib, bandwidth: 5.0e+10, latency: 5.0e-06}                       # optional
        host_memory_bytes: 2199023255552                                              # optional
        disk_bytes: 3.0e+12           # optional: local disk the NVMe optimizer tier may fill, per node
        disk_read_bytes_per_s: 3.0e+9 # optional (else `dtorch probe --disk`'s, else a nominal figure)
        disk_write_bytes_per_s: 1.5e+9
        host_adam_params_per_s: 2.0e+9  # optional (else `dtorch probe`'s): fused CPU AdamW per rank
        host_link_bytes_per_s: 2.5e+10  # optional: pinned host <-> device copies per device
    calibration: {}             # written by `dtorch probe`

Every malformed value raises ConfigError naming the field path (``groups[0].num_nodes``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any

from dtorch.cluster.local import default_workers, local_cluster
from dtorch.cluster.presets import DEVICES, NODE_DEFAULTS, canonical, preset_names
from dtorch.cluster.spec import Cluster, DeviceType, Link, NodeGroup
from dtorch.docio import read_document
from dtorch.errors import ConfigError, choices

_SHORT = re.compile(r"^\s*([A-Za-z0-9_\-]+)\s*(?::\s*(\d+)\s*(?:[xX*]\s*(\d+))?)?\s*$")
INTRA_KINDS = ("nvlink", "xgmi", "pcie", "shm")
INTER_KINDS = ("ib", "roce", "ethernet")


HOST_OPTIMIZER_FIELDS = ("host_adam_params_per_s", "host_adam_loop_params_per_s", "host_link_bytes_per_s")
"""Optional node-group figures of the host optimizer tier (else `dtorch probe`'s, else nominal)."""

def _preset_device(name: str, field: str) -> str:
    key = canonical(name)
    if key is None:
        raise ConfigError(field, name, f"unknown device preset; {choices(preset_names())}")
    return key


def preset_group(device: str, num_nodes: int = 1, devices_per_node: int | None = None) -> NodeGroup:
    """A NodeGroup of a preset device type with the preset's links and node size."""
    key = _preset_device(device, "device")
    intra, inter, dpn, host = NODE_DEFAULTS[key]
    return NodeGroup(DEVICES[key], num_nodes, devices_per_node or dpn, intra, inter, host)


def parse_shorthand(spec: str) -> Cluster:
    """``h100:8x8`` / ``h100:8`` / ``h100`` / ``h100:4x8+a100:2x8`` -> Cluster."""
    groups = []
    for part in spec.split("+"):
        m = _SHORT.match(part)
        if not m:
            raise ConfigError(
                "cluster", spec,
                "use a preset shorthand like h100:8x8 (nodes x GPUs per node), h100:4x8+a100:2x8, or a .yaml/.json file",
            )
        name, a, b = m.groups()
        key = _preset_device(name, "cluster")
        if b is not None:
            nodes, per = int(a), int(b)
        elif a is not None:
            nodes, per = 1, int(a)
        else:
            nodes, per = 1, None
        if nodes < 1 or (per is not None and per < 1):
            raise ConfigError("cluster", part, "node and device counts must be positive, e.g. h100:8x8")
        groups.append(preset_group(key, nodes, per))
    return Cluster(groups=groups, name=spec.strip())


# ---- validation helpers --------------------------------------------------------------------------
def _num(d: dict, key: str, path: str, *, positive: bool = True, integer: bool = False, default: Any = None) -> Any:
    if key not in d:
        if default is not None:
            return default
        raise ConfigError(f"{path}.{key}", None, "missing; give a number")
    v = d[key]
    try:
        if isinstance(v, bool):
            raise TypeError
        x = float(v)
        if integer:
            if x != int(x):
                raise ValueError
            x = int(x)
    except (TypeError, ValueError):
        raise ConfigError(f"{path}.{key}", v, "must be an integer" if integer else "must be a number") from None
    if positive and not x > 0:
        raise ConfigError(f"{path}.{key}", v, "must be positive")
    return x


def _mapping(v: Any, path: str) -> dict:
    if not isinstance(v, dict):
        raise ConfigError(path, v if not isinstance(v, (list, dict)) else type(v).__name__, "must be a mapping")
    return v


def _link(v: Any, path: str, default: Link, kinds: tuple[str, ...]) -> Link:
    if v is None:
        return default
    d = _mapping(v, path)
    fields = ("kind", "bandwidth", "latency", "efficiency", "p2p_latency", "unit_gather_s", "unit_reduce_s",
              "unit_gather_s_per_byte", "unit_reduce_s_per_byte", "func_latency_s",
              "a2a_bandwidth", "a2a_latency", "sync_skew")
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise ConfigError(f"{path}.{unknown[0]}", d[unknown[0]], f"unknown link field; use {', '.join(fields)}")
    kind = d.get("kind", default.kind)
    if kind not in kinds:
        raise ConfigError(f"{path}.kind", kind, choices(kinds))
    eff = _num(d, "efficiency", path, default=default.efficiency)
    if eff > 1:
        raise ConfigError(f"{path}.efficiency", eff, "a fraction of line rate in (0, 1]")
    return Link(
        kind=kind,
        bandwidth=_num(d, "bandwidth", path, default=default.bandwidth),
        latency=_num(d, "latency", path, positive=False, default=default.latency),
        efficiency=eff,
        p2p_latency=_num(d, "p2p_latency", path, positive=False, default=default.p2p_latency),
        unit_gather_s=_num(d, "unit_gather_s", path, positive=False, default=default.unit_gather_s),
        unit_reduce_s=_num(d, "unit_reduce_s", path, positive=False, default=default.unit_reduce_s),
        unit_gather_s_per_byte=_num(d, "unit_gather_s_per_byte", path, positive=False,
                                    default=default.unit_gather_s_per_byte),
        unit_reduce_s_per_byte=_num(d, "unit_reduce_s_per_byte", path, positive=False,
                                    default=default.unit_reduce_s_per_byte),
        func_latency_s=_num(d, "func_latency_s", path, positive=False, default=default.func_latency_s),
        a2a_bandwidth=_num(d, "a2a_bandwidth", path, positive=False, default=default.a2a_bandwidth),
        a2a_latency=_num(d, "a2a_latency", path, positive=False, default=default.a2a_latency),
        sync_skew=_rows(d.get("sync_skew", default.sync_skew), f"{path}.sync_skew", (2, 3)),
    )


def _rows(v: Any, path: str, width: int | tuple[int, ...]) -> tuple[tuple[float, ...], ...]:
    """A table of non-negative numbers, `width` (or one of the widths) per row (a probed curve written
    out by `cluster_to_dict`)."""
    widths = (width,) if isinstance(width, int) else width
    if not isinstance(v, (list, tuple)) or not all(
            isinstance(r, (list, tuple)) and len(r) in widths
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in r) for r in v):
        raise ConfigError(path, v, f"a list of [{', '.join(['number'] * widths[-1])}] rows, as `dtorch probe` "
                          "measures them")
    return tuple(tuple(float(x) for x in r) for r in v)


def _device(v: Any, path: str) -> tuple[DeviceType, str | None]:
    if isinstance(v, str):
        key = _preset_device(v, path)
        return DEVICES[key], key
    d = _mapping(v, path)
    base_key = canonical(d["preset"]) if isinstance(d.get("preset"), str) else None
    if "preset" in d and base_key is None:
        raise ConfigError(f"{path}.preset", d["preset"], choices(preset_names()))
    base = DEVICES[base_key] if base_key else None
    known = {f.name for f in dataclasses.fields(DeviceType)} | {"preset"}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ConfigError(f"{path}.{unknown[0]}", d[unknown[0]], f"unknown device field; {choices(sorted(known))}")
    name = d.get("name", base.name if base else None)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{path}.name", name, "give the device a name (or a preset)")
    peak = d.get("peak_flops", base.peak_flops if base else None)
    peak = _mapping(peak, f"{path}.peak_flops")
    if not peak:
        raise ConfigError(f"{path}.peak_flops", peak, "give at least one dtype: {bfloat16: 9.89e+14}")
    peak = {str(k): _num(peak, k, f"{path}.peak_flops") for k in peak}
    kind = d.get("kind", base.kind if base else "cuda")
    if kind not in ("cuda", "rocm", "cpu"):
        raise ConfigError(f"{path}.kind", kind, choices(("cuda", "rocm", "cpu")))
    eff = _num(d, "matmul_efficiency", path, default=base.matmul_efficiency if base else 0.6)
    if eff > 1:
        raise ConfigError(f"{path}.matmul_efficiency", eff, "a fraction of peak in (0, 1]")
    dev = DeviceType(
        name=name,
        peak_flops=peak,
        memory_bytes=_num(d, "memory_bytes", path, integer=True, default=base.memory_bytes if base else None),
        memory_bandwidth=_num(d, "memory_bandwidth", path, default=base.memory_bandwidth if base else None),
        matmul_efficiency=eff,
        kind=kind,
        op_overhead_s=_num(d, "op_overhead_s", path, positive=False,
                           default=base.op_overhead_s if base else 0.0),
        dtensor_op_overhead_s=_num(d, "dtensor_op_overhead_s", path, positive=False,
                                   default=base.dtensor_op_overhead_s if base else 0.0),
        elementwise_speed=_speeds(d.get("elementwise_speed", base.elementwise_speed if base else {}),
                                  f"{path}.elementwise_speed"),
        attention_flops={str(dt): _rows(rows, f"{path}.attention_flops.{dt}", 3) for dt, rows in
                         _mapping(d.get("attention_flops", base.attention_flops if base else {}) or {},
                                  f"{path}.attention_flops").items()},
        mfu_peak_flops=_speeds(d.get("mfu_peak_flops", base.mfu_peak_flops if base else {}), f"{path}.mfu_peak_flops"),
    )
    return dev, base_key


def _speeds(v: Any, path: str) -> dict[str, float]:
    m = _mapping(v or {}, path)
    return {str(k): _num(m, k, path) for k in m}


def cluster_from_dict(data: Any, source: str = "cluster") -> Cluster:
    """Validate a parsed cluster document (see module doc) and build the Cluster."""
    d = _mapping(data, source)
    unknown = sorted(set(d) - {"name", "groups", "calibration"})
    if unknown:
        raise ConfigError(unknown[0], d[unknown[0]], "unknown cluster field; use name, groups, calibration")
    groups_raw = d.get("groups")
    if not isinstance(groups_raw, list) or not groups_raw:
        raise ConfigError("groups", groups_raw, "give a non-empty list of node groups (device, num_nodes, devices_per_node)")
    groups = []
    for i, g in enumerate(groups_raw):
        path = f"groups[{i}]"
        g = _mapping(g, path)
        allowed = {"device", "num_nodes", "devices_per_node", "intra", "inter", "host_memory_bytes", "host_cores",
                   "disk_bytes", "disk_read_bytes_per_s", "disk_write_bytes_per_s", "disk_read_write_bytes_per_s",
                   *HOST_OPTIMIZER_FIELDS}
        unknown = sorted(set(g) - allowed)
        if unknown:
            raise ConfigError(f"{path}.{unknown[0]}", g[unknown[0]], f"unknown node-group field; {choices(sorted(allowed))}")
        if "device" not in g:
            raise ConfigError(f"{path}.device", None, f"missing; a preset ({', '.join(preset_names())}) or a mapping")
        dev, key = _device(g["device"], f"{path}.device")
        d_intra, d_inter, d_per, d_host = NODE_DEFAULTS.get(key or "", NODE_DEFAULTS["h100-sxm"])
        if key is None and dev.kind == "cpu":
            d_intra, d_inter, d_per, d_host = NODE_DEFAULTS["cpu"]
        groups.append(NodeGroup(
            device=dev,
            num_nodes=_num(g, "num_nodes", path, integer=True, default=1),
            devices_per_node=_num(g, "devices_per_node", path, integer=True, default=d_per),
            intra=_link(g.get("intra"), f"{path}.intra", d_intra, INTRA_KINDS),
            inter=_link(g.get("inter"), f"{path}.inter", d_inter, INTER_KINDS),
            host_memory_bytes=_num(g, "host_memory_bytes", path, integer=True, positive=False, default=d_host),
            host_cores=_num(g, "host_cores", path, integer=True, positive=False, default=0),
            disk_bytes=_num(g, "disk_bytes", path, integer=True, positive=False, default=0),
            disk_read_bytes_per_s=_num(g, "disk_read_bytes_per_s", path, positive=False, default=0.0),
            disk_write_bytes_per_s=_num(g, "disk_write_bytes_per_s", path, positive=False, default=0.0),
            disk_read_write_bytes_per_s=_num(g, "disk_read_write_bytes_per_s", path, positive=False, default=0.0),
            **{k: _num(g, k, path, positive=False, default=0.0) for k in HOST_OPTIMIZER_FIELDS},
        ))
    name = d.get("name", "cluster")
    calib = d.get("calibration") or {}
    _mapping(calib, "calibration")
    return Cluster(groups=groups, name=str(name), calibration=dict(calib))


def cluster_to_dict(cluster: Cluster) -> dict[str, Any]:
    """The explicit document form (every number written out, so a reload is exact)."""
    return {
        "name": cluster.name,
        "groups": [
            {
                "device": dataclasses.asdict(g.device),
                "num_nodes": g.num_nodes,
                "devices_per_node": g.devices_per_node,
                "intra": dataclasses.asdict(g.intra),
                "inter": dataclasses.asdict(g.inter),
                "host_memory_bytes": g.host_memory_bytes,
                "host_cores": g.host_cores,
                "disk_bytes": g.disk_bytes,
                "disk_read_bytes_per_s": g.disk_read_bytes_per_s,
                "disk_write_bytes_per_s": g.disk_write_bytes_per_s,
                "disk_read_write_bytes_per_s": g.disk_read_write_bytes_per_s,
                **{k: getattr(g, k) for k in HOST_OPTIMIZER_FIELDS},
            }
            for g in cluster.groups
        ],
        "calibration": dict(cluster.calibration),
    }


def save_cluster(cluster: Cluster, path: str | Path) -> None:
    """Write a cluster as YAML (.yaml/.yml) or JSON (anything else)."""
    p = Path(path)
    doc = cluster_to_dict(cluster)
    if p.suffix in (".yaml", ".yml"):
        import yaml

        p.write_text(yaml.safe_dump(doc, sort_keys=False))
    else:
        p.write_text(json.dumps(doc, indent=2) + "\n")


def read_cluster_file(path: str | Path) -> Cluster:
    p = Path(path)
    data = read_document(p, "cluster", "cluster file")
    c = cluster_from_dict(data, source=str(p))
    if c.name == "cluster":
        c.name = p.stem
    return c


def load_cluster(spec: str, *, workload: tuple[int, int, int] | None = None) -> Cluster:
    """The one entry point: a preset (``h100``), a shorthand (``h100:8x8``, ``h100:4x8+a100:2x8``),
    ``detect`` / ``local`` for this machine, or a path to a .yaml/.yml/.json file. `workload` =
    (hidden, heads, seq) of the model tells ``detect`` which block to time per precision on a CPU."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError("cluster", spec, "give a preset shorthand like h100:8x8 or a cluster file")
    s = spec.strip()
    if s in ("detect", "local", "this"):
        # the workers `dtorch train` would start here, as it sees them (its calibration included),
        # so that `dtorch plan` and `dtorch train` on one machine make one prediction
        return local_cluster(default_workers(), workload=workload)
    if s.endswith((".yaml", ".yml", ".json")) or os.sep in s or Path(s).is_file():
        return read_cluster_file(s)
    return parse_shorthand(s)
