"""The inference-pool overlay (deploy/kubernetes/overlays/inference-pool): production plus
kvshuttle's endpoint picker behind an InferencePool of the decode pods, and kvshuttle-sidecar in
each decode pod in front of its vLLM. Its Gateway API objects are valid against the vendored
CRDs' schemas, strictly; its names line up (pool -> decode pods on the planned port, which is the
sidecar's; the sidecar -> its pod's vLLM; endpointPickerRef -> the picker's Service and port,
HTTPRoute -> the pool, NetworkPolicies -> the picker's pods and the sidecars, from the gateway's
Envoy pods, and from the picker and the sidecar to what they call); the router grants the
picker's and the sidecar's identities, the registry the sidecar's; and the stack's own checks
still hold with the picker and the sidecar in it. Each check also catches a broken copy."""

from __future__ import annotations

import copy
import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from deploy.kubernetes import check
from tests.deploy import address_checks as addresses
from tests.deploy import auth_checks as auth
from tests.deploy import manifest_checks as checks
from tests.deploy import manifests as m
from tests.deploy import pool_checks as pool

from kvshuttle.sidecar.config import SidecarSettings

pytestmark = pytest.mark.k8s

Objects = list[dict[str, Any]]
RENDERED = check.render("inference-pool")


def objects() -> Objects:
    return copy.deepcopy(RENDERED)


def test_it_is_production_plus_the_picker_pool_route_and_sidecar() -> None:
    production = {check.describe(o) for o in check.render("production")}
    here = {check.describe(o) for o in RENDERED}
    assert here - production == {
        "ServiceAccount/kvshuttle-epp",
        "Deployment/kvshuttle-epp",
        "Service/kvshuttle-epp",
        "PodDisruptionBudget/kvshuttle-epp",
        "Certificate/kvshuttle-epp",
        "NetworkPolicy/kvshuttle-epp",
        "NetworkPolicy/kvshuttle-decode-from-gateway",
        "InferencePool/kvshuttle-decode",
        "HTTPRoute/kvshuttle",
        "Certificate/kvshuttle-sidecar",
        "NetworkPolicy/kvshuttle-prefill-from-sidecar",
        "NetworkPolicy/kvshuttle-decode-sidecar-metrics",
        "ServiceMonitor/kvshuttle-sidecar",
    }
    assert production <= here
    # Only the decode pods change among production's workloads; prefill keeps vLLM on its port.
    changed = {
        w.name
        for w in m.workloads(RENDERED)
        if w.pod != next((p.pod for p in m.workloads(check.render("production")) if p.name == w.name), w.pod)
    }
    assert changed == {"kvshuttle-vllm-decode", "kvshuttle-registry", "kvshuttle-router"}  # + grants
    assert {o["metadata"].get("namespace") for o in RENDERED if o["kind"] != "Namespace"} == {"kvshuttle"}


def test_the_gateway_api_objects_are_valid_against_their_crds() -> None:
    errors, unchecked = check.validate(RENDERED)
    assert errors == []
    assert not {"InferencePool", "HTTPRoute"} & {c.split("/")[0] for c in unchecked}
    assert check.crd_schema(m.one(RENDERED, "InferencePool", "kvshuttle-decode")) is not None
    assert check.crd_schema(m.one(RENDERED, "HTTPRoute", "kvshuttle")) is not None


def test_the_validator_refuses_what_the_crd_schemas_do_not_allow() -> None:
    broken = objects()
    pool_spec = m.one(broken, "InferencePool", "kvshuttle-decode")["spec"]
    pool_spec["endpointPickerRef"]["failureMode"] = "Open"  # not in the enum
    pool_spec["targetPorts"] = [{"numbre": 8000}]  # unknown field, required one missing
    route = m.one(broken, "HTTPRoute", "kvshuttle")
    route["spec"]["rules"][0]["backendRefs"][0]["weight"] = "one"  # an integer
    del route["spec"]["parentRefs"][0]["name"]
    errors, _ = check.validate(broken)
    for expected in (
        "InferencePool/kvshuttle-decode: 'Open' is not one of ['FailOpen', 'FailClose']",
        "InferencePool/kvshuttle-decode: 'number' is a required property (at spec.targetPorts.0)",
        "InferencePool/kvshuttle-decode: Additional properties are not allowed ('numbre' was unexpected)",
        "HTTPRoute/kvshuttle: 'one' is not of type 'integer' (at spec.rules.0.backendRefs.0.weight)",
        "HTTPRoute/kvshuttle: 'name' is a required property (at spec.parentRefs.0)",
    ):
        assert any(e.startswith(expected) for e in errors), (expected, errors)
    assert len(errors) == 5, errors


