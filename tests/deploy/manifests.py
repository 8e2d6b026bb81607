"""Reading rendered Kubernetes objects: pods of workloads, containers' environment as the
kubelet resolves it, NetworkPolicy selection, and the services' settings fields an environment
variable names. Used by test_kubernetes_manifests.py."""

from __future__ import annotations

import base64
import dataclasses
import re
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, SecretStr
from pydantic_settings import BaseSettings

from kvshuttle.agent.config import AgentSettings
from kvshuttle.epp.config import EppSettings
from kvshuttle.gateway.config import GatewaySettings
from kvshuttle.registry.config import RegistrySettings
from kvshuttle.router.config import RouterSettings
from kvshuttle.sidecar.config import SidecarSettings

Obj = dict[str, Any]

SETTINGS: dict[str, type[BaseSettings]] = {
    "KVSHUTTLE_REGISTRY_": RegistrySettings,
    "KVSHUTTLE_ROUTER_": RouterSettings,
    "KVSHUTTLE_AGENT_": AgentSettings,
    "KVSHUTTLE_GATEWAY_": GatewaySettings,
    "KVSHUTTLE_EPP_": EppSettings,
    "KVSHUTTLE_SIDECAR_": SidecarSettings,
}
WORKLOAD_KINDS = frozenset({"Deployment", "StatefulSet", "DaemonSet"})
# Values the downward API gives a pod, for resolving $(VAR) references.
SAMPLE_FIELDS = {"metadata.name": "kvshuttle-vllm-decode-0", "status.podIP": "10.0.0.7"}


@dataclass(frozen=True)
class Workload:
    kind: str
    name: str
    replicas: int
    pod: Obj  # the pod template

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.pod["metadata"].get("labels", {}))

    @property
    def spec(self) -> Obj:
        return dict(self.pod["spec"])

    @property
    def component(self) -> str:
        return self.labels.get("app.kubernetes.io/component", "")

    def containers(self) -> list[Obj]:
        return list(self.spec["containers"])

    def container(self, name: str) -> Obj:
        for container in self.containers():
            if container["name"] == name:
                return dict(container)
        raise KeyError(f"{self.kind}/{self.name} has no container {name!r}")

    def volume(self, name: str) -> Obj:
        for volume in self.spec.get("volumes", []):
            if volume["name"] == name:
                return dict(volume)
        raise KeyError(f"{self.kind}/{self.name} has no volume {name!r}")


def workloads(objects: list[Obj]) -> list[Workload]:
    return [
        Workload(o["kind"], o["metadata"]["name"], int(o["spec"].get("replicas", 1)), o["spec"]["template"])
        for o in objects
        if o["kind"] in WORKLOAD_KINDS
    ]


def find(objects: list[Obj], kind: str, name: str | None = None) -> list[Obj]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objects: list[Obj], kind: str, name: str) -> Obj:
    found = find(objects, kind, name)
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def generated(objects: list[Obj], kind: str, base_name: str) -> Obj:
    """The ConfigMap or Secret kustomize generated as `base_name` (its name has a hash suffix)."""
    found = [
        o
        for o in find(objects, kind)
        if re.fullmatch(rf"{base_name}(-[a-z0-9]{{10}})?", o["metadata"]["name"])
    ]
    assert len(found) == 1, f"expected one {kind} {base_name}, found {[o['metadata']['name'] for o in found]}"
    return found[0]


def data_of(obj: Obj) -> dict[str, str]:
    """A ConfigMap's or Secret's data, decoded."""
    if obj["kind"] == "Secret":
        return {k: base64.b64decode(v).decode() for k, v in obj.get("data", {}).items()}
    return dict(obj.get("data", {}))


# --- environment -------------------------------------------------------------------------------


def env(container: Obj, objects: list[Obj]) -> dict[str, str]:
    """The container's environment as the kubelet sets it: literal values with $(VAR) expanded,
    ConfigMap keys looked up, downward-API fields as SAMPLE_FIELDS, and each Secret key as
    "<secret:NAME/KEY>" (its value is never the point)."""
    resolved: dict[str, str] = {}
    for var in container.get("env", []):
        name = var["name"]
        if "value" in var:
            resolved[name] = re.sub(r"\$\((\w+)\)", lambda m: resolved.get(m[1], m[0]), var["value"])
            continue
        source = var["valueFrom"]
        if "fieldRef" in source:
            resolved[name] = SAMPLE_FIELDS[source["fieldRef"]["fieldPath"]]
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            resolved[name] = data_of(one(objects, "ConfigMap", ref["name"]))[ref["key"]]
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            resolved[name] = f"<secret:{ref['name']}/{ref['key']}>"
        else:
            raise AssertionError(f"{name}: unexpected valueFrom {source}")
    return resolved


def secret_refs(container: Obj) -> dict[str, tuple[str, str]]:
    """Env var -> (Secret, key) for the vars that come from a Secret."""
    return {
        var["name"]: (var["valueFrom"]["secretKeyRef"]["name"], var["valueFrom"]["secretKeyRef"]["key"])
        for var in container.get("env", [])
        if "secretKeyRef" in var.get("valueFrom", {})
    }


