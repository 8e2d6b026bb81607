"""One trace per turn, engines included: what the stand-in and the real-vLLM tracing tests check
of the spans an in-process OTLP receiver (deploy/local/otlp.py) got from a whole local stack."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from bench.report import save
from deploy.local.otlp import OtlpReceiver, Span, trace_tree

from kvshuttle.core.digest import log_digest
from kvshuttle.gateway.config import DEFAULT_TENANT

GATEWAY, ROUTER, REGISTRY = "kvshuttle-gateway", "kvshuttle-router", "kvshuttle-registry"
EPP, SIDECAR = "kvshuttle-epp", "kvshuttle-sidecar"
# The endpoint picker's span of one request: Envoy's ext_proc stream.
EPP_PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
PLAN_TURN = "/kvshuttle.router.v1.RouterService/PlanTurn"
COMMIT_TURN = "/kvshuttle.router.v1.RouterService/CommitTurn"
# What the printed trees show of the spans' attributes (where a span has them).
TREE_ATTRIBUTES = (
    "gen_ai.usage.prompt_tokens",
    "gen_ai.usage.completion_tokens",
    "gen_ai.latency.time_in_queue",
    "gen_ai.latency.time_to_first_token",
    "gen_ai.latency.time_in_model_prefill",
    "kvshuttle.decision",
    "kvshuttle.reused_tokens",
    "kvshuttle.remote_cached_tokens",
)
ROOT = Path(__file__).resolve().parents[2]


def turn_traces(
    receiver: OtlpReceiver,
    conversation: str,
    turns: int,
    engines: tuple[str, str],
    timeout: float = 90.0,
    runner: str = GATEWAY,
) -> list[list[Span]]:
    """The traces of the conversation's `turns` turns (the `turn` spans of `runner`, the service
    that ran them, by the conversation's digest), in order, once each holds its commit and both
    engines' `llm_request` spans (`engines`: the prefill and decode engines' service names), and
    every span's parent and every call's server span arrived (each process exports on its own
    schedule)."""
    digest = log_digest(f"tenants/{DEFAULT_TENANT}/conversations/{conversation}")

    def roots(spans: list[Span]) -> list[Span]:
        return sorted(
            (
                s
                for s in spans
                if (s.service, s.name) == (runner, "turn")
                and s.attributes.get("kvshuttle.conversation") == digest
            ),
            key=lambda s: s.start_ns,
        )

    def complete(spans: list[Span]) -> bool:
        found = roots(spans)
        if len(found) < turns:
            return False
        for root in found:
            trace = [s for s in spans if s.trace_id == root.trace_id]
            have = {(s.service, s.name) for s in trace}
            wanted = {(ROUTER, "commit"), (engines[0], "llm_request"), (engines[1], "llm_request")}
            ids = {s.span_id for s in trace}
            orphaned = any(s.parent_id and s.parent_id not in ids for s in trace)
            if not wanted <= have or unanswered(trace) or orphaned:
                return False
        return True

    got = receiver.wait_for(complete, timeout)
    return [receiver.trace(root.trace_id) for root in roots(got)]


def unanswered(trace: list[Span]) -> list[Span]:
    """The CLIENT spans (calls) of `trace` without a span of the server that took them (each
    process exports on its own schedule: the callee's may come later)."""
    parents = {s.parent_id for s in trace}
    return [s for s in trace if s.kind == "CLIENT" and s.span_id not in parents]


def check_one_trace_per_turn(
    trace: list[Span],
    engines: tuple[str, str],
    *,
    runner: str = GATEWAY,
    planner: str = GATEWAY,
    root: tuple[str, str] = (GATEWAY, "turn"),
) -> None:
    """One root (`root`: the gateway's turn, or the endpoint picker's request), every other
    span's parent in the trace; `planner` (PlanTurn's caller), `runner` (the turn's: prefill,
    decode, CommitTurn), the router, the registry and both engines in it; each engine's
    `llm_request` a child of the runner's span of the request that engine served, timed and
    counted as vLLM does."""
    ids = {s.span_id: s for s in trace}
    roots = [s for s in trace if not s.parent_id]
    assert [(r.service, r.name) for r in roots] == [root], trace_tree(trace)
    orphans = [(s.service, s.name) for s in trace if s.parent_id and s.parent_id not in ids]
    assert not orphans, trace_tree(trace)
    assert {planner, runner, ROUTER, REGISTRY, *engines} <= {s.service for s in trace}, trace_tree(trace)
    assert not unanswered(trace), trace_tree(trace)  # every call's server joined the trace

    def one(service: str, name: str) -> Span:
        (span,) = [s for s in trace if (s.service, s.name) == (service, name)]
        return span

    turn = one(runner, "turn")
    for role, engine in zip(("prefill", "decode"), engines, strict=True):
        call = one(runner, role)
        assert call.parent_id == turn.span_id and call.kind == "CLIENT"
        served = one(engine, "llm_request")
        assert served.parent_id == call.span_id and served.kind == "SERVER", trace_tree(trace)
        attributes = served.attributes
        assert attributes["gen_ai.usage.prompt_tokens"] == turn.attributes["kvshuttle.prompt_tokens"]
        assert 0 < attributes["gen_ai.latency.time_to_first_token"] <= attributes["gen_ai.latency.e2e"]
    # The router's server spans are children of the callers'; the registry's of the router's.
    for method, caller in ((PLAN_TURN, planner), (COMMIT_TURN, runner)):
        client, server = one(caller, method), one(ROUTER, method)
        assert (client.kind, server.kind, server.parent_id) == ("CLIENT", "SERVER", client.span_id)
    registry = [s for s in trace if s.service == REGISTRY and s.kind == "SERVER"]
    assert registry and all(ids[s.parent_id].service == ROUTER for s in registry), trace_tree(trace)


def keep_trees(bench: str, name: str, traces: list[list[Span]]) -> Path:
    """Print the traces' trees and keep them, with every span, as `name-<utc>.json` under
    $KVSHUTTLE_RESULTS_DIR or .run/results (bench/report.py's header; `bench`: what made it)."""
    trees = [trace_tree(t, TREE_ATTRIBUTES) for t in traces]
    out_dir = Path(os.environ.get("KVSHUTTLE_RESULTS_DIR") or ROOT / ".run" / "results")
    figures = {
        "trees": [tree.splitlines() for tree in trees],
        "traces": [[dataclasses.asdict(s) for s in t] for t in traces],
    }
    path = save(bench, figures, args=None, name=name, directory=out_dir)
    print("\n" + "\n\n".join(trees) + f"\n(kept in {path})")
    return path