def test_the_pool_holds_the_decode_pods_on_the_planned_port() -> None:
    assert pool.pool_problems(RENDERED) == []


def test_the_pool_port_is_the_sidecar_in_front_of_the_pods_vllm() -> None:
    """Pool targetPort == the sidecar's containerPort and LISTEN == the agent's registered
    endpoint's port; the sidecar's DECODE_ENDPOINT == vLLM's --host:--port (loopback); its
    node, models, key, tenant and router list are the picker's."""
    assert pool.decode_sidecar_problems(RENDERED) == []
    decode = checks.service_workload(RENDERED, "decode")
    assert [c["name"] for c in decode.containers()] == ["sidecar", "agent", "vllm"]
    assert checks.http_port(decode, RENDERED) == 8000
    assert checks.flag(decode.container("vllm")["args"], "port") == "8200"


def test_the_pool_names_the_picker_service_and_port() -> None:
    assert pool.picker_problems(RENDERED) == []


def test_the_route_sends_to_the_pool() -> None:
    assert pool.route_problems(RENDERED) == []


def test_only_the_gateway_envoy_reaches_the_picker_which_reaches_the_router() -> None:
    assert pool.network_problems(RENDERED) == []


def test_the_vllm_probes_pass_only_while_its_health_answers_200() -> None:
    """vLLM on loopback is probed by a command in its container: run here as rendered (python3
    being this interpreter, vLLM a real HTTP server on 127.0.0.1), it exits 0 on a 200 from
    /health and fails on a 503 and with nothing listening."""
    vllm = checks.service_workload(RENDERED, "decode").container("vllm")
    url = checks.loopback_health(vllm)
    commands = {
        json.dumps(vllm[k]["exec"]["command"]) for k in ("startupProbe", "readinessProbe", "livenessProbe")
    }
    (command,) = [json.loads(c) for c in commands]
    assert command[0] == "python3" and url == "http://127.0.0.1:8200/health" and url in command[-1]
    status = {"code": 200}

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status["code"] if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    def probe(port: int) -> int:
        run = [sys.executable, *command[1:-1], command[-1].replace(":8200/", f":{port}/")]
        return subprocess.run(run, capture_output=True, check=False).returncode

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        port = server.server_address[1]
        assert probe(port) == 0
        status["code"] = 503
        assert probe(port) != 0
        server.shutdown()
    assert probe(port) != 0  # nothing listening


def test_the_router_grants_the_picker_and_sidecar_the_gateway_role_the_registry_nodes_read() -> None:
    assert pool.identity_problems(RENDERED) == []


def test_the_picker_settings_load_from_its_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every KVSHUTTLE_EPP_* variable names a field of EppSettings, and they load as rendered."""
    assert checks.settings_problems(RENDERED, tmp_path, monkeypatch) == []
    env = m.env(_epp(objects()), RENDERED)
    assert {k for k in env if k.startswith("KVSHUTTLE_EPP_")} >= {
        "KVSHUTTLE_EPP_SERVER__LISTEN",
        "KVSHUTTLE_EPP_MODELS",
        "KVSHUTTLE_EPP_ROUTER__ADDRESS",
        "KVSHUTTLE_EPP_CACHE_SALT_KEY",
    }


def test_the_sidecar_settings_load_from_its_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every KVSHUTTLE_SIDECAR_* variable names a field of SidecarSettings, and they load as
    rendered (settings_problems loads each container's, the sidecar's through SidecarSettings)."""
    assert checks.settings_problems(RENDERED, tmp_path, monkeypatch) == []
    sidecar = checks.service_workload(RENDERED, "decode").container("sidecar")
    env = m.env(sidecar, RENDERED)
    names = {k for k in env if k.startswith("KVSHUTTLE_SIDECAR_")}
    assert names >= {
        "KVSHUTTLE_SIDECAR_LISTEN",
        "KVSHUTTLE_SIDECAR_DECODE_ENDPOINT",
        "KVSHUTTLE_SIDECAR_NODE",
        "KVSHUTTLE_SIDECAR_MODELS",
        "KVSHUTTLE_SIDECAR_ROUTER__ADDRESS",
        "KVSHUTTLE_SIDECAR_REGISTRY__ADDRESS",
        "KVSHUTTLE_SIDECAR_CACHE_SALT_KEY",
    }
    assert all(m.setting_field(n) is not None for n in names)
    with monkeypatch.context() as patch:
        for name in [k for k in os.environ if k.startswith("KVSHUTTLE_")]:
            patch.delenv(name)
        for name in names:
            patch.setenv(name, env[name])
        loaded = SidecarSettings()  # type: ignore[call-arg]  # node: from the env
    assert loaded.node == "nodes/kvshuttle-vllm-decode-0"
    assert loaded.decode_endpoint == "http://127.0.0.1:8200"
    assert loaded.registry.tls and loaded.router.tls


