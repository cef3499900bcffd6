"""Regenerate dtorch/integrations/schemas/ from the upstream files named in its sources.json.

    python scripts/k8s_schemas.py SRC_DIR      # SRC_DIR/<repo>/<path> as listed in sources.json

Keeps only what validation needs: each CRD's openAPIV3Schema of the served version, and the
Kubernetes core/v1 models reachable from PodTemplateSpec and Event; descriptions are dropped (size).
"""

import json
import sys
from pathlib import Path

import yaml

OUT = Path(__file__).resolve().parents[1] / "dtorch" / "integrations" / "schemas"


def strip(node):
    if isinstance(node, dict):
        return {k: strip(v) for k, v in node.items() if k not in ("description", "example")}
    if isinstance(node, list):
        return [strip(v) for v in node]
    return node


def closure(defs: dict, roots: list[str]) -> dict:
    keep, todo = {}, list(roots)
    while todo:
        name = todo.pop()
        if name in keep:
            continue
        keep[name] = defs[name]
        text = json.dumps(defs[name])
        for part in text.split('"$ref": "')[1:]:
            todo.append(part.split('"')[0].rsplit("/", 1)[-1])
    return keep


def main(src: Path) -> None:
    sources = json.loads((OUT / "sources.json").read_text())
    merged: dict[str, dict] = {}  # openapi entries naming the same file are merged into it
    for entry in sources["schemas"]:
        raw = (src / entry["repo"] / entry["path"]).read_text()
        if entry["kind"] == "crd":
            crd = yaml.safe_load(raw)
            ver = next(v for v in crd["spec"]["versions"] if v["name"] == entry["version"])
            doc = strip(ver["schema"]["openAPIV3Schema"])
        else:
            comps = json.loads(raw)["components"]["schemas"]
            schemas = merged.setdefault(entry["file"], {})
            schemas.update(strip(closure(comps, entry["roots"])))
            doc = {"components": {"schemas": schemas}}
        (OUT / entry["file"]).write_text(json.dumps(doc, separators=(",", ":"), sort_keys=True) + "\n")
        print(entry["file"], (OUT / entry["file"]).stat().st_size, "bytes")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
