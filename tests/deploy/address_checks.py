"""The addresses clients dial, against the replicas that exist: the gateway's router list names
exactly the router StatefulSet's pods (conversation affinity needs each replica by name, and a
replica left out, or a name of no pod, would split or strand conversations), the agents reach
the registry as the router does (every replica, round robin over the headless Service), and
each TLS client checks its server's certificate against a name the certificate carries."""

from __future__ import annotations

from typing import Any

from tests.deploy import manifests as m
from tests.deploy.manifest_checks import engines, service_workload
from tests.deploy.network_checks import dialled

Objects = list[dict[str, Any]]


def router_pods(objects: Objects) -> list[str]:
    """host:port of each router replica by its own DNS name (<pod>.<headless Service>)."""
    router = service_workload(objects, "router")
    spec = m.one(objects, router.kind, router.name)["spec"]
    service = m.one(objects, "Service", str(spec.get("serviceName", "")))
    assert service["spec"].get("clusterIP") == "None", f"Service {service['metadata']['name']} not headless"
    listen = m.env(router.container("router"), objects)["KVSHUTTLE_ROUTER_SERVER__LISTEN"]
    port = m.port_of_address(listen)
    return [f"{router.name}-{i}.{spec['serviceName']}:{port}" for i in range(router.replicas)]


def router_list_problems(objects: Objects) -> list[str]:
    """The gateway routes conversations among the router pods by name, all of them, and every
    gateway replica keys that choice alike (CACHE_SALT_KEY from one Secret)."""
    router = service_workload(objects, "router")
    if router.kind != "StatefulSet" or "serviceName" not in m.one(objects, router.kind, router.name)["spec"]:
        return [f"{router.kind}/{router.name}: not a StatefulSet with a serviceName (no stable pod names)"]
    gateway = service_workload(objects, "gateway").container("gateway")
    env = m.env(gateway, objects)
    problems = []
    listed, pods = m.addresses(env["KVSHUTTLE_GATEWAY_ROUTER__ADDRESS"]), router_pods(objects)
    if sorted(listed) != sorted(pods):
        problems.append(f"gateway: ROUTER__ADDRESS names {listed}, the router StatefulSet's pods are {pods}")
    if env.get("KVSHUTTLE_GATEWAY_ROUTER__AFFINITY") != "conversation":
        affinity = env.get("KVSHUTTLE_GATEWAY_ROUTER__AFFINITY")
        problems.append(f"gateway: ROUTER__AFFINITY {affinity!r}, want 'conversation'")
    if "KVSHUTTLE_GATEWAY_CACHE_SALT_KEY" not in m.secret_refs(gateway):
        problems.append("gateway: CACHE_SALT_KEY (the affinity's key) not from a Secret every replica shares")
    return problems


def registry_address_problems(objects: Objects) -> list[str]:
    """The router and every agent reach the registry alike: one DNS name of its headless Service,
    so calls go round robin over every replica. Replicas of the in-memory store would each hold
    their own leases and index: that store runs one."""
    registry = service_workload(objects, "registry")
    spec = m.one(objects, registry.kind, registry.name)["spec"]
    listen = m.env(registry.container("registry"), objects)["KVSHUTTLE_REGISTRY_SERVER__LISTEN"]
    want = f"dns:///{spec.get('serviceName')}:{m.port_of_address(listen)}"
    problems = []
    store = m.env(registry.container("registry"), objects)["KVSHUTTLE_REGISTRY_STORE"]
    if store == "memory" and registry.replicas != 1:
        problems.append(f"registry: {registry.replicas} replicas of the in-memory store; it runs one")
    callers = [(service_workload(objects, "router"), "router", "ROUTER")]
    callers += [(w, "agent", "AGENT") for w in engines(objects)]
    for w, container, prefix in callers:
        got = m.env(w.container(container), objects)[f"KVSHUTTLE_{prefix}_REGISTRY__ADDRESS"]
        if got != want:
            problems.append(f"{w.name}/{container}: REGISTRY__ADDRESS {got}, want every replica: {want}")
    return problems


# --- TLS names -----------------------------------------------------------------------------------


def name_covered(name: str, dns_names: list[str]) -> bool:
    """Whether a certificate of `dns_names` verifies for `name`, as gRPC checks it: an equal
    name, or a wildcard of the leftmost label over a domain of two labels or more (gRPC refuses
    "*.kvshuttle-router" for "a.kvshuttle-router": "Invalid toplevel subdomain")."""
    name = name.lower()
    for entry in (d.lower() for d in dns_names):
        if entry == name:
            return True
        domain = entry.removeprefix("*.")
        if entry.startswith("*.") and "." in domain and name.split(".", 1)[-1] == domain and "." in name:
            return True
    return False


def server_dns_names(objects: Objects, w: m.Workload, container: str) -> list[str]:
    """The DNS names of the certificate `container` serves: its Certificate's (by the Secret
    mounted where SERVER__TLS_CERT_FILE is), or the CSI driver's for a per-pod certificate."""
    c = w.container(container)
    cert_file = next((v for k, v in m.env(c, objects).items() if k.endswith("_SERVER__TLS_CERT_FILE")), None)
    if cert_file is None:
        return []
    volume = next(v for p, v in m.secret_mounts(w, c).items() if cert_file.startswith(f"{p}/"))
    if "csi" in volume:
        return str(volume["csi"]["volumeAttributes"]["csi.cert-manager.io/dns-names"]).split(",")
    certificates = m.find(objects, "Certificate")
    (spec,) = [x["spec"] for x in certificates if x["spec"]["secretName"] == volume["secret"]["secretName"]]
    return [str(d) for d in spec.get("dnsNames", [])]


def _server_container(w: m.Workload) -> str:
    return "agent" if "agent" in {c["name"] for c in w.containers()} else w.component


def _tls_dials(objects: Objects, w: m.Workload, c: dict[str, Any]) -> list[tuple[str, m.Workload, str]]:
    """(what is dialled, the server's workload, the name checked) of each TLS connection of `c`:
    the name is TLS_SERVER_NAME, else the host of the address. The router dials agents at the
    pod IP each registered."""
    env = m.env(c, objects)
    conns = {n.removesuffix("__ADDRESS"): m.addresses(v) for n, v in env.items() if n.endswith("__ADDRESS")}
    if c["name"] == "router":
        conns["KVSHUTTLE_ROUTER_AGENTS"] = []
    dials = []
    for conn, addresses in sorted(conns.items()):
        if env.get(f"{conn}__TLS") != "true":
            continue
        override = env.get(f"{conn}__TLS_SERVER_NAME")
        if conn == "KVSHUTTLE_ROUTER_AGENTS":
            pod_ip = m.SAMPLE_FIELDS["status.podIP"]
            dials += [(f"{e.name} pod IP", e, override or pod_ip) for e in engines(objects)]
        for address in addresses:
            dials.append((address, dialled(objects, address), override or m.host_of_address(address)))
    return dials


def tls_name_problems(objects: Objects) -> list[str]:
    """Every TLS connection: the name its client checks is one of the server certificate's."""
    problems = []
    for w in m.workloads(objects):
        for c in w.containers():
            for address, callee, checked in _tls_dials(objects, w, c):
                names = server_dns_names(objects, callee, _server_container(callee))
                if not name_covered(checked, names):
                    problems.append(
                        f"{w.name} -> {callee.name}: checks the certificate for {checked!r} "
                        f"(dialling {address}), it names {names}"
                    )
    return problems
