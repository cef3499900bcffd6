"""What the hardware is: `Cluster` (nodes x devices, links), presets, shorthand and file loading.

`load_cluster(spec)` is the one entry point: a preset (``h100``), a shorthand (``h100:8x8``,
``h100:4x8+a100:2x8``), ``detect`` for this machine, or a YAML/JSON file.
"""

from dtorch.cluster.load import load_cluster, save_cluster
from dtorch.cluster.local import local_cluster
from dtorch.cluster.machine import detect
from dtorch.cluster.spec import Cluster, DeviceType, Link, NodeGroup

__all__ = ["Cluster", "DeviceType", "Link", "NodeGroup", "detect", "load_cluster", "local_cluster", "save_cluster"]
