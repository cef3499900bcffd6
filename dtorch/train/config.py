"""The job description as a file: `dtorch train --config job.toml` (or .yaml/.yml), and
`--print-config` to write the resolved one.

The file's fields are exactly `JobConfig`'s (one field per `dtorch train` option, same names with
underscores), flat, no sections. Its JSON Schema is derived from the dataclass (`schema(JobConfig)`): types,
choices, defaults and help text, with unknown fields refused, so the field list is written once.
A file is validated against that schema with `jsonschema`; the first problem is a `ConfigError`
naming the field (one line, exit 2 from the CLI).

Precedence: JobConfig's defaults, then the file, then the flags given on the command line
(`dtorch.train.job.from_command_line`). This module takes the dataclass as an argument and imports
no other module of the package's rooms: `job.py` imports it.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any

from dtorch.errors import ConfigError

FORMATS = {".toml": "toml", ".yaml": "yaml", ".yml": "yaml", ".json": "json"}
"""File extensions a job description may have; `.json` is what `dtorch train` writes for its
workers (`job.json`)."""

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean"}
_SAID = {"string": "a string", "integer": "an integer", "number": "a number", "boolean": "true or false",
         "null": "nothing (unset)"}


def _kinds(hint: Any) -> tuple[list[type], bool]:
    """(the non-None types of a field's annotation, whether None is allowed)."""
    args = typing.get_args(hint)
    if not args:
        return [hint], False
    return [a for a in args if a is not type(None)], type(None) in args


def schema(cls: type) -> dict[str, Any]:
    """The JSON Schema of a job description, derived from the dataclass `cls` (JobConfig): types,
    choices from the flag's `choices`, the default, the flag's help as description; no other field
    is allowed."""
    hints = typing.get_type_hints(cls)
    props: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        kinds, nullable = _kinds(hints[f.name])
        types = [_JSON_TYPES[k] for k in kinds] + (["null"] if nullable else [])
        prop: dict[str, Any] = {"type": types[0] if len(types) == 1 else types,
                                "description": f.metadata["help"], "default": f.default}
        choices = f.metadata["argparse"].get("choices")
        if choices is not None:
            prop["enum"] = list(choices) + ([None] if nullable else [])
        props[f.name] = prop
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "dtorch train job",
            "type": "object", "properties": props, "additionalProperties": False}


def validate(doc: Any, cls: type, source: str = "config") -> dict[str, Any]:
    """`doc` checked against `schema(cls)`; returns it. Raises ConfigError naming the first bad field
    (an unknown name with the nearest known one, a value of the wrong type or not among the choices)."""
    import jsonschema

    if not isinstance(doc, dict):
        raise ConfigError("config", source, "a job description is a table of fields (name = value), "
                          "e.g. steps = 100; see dtorch train --print-config")
    names = [f.name for f in dataclasses.fields(cls)]
    for key in doc:
        if key not in names:
            near = difflib.get_close_matches(str(key).replace("-", "_"), names, n=1)
            hint = f"did you mean {near[0]}? " if near else ""
            raise ConfigError(str(key), doc[key], f"not an option of dtorch train (this version of dtorch does not know "
                              f"it) in {source}; {hint}the fields are the options' names with underscores "
                              "(dtorch train --print-config)")
    doc_schema = schema(cls)
    for error in sorted(jsonschema.Draft202012Validator(doc_schema).iter_errors(doc), key=lambda e: list(e.path)):
        name = str(error.path[0]) if error.path else "config"
        prop = doc_schema["properties"].get(name, {})
        if error.validator == "enum":
            fix = "use one of {" + ", ".join(str(c) for c in prop["enum"] if c is not None) + "}"
        else:
            want = prop.get("type")
            fix = "expected " + " or ".join(_SAID[t] for t in (want if isinstance(want, list) else [want]))
        raise ConfigError(name, error.instance, f"{fix} (in {source})")
    return doc


def read(path: str | os.PathLike, cls: type, *, follow_links: bool = True) -> dict[str, Any]:
    """The fields of a job description file, parsed by its extension (.toml, .yaml/.yml, .json) and
    validated; not yet merged with the defaults. Without `follow_links` a link is refused (a run
    directory's job.json)."""
    p = Path(path)
    kind = FORMATS.get(p.suffix.lower())
    if kind is None:
        raise ConfigError("config", str(path), "use a .toml, .yaml or .yml file (the format follows the extension)")
    from dtorch.checkpoint.files import read_small

    try:
        text = read_small(p.resolve() if follow_links else p, 1 << 20).decode()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError("config", str(path), f"cannot read the job description ({e})") from None
    try:
        if kind == "toml":
            if sys.version_info >= (3, 11):
                import tomllib
            else:  # Python 3.10: the same parser, from PyPI
                import tomli as tomllib
            doc = tomllib.loads(text)
        elif kind == "yaml":
            import yaml

            doc = yaml.safe_load(text)
            doc = {} if doc is None else doc
        else:
            doc = json.loads(text)
    except ValueError as e:  # tomllib.TOMLDecodeError, json.JSONDecodeError and yaml.YAMLError's
        raise ConfigError("config", str(path), f"not valid {kind.upper()}: {str(e).splitlines()[0]}") from None
    except Exception as e:  # yaml.YAMLError is not a ValueError
        raise ConfigError("config", str(path), f"not valid {kind.upper()}: {' '.join(str(e).split())}") from None
    return validate(doc, cls, str(path))


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value) if value == value and abs(value) != float("inf") else str(value).lower()
    return json.dumps(value, ensure_ascii=False)  # a JSON string is a TOML basic string


def dumps(config: Any, kind: str = "toml") -> str:
    """The whole configuration as a job description file of `kind` (toml or yaml), every field with
    its help as a comment; `read` of it gives the same JobConfig. TOML has no null: an unset optional
    field is written as a comment (absent means its default, None)."""
    import yaml

    lines = ["# dtorch train --config FILE: a job description (dtorch train --print-config writes one)"]
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        lines.append("")
        lines += ["# " + line for line in textwrap.wrap(f.metadata["help"], 98)]
        if kind == "yaml":
            lines.append(yaml.safe_dump({f.name: value}, default_flow_style=True, width=1 << 20)
                         .strip().removeprefix("{").removesuffix("}"))
        elif value is None:
            assert f.default is None, f"{f.name}: TOML cannot write None over a default of {f.default!r}"
            lines.append(f"# {f.name} =")
        else:
            lines.append(f"{f.name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"

