"""NetworkPolicies against the calls the services really make, each derived from the rendered
configuration (the addresses callers dial, the ports servers advertise): every call allowed,
nothing allowed that no caller makes, every pod under a policy behind a default deny, and no pod
let in to a health-only port: only the kubelet probes it, and it comes from the pod's node, which
NetworkPolicy always admits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tests.deploy import manifests as m
from tests.deploy.manifest_checks import health_port

Objects = list[dict[str, Any]]


@dataclass(frozen=True, order=True)
class Call:
    """`source` (a workload, "monitoring" or "*") connects to workload `dest` on ports
    port..end_port."""

    source: str
    dest: str
    port: int
    end_port: int


def dialled(objects: Objects, address: str) -> m.Workload:
    """The workload a client address reaches: a Service name, or a StatefulSet pod's
    <pod>.<service> name, with an optional dns:/// scheme."""
    host = m.host_of_address(address)
    service = m.one(objects, "Service", host.split(".")[-1] if "." in host else host)
    (workload,) = [
        w for w in m.workloads(objects) if m.selects({"matchLabels": service["spec"]["selector"]}, w.labels)
    ]
    return workload


def calls(objects: Objects) -> set[Call]:
    """Every connection between pods the configuration makes, and Prometheus' scrapes."""
    found: set[Call] = set()
    for w in m.workloads(objects):
        for c in w.containers():
            env = m.env(c, objects)
            for name, value in env.items():
                if name.endswith("__ADDRESS"):  # a client of another kvshuttle service
                    for address in m.addresses(value):
                        port = m.port_of_address(address)
                        found.add(Call(w.name, dialled(objects, address).name, port, port))
                if name.endswith("TELEMETRY__METRICS_LISTEN"):
                    found.add(Call("monitoring", w.name, *[m.port_of_address(value)] * 2))
            if c["name"] == "gateway":
                found.add(Call("*", w.name, *[m.port_of_address(env["KVSHUTTLE_GATEWAY_LISTEN"])] * 2))
            if c["name"] == "agent":
                engines = [
                    e.name for e in m.workloads(objects) if "agent" in {x["name"] for x in e.containers()}
                ]
                http = m.port_of_address(env["KVSHUTTLE_AGENT_NODE__HTTP_ENDPOINT"])
                found.add(Call(_role(objects, "gateway"), w.name, http, http))  # prefill and decode requests
                found.add(Call("monitoring", w.name, http, http))  # vLLM's /metrics
                agent = m.port_of_address(env["KVSHUTTLE_AGENT_NODE__AGENT_ENDPOINT"])
                found.add(Call(_role(objects, "router"), w.name, agent, agent))  # status, park, prefetch
                side = int(env["KVSHUTTLE_AGENT_NODE__SIDE_CHANNEL_PORT"])
                pool = int(env["KVSHUTTLE_AGENT_POOL__SERVE_PORT"])
                low, high = map(int, env["UCX_TCP_PORT_RANGE"].split("-"))
                for peer in engines:  # P <-> D reads, prefill -> pools, agent <-> agent pulls
                    found |= {
                        Call(peer, w.name, side, side),
                        Call(peer, w.name, pool, pool),
                        Call(peer, w.name, low, high),
                    }
    return found


def _role(objects: Objects, component: str) -> str:
    (name,) = [w.name for w in m.workloads(objects) if w.component == component]
    return name


def allowed(objects: Objects) -> set[Call]:
    pods = m.workloads(objects)
    out: set[Call] = set()
    for policy in m.find(objects, "NetworkPolicy"):
        dests = [w.name for w in pods if m.selects(policy["spec"]["podSelector"], w.labels)]
        for rule in m.allowed_ingress(policy, pods):
            out |= {Call(rule.source, d, rule.port, rule.end_port) for d in dests}
    return out


def network_problems(objects: Objects) -> list[str]:
    problems = []
    policies = m.find(objects, "NetworkPolicy")
    deny = [p for p in policies if p["spec"]["podSelector"] == {} and not p["spec"].get("ingress")]
    if not deny or "Ingress" not in deny[0]["spec"].get("policyTypes", []):
        problems.append("no default-deny ingress NetworkPolicy")
    for w in m.workloads(objects):
        if not any(
            m.selects(p["spec"]["podSelector"], w.labels) and p["spec"].get("ingress") for p in policies
        ):
            problems.append(f"{w.name}: no NetworkPolicy lets anything in")
    made, let_in = calls(objects), allowed(objects)
    for call in sorted(made - let_in):
        problems.append(f"call not allowed by any NetworkPolicy: {call}")
    for rule in sorted(let_in - made):
        problems.append(f"allowed, but no caller makes this call: {rule}")
    for w in m.workloads(objects):
        for c in w.containers():
            port = health_port(w, c, objects)
            for rule in sorted(
                r for r in let_in if r.dest == w.name and r.port <= (port or -1) <= r.end_port
            ):
                problems.append(
                    f"{w.name}/{c['name']}: health port {port} open to {rule.source}, not the kubelet alone"
                )
    return problems