def test_a_misspelt_sidecar_setting_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    broken = objects()
    env = _sidecar(broken)["env"]
    (var,) = [v for v in env if v["name"] == "KVSHUTTLE_SIDECAR_DECODE_ENDPOINT"]
    var["name"] = "KVSHUTTLE_SIDECAR_DECODE_URL"
    found = checks.settings_problems(broken, tmp_path, monkeypatch)
    assert found == [
        "kvshuttle-vllm-decode/sidecar: KVSHUTTLE_SIDECAR_DECODE_URL is no setting of the service"
    ]


def test_prometheus_scrapes_the_picker() -> None:
    service = m.one(RENDERED, "Service", "kvshuttle-epp")
    monitors = [
        s
        for s in m.find(RENDERED, "ServiceMonitor")
        if m.selects(s["spec"]["selector"], service["metadata"]["labels"])
    ]
    assert [s["metadata"]["name"] for s in monitors] == ["kvshuttle"]
    assert auth.crd_problems(RENDERED) == []  # and on a port the Service has


@pytest.mark.parametrize(
    "problems_of",
    [
        checks.probe_problems,
        checks.security_problems,
        checks.image_problems,
        checks.resource_problems,
        checks.pdb_problems,
        checks.secret_problems,
        checks.sidecar_problems,
        auth.crd_problems,
        auth.identity_problems,
        lambda o: auth.overlay_problems(o, "production"),
        addresses.tls_name_problems,
        addresses.router_list_problems,
        addresses.registry_address_problems,
    ],
)
def test_the_stack_checks_hold_with_the_picker(problems_of: Callable[[Objects], list[str]]) -> None:
    assert problems_of(RENDERED) == []


# --- each check catches a broken object ----------------------------------------------------------


def _epp(o: Objects) -> dict[str, Any]:
    (container,) = m.one(o, "Deployment", "kvshuttle-epp")["spec"]["template"]["spec"]["containers"]
    found: dict[str, Any] = container
    return found


def _decode(o: Objects) -> dict[str, Any]:
    found: dict[str, Any] = m.one(o, "StatefulSet", "kvshuttle-vllm-decode")["spec"]["template"]["spec"]
    return found


def _sidecar(o: Objects) -> dict[str, Any]:
    (found,) = [c for c in _decode(o)["containers"] if c["name"] == "sidecar"]
    return dict(found)


def _set_env(container: dict[str, Any], name: str, value: str) -> None:
    (var,) = [v for v in container["env"] if v["name"] == name]
    var.clear()
    var.update({"name": name, "value": value})


def _no_sidecar(o: Objects) -> None:
    _decode(o)["containers"] = [c for c in _decode(o)["containers"] if c["name"] != "sidecar"]


def _sidecar_listens_elsewhere(o: Objects) -> None:
    _set_env(_sidecar(o), "KVSHUTTLE_SIDECAR_LISTEN", "0.0.0.0:8100")


def _sidecar_to_another_vllm_port(o: Objects) -> None:
    _set_env(_sidecar(o), "KVSHUTTLE_SIDECAR_DECODE_ENDPOINT", "http://127.0.0.1:8000")


def _vllm_on_the_pod_address(o: Objects) -> None:
    (vllm,) = [c for c in _decode(o)["containers"] if c["name"] == "vllm"]
    vllm["args"] = [a.replace("--host=127.0.0.1", "--host=0.0.0.0") for a in vllm["args"]]


