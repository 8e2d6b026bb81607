"""The inference-pool overlay's names, each resolved the way the cluster resolves it: the
InferencePool's selector to the decode pods and its target port to the port the router's plans
name, which is the decode pods' kvshuttle-sidecar's, the sidecar's decode endpoint to its pod's
vLLM and its settings to the picker's, its endpointPickerRef to the picker's Service, port and
pods, the HTTPRoute's backend to the pool, and the NetworkPolicies that let the gateway's Envoy
pods (and only them) reach the picker and the decode pods, and the picker and the sidecar reach
what they call. Used by test_inference_pool.py."""

from __future__ import annotations

import json
from typing import Any

from tests.deploy import auth_checks as auth
from tests.deploy import manifests as m
from tests.deploy.manifest_checks import LOOPBACK_HOSTS, flag, http_port, service_workload

from kvshuttle.core.auth import ROLE_PERMISSIONS, Permission, Role
from kvshuttle.gateway.config import DEFAULT_TENANT
from kvshuttle.sidecar.config import SidecarSettings

Objects = list[dict[str, Any]]
POOL_GROUP = "inference.networking.k8s.io"
# The label Istio, kgateway and agentgateway put on the Envoy pods of a Gateway.
GATEWAY_NAME_LABEL = "gateway.networking.k8s.io/gateway-name"


def _pool(objects: Objects) -> dict[str, Any]:
    (pool,) = m.find(objects, "InferencePool")
    return pool


def _service_port(service: dict[str, Any], number: int) -> dict[str, Any] | None:
    return next((p for p in service["spec"]["ports"] if p["port"] == number), None)


def _container_port(w: m.Workload, target: int | str) -> int | None:
    """The container port a Service's targetPort (number or name) reaches in the workload."""
    for c in w.containers():
        for p in c.get("ports", []):
            if target in (p["containerPort"], p.get("name")):
                return int(p["containerPort"])
    return None


def _selected(objects: Objects, selector: dict[str, Any]) -> list[str]:
    return [w.name for w in m.workloads(objects) if m.selects(selector, w.labels)]


def pool_problems(objects: Objects) -> list[str]:
    """The pool holds the decode pods, on the port the plans name as their endpoint."""
    problems = []
    pool = _pool(objects)
    decode = service_workload(objects, "decode")
    members = _selected(objects, pool["spec"]["selector"])
    if members != [decode.name]:
        problems.append(f"InferencePool selects {members}, want the decode pods ({decode.name}) alone")
    # The picker answers with the plan's decode endpoint: the agent's NODE__HTTP_ENDPOINT.
    agent = m.env(decode.container("agent"), objects)
    planned = m.port_of_address(agent["KVSHUTTLE_AGENT_NODE__HTTP_ENDPOINT"])
    ports = [p["number"] for p in pool["spec"]["targetPorts"]]
    if ports != [planned] or _container_port(decode, planned) is None:
        problems.append(f"InferencePool targetPorts {ports}, the plans name decode port {planned}")
    return problems


def _sidecar_env(objects: Objects, decode: m.Workload) -> dict[str, str]:
    """The sidecar's settings as it reads them: its environment over SidecarSettings' defaults."""
    env = m.env(decode.container("sidecar"), objects)
    defaults = {"LISTEN": "listen", "DECODE_ENDPOINT": "decode_endpoint", "TENANT": "tenant"}
    for name, field in defaults.items():
        env.setdefault(f"KVSHUTTLE_SIDECAR_{name}", str(SidecarSettings.model_fields[field].default))
    return env


