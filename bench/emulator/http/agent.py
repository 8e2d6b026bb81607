"""kvshuttle's agent beside a stand-in engine: `kvshuttle-agent` as it ships (the same
KVSHUTTLE_AGENT_* settings), its pool's KV moved over the stand-ins' side channel
(bench/emulator/http/pool_plane.py) instead of NIXL. What deploy/local/stack.py runs per engine when
the engines are stand-ins and the agents have pools.

    python -m bench.emulator.http.agent
"""

from __future__ import annotations

from bench.emulator.http.pool_plane import StandinDataPlane
from kvshuttle.agent.config import AgentSettings
from kvshuttle.agent.main import main as agent_main


def data_plane(settings: AgentSettings) -> StandinDataPlane:
    layout = settings.pool_layout()
    if layout is None:
        raise SystemExit(
            "bench.emulator.http.agent: the agent has no pool (KVSHUTTLE_AGENT_POOL__SIZE_BYTES)"
        )
    return StandinDataPlane(layout)


if __name__ == "__main__":
    agent_main(data_plane)
