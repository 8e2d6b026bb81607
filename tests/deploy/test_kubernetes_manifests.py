"""The Kubernetes manifests as `kubectl kustomize` renders each overlay (deploy/kubernetes),
checked for what a deployment needs to be right: every vLLM pod has the agent sidecar configured
as its engine is, probes on every container, NetworkPolicies that allow exactly the calls made,
no container as root, versioned images, resource requests, PodDisruptionBudgets, secrets only
through Secrets, settings that exist and load, each overlay's promises, and addresses that name
the replicas there are (the gateway's router pods, every registry replica, certificate names).
`make deploy-check`
also validates every object against Kubernetes' schema (deploy/kubernetes/check.py); the CRD
objects (cert-manager, Prometheus Operator) are checked here by shape.

Each check passes the real objects, and each catches a broken copy (the `broken` tests)."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from deploy.kubernetes import check
from tests.deploy import address_checks as addresses
from tests.deploy import auth_checks as auth
from tests.deploy import manifest_checks as checks
from tests.deploy import manifests as m
from tests.deploy.network_checks import network_problems

pytestmark = pytest.mark.k8s

Objects = list[dict[str, Any]]
RENDERED = {overlay: check.render(overlay) for overlay in check.STACK_OVERLAYS}


@pytest.fixture(params=check.STACK_OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def objects_of(overlay: str) -> Objects:
    return copy.deepcopy(RENDERED[overlay])


def test_each_overlay_renders_what_it_should(overlay: str) -> None:
    kinds = sorted({o["kind"] for o in RENDERED[overlay]})
    assert {"StatefulSet", "Deployment", "Service", "NetworkPolicy", "PodDisruptionBudget"} <= set(kinds)
    names = {w.name for w in m.workloads(RENDERED[overlay])}
    assert names == {
        "kvshuttle-registry",
        "kvshuttle-router",
        "kvshuttle-gateway",
        "kvshuttle-vllm-prefill",
        "kvshuttle-vllm-decode",
    }
    crds = {o["kind"] for o in RENDERED[overlay] if check.api_group(o) in check.CRD_GROUPS}
    assert crds == ({"Certificate", "Issuer", "ServiceMonitor"} if overlay == "production" else set())


def test_every_vllm_pod_has_the_agent_sidecar_configured_as_its_engine(overlay: str) -> None:
    assert len(checks.engines(RENDERED[overlay])) == 2
    assert checks.sidecar_problems(RENDERED[overlay]) == []


def test_every_container_has_probes(overlay: str) -> None:
    assert checks.probe_problems(RENDERED[overlay]) == []


def test_network_policies_allow_exactly_the_calls_made(overlay: str) -> None:
    assert network_problems(RENDERED[overlay]) == []


def test_no_container_runs_as_root(overlay: str) -> None:
    assert checks.security_problems(RENDERED[overlay]) == []


def test_images_are_versioned(overlay: str) -> None:
    assert checks.image_problems(RENDERED[overlay]) == []


def test_every_container_requests_resources(overlay: str) -> None:
    assert checks.resource_problems(RENDERED[overlay]) == []


def test_replicated_workloads_have_disruption_budgets(overlay: str) -> None:
    assert checks.pdb_problems(RENDERED[overlay]) == []


def test_secrets_come_only_from_secrets(overlay: str) -> None:
    assert checks.secret_problems(RENDERED[overlay]) == []


def test_settings_exist_and_load(overlay: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert checks.settings_problems(RENDERED[overlay], tmp_path, monkeypatch) == []


def test_the_overlay_keeps_its_promises(overlay: str) -> None:
    assert auth.overlay_problems(RENDERED[overlay], overlay) == []


def test_every_caller_has_an_identity_the_callee_grants(overlay: str) -> None:
    assert auth.identity_problems(RENDERED[overlay]) == []


def test_crd_objects_have_the_right_shape(overlay: str) -> None:
    assert auth.crd_problems(RENDERED[overlay]) == []


def test_the_gateway_lists_every_router_pod_by_name(overlay: str) -> None:
    assert addresses.router_list_problems(RENDERED[overlay]) == []


def test_agents_reach_every_registry_replica_as_the_router_does(overlay: str) -> None:
    assert addresses.registry_address_problems(RENDERED[overlay]) == []


def test_every_tls_client_checks_a_name_the_server_certificate_has(overlay: str) -> None:
    assert addresses.tls_name_problems(RENDERED[overlay]) == []


def test_the_router_profile_is_the_shipped_one() -> None:
    shipped = (checks.REPO / "deploy/profiles/qwen3-32b-h200.toml").read_text()
    assert (checks.REPO / "deploy/kubernetes/base/profiles.toml").read_text() == shipped


# --- each check catches a broken object ----------------------------------------------------------


def _workload_spec(objects: Objects, name: str) -> dict[str, Any]:
    (obj,) = [o for o in objects if o["kind"] in m.WORKLOAD_KINDS and o["metadata"]["name"] == name]
    spec: dict[str, Any] = obj["spec"]["template"]["spec"]
    return spec


def _container(objects: Objects, workload: str, name: str) -> dict[str, Any]:
    (found,) = [c for c in _workload_spec(objects, workload)["containers"] if c["name"] == name]
    container: dict[str, Any] = found
    return container


def _set_env(container: dict[str, Any], name: str, value: str) -> None:
    container["env"] = [v for v in container["env"] if v["name"] != name] + [{"name": name, "value": value}]


def _drop_agent(o: Objects) -> None:
    spec = _workload_spec(o, "kvshuttle-vllm-decode")
    spec["containers"][:] = [c for c in spec["containers"] if c["name"] != "agent"]


def _ttl_mismatch(o: Objects) -> None:
    _set_env(
        _container(o, "kvshuttle-router", "router"), "KVSHUTTLE_ROUTER_POLICY__DECODER_KV_BLOCKS_TTL_S", "300"
    )


def _no_probe(o: Objects) -> None:
    del _container(o, "kvshuttle-router", "router")["readinessProbe"]


def _probe_main_port(o: Objects) -> None:
    _container(o, "kvshuttle-registry", "registry")["livenessProbe"]["grpc"] = {"port": 50051}


def _health_elsewhere(o: Objects) -> None:
    agent = _container(o, "kvshuttle-vllm-decode", "agent")
    _set_env(agent, "KVSHUTTLE_AGENT_SERVER__HEALTH_LISTEN", "0.0.0.0:8082")
    (port,) = [p for p in agent["ports"] if p["containerPort"] == 8081]
    port["containerPort"] = 8082


def _no_health_listener(o: Objects) -> None:
    router = _container(o, "kvshuttle-router", "router")
    router["env"] = [v for v in router["env"] if v["name"] != "KVSHUTTLE_ROUTER_SERVER__HEALTH_LISTEN"]


def _health_port_open(o: Objects) -> None:
    (policy,) = m.find(o, "NetworkPolicy", "kvshuttle-router")
    (gateway_rule,) = [
        r for r in policy["spec"]["ingress"] if r["ports"] == [{"protocol": "TCP", "port": 50061}]
    ]
    gateway_rule["ports"].append({"protocol": "TCP", "port": 8081})


def _exec_probe(o: Objects) -> None:
    probe = _container(o, "kvshuttle-router", "router")["readinessProbe"]
    del probe["grpc"]
    probe["exec"] = {"command": ["/opt/venv/bin/python", "-c", "0"]}


def _open_side_channel(o: Objects) -> None:
    (policy,) = m.find(o, "NetworkPolicy", "kvshuttle-engines")
    policy["spec"]["ingress"].append({"ports": [{"protocol": "TCP", "port": 5600}]})


def _no_policy(o: Objects) -> None:
    o[:] = [
        x for x in o if not (x["kind"] == "NetworkPolicy" and x["metadata"]["name"] == "kvshuttle-router")
    ]


def _root(o: Objects) -> None:
    _container(o, "kvshuttle-gateway", "gateway")["securityContext"]["runAsUser"] = 0


def _latest(o: Objects) -> None:
    c = _container(o, "kvshuttle-registry", "registry")
    c["image"] = c["image"].rsplit(":", 1)[0] + ":latest"


def _no_requests(o: Objects) -> None:
    del _container(o, "kvshuttle-vllm-prefill", "agent")["resources"]["requests"]


def _no_pdb(o: Objects) -> None:
    o[:] = [
        x
        for x in o
        if not (x["kind"] == "PodDisruptionBudget" and x["metadata"]["name"] == "kvshuttle-router")
    ]
    _workload_spec(o, "kvshuttle-router")  # still there
    (router,) = [x for x in o if x["kind"] == "StatefulSet" and x["metadata"]["name"] == "kvshuttle-router"]
    router["spec"]["replicas"] = 3


def _literal_secret(o: Objects) -> None:
    _set_env(
        _container(o, "kvshuttle-router", "router"),
        "KVSHUTTLE_ROUTER_TURN_SIGNING_KEY",
        "0123456789abcdef0123",
    )


def _typo(o: Objects) -> None:
    _set_env(
        _container(o, "kvshuttle-registry", "registry"), "KVSHUTTLE_REGISTRY_SERVER__LISTNE", "0.0.0.0:1"
    )


def _bad_value(o: Objects) -> None:
    _set_env(
        _container(o, "kvshuttle-vllm-decode", "agent"), "KVSHUTTLE_AGENT_LEASE__TTL", "1"
    )  # heartbeat 2 s >= ttl/3


def _redis_in_dev(o: Objects) -> None:
    _set_env(_container(o, "kvshuttle-registry", "registry"), "KVSHUTTLE_REGISTRY_STORE", "redis")


def _foreign_node(o: Objects) -> None:
    c = _container(o, "kvshuttle-registry", "registry")
    (var,) = [v for v in c["env"] if v["name"] == "KVSHUTTLE_REGISTRY_AUTH__IDENTITIES"]
    var["value"] = var["value"].replace("nodes/kvshuttle-vllm-decode-0", "nodes/kvshuttle-vllm-prefill-0")


def _workload(o: Objects, name: str) -> dict[str, Any]:
    (found,) = [x for x in o if x["kind"] in m.WORKLOAD_KINDS and x["metadata"]["name"] == name]
    return found


def _more_routers(o: Objects) -> None:
    _workload(o, "kvshuttle-router")["spec"]["replicas"] = 3


def _router_deployment(o: Objects) -> None:
    router = _workload(o, "kvshuttle-router")
    router["kind"] = "Deployment"
    del router["spec"]["serviceName"], router["spec"]["podManagementPolicy"]


def _routers_by_one_name(o: Objects) -> None:
    _set_env(
        _container(o, "kvshuttle-gateway", "gateway"),
        "KVSHUTTLE_GATEWAY_ROUTER__ADDRESS",
        "dns:///kvshuttle-router:50061",
    )


def _round_robin(o: Objects) -> None:
    _set_env(
        _container(o, "kvshuttle-gateway", "gateway"), "KVSHUTTLE_GATEWAY_ROUTER__AFFINITY", "round_robin"
    )


def _agent_on_one_replica(o: Objects) -> None:
    address = "kvshuttle-registry-0.kvshuttle-registry:50051"
    _set_env(_container(o, "kvshuttle-vllm-prefill", "agent"), "KVSHUTTLE_AGENT_REGISTRY__ADDRESS", address)


def _two_memory_registries(o: Objects) -> None:
    _workload(o, "kvshuttle-registry")["spec"]["replicas"] = 2


def _router_certificate_names(names: list[str]) -> Callable[[Objects], None]:
    def rename(o: Objects) -> None:
        (certificate,) = m.find(o, "Certificate", "kvshuttle-router")
        certificate["spec"]["dnsNames"] = names

    return rename


def _bad_monitor(o: Objects) -> None:
    for x in o:
        if x["kind"] == "ServiceMonitor":
            x["spec"]["endpoints"][0]["port"] = "metricz"


BROKEN: dict[str, tuple[Callable[[Objects], None], Callable[[Objects], list[str]], str]] = {
    "a vLLM pod without its agent": (_drop_agent, checks.sidecar_problems, "want vllm and its agent"),
    "decoder_kv_blocks_ttl unlike the router's": (
        _ttl_mismatch,
        checks.sidecar_problems,
        "decoder_kv_blocks_ttl",
    ),
    "no readiness probe": (_no_probe, checks.probe_problems, "no readinessProbe"),
    "a probe on the main port": (_probe_main_port, checks.probe_problems, "the health listener is on 8081"),
    "a health listener the probe does not ask": (
        _health_elsewhere,
        checks.probe_problems,
        "probes port 8081, the health listener is on 8082",
    ),
    "no health listener": (_no_health_listener, checks.probe_problems, "no SERVER__HEALTH_LISTEN"),
    "the health port open to a pod": (_health_port_open, network_problems, "health port 8081 open to"),
    "the side channel open to all": (_open_side_channel, network_problems, "no caller makes this call"),
    "a pod no policy lets in": (_no_policy, network_problems, "not allowed by any NetworkPolicy"),
    "a container as root": (_root, checks.security_problems, "may run as root"),
    "an image tagged latest": (_latest, checks.image_problems, "no version tag"),
    "no resource requests": (_no_requests, checks.resource_problems, "want cpu and memory"),
    "replicas without a PDB": (_no_pdb, checks.pdb_problems, "no PodDisruptionBudget"),
    "a secret in the manifest": (_literal_secret, checks.secret_problems, "not from a Secret"),
    "a misspelt setting": (_typo, lambda o: checks.settings_problems(o, *_SETTINGS_ARGS), "no setting"),
    "a setting the service refuses": (
        _bad_value,
        lambda o: checks.settings_problems(o, *_SETTINGS_ARGS),
        "heartbeat",
    ),
    "dev with Redis": (_redis_in_dev, lambda o: auth.overlay_problems(o, "dev"), "want memory"),
    "an agent granted another's node": (_foreign_node, auth.identity_problems, "kvshuttle-vllm-decode-0"),
    "the routers by one DNS name": (
        _routers_by_one_name,
        addresses.router_list_problems,
        "ROUTER__ADDRESS names",
    ),
    "round robin over the routers": (_round_robin, addresses.router_list_problems, "want 'conversation'"),
    "routers without stable names": (_router_deployment, addresses.router_list_problems, "not a StatefulSet"),
    "an agent on one registry replica": (
        _agent_on_one_replica,
        addresses.registry_address_problems,
        "want every replica",
    ),
    "two replicas of the in-memory registry": (
        _two_memory_registries,
        addresses.registry_address_problems,
        "2 replicas of the in-memory store",
    ),
}
BROKEN_PRODUCTION = {
    "a ServiceMonitor on a port no Service has": (_bad_monitor, auth.crd_problems, "has no port metricz"),
    "an exec probe instead of the native one": (
        _exec_probe,
        checks.probe_problems,
        "not a native grpc probe",
    ),
    "a router replica the gateway does not list": (
        _more_routers,
        addresses.router_list_problems,
        "kvshuttle-router-2.kvshuttle-router:50061",
    ),
    "a router pod the certificate does not name": (
        _router_certificate_names(["kvshuttle-router", "kvshuttle-router-0.kvshuttle-router"]),
        addresses.tls_name_problems,
        "for 'kvshuttle-router-1.kvshuttle-router'",
    ),
    "a wildcard gRPC refuses for the router pods": (
        _router_certificate_names(["kvshuttle-router", "*.kvshuttle-router"]),
        addresses.tls_name_problems,
        "for 'kvshuttle-router-0.kvshuttle-router'",
    ),
}
_SETTINGS_ARGS: list[Any] = []


@pytest.mark.parametrize("case", [*BROKEN, *BROKEN_PRODUCTION])
def test_each_check_catches_a_broken_object(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    break_it, problems_of, expected = {**BROKEN, **BROKEN_PRODUCTION}[case]
    objects = objects_of("production" if case in BROKEN_PRODUCTION else "dev")
    _SETTINGS_ARGS[:] = [tmp_path, monkeypatch]
    assert problems_of(objects) == []
    break_it(objects)
    found = problems_of(objects)
    assert any(expected in p for p in found), json.dumps(found, indent=1)


def test_the_validator_refuses_what_the_schema_does_not_know() -> None:
    objects = objects_of("dev")
    assert check.validate(objects) == ([], [])
    _container(objects, "kvshuttle-router", "router")["livenessProbe"]["grpcc"] = {"port": 50061}
    objects.append({"apiVersion": "apps/v1", "kind": "Deploymnet", "metadata": {"name": "x"}})
    errors, _ = check.validate(objects)
    assert len(errors) == 2, errors
    assert "grpcc" in errors[0] and "Deploymnet" in errors[1]