def decode_sidecar_problems(objects: Objects) -> list[str]:
    """The decode pods run kvshuttle-sidecar on the pool's target port, the port the agent
    registers as the node's HTTP endpoint (so the picker's pick is the sidecar); the sidecar's
    decode endpoint is its pod's vLLM, which listens on loopback alone; the sidecar's node is the
    agent's, and its models, cache salt key, tenant and router list are the picker's (it
    tokenizes and salts as the picker planned, and commits to the router replica that planned)."""
    decode = service_workload(objects, "decode")
    if "sidecar" not in {c["name"] for c in decode.containers()}:
        return [f"{decode.name}: no sidecar container: the pool's port reaches vLLM, with no P/D"]
    sidecar, vllm = decode.container("sidecar"), decode.container("vllm")
    s, a = _sidecar_env(objects, decode), m.env(decode.container("agent"), objects)
    epp = service_workload(objects, "epp").container("epp")
    e = m.env(epp, objects)
    problems = []
    if sidecar.get("command") != ["kvshuttle-sidecar"] or sidecar["image"] != epp["image"]:
        problems.append(f"{decode.name}/sidecar: runs {sidecar.get('command')} of {sidecar['image']}")
    listen = m.port_of_address(s["KVSHUTTLE_SIDECAR_LISTEN"])
    targets = [p["number"] for p in _pool(objects)["spec"]["targetPorts"]]
    owners = [
        c["name"] for c in decode.containers() for p in c.get("ports", []) if p["containerPort"] in targets
    ]
    if targets != [listen] or owners != ["sidecar"]:
        problems.append(
            f"InferencePool targetPorts {targets}: declared by {owners}, the sidecar listens on {listen}"
        )
    registered = a["KVSHUTTLE_AGENT_NODE__HTTP_ENDPOINT"]
    if registered != f"http://{m.SAMPLE_FIELDS['status.podIP']}:{listen}":
        problems.append(f"the decode agent registers {registered}, not the sidecar's port {listen}")
    host, port = flag(vllm["args"], "host"), flag(vllm["args"], "port")
    if s["KVSHUTTLE_SIDECAR_DECODE_ENDPOINT"].rstrip("/") != f"http://{host}:{port}":
        problems.append(
            f"sidecar DECODE_ENDPOINT {s['KVSHUTTLE_SIDECAR_DECODE_ENDPOINT']}, vLLM listens on {host}:{port}"
        )
    if host not in LOOPBACK_HOSTS:
        problems.append(f"{decode.name}/vllm listens on {host}: reachable around the sidecar")
    node = f"nodes/{a['KVSHUTTLE_AGENT_NODE__NAME'].removeprefix('nodes/')}"
    if s.get("KVSHUTTLE_SIDECAR_NODE") != node:
        problems.append(f"sidecar NODE {s.get('KVSHUTTLE_SIDECAR_NODE')}, the agent registers {node}")
    same = {
        "MODELS": (
            json.loads(s.get("KVSHUTTLE_SIDECAR_MODELS", "{}")),
            json.loads(e["KVSHUTTLE_EPP_MODELS"]),
        ),
        "CACHE_SALT_KEY": (s.get("KVSHUTTLE_SIDECAR_CACHE_SALT_KEY"), e.get("KVSHUTTLE_EPP_CACHE_SALT_KEY")),
        "TENANT": (s["KVSHUTTLE_SIDECAR_TENANT"], e.get("KVSHUTTLE_EPP_TENANT", DEFAULT_TENANT)),
        "ROUTER__ADDRESS": (s.get("KVSHUTTLE_SIDECAR_ROUTER__ADDRESS"), e["KVSHUTTLE_EPP_ROUTER__ADDRESS"]),
        "ROUTER__AFFINITY": (
            s.get("KVSHUTTLE_SIDECAR_ROUTER__AFFINITY"),
            e.get("KVSHUTTLE_EPP_ROUTER__AFFINITY"),
        ),
        "REGISTRY__ADDRESS (as the agent's)": (
            s.get("KVSHUTTLE_SIDECAR_REGISTRY__ADDRESS"),
            a["KVSHUTTLE_AGENT_REGISTRY__ADDRESS"],
        ),
    }
    problems += [
        f"sidecar {what} {got!r}, want {want!r}" for what, (got, want) in same.items() if got != want
    ]
    return problems