def _agent_registers_vllm(o: Objects) -> None:
    (agent,) = [c for c in _decode(o)["containers"] if c["name"] == "agent"]
    _set_env(agent, "KVSHUTTLE_AGENT_NODE__HTTP_ENDPOINT", "http://$(POD_IP):8200")


def _sidecar_of_another_salt(o: Objects) -> None:
    (var,) = [v for v in _sidecar(o)["env"] if v["name"] == "KVSHUTTLE_SIDECAR_CACHE_SALT_KEY"]
    var["valueFrom"]["secretKeyRef"]["key"] = "other-key"


def _prefill_closed_to_sidecar(o: Objects) -> None:
    o.remove(m.one(o, "NetworkPolicy", "kvshuttle-prefill-from-sidecar"))


def _router_closed_to_sidecar(o: Objects) -> None:
    policy = m.one(o, "NetworkPolicy", "kvshuttle-router")
    for rule in policy["spec"]["ingress"]:
        rule["from"] = [p for p in rule["from"] if "decode" not in json.dumps(p)]


def _sidecar_not_a_viewer(o: Objects) -> None:
    (var,) = [
        v
        for v in m.one(o, "StatefulSet", "kvshuttle-registry")["spec"]["template"]["spec"]["containers"][0][
            "env"
        ]
        if v["name"] == "KVSHUTTLE_REGISTRY_AUTH__IDENTITIES"
    ]
    grants = json.loads(var["value"])
    grants["spiffe://kvshuttle/sidecar"] = {"role": "agent", "node": "nodes/x"}
    var["value"] = json.dumps(grants)


def _sidecar_ungranted_by_router(o: Objects) -> None:
    m.one(o, "Certificate", "kvshuttle-sidecar")["spec"]["uris"] = ["spiffe://kvshuttle/decode"]


def _vllm_probe_on_the_pod_port(o: Objects) -> None:
    (vllm,) = [c for c in _decode(o)["containers"] if c["name"] == "vllm"]
    vllm["livenessProbe"] = {"httpGet": {"path": "/health", "port": 8200}}


def _selector_typo(o: Objects) -> None:
    m.one(o, "InferencePool", "kvshuttle-decode")["spec"]["selector"]["matchLabels"][
        "app.kubernetes.io/component"
    ] = "decoder"


def _prefill_too(o: Objects) -> None:
    del m.one(o, "InferencePool", "kvshuttle-decode")["spec"]["selector"]["matchLabels"][
        "app.kubernetes.io/component"
    ]


def _pool_port(o: Objects) -> None:
    m.one(o, "InferencePool", "kvshuttle-decode")["spec"]["targetPorts"] = [{"number": 8200}]


def _picker_name(o: Objects) -> None:
    m.one(o, "InferencePool", "kvshuttle-decode")["spec"]["endpointPickerRef"]["name"] = "kvshuttle-gateway"


def _picker_port(o: Objects) -> None:
    m.one(o, "InferencePool", "kvshuttle-decode")["spec"]["endpointPickerRef"]["port"] = {"number": 9464}


def _picker_listens_elsewhere(o: Objects) -> None:
    env = _epp(o)["env"]
    (listen,) = [v for v in env if v["name"] == "KVSHUTTLE_EPP_SERVER__LISTEN"]
    listen["value"] = "0.0.0.0:9010"


def _route_to_service(o: Objects) -> None:
    ref = m.one(o, "HTTPRoute", "kvshuttle")["spec"]["rules"][0]["backendRefs"][0]
    ref.update({"group": "", "kind": "Service", "name": "kvshuttle-vllm-decode", "port": 8000})


def _picker_open_to_all(o: Objects) -> None:
    m.one(o, "NetworkPolicy", "kvshuttle-epp")["spec"]["ingress"][0]["from"] = [{"podSelector": {}}]


def _policy_on_the_gateway(o: Objects) -> None:
    policy = m.one(o, "NetworkPolicy", "kvshuttle-epp")
    policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] = "gateway"


def _other_gateway(o: Objects) -> None:
    m.one(o, "HTTPRoute", "kvshuttle")["spec"]["parentRefs"][0]["name"] = "public-gateway"


