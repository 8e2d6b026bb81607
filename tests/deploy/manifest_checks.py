"""Checks of rendered Kubernetes objects (deploy/kubernetes), each a function returning the
problems it finds (empty: none), so that test_kubernetes_manifests.py can show each one catching
a broken object as well as passing the real ones."""

from __future__ import annotations

import json
import os
import re
import tomllib
from pathlib import Path
from typing import Any

from tests.deploy import manifests as m

from kvshuttle.agent.main import SERVICE as AGENT_SERVICE
from kvshuttle.registry.main import SERVICE as REGISTRY_SERVICE
from kvshuttle.router.main import SERVICE as ROUTER_SERVICE

REPO = Path(__file__).resolve().parents[2]
ENGINE_COMPONENTS = ("prefill", "decode")
GRPC_PORTS = {"registry": 50051, "router": 50061, "agent": 50071, "epp": 9002}
# The health names a gRPC service's probes may ask for: the server's own ("") or the service's.
# The endpoint picker's are those its protocol names, one per probe (overlays/inference-pool).
HEALTH_SERVICES = {
    role: {"readinessProbe": {"", name}, "livenessProbe": {"", name}}
    for role, name in (("registry", REGISTRY_SERVICE), ("router", ROUTER_SERVICE), ("agent", AGENT_SERVICE))
}
HEALTH_SERVICES["epp"] = {"readinessProbe": {"readiness"}, "livenessProbe": {"liveness"}}
# Containers that may write their root filesystem: vLLM and its kernels write compile caches
# beside their packages.
WRITABLE_ROOT = frozenset({"vllm"})
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})
Objects = list[dict[str, Any]]


def engines(objects: Objects) -> list[m.Workload]:
    return [w for w in m.workloads(objects) if w.component in ENGINE_COMPONENTS]


def service_workload(objects: Objects, role: str) -> m.Workload:
    (found,) = [w for w in m.workloads(objects) if w.component == role]
    return found


def flag(args: list[str], name: str) -> str:
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    assert len(values) == 1, f"--{name} given {len(values)} times"
    return values[0]


def port_of(endpoint: str) -> int:
    return int(endpoint.rstrip("/").rsplit(":", 1)[1])


def profile() -> dict[str, Any]:
    (only,) = tomllib.loads((REPO / "deploy/kubernetes/base/profiles.toml").read_text())["profile"]
    return dict(only)


# --- the checks ----------------------------------------------------------------------------------


def http_port(w: m.Workload, objects: Objects) -> int:
    """The engine pod's serving port: vLLM's --port, or, with kvshuttle-sidecar in front of vLLM
    (overlays/inference-pool's decode pods), the sidecar's LISTEN port."""
    if "sidecar" in {c["name"] for c in w.containers()}:
        return m.port_of_address(m.env(w.container("sidecar"), objects)["KVSHUTTLE_SIDECAR_LISTEN"])
    return int(flag(w.container("vllm")["args"], "port"))


