"""What `KvshuttleStack` (deploy/local/stack.py) reads of the prefill/decode pair it runs beside:
`VllmPair` (deploy/local/launch.py, real vLLM) and `StandinPair` (bench/emulator/http/launcher.py, stand-in
engines) both have this shape.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Protocol


class EngineSpecLike(Protocol):
    @property
    def role(self) -> Literal["prefill", "decode"]: ...


class EndpointSpec(Protocol):
    """The ports and names an engine's endpoints are made of (EngineSpec, StandinSpec)."""

    @property
    def name(self) -> str: ...
    @property
    def engine_id(self) -> str: ...
    @property
    def host(self) -> str: ...
    @property
    def http_port(self) -> int: ...
    @property
    def kv_events_port(self) -> int: ...
    @property
    def kv_replay_port(self) -> int: ...
    @property
    def side_channel_port(self) -> int: ...


class EngineEndpoints:
    """An engine's endpoints, from its spec: one definition for vLLM and the stand-ins."""

    spec: EndpointSpec

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def engine_id(self) -> str:
        return self.spec.engine_id

    @property
    def url(self) -> str:
        """Base URL of the OpenAI-compatible HTTP server (no trailing slash, no /v1)."""
        return f"http://{self.spec.host}:{self.spec.http_port}"

    @property
    def events_endpoint(self) -> str:
        """Where a ZMQ SUB connects for KV events."""
        return f"tcp://{self.spec.host}:{self.spec.kv_events_port}"

    @property
    def replay_endpoint(self) -> str:
        """Where a ZMQ DEALER asks for a replay of KV events from a sequence number."""
        return f"tcp://{self.spec.host}:{self.spec.kv_replay_port}"

    @property
    def side_channel(self) -> tuple[str, int]:
        """The NIXL handshake endpoint (a stand-in's: its HTTP read of held blocks)."""
        return self.spec.host, self.spec.side_channel_port


class Engine(Protocol):
    """What the stack reads of one engine (deploy.local.vllm_engine.VllmEngine, or a stand-in)."""

    @property
    def spec(self) -> EngineSpecLike: ...
    @property
    def name(self) -> str: ...
    @property
    def engine_id(self) -> str: ...
    @property
    def url(self) -> str: ...
    @property
    def events_endpoint(self) -> str: ...
    @property
    def replay_endpoint(self) -> str: ...
    @property
    def side_channel(self) -> tuple[str, int]: ...


class EnginePair(Protocol):
    """What the stack reads of its engines (deploy.local.launch.VllmPair, StandinPair, or any
    number of engines: bench/cluster's emulated cluster); one agent runs beside each."""

    @property
    def model_dir(self) -> Path: ...
    @property
    def engines(self) -> tuple[Engine, ...]: ...
