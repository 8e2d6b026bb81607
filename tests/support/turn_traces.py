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
    receiver: OtlpReceiver, conversation: str, turns: int, engines: tuple[str, str], timeout: float = 90.0
) -> list[list[Span]]:
    """The traces of the conversation's `turns` turns (the gateway's `turn` spans, by the
    conversation's digest), in order, once each holds its commit and both engines'
    `llm_request` spans (`engines`: the prefill and decode engines' service names)."""
    digest = log_digest(f"tenants/{DEFAULT_TENANT}/conversations/{conversation}")

    def roots(spans: list[Span]) -> list[Span]:
        return sorted(
            (
                s
                for s in spans
                if (s.service, s.name) == (GATEWAY, "turn")
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
            if not wanted <= have or unanswered(trace):
                return False
        return True

    got = receiver.wait_for(complete, timeout)
    return [receiver.trace(root.trace_id) for root in roots(got)]


def unanswered(trace: list[Span]) -> list[Span]:
    """The CLIENT spans (calls) of `trace` without a span of the server that took them (each
    process exports on its own schedule: the callee's may come later)."""
    parents = {s.parent_id for s in trace}
    return [s for s in trace if s.kind == "CLIENT" and s.span_id not in parents]


def check_one_trace_per_turn(trace: list[Span], engines: tuple[str, str]) -> None:
    """One root (the gateway's turn), every other span's parent in the trace; the gateway, the
    router, the registry and both engines in it; each engine's `llm_request` a child of the
    gateway's span of the request that engine served, timed and counted as vLLM does."""
    ids = {s.span_id: s for s in trace}
    roots = [s for s in trace if not s.parent_id]
    assert [(r.service, r.name) for r in roots] == [(GATEWAY, "turn")], trace_tree(trace)
    orphans = [(s.service, s.name) for s in trace if s.parent_id and s.parent_id not in ids]
    assert not orphans, trace_tree(trace)
    assert {GATEWAY, ROUTER, REGISTRY, *engines} <= {s.service for s in trace}, trace_tree(trace)
    assert not unanswered(trace), trace_tree(trace)  # every call's server joined the trace
    root = roots[0]

    def one(service: str, name: str) -> Span:
        (span,) = [s for s in trace if (s.service, s.name) == (service, name)]
        return span

    for role, engine in zip(("prefill", "decode"), engines, strict=True):
        call = one(GATEWAY, role)
        assert call.parent_id == root.span_id and call.kind == "CLIENT"
        served = one(engine, "llm_request")
        assert served.parent_id == call.span_id and served.kind == "SERVER", trace_tree(trace)
        attributes = served.attributes
        assert attributes["gen_ai.usage.prompt_tokens"] == root.attributes["kvshuttle.prompt_tokens"]
        assert 0 < attributes["gen_ai.latency.time_to_first_token"] <= attributes["gen_ai.latency.e2e"]
    # The router's server spans are children of the gateway's calls; the registry's of the router's.
    for method in (PLAN_TURN, COMMIT_TURN):
        client, server = one(GATEWAY, method), one(ROUTER, method)
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
