"""Validates rendered Kubernetes documents against schemas/kubernetes-1.34.yaml (JSON Schema
draft 2020-12, offline), the equivalent of kubeconform for the kinds deploy/k8s uses."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

SCHEMAS = Path(__file__).resolve().parent / "schemas" / "kubernetes-1.34.yaml"


@lru_cache(maxsize=1)
def _bundle():
    import yaml

    return yaml.safe_load(SCHEMAS.read_text())


def kinds() -> set[str]:
    return set(_bundle()["kinds"])


def validate(doc: dict) -> list[str]:
    """Problems of one document ("Deployment/llm: spec.template...: ..."), empty when valid."""
    import jsonschema

    bundle = _bundle()
    key = f"{doc.get('apiVersion')}/{doc.get('kind')}"
    where = f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"
    if key not in bundle["kinds"]:
        return [f"{where}: no schema for {key} in {SCHEMAS.name} (add one)"]
    schema = {"$schema": bundle["$schema"], "$defs": bundle["$defs"], **bundle["kinds"][key]}
    validator = jsonschema.Draft202012Validator(schema)
    out = []
    for e in sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path)):
        path = ".".join(str(p) for p in e.absolute_path) or "(document)"
        out.append(f"{where}: {path}: {e.message[:300]}")
    return out
