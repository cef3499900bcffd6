"""Reading the JSON-lines files a run writes (metrics, events, OOMs, traces), tolerant of a torn
last line. A leaf of `dtorch.monitor`: the report, the comms trace and the OOM log all read with it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every whole JSON object line of `path`; torn or garbled lines are skipped."""
    out = []
    if not path.exists():
        return out
    with open(path, "rb") as f:
        for raw in f:
            try:
                rec = json.loads(raw)
            except (ValueError, UnicodeDecodeError):
                continue
            if isinstance(rec, dict):
                out.append(rec)
    return out
