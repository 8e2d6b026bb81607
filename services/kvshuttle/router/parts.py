"""What one router replica's planner and committer share: its registry port, clock, cost models,
turn codec, policy, metrics, tracer, caches, placement ledger and shuttle. `Router` makes one and
hands it to both."""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry import trace

from kvshuttle.core.clock import Clock
from kvshuttle.router.chains import ChainCache
from kvshuttle.router.cost import CostModel
from kvshuttle.router.ledger import PlacementLedger
from kvshuttle.router.metrics import RouterMetrics
from kvshuttle.router.node_directory import NodeDirectory
from kvshuttle.router.policy import RouterPolicy
from kvshuttle.router.ports import AgentPort, RegistryPort
from kvshuttle.router.shuttle import Shuttle
from kvshuttle.router.turn_memory import TurnMemory
from kvshuttle.router.turns import TurnCodec

__all__ = ["RouterParts"]


@dataclass(frozen=True, slots=True)
class RouterParts:
    port: RegistryPort
    clock: Clock
    # One cost model per served model, by model name; calibrated as turns commit.
    costs: Mapping[str, CostModel]
    codec: TurnCodec
    policy: RouterPolicy
    metrics: RouterMetrics
    tracer: trace.Tracer
    nodes: NodeDirectory
    memory: TurnMemory
    chains: ChainCache
    # What this replica placed on each node that no report shows yet; and its draws among
    # near-tied nodes.
    ledger: PlacementLedger
    rng: random.Random
    # Moves this replica's committed retentions into agents' pools (None: parking off).
    shuttle: Shuttle | None = None
    # The agents, asked whether a pool holder still serves before a plan reads from it.
    agents: AgentPort | None = None