def secret_mounts(workload: Workload, container: Obj) -> dict[str, Obj]:
    """mountPath -> volume, for the container's mounts of Secret or CSI (certificate) volumes."""
    mounts = {}
    for mount in container.get("volumeMounts", []):
        volume = workload.volume(mount["name"])
        if "secret" in volume or "csi" in volume:
            mounts[mount["mountPath"]] = volume
    return mounts


# --- settings fields -----------------------------------------------------------------------------


def _nested(annotation: Any) -> list[type]:
    """The settings groups an annotation holds (X, X | None): pydantic models and dataclasses
    (the router's policy), none for anything else."""
    candidates = [annotation, *typing.get_args(annotation)]
    return [
        a
        for a in candidates
        if isinstance(a, type) and (issubclass(a, BaseModel) or dataclasses.is_dataclass(a))
    ]


def _field_annotation(group: type, name: str) -> Any | None:
    if issubclass(group, BaseModel):
        field = group.model_fields.get(name)
        return None if field is None else field.annotation
    names = {f.name for f in dataclasses.fields(typing.cast(Any, group))}
    return typing.get_type_hints(group)[name] if name in names else None


def setting_field(env_name: str) -> tuple[type[BaseSettings], list[str], Any] | None:
    """(settings class, field path, the field's annotation) that KVSHUTTLE_* `env_name` sets; None
    when no field is called that (a typo), or the name has no service's prefix."""
    prefix = next((p for p in SETTINGS if env_name.startswith(p)), None)
    if prefix is None:
        return None
    settings = SETTINGS[prefix]
    path = env_name.removeprefix(prefix).lower().split("__")
    group: type = settings
    annotation: Any = None
    for depth, part in enumerate(path):
        annotation = _field_annotation(group, part)
        if annotation is None:
            return None
        if depth < len(path) - 1:
            nested = _nested(annotation)
            if not nested:
                return None
            group = nested[0]
    return settings, path, annotation


def is_secret(annotation: Any) -> bool:
    """Whether a field holds a secret: SecretStr, optional or inside a dict."""
    if annotation is SecretStr:
        return True
    return any(is_secret(a) for a in typing.get_args(annotation))


def kvshuttle_env(environment: Mapping[str, str]) -> Iterator[tuple[str, str]]:
    return (
        (k, v) for k, v in environment.items() if k.startswith("KVSHUTTLE_") and setting_field(k) is not None
    )


# --- NetworkPolicy -------------------------------------------------------------------------------


def selects(selector: Obj, labels: Mapping[str, str]) -> bool:
    """A label selector (matchLabels, matchExpressions In / Exists) against labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        op, key = expr["operator"], expr["key"]
        if op == "In" and labels.get(key) not in expr["values"]:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op not in ("In", "Exists"):
            raise AssertionError(f"selector operator {op} not understood by this test")
    return True


@dataclass(frozen=True)
class Allowed:
    """One (source, port range) an ingress rule lets in: source is a workload name, "monitoring"
    (Prometheus' namespace) or "*" (anyone)."""

    policy: str
    source: str
    port: int
    end_port: int

    def covers(self, port: int) -> bool:
        return self.port <= port <= self.end_port


def allowed_ingress(policy: Obj, pods: list[Workload]) -> list[Allowed]:
    """What one NetworkPolicy lets in, its pod selectors resolved to the workloads they match."""
    out: list[Allowed] = []
    name = policy["metadata"]["name"]
    for rule in policy["spec"].get("ingress", []):
        ports = [(p["port"], p.get("endPort", p["port"])) for p in rule.get("ports", [])]
        assert ports, f"NetworkPolicy {name}: a rule without ports lets in every port"
        sources: list[str] = []
        if "from" not in rule:
            sources = ["*"]
        for peer in rule.get("from", []):
            if "namespaceSelector" in peer:
                ns = peer["namespaceSelector"].get("matchLabels", {})
                assert ns == {"kubernetes.io/metadata.name": "monitoring"}, f"{name}: namespace peer {peer}"
                sources.append("monitoring")
            else:
                matched = [w.name for w in pods if selects(peer["podSelector"], w.labels)]
                assert matched, f"NetworkPolicy {name}: peer {peer} selects no pod"
                sources.extend(matched)
        out.extend(Allowed(name, s, lo, hi) for s in sources for lo, hi in ports)
    return out


def addresses(target: str) -> list[str]:
    """The addresses of a client's target: one, or each of a comma-separated list."""
    return [a.strip() for a in target.split(",")]


def host_of_address(address: str) -> str:
    """The host of host:port or dns:///host:port."""
    return address.removeprefix("dns:///").rsplit(":", 1)[0]


def port_of_address(address: str) -> int:
    """The port of host:port, dns:///host:port or http://host:port."""
    return int(address.rstrip("/").rsplit(":", 1)[1])