def sidecar_problems(objects: Objects) -> list[str]:
    """Each engine pod: vLLM plus the agent (and, in a decode pod, perhaps kvshuttle-sidecar in
    front of vLLM), configured alike (ports, model, block size, the side-channel host from the
    pod IP, a fresh engine id per start, the KV-transfer settings kvshuttle relies on)."""
    problems = []
    router = m.env(service_workload(objects, "router").container("router"), objects)
    gateway = m.env(service_workload(objects, "gateway").container("gateway"), objects)
    models = json.loads(gateway["KVSHUTTLE_GATEWAY_MODELS"])
    for w in engines(objects):
        names = sorted(c["name"] for c in w.containers())
        allowed = [["agent", "vllm"]] + ([["agent", "sidecar", "vllm"]] if w.component == "decode" else [])
        if names not in allowed:
            problems.append(f"{w.name}: containers {names}, want vllm and its agent (decode: and a sidecar)")
            continue
        vllm, agent = w.container("vllm"), w.container("agent")
        v, a = m.env(vllm, objects), m.env(agent, objects)
        args = vllm["args"]
        kv = json.loads(v["KV_TRANSFER_CONFIG"])
        extra = kv["kv_connector_extra_config"]
        events = json.loads(flag(args, "kv-events-config"))
        pod_ip = m.SAMPLE_FIELDS["status.podIP"]
        want = {
            "NODE__ROLE": (a["KVSHUTTLE_AGENT_NODE__ROLE"], w.component),
            "NODE__NAME is the pod's": (a["KVSHUTTLE_AGENT_NODE__NAME"], m.SAMPLE_FIELDS["metadata.name"]),
            "NODE__HTTP_ENDPOINT": (
                a["KVSHUTTLE_AGENT_NODE__HTTP_ENDPOINT"],
                f"http://{pod_ip}:{http_port(w, objects)}",
            ),
            "side-channel host (vLLM)": (v["VLLM_NIXL_SIDE_CHANNEL_HOST"], pod_ip),
            "side-channel host (agent)": (a["KVSHUTTLE_AGENT_NODE__SIDE_CHANNEL_HOST"], pod_ip),
            "side-channel port": (
                a["KVSHUTTLE_AGENT_NODE__SIDE_CHANNEL_PORT"],
                v["VLLM_NIXL_SIDE_CHANNEL_PORT"],
            ),
            "pool serve host": (a["KVSHUTTLE_AGENT_POOL__SERVE_HOST"], pod_ip),
            "agent endpoint": (a["KVSHUTTLE_AGENT_NODE__AGENT_ENDPOINT"], f"{pod_ip}:{GRPC_PORTS['agent']}"),
            "block size": (a["KVSHUTTLE_AGENT_NODE__BLOCK_SIZE"], flag(args, "block-size")),
            "model": (a["KVSHUTTLE_AGENT_NODE__MODEL"], flag(args, "served-model-name")),
            "model (router profile)": (profile()["model"], flag(args, "served-model-name")),
            "model (gateway)": (sorted(models), [flag(args, "served-model-name")]),
            "KV bytes per token": (
                int(a["KVSHUTTLE_AGENT_NODE__KV_BYTES_PER_TOKEN"]),
                profile()["kv_bytes_per_token"],
            ),
            "events endpoint": (
                a["KVSHUTTLE_AGENT_EVENTS__ENDPOINT"],
                events["endpoint"].replace("*", "127.0.0.1"),
            ),
            "replay endpoint": (
                a["KVSHUTTLE_AGENT_EVENTS__REPLAY_ENDPOINT"],
                events["replay_endpoint"].replace("*", "127.0.0.1"),
            ),
            "events topic": (a["KVSHUTTLE_AGENT_EVENTS__TOPIC"], events["topic"]),
            "events on": (events["enable_kv_cache_events"], True),
            "connector": (kv["kv_connector"], "NixlConnector"),
            "engine id drawn at start": (kv["engine_id"], "@ENGINE_ID@"),
            "bidirectional_kv_xfer": (extra["bidirectional_kv_xfer"], True),
            "decoder_kv_blocks_ttl = router's": (
                extra["decoder_kv_blocks_ttl"],
                float(router["KVSHUTTLE_ROUTER_POLICY__DECODER_KV_BLOCKS_TTL_S"]),
            ),
            "kv_recompute_threshold = profile's min_reuse_tokens": (
                extra["kv_recompute_threshold"],
                profile()["min_reuse_tokens"],
            ),
            "kv_load_failure_policy": (
                kv.get("kv_load_failure_policy"),
                "recompute" if w.component == "prefill" else None,
            ),
            "engine id file": (a["KVSHUTTLE_AGENT_NODE__ENGINE_ID_FILE"], v["KVSHUTTLE_ENGINE_ID_FILE"]),
            "the agent itself, no wrapper": (agent.get("command"), ["kvshuttle-agent"]),
            "UCX ports": (a["UCX_TCP_PORT_RANGE"], v["UCX_TCP_PORT_RANGE"]),
        }
        problems += [
            f"{w.name}: {what}: {got!r} != {expected!r}"
            for what, (got, expected) in want.items()
            if got != expected
        ]
        # The engine id file lives on a volume both containers mount, at the same place.
        shared = {mt["name"] for mt in vllm["volumeMounts"]} & {mt["name"] for mt in agent["volumeMounts"]}
        id_dir = str(Path(v["KVSHUTTLE_ENGINE_ID_FILE"]).parent)
        if not any(mt["mountPath"] == id_dir and mt["name"] in shared for mt in agent["volumeMounts"]):
            problems.append(f"{w.name}: the agent does not share {id_dir} with vLLM")
        if "KVSHUTTLE_AGENT_NODE__ENGINE_ID" in a:
            problems.append(f"{w.name}: a fixed engine id; the agent follows the one vLLM drew (its file)")
    return problems


def grpc_role(w: m.Workload, c: dict[str, Any]) -> str | None:
    """The kvshuttle gRPC service a container runs (registry, router, agent), if any."""
    role = "agent" if c["name"] == "agent" else w.component
    return role if role in GRPC_PORTS else None


def health_port(w: m.Workload, c: dict[str, Any], objects: Objects) -> int | None:
    """The port of the container's plaintext health-only listener (SERVER__HEALTH_LISTEN)."""
    listen = next((v for k, v in m.env(c, objects).items() if k.endswith("_SERVER__HEALTH_LISTEN")), None)
    return None if listen is None else m.port_of_address(listen)


