"""Errors that speak to the user.

`ConfigError` is raised for every user mistake (a bad preset name, a malformed cluster file, an
impossible fixed plan field). It names the field, the value seen and the valid choices or the fix;
the CLI prints it as one line and exits with code 2, no traceback. Internal invariants use `assert`.
"""

from __future__ import annotations

from collections.abc import Iterable


class ConfigError(ValueError):
    """A user-facing configuration error: `field`, the `value` seen, and what to do instead."""

    def __init__(self, field: str, value: object, fix: str):
        self.field = field
        self.value = value
        self.fix = fix
        super().__init__(f"{field}={value!r}: {fix}")


def choices(values: Iterable[object]) -> str:
    """Format valid choices for an error message: `use one of {a, b, c}`."""
    return "use one of {" + ", ".join(str(v) for v in values) + "}"
