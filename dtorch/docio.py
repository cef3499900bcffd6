"""Reading the small documents a user writes or DTorch stores (plans, clusters, calibrations)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dtorch.errors import ConfigError


def read_document(path: str | Path, field: str, what: str, fix: str = "") -> Any:
    """Parse a JSON file, or YAML by suffix (.yaml/.yml). Unreadable or malformed files raise
    ConfigError(field, path, ...) naming `what` the file should be, and `fix` when given."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(field, str(p), f"cannot read the {what} ({e.strerror})") from None
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            return yaml.safe_load(text)
        return json.loads(text)
    except Exception as e:  # noqa: BLE001 - any parse error is the file's, not ours
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(field, str(p), f"not valid {p.suffix.lstrip('.') or 'JSON'}: {first}"
                          + (f"; {fix}" if fix else "")) from None
