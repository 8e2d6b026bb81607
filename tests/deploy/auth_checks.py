"""The overlays' own promises (dev: one replica, memory, tokens; production: Redis, replicas,
mTLS) and the identities of the authorization work: every caller presents an identity the
service it calls grants the right role, every engine pod's agent one scoped to its own node;
cert-manager's and the Prometheus Operator's objects (CRDs, not schema-checked) checked by shape."""

from __future__ import annotations

import json
from typing import Any

from tests.deploy import manifests as m
from tests.deploy.manifest_checks import engines, service_workload

from kvshuttle.core.auth import Role
from kvshuttle.serving.identities import Identities
from kvshuttle.serving.settings import AuthSettings

Objects = list[dict[str, Any]]
# Who calls whom, and the role the callee must grant the caller.
CALLERS = (("router", "registry", "REGISTRY", "router"), ("gateway", "router", "ROUTER", "gateway"))
SERVERS = {"registry": "REGISTRY", "router": "ROUTER", "agent": "AGENT"}


def _server_envs(objects: Objects) -> dict[str, dict[str, str]]:
    """role -> the environment of that role's gRPC server (one agent: all are alike)."""
    envs = {r: m.env(service_workload(objects, r).container(r), objects) for r in ("registry", "router")}
    envs["agent"] = m.env(engines(objects)[0].container("agent"), objects)
    return envs


def overlay_problems(objects: Objects, overlay: str) -> list[str]:
    problems = []
    servers = _server_envs(objects)
    store = servers["registry"]["KVSHUTTLE_REGISTRY_STORE"]
    replicas = {w.name: w.replicas for w in m.workloads(objects)}
    tls = {role: f"KVSHUTTLE_{p}_SERVER__TLS_CLIENT_CA_FILE" in servers[role] for role, p in SERVERS.items()}
    insecure = {
        role: servers[role].get(f"KVSHUTTLE_{p}_AUTH__INSECURE") == "true" for role, p in SERVERS.items()
    }
    if overlay == "dev":
        if store != "memory" or set(replicas.values()) != {1}:
            problems.append(f"dev: store {store}, replicas {replicas}; want memory and one of each")
        if any(tls.values()) or not all(insecure.values()):
            problems.append(f"dev: plaintext with tokens expected (TLS {tls}, insecure {insecure})")
    else:
        registry = servers["registry"]
        if store != "redis" or "KVSHUTTLE_REGISTRY_REDIS__URL" not in registry:
            problems.append(f"production: the registry's store is {store}, want redis with REDIS__URL")
        if min(replicas.values()) < 2:
            problems.append(f"production: replicas {replicas}, want at least two of each")
        if not all(tls.values()) or any(insecure.values()):
            problems.append(f"production: mTLS on every server expected (TLS {tls}, insecure {insecure})")
        for w in m.workloads(objects):
            for c in w.containers():
                env = m.env(c, objects)
                conns = {n.removesuffix("__ADDRESS") for n in env if n.endswith("__ADDRESS")}
                if c["name"] == "router":
                    conns.add("KVSHUTTLE_ROUTER_AGENTS")
                for conn in sorted(conns):
                    if env.get(f"{conn}__TLS") != "true" or f"{conn}__CERT_CHAIN" not in env:
                        problems.append(f"{w.name}: {conn} dialled without mTLS")
    return problems


def grants(env: dict[str, str], prefix: str) -> dict[str, dict[str, Any]]:
    return dict(json.loads(env.get(f"KVSHUTTLE_{prefix}_AUTH__IDENTITIES", "{}")))


def _token_identity(
    objects: Objects, w: m.Workload, c: dict[str, Any], path: str, server_tokens: dict[str, str]
) -> str | None:
    """The identity whose token the file at `path` holds, in the server's tokens file."""
    for mount, volume in m.secret_mounts(w, c).items():
        if path.startswith(f"{mount}/"):
            secret = m.data_of(m.one(objects, "Secret", volume["secret"]["secretName"]))
            token = secret[path.removeprefix(f"{mount}/")].strip()
            return next((ident for ident, t in server_tokens.items() if t == token), None)
    return None


def _server_tokens(objects: Objects, role: str) -> dict[str, str]:
    w = service_workload(objects, role) if role != "agent" else engines(objects)[0]
    c = w.container(role)
    path = m.env(c, objects).get(f"KVSHUTTLE_{SERVERS[role]}_AUTH__TOKENS_FILE", "")
    for mount, volume in m.secret_mounts(w, c).items():
        if path.startswith(f"{mount}/"):
            return dict(
                json.loads(
                    m.data_of(m.one(objects, "Secret", volume["secret"]["secretName"]))[
                        path.removeprefix(f"{mount}/")
                    ]
                )
            )
    return {}


