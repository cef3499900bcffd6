"""Validate manifests against the schemas kept in `schemas/` (see its sources.json for versions
and upstream commits), with `jsonschema`.

- A TrainJob, JobSet or Volcano Job is checked against its CRD's openAPIV3Schema;
- every full pod template inside (JobSet's Job template, Volcano's task templates) is also
  checked against the Kubernetes core/v1 `PodTemplateSpec` model;
- the Role and RoleBinding of `--rbac` against the rbac.authorization.k8s.io/v1 models.
Strict like `kubectl apply --validate=strict`: an object schema that lists its properties
rejects any other field (a typo fails here instead of being pruned by the API server), unless
it is marked x-kubernetes-preserve-unknown-fields. Not checked: CEL rules
(x-kubernetes-validations) and formats.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

SCHEMAS = Path(__file__).with_name("schemas")
CRDS = {("trainer.kubeflow.org/v1alpha1", "TrainJob"): "trainjob-v1alpha1.json",
        ("jobset.x-k8s.io/v1alpha2", "JobSet"): "jobset-v1alpha2.json",
        ("batch.volcano.sh/v1alpha1", "Job"): "vcjob-v1alpha1.json"}
# Built-in kinds `dtorch submit k8s --rbac` writes: (file, OpenAPI model)
BUILTIN = {("rbac.authorization.k8s.io/v1", "Role"): ("rbac-v1.json", "io.k8s.api.rbac.v1.Role"),
           ("rbac.authorization.k8s.io/v1", "RoleBinding"): ("rbac-v1.json", "io.k8s.api.rbac.v1.RoleBinding"),
           # a ServiceAccount of dtorch's carries metadata only: checked as ObjectMeta below
           ("v1", "ServiceAccount"): None}


def _strict(node: Any) -> Any:
    if isinstance(node, dict):
        out = {k: _strict(v) for k, v in node.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_strict(v) for v in node]
    return node


@functools.cache
def _validator(name: str, ref: str | None = None):
    import jsonschema

    doc = _strict(json.loads((SCHEMAS / name).read_text()))
    if ref is not None:
        doc = {"$ref": f"#/components/schemas/{ref}", "components": doc["components"]}
    return jsonschema.Draft7Validator(doc)


def _errors(validator, obj: Any, where: str) -> list[str]:
    out = []
    for e in sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path)):
        path = ".".join(str(p) for p in e.absolute_path)
        out.append(f"{where}{'.' + path if path else ''}: {e.message}")
    return out


def pod_templates(doc: dict) -> list[tuple[str, dict]]:
    """(path, template) of every full pod template in a manifest."""
    spec = doc.get("spec", {})
    if doc.get("kind") == "JobSet":
        return [(f"spec.replicatedJobs.{i}.template.spec.template", rj["template"]["spec"]["template"])
                for i, rj in enumerate(spec.get("replicatedJobs", []))]
    if doc.get("kind") == "Job" and doc.get("apiVersion", "").startswith("batch.volcano.sh/"):
        return [(f"spec.tasks.{i}.template", t["template"]) for i, t in enumerate(spec.get("tasks", []))]
    return []


def validate(doc: dict) -> list[str]:
    """Every schema violation in `doc` (empty when valid)."""
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key in BUILTIN:
        if BUILTIN[key] is None:
            extra = sorted(set(doc) - {"apiVersion", "kind", "metadata"})
            meta = _validator("core-v1.json", "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta")
            return ([f"{doc['kind']}: fields not checked here: {extra}"] if extra else []) + \
                _errors(meta, doc.get("metadata", {}), f"{doc['kind']}.metadata")
        return _errors(_validator(*BUILTIN[key]), doc, doc["kind"])
    if key not in CRDS:
        return [f"apiVersion/kind {key}: no schema kept for it; known: {sorted(CRDS) + sorted(BUILTIN)}"]
    errs = _errors(_validator(CRDS[key]), doc, doc["kind"])
    core = _validator("core-v1.json", "io.k8s.api.core.v1.PodTemplateSpec")
    for where, tmpl in pod_templates(doc):
        errs += _errors(core, tmpl, f"{doc['kind']}.{where} (core/v1 PodTemplateSpec)")
    return errs