def probe_problems(objects: Objects) -> list[str]:
    problems = []
    for w in m.workloads(objects):
        for c in w.containers():
            where = f"{w.name}/{c['name']}"
            role = grpc_role(w, c)
            if role is not None:
                problems += health_listener_problems(w, c, objects)
            loopback = loopback_health(c) if c["name"] == "vllm" else None
            for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
                probe = c.get(kind)
                if probe is None:
                    if kind != "startupProbe":
                        problems.append(f"{where}: no {kind}")
                elif role is not None:
                    problems += grpc_probe_problems(where, kind, probe, role, health_port(w, c, objects))
                elif loopback is not None:
                    if loopback not in " ".join(probe.get("exec", {}).get("command", [])):
                        problems.append(f"{where}: {kind} does not GET {loopback}: {probe}")
                elif probe.get("httpGet", {}).get("path") != "/health":
                    problems.append(f"{where}: {kind} is not an HTTP GET of /health: {probe}")
            if c["name"] == "vllm" and "startupProbe" not in c:
                problems.append(f"{where}: no startupProbe (loading weights takes minutes)")
    return problems


def loopback_health(vllm: dict[str, Any]) -> str | None:
    """vLLM's /health URL when it listens on the pod's loopback alone (behind kvshuttle-sidecar),
    which the kubelet's HTTP probe (to the pod IP) cannot reach: its probes run in the container.
    None when it listens on the pod's address."""
    host = flag(vllm["args"], "host")
    return f"http://{host}:{flag(vllm['args'], 'port')}/health" if host in LOOPBACK_HOSTS else None


def health_listener_problems(w: m.Workload, c: dict[str, Any], objects: Objects) -> list[str]:
    """A gRPC service serves plaintext health on a port of its own, declared once in the pod."""
    where, port = f"{w.name}/{c['name']}", health_port(w, c, objects)
    if port is None:
        return [f"{where}: no SERVER__HEALTH_LISTEN (the kubelet's grpc probe speaks plaintext only)"]
    declared = [(x["name"], p["containerPort"]) for x in w.containers() for p in x.get("ports", [])]
    if [name for name, number in declared if number == port] != [c["name"]]:
        return [f"{where}: health port {port} is not declared by this container alone: {declared}"]
    return []


def grpc_probe_problems(
    where: str, kind: str, probe: dict[str, Any], role: str, port: int | None
) -> list[str]:
    """The kubelet's own grpc probe (plaintext) on the health-only listener, in every overlay: the
    main port serves TLS in production, which that probe cannot speak."""
    grpc = probe.get("grpc")
    if grpc is None or set(probe) & {"exec", "httpGet", "tcpSocket"}:
        return [f"{where}: {kind} is not a native grpc probe: {probe}"]
    if grpc.get("port") != port:
        return [f"{where}: {kind} probes port {grpc.get('port')}, the health listener is on {port}"]
    wanted = HEALTH_SERVICES[role][kind]
    if grpc.get("service", "") not in wanted:
        return [f"{where}: {kind} asks for {grpc.get('service', '')!r}, want one of {sorted(wanted)}"]
    return []


def security_problems(objects: Objects) -> list[str]:
    problems = []
    for w in m.workloads(objects):
        pod = w.spec.get("securityContext", {})
        if w.spec.get("automountServiceAccountToken") is not False:
            problems.append(f"{w.name}: mounts a service account token it never uses")
        for c in w.containers():
            where = f"{w.name}/{c['name']}"
            sc = {**pod, **c.get("securityContext", {})}
            if sc.get("runAsNonRoot") is not True or not sc.get("runAsUser"):
                user = (sc.get("runAsNonRoot"), sc.get("runAsUser"))
                problems.append(f"{where}: may run as root (runAsNonRoot, runAsUser: {user})")
            if sc.get("allowPrivilegeEscalation") is not False:
                problems.append(f"{where}: allowPrivilegeEscalation is not false")
            if sc.get("capabilities", {}).get("drop") != ["ALL"]:
                problems.append(f"{where}: does not drop all capabilities")
            if sc.get("seccompProfile", {}).get("type") != "RuntimeDefault":
                problems.append(f"{where}: no RuntimeDefault seccomp profile")
            if c["name"] not in WRITABLE_ROOT and sc.get("readOnlyRootFilesystem") is not True:
                problems.append(f"{where}: root filesystem writable")
    return problems