def picker_problems(objects: Objects) -> list[str]:
    """endpointPickerRef names the picker's Service, on the port its ext_proc server listens."""
    ref = _pool(objects)["spec"]["endpointPickerRef"]
    if ref.get("group", "") != "" or ref.get("kind", "Service") != "Service":
        return [f"endpointPickerRef {ref}: not a Service"]
    services = m.find(objects, "Service", ref["name"])
    if not services:
        return [f"endpointPickerRef names Service {ref['name']}, which is not rendered"]
    pickers = _selected(objects, {"matchLabels": services[0]["spec"]["selector"]})
    epp = service_workload(objects, "epp")
    if pickers != [epp.name]:
        return [f"endpointPickerRef: Service {ref['name']} selects {pickers}, want {epp.name}"]
    port = _service_port(services[0], ref["port"]["number"])
    if port is None:
        return [f"endpointPickerRef: Service {ref['name']} has no port {ref['port']['number']}"]
    problems = []
    listen = m.port_of_address(m.env(epp.container("epp"), objects)["KVSHUTTLE_EPP_SERVER__LISTEN"])
    if _container_port(epp, port.get("targetPort", port["port"])) != listen:
        problems.append(
            f"endpointPickerRef: port {ref['port']['number']} does not reach ext_proc on {listen}"
        )
    if epp.container("epp").get("command") != ["kvshuttle-epp"]:
        problems.append(f"{epp.name}: runs {epp.container('epp').get('command')}, want kvshuttle-epp")
    if epp.container("epp")["image"] != service_workload(objects, "gateway").container("gateway")["image"]:
        problems.append(f"{epp.name}: not the gateway's image")
    return problems


def route_problems(objects: Objects) -> list[str]:
    """Every HTTPRoute sends to the pool, from a Gateway."""
    problems = []
    pool = _pool(objects)["metadata"]["name"]
    routes = m.find(objects, "HTTPRoute")
    if not routes:
        problems.append("no HTTPRoute")
    for route in routes:
        name = route["metadata"]["name"]
        if not all(p.get("kind", "Gateway") == "Gateway" for p in route["spec"]["parentRefs"]):
            problems.append(f"HTTPRoute {name}: a parent that is not a Gateway")
        for rule in route["spec"]["rules"]:
            for ref in rule["backendRefs"]:
                if (ref.get("group"), ref.get("kind"), ref["name"]) != (POOL_GROUP, "InferencePool", pool):
                    problems.append(f"HTTPRoute {name}: backend {ref}, want InferencePool {pool}")
    return problems


def _gateway_names(objects: Objects) -> set[str]:
    return {p["name"] for r in m.find(objects, "HTTPRoute") for p in r["spec"]["parentRefs"]}


def _ingress(objects: Objects, workload: str) -> list[tuple[dict[str, Any], int, int]]:
    """(peer, port, end port) of every ingress rule that applies to the workload's pods."""
    (w,) = [x for x in m.workloads(objects) if x.name == workload]
    return [
        (peer, p["port"], p.get("endPort", p["port"]))
        for policy in m.find(objects, "NetworkPolicy")
        if m.selects(policy["spec"]["podSelector"], w.labels)
        for rule in policy["spec"].get("ingress", [])
        for p in rule.get("ports", [])
        for peer in rule.get("from", [{}])
    ]


def _is_envoy(peer: dict[str, Any], gateways: set[str]) -> bool:
    labels = peer.get("podSelector", {}).get("matchLabels", {})
    return "namespaceSelector" not in peer and labels.get(GATEWAY_NAME_LABEL) in gateways


