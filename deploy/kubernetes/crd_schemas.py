"""The vendored CRDs' schemas (deploy/kubernetes/schemas, README.md there) as JSON Schemas, for
validating the objects of those kinds offline, as strictly as the API server does: each served
version's `openAPIV3Schema` (OpenAPI 3.0, structural) converted, with every object closed to
properties its schema does not list (the API server's strict field validation), unless it
preserves unknown fields. CEL rules (`x-kubernetes-validations`) are not evaluated; they are
counted, so that the check says what it left out."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import yaml

SCHEMAS = Path(__file__).resolve().parent / "schemas"

Schema = dict[str, Any]


@dataclass(frozen=True)
class CrdSchema:
    api_version: str  # group/version
    kind: str
    source: str  # the vendored file, relative to SCHEMAS
    validator: jsonschema.Draft4Validator
    cel_rules: int  # x-kubernetes-validations not evaluated


def to_json_schema(schema: Schema) -> tuple[Schema, int]:
    """(JSON Schema, CEL rules dropped) of an OpenAPI 3.0 structural schema. Draft 4 is the
    JSON Schema dialect OpenAPI 3.0 builds on (boolean exclusiveMinimum/Maximum)."""
    rules = 0

    def convert(node: Schema) -> Schema:
        nonlocal rules
        out: Schema = {k: v for k, v in node.items() if not k.startswith("x-kubernetes-")}
        rules += len(node.get("x-kubernetes-validations", []))
        if "properties" in node:
            out["properties"] = {name: convert(sub) for name, sub in node["properties"].items()}
        if isinstance(node.get("additionalProperties"), dict):
            out["additionalProperties"] = convert(node["additionalProperties"])
        if "items" in node:
            out["items"] = convert(node["items"])
        for key in ("allOf", "anyOf", "oneOf"):
            if key in node:
                out[key] = [convert(sub) for sub in node[key]]
        if "not" in node:
            out["not"] = convert(node["not"])
        if node.get("x-kubernetes-int-or-string"):
            out.pop("type", None)
            out["anyOf"] = [{"type": "integer"}, {"type": "string"}, *out.get("anyOf", [])]
        if out.pop("nullable", False) and "type" in out:
            out["type"] = [out["type"], "null"]
        # An object with listed properties takes no other (a map, or metadata, stays open).
        preserves = node.get("x-kubernetes-preserve-unknown-fields", False)
        if "properties" in out and "additionalProperties" not in out and not preserves:
            out["additionalProperties"] = False
        return out

    return convert(schema), rules


def _served_versions(path: Path) -> Iterator[CrdSchema]:
    crd = yaml.safe_load(path.read_text())
    assert crd["kind"] == "CustomResourceDefinition", f"{path}: not a CRD"
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    for version in crd["spec"]["versions"]:
        if not version.get("served"):
            continue
        schema, rules = to_json_schema(version["schema"]["openAPIV3Schema"])
        jsonschema.Draft4Validator.check_schema(schema)
        yield CrdSchema(
            f"{group}/{version['name']}",
            kind,
            str(path.relative_to(SCHEMAS)),
            jsonschema.Draft4Validator(schema),
            rules,
        )


def load() -> dict[tuple[str, str], CrdSchema]:
    """(apiVersion, kind) -> its schema, for every served version of every vendored CRD."""
    return {
        (s.api_version, s.kind): s
        for path in sorted(SCHEMAS.glob("*/*.yaml"))
        for s in _served_versions(path)
    }


def errors(schema: CrdSchema, obj: dict[str, Any]) -> list[str]:
    """Every way `obj` breaks the schema, each as "message (at path)"."""
    return [
        f"{e.message} (at {'.'.join(map(str, e.absolute_path)) or '.'})"
        for e in sorted(schema.validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))
    ]