def _router_closed_to_picker(o: Objects) -> None:
    policy = m.one(o, "NetworkPolicy", "kvshuttle-router")
    policy["spec"]["ingress"] = [
        r for r in policy["spec"]["ingress"] if "epp" not in json.dumps(r.get("from", []))
    ]


def _ungranted(o: Objects) -> None:
    m.one(o, "Certificate", "kvshuttle-epp")["spec"]["uris"] = ["spiffe://kvshuttle/picker"]


def _probe_asks_the_server(o: Objects) -> None:
    _epp(o)["readinessProbe"]["grpc"]["service"] = "liveness"


BROKEN: dict[str, tuple[Callable[[Objects], None], Callable[[Objects], list[str]], str]] = {
    "a selector no pod has": (_selector_typo, pool.pool_problems, "InferencePool selects []"),
    "a pool of prefill and decode pods": (_prefill_too, pool.pool_problems, "want the decode pods"),
    "a pool port the plans do not name": (_pool_port, pool.pool_problems, "plans name decode port 8000"),
    "endpointPickerRef to another Service": (_picker_name, pool.picker_problems, "want kvshuttle-epp"),
    "endpointPickerRef on the metrics port": (_picker_port, pool.picker_problems, "does not reach ext_proc"),
    "a picker listening elsewhere": (_picker_listens_elsewhere, pool.picker_problems, "ext_proc on 9010"),
    "a route to the decode Service": (_route_to_service, pool.route_problems, "want InferencePool"),
    "the picker open to every pod": (_picker_open_to_all, pool.network_problems, "ext_proc port 9002 open"),
    "the picker's policy on other pods": (_policy_on_the_gateway, pool.network_problems, "no NetworkPolicy"),
    "Envoy of another Gateway": (_other_gateway, pool.network_problems, "may not reach port 8000"),
    "the router closed to the picker": (
        _router_closed_to_picker,
        pool.network_problems,
        "-> kvshuttle-router",
    ),
    "a picker identity the router does not grant": (_ungranted, pool.identity_problems, "want role gateway"),
    "no sidecar in the decode pods": (_no_sidecar, pool.decode_sidecar_problems, "no sidecar container"),
    "a sidecar off the pool's port": (
        _sidecar_listens_elsewhere,
        pool.decode_sidecar_problems,
        "the sidecar listens on 8100",
    ),
    "a sidecar sending to another port than vLLM's": (
        _sidecar_to_another_vllm_port,
        pool.decode_sidecar_problems,
        "vLLM listens on 127.0.0.1:8200",
    ),
    "vLLM reachable around the sidecar": (
        _vllm_on_the_pod_address,
        pool.decode_sidecar_problems,
        "reachable around the sidecar",
    ),
    "the agent registering vLLM, not the sidecar": (
        _agent_registers_vllm,
        pool.decode_sidecar_problems,
        "not the sidecar's port 8000",
    ),
    "a sidecar salting otherwise than the picker": (
        _sidecar_of_another_salt,
        pool.decode_sidecar_problems,
        "sidecar CACHE_SALT_KEY",
    ),
    "prefill closed to the sidecar": (
        _prefill_closed_to_sidecar,
        pool.network_problems,
        "kvshuttle-vllm-decode -> kvshuttle-vllm-prefill",
    ),
    "the router closed to the sidecar": (
        _router_closed_to_sidecar,
        pool.network_problems,
        "kvshuttle-vllm-decode -> kvshuttle-router",
    ),
    "a sidecar the registry lets not read nodes": (
        _sidecar_not_a_viewer,
        pool.identity_problems,
        "want nodes.read",
    ),
    "a sidecar identity the router does not grant": (
        _sidecar_ungranted_by_router,
        pool.identity_problems,
        "sidecar -> router",
    ),
    "a vLLM probe the kubelet cannot reach": (
        _vllm_probe_on_the_pod_port,
        checks.probe_problems,
        "does not GET http://127.0.0.1:8200/health",
    ),
    "a readiness probe on liveness": (
        _probe_asks_the_server,
        checks.probe_problems,
        "want one of ['readiness']",
    ),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_each_check_catches_a_broken_object(case: str) -> None:
    break_it, problems_of, expected = BROKEN[case]
    broken = objects()
    assert problems_of(broken) == []
    break_it(broken)
    found = problems_of(broken)
    assert any(expected in p for p in found), json.dumps(found, indent=1)
