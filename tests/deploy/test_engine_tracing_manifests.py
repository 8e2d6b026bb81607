"""vLLM's part of a turn's trace on Kubernetes: in every overlay each engine runs with
`--otlp-traces-endpoint` set to the collector its agent, and the decode pod's sidecar where there
is one (every kvshuttle service), exports to, and names itself by role, so its `llm_request`
spans join the turns' traces (docs/operations/tracing.md)."""

from __future__ import annotations

import pytest
from deploy.kubernetes import check
from tests.deploy import manifest_checks as checks
from tests.deploy import manifests as m

pytestmark = pytest.mark.k8s


@pytest.mark.parametrize("overlay", check.OVERLAYS)
def test_every_engine_exports_its_request_spans_where_kvshuttle_does(overlay: str) -> None:
    objects = check.render(overlay)
    engines = checks.engines(objects)
    assert len(engines) == 2
    for engine in engines:
        vllm, agent = engine.container("vllm"), engine.container("agent")
        environment = m.env(vllm, objects)
        # The kubelet expands $(OTLP_ENDPOINT) in args from the container's environment.
        flag = checks.flag(vllm["args"], "otlp-traces-endpoint")
        assert flag == "$(OTLP_ENDPOINT)"
        endpoint = environment["OTLP_ENDPOINT"]
        assert endpoint == m.env(agent, objects)["KVSHUTTLE_AGENT_TELEMETRY__OTLP_ENDPOINT"]
        assert endpoint.startswith("http://")
        assert environment["OTEL_SERVICE_NAME"] == f"vllm-{engine.component}"
        # Behind an InferencePool the decode pod's sidecar sends the engine requests: the same collector.
        if any(c["name"] == "sidecar" for c in engine.containers()):
            assert (
                m.env(engine.container("sidecar"), objects)["KVSHUTTLE_SIDECAR_TELEMETRY__OTLP_ENDPOINT"]
                == endpoint
            )