def presented(
    objects: Objects, w: m.Workload, c: dict[str, Any], conn: str, callee: str, pod: str
) -> str | None:
    """The identity `c` presents on its connection `conn` (e.g. ROUTER_REGISTRY) to `callee`."""
    env = m.env(c, objects)
    token_file = env.get(f"KVSHUTTLE_{conn}__TOKEN_FILE")
    if token_file is not None:
        return _token_identity(
            objects,
            w,
            c,
            token_file.replace(m.SAMPLE_FIELDS["metadata.name"], pod),
            _server_tokens(objects, callee),
        )
    cert = env.get(f"KVSHUTTLE_{conn}__CERT_CHAIN")
    if cert is None:
        return None
    volume = next(v for p, v in m.secret_mounts(w, c).items() if cert.startswith(f"{p}/"))
    if "csi" in volume:
        return str(volume["csi"]["volumeAttributes"]["csi.cert-manager.io/uri-sans"]).replace(
            "${POD_NAME}", pod
        )
    (certificate,) = [
        x for x in m.find(objects, "Certificate") if x["spec"]["secretName"] == volume["secret"]["secretName"]
    ]
    (uri,) = certificate["spec"]["uris"]
    return str(uri)


def identity_problems(objects: Objects) -> list[str]:
    problems = []
    servers = _server_envs(objects)
    for caller, callee, conn, role in CALLERS:
        w = service_workload(objects, caller)
        ident = presented(objects, w, w.container(caller), f"{caller.upper()}_{conn}", callee, w.name)
        grant = grants(servers[callee], SERVERS[callee]).get(ident or "")
        if grant is None or grant["role"] != role:
            problems.append(f"{caller} -> {callee}: identity {ident} has grant {grant}, want role {role}")
    router = service_workload(objects, "router")
    ident = presented(objects, router, router.container("router"), "ROUTER_AGENTS", "agent", router.name)
    if (grants(servers["agent"], "AGENT").get(ident or "") or {}).get("role") != "router":
        problems.append(f"router -> agents: identity {ident} not granted role router by the agents")
    # The registry's own reading of its grants (named, or by pattern for certificates).
    registry_identities = Identities(
        AuthSettings.model_validate({"identities": grants(servers["registry"], "REGISTRY")}).identities
    )
    pods = [f"{w.name}-{ordinal}" for w in engines(objects) for ordinal in range(w.replicas)]
    for w in engines(objects):
        for ordinal in range(w.replicas):
            pod = f"{w.name}-{ordinal}"
            agent = w.container("agent")
            ident = presented(objects, w, agent, "AGENT_REGISTRY", "registry", pod)
            by_certificate = "KVSHUTTLE_AGENT_REGISTRY__CERT_CHAIN" in m.env(agent, objects)
            granted = (
                registry_identities.of_certificate([ident or ""], [])
                if by_certificate
                else registry_identities.named(ident or "")
            )
            scope = (
                []
                if granted is None or granted.role is not Role.AGENT
                else [f"nodes/{p}" for p in pods if granted.acts_for_node(f"nodes/{p}")]
            )
            if scope != [f"nodes/{pod}"] or not granted or not granted.acts_for_node(f"nodes/{pod}-pool"):
                problems.append(
                    f"{pod}: its agent's identity {ident} acts for {scope}, want nodes/{pod} alone"
                )
    return problems


def crd_problems(objects: Objects) -> list[str]:
    """cert-manager Certificates and Issuer, Prometheus Operator ServiceMonitors: by shape."""
    problems = []
    issuers = {i["metadata"]["name"] for i in m.find(objects, "Issuer")}
    mounted = {
        v["secret"]["secretName"]
        for w in m.workloads(objects)
        for v in w.spec.get("volumes", [])
        if "secret" in v
    }
    for cert in m.find(objects, "Certificate"):
        spec, name = cert["spec"], cert["metadata"]["name"]
        if cert["apiVersion"] != "cert-manager.io/v1" or spec.get("issuerRef", {}).get("name") not in issuers:
            problems.append(f"Certificate {name}: not cert-manager.io/v1 from a rendered Issuer")
        if spec.get("secretName") not in mounted:
            problems.append(f"Certificate {name}: its Secret {spec.get('secretName')} is mounted by no pod")
        if not spec.get("uris") or "client auth" not in spec.get("usages", []):
            problems.append(f"Certificate {name}: no URI identity or no client auth usage")
    for csi in [v["csi"] for w in m.workloads(objects) for v in w.spec.get("volumes", []) if "csi" in v]:
        if (
            csi["driver"] != "csi.cert-manager.io"
            or csi["volumeAttributes"]["csi.cert-manager.io/issuer-name"] not in issuers
        ):
            problems.append(f"CSI certificate volume {csi}: not cert-manager's from a rendered Issuer")
    services = m.find(objects, "Service")
    for monitor in m.find(objects, "ServiceMonitor"):
        name = monitor["metadata"]["name"]
        chosen = [
            s for s in services if m.selects(monitor["spec"]["selector"], s["metadata"].get("labels", {}))
        ]
        if monitor["apiVersion"] != "monitoring.coreos.com/v1" or not chosen:
            problems.append(f"ServiceMonitor {name}: not monitoring.coreos.com/v1 or selects no Service")
        for endpoint in monitor["spec"]["endpoints"]:
            for s in chosen:
                if endpoint["port"] not in {p["name"] for p in s["spec"]["ports"]}:
                    service = s["metadata"]["name"]
                    problems.append(
                        f"ServiceMonitor {name}: Service {service} has no port {endpoint['port']}"
                    )
    return problems
