"""deploy/grafana/kvshuttle.json: every metric a panel's PromQL reads is one the services really
export. The names come from the services' own metrics code, registered on a fresh
CollectorRegistry as each service registers it (the gRPC services' RPC metrics, the gateway's,
the router's with its cache collector, the registry's collector over a real in-memory
registry), each family expanded to the sample names Prometheus scrapes (_total, _bucket, ...).
The dashboard reads no agent metric: the agent's collector needs a running agent."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from kvshuttle.core.clock import SystemClock
from kvshuttle.gateway.metrics import GatewayMetrics
from kvshuttle.registry.api.metrics import register_metrics
from kvshuttle.registry.block_index import BlockIndex
from kvshuttle.registry.service.registry import Registry
from kvshuttle.registry.store.memory.store import InMemoryStore
from kvshuttle.router.chains import ChainCache
from kvshuttle.router.hints import RetentionHints
from kvshuttle.router.metrics import RouterMetrics
from kvshuttle.serving.metrics import RpcMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy/grafana/kvshuttle.json"
# The sample names a family of each type is scraped as.
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
}
# PromQL words that are not metric names (functions are followed by "(", and are cut so).
KEYWORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset"}
)


def exported_samples() -> set[str]:
    prometheus = CollectorRegistry()
    RpcMetrics(prometheus)
    GatewayMetrics(prometheus)
    RouterMetrics(prometheus).watch_caches(ChainCache(1 << 20), RetentionHints(1 << 20))
    register_metrics(Registry(InMemoryStore(), SystemClock(), BlockIndex(100)), prometheus)
    names: set[str] = set()
    for family in prometheus.collect():
        names |= {family.name + suffix for suffix in SUFFIXES[family.type]}
        names |= {sample.name for sample in family.samples}
    return names


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: its identifiers, less label matchers, range
    selectors, grouping clauses, strings, function calls and keywords."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r"\boffset\s+\S+", " ", expr)
    # Not inside a number (1e3, 5m): an identifier starts after neither a word character nor "."
    words = re.findall(r"(?<![\w:.])[A-Za-z_:][\w:]*(?![\w:])(?!\s*\()", expr)
    return {w for w in words if w not in KEYWORDS}


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel with queries, rows' nested panels included."""
    found = []
    for panel in dashboard["panels"]:
        found += [panel, *panel.get("panels", [])]
    return [p for p in found if p["type"] != "row"]


def dashboard_problems(dashboard: dict[str, Any], exported: set[str]) -> list[str]:
    problems = []
    ids = [p["id"] for p in dashboard["panels"]]
    if len(ids) != len(set(ids)):
        problems.append(f"panel ids repeat: {ids}")
    for panel in panels(dashboard):
        if not panel.get("targets"):
            problems.append(f"{panel['title']}: no query")
        for target in panel.get("targets", []):
            names = metric_names(target["expr"])
            if not names:
                problems.append(f"{panel['title']}: reads no metric: {target['expr']}")
            for name in sorted(names - exported):
                problems.append(f"{panel['title']}: {name} is exported by no service")
    return problems


DASHBOARD_JSON = json.loads(DASHBOARD.read_text())


def test_the_services_export_what_the_operations_guide_names() -> None:
    exported = exported_samples()
    assert {
        "kvshuttle_router_tokens_total",
        "kvshuttle_router_decisions_total",
        "kvshuttle_gateway_ttft_seconds_bucket",
        "kvshuttle_registry_expirations_total",
        "kvshuttle_router_moves_total",
        "kvshuttle_router_move_seconds_bucket",
        "kvshuttle_router_moves_in_flight",
        "kvshuttle_rpc_total",
    } <= exported


def test_every_panel_reads_metrics_the_services_export() -> None:
    assert dashboard_problems(DASHBOARD_JSON, exported_samples()) == []


def test_the_dashboard_covers_what_to_watch() -> None:
    read = {n for p in panels(DASHBOARD_JSON) for t in p["targets"] for n in metric_names(t["expr"])}
    assert {
        "kvshuttle_router_tokens_total",  # reuse ratio, tokens saved
        "kvshuttle_router_decisions_total",  # decisions by reason
        "kvshuttle_gateway_ttft_seconds_bucket",  # TTFT
        "kvshuttle_registry_expirations_total",  # expiries
        "kvshuttle_router_moves_total",  # moves
    } <= read


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        (
            'sum by (kind) (rate(kvshuttle_router_tokens_total{kind="reused", x=~"a|b"}[$__rate_interval]))',
            {"kvshuttle_router_tokens_total"},
        ),
        (
            "histogram_quantile(0.95, sum by (le) (rate(a_bucket[5m]))) / on (job) group_left b offset 5m",
            {"a_bucket", "b"},
        ),
        ("sum(increase(kvshuttle_x_total[$__range])) > bool 1e3", {"kvshuttle_x_total"}),
    ],
)
def test_metric_names_reads_promql(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_a_misspelt_metric_is_caught() -> None:
    broken = json.loads(DASHBOARD.read_text())
    target = panels(broken)[0]["targets"][0]
    target["expr"] = target["expr"].replace("kvshuttle_router_tokens_total", "kvshuttle_router_token_total")
    problems = dashboard_problems(broken, exported_samples())
    assert any("kvshuttle_router_token_total is exported by no service" in p for p in problems), problems