def network_problems(objects: Objects) -> list[str]:
    """Envoy reaches the picker's ext_proc port, and nobody else does; Envoy reaches the decode
    pods on the pool's port; the picker reaches every router replica."""
    problems = []
    gateways = _gateway_names(objects)
    epp = service_workload(objects, "epp")
    ext_proc = m.port_of_address(m.env(epp.container("epp"), objects)["KVSHUTTLE_EPP_SERVER__LISTEN"])
    rules = _ingress(objects, epp.name)
    if not any(_is_envoy(peer, gateways) and lo <= ext_proc <= hi for peer, lo, hi in rules):
        problems.append(f"{epp.name}: no NetworkPolicy lets the Envoy pods of {sorted(gateways)} in")
    for peer, lo, hi in rules:
        if lo <= ext_proc <= hi and not _is_envoy(peer, gateways):
            problems.append(f"{epp.name}: ext_proc port {ext_proc} open to {peer or 'anyone'}")
    decode = service_workload(objects, "decode")
    port = _pool(objects)["spec"]["targetPorts"][0]["number"]
    if not any(
        _is_envoy(peer, gateways) and lo <= port <= hi for peer, lo, hi in _ingress(objects, decode.name)
    ):
        problems.append(f"{decode.name}: the Envoy pods may not reach port {port}")
    router, registry = service_workload(objects, "router"), service_workload(objects, "registry")
    dials = [
        (epp, router, a)
        for a in m.addresses(m.env(epp.container("epp"), objects)["KVSHUTTLE_EPP_ROUTER__ADDRESS"])
    ]
    if "sidecar" in {c["name"] for c in decode.containers()}:
        s = m.env(decode.container("sidecar"), objects)
        dials += [(decode, router, a) for a in m.addresses(s["KVSHUTTLE_SIDECAR_ROUTER__ADDRESS"])]
        dials += [(decode, registry, a) for a in m.addresses(s["KVSHUTTLE_SIDECAR_REGISTRY__ADDRESS"])]
        # The plan's prefill: the prefill pods' serving port, as their agents register it.
        prefill = service_workload(objects, "prefill")
        dials.append((decode, prefill, f"{prefill.name}:{http_port(prefill, objects)}"))
    for client, server, address in dials:
        if not _reaches(objects, client, server, m.port_of_address(address)):
            problems.append(f"{client.name} -> {server.name} ({address}): not allowed by any NetworkPolicy")
    return problems


def _reaches(objects: Objects, client: m.Workload, server: m.Workload, port: int) -> bool:
    return any(
        lo <= port <= hi and "podSelector" in peer and m.selects(peer["podSelector"], client.labels)
        for peer, lo, hi in _ingress(objects, server.name)
    )


def identity_problems(objects: Objects) -> list[str]:
    """The router grants the gateway's role to the identities the picker and the decode pods'
    sidecar present (the picker plans turns, the sidecar commits and aborts them); the registry
    grants the sidecar's a role with nodes.read (ListNodes, its SSRF allow list)."""
    problems = []
    epp, router = service_workload(objects, "epp"), service_workload(objects, "router")
    decode, registry = service_workload(objects, "decode"), service_workload(objects, "registry")
    router_grants = auth.grants(m.env(router.container("router"), objects), "ROUTER")
    callers = [(epp, "epp", "EPP_ROUTER")]
    if "sidecar" in {c["name"] for c in decode.containers()}:
        callers.append((decode, "sidecar", "SIDECAR_ROUTER"))
        sidecar = decode.container("sidecar")
        ident = auth.presented(objects, decode, sidecar, "SIDECAR_REGISTRY", "registry", decode.name)
        grant = auth.grants(m.env(registry.container("registry"), objects), "REGISTRY").get(ident or "")
        if grant is None or Permission.NODES_READ not in ROLE_PERMISSIONS[Role(grant["role"])]:
            problems.append(
                f"sidecar -> registry: identity {ident} has grant {grant}, want nodes.read (viewer)"
            )
    for w, container, conn in callers:
        ident = auth.presented(objects, w, w.container(container), conn, "router", w.name)
        grant = router_grants.get(ident or "")
        if grant is None or grant["role"] != "gateway":
            problems.append(f"{container} -> router: identity {ident} has grant {grant}, want role gateway")
    return problems