def image_problems(objects: Objects) -> list[str]:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    problems = []
    for w in m.workloads(objects):
        for c in w.containers():
            image = c["image"]
            name, _, digest = image.partition("@")
            repo, _, tag = name.rpartition(":") if ":" in name.rsplit("/", 1)[-1] else (name, "", "")
            if not tag or tag == "latest":
                problems.append(f"{w.name}/{c['name']}: image {image} has no version tag")
            if digest and not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
                problems.append(f"{w.name}/{c['name']}: digest {digest} is not sha256:<64 hex>")
            if repo.endswith("/kvshuttle") and tag != version:
                problems.append(f"{w.name}/{c['name']}: kvshuttle image {tag}, the project is {version}")
    return problems


def resource_problems(objects: Objects) -> list[str]:
    problems = []
    for w in m.workloads(objects):
        for c in w.containers():
            requests = c.get("resources", {}).get("requests", {})
            if not {"cpu", "memory"} <= requests.keys():
                problems.append(f"{w.name}/{c['name']}: requests {requests}, want cpu and memory")
            if "memory" not in c.get("resources", {}).get("limits", {}):
                problems.append(f"{w.name}/{c['name']}: no memory limit")
            if c["name"] == "vllm" and "nvidia.com/gpu" not in requests:
                problems.append(f"{w.name}/vllm: requests no GPU")
    return problems


def pdb_problems(objects: Objects) -> list[str]:
    problems = []
    pdbs = m.find(objects, "PodDisruptionBudget")
    for w in m.workloads(objects):
        covering = [p for p in pdbs if m.selects(p["spec"]["selector"], w.labels)]
        if w.replicas > 1 and not covering:
            problems.append(f"{w.name}: {w.replicas} replicas and no PodDisruptionBudget")
        for p in covering:
            spec = p["spec"]
            if "minAvailable" in spec and int(spec["minAvailable"]) >= w.replicas:
                problems.append(f"{w.name}: PodDisruptionBudget {p['metadata']['name']} never lets a pod go")
    return problems


def secret_problems(objects: Objects) -> list[str]:
    """Secrets reach containers only through Secret references: a secret setting (SecretStr)
    from a secretKeyRef, a file setting that holds one (tokens, keys, API keys) under a mounted
    Secret or certificate volume; the Redis URL (its password) from a Secret; no literal."""
    problems = []
    file_fields = {"tokens_file", "token_file", "api_keys_file", "private_key", "tls_key_file"}
    for w in m.workloads(objects):
        for c in w.containers():
            refs = m.secret_refs(c)
            mounts = m.secret_mounts(w, c)
            for name, value in m.env(c, objects).items():
                field = m.setting_field(name)
                if field is None:
                    continue
                _, path, annotation = field
                where = f"{w.name}/{c['name']} {name}"
                if (m.is_secret(annotation) or path == ["redis", "url"]) and name not in refs:
                    problems.append(f"{where}: a secret set in the manifest, not from a Secret")
                if path[-1] in file_fields and not any(value.startswith(f"{p}/") for p in mounts):
                    problems.append(f"{where}: {value} is not on a mounted Secret")
    for cm in m.find(objects, "ConfigMap"):
        for key in m.data_of(cm):
            if re.search(r"token|password|secret|key\b", key, re.IGNORECASE):
                problems.append(f"ConfigMap {cm['metadata']['name']}: {key} looks like a secret")
    return problems


def settings_problems(objects: Objects, tmp_path: Path, monkeypatch: Any) -> list[str]:
    """Every KVSHUTTLE_* variable names a real settings field, and each service's settings load
    from its container's environment as rendered (values validated as the service would)."""
    problems = []
    for w in m.workloads(objects):
        for c in w.containers():
            environment = m.env(c, objects)
            for name in environment:
                service = any(name.startswith(prefix) for prefix in m.SETTINGS)
                if service and m.setting_field(name) is None:
                    problems.append(f"{w.name}/{c['name']}: {name} is no setting of the service")
            prefixes = {p for p in m.SETTINGS if any(k.startswith(p) for k in environment)}
            for prefix in prefixes:
                problems += _load(w, c, prefix, environment, tmp_path, monkeypatch)
    return problems


def _load(
    w: m.Workload, c: dict[str, Any], prefix: str, environment: dict[str, str], tmp: Path, mp: Any
) -> list[str]:
    with mp.context() as patch:
        for name in [k for k in os.environ if k.startswith("KVSHUTTLE_")]:
            patch.delenv(name)
        for name, value in environment.items():
            if not name.startswith(prefix) or m.setting_field(name) is None:
                continue
            if name.endswith("API_KEYS_FILE"):  # read while the settings load: a stand-in file
                (tmp / "api-keys.json").write_text("{}")
                patch.setenv(name, str(tmp / "api-keys.json"))
            else:
                patch.setenv(name, value)
        try:
            m.SETTINGS[prefix]()
        except ValueError as exc:
            return [f"{w.name}/{c['name']}: {m.SETTINGS[prefix].__name__} does not load: {exc}"]
    return []
