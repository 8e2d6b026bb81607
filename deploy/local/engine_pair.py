"""What `KvshuttleStack` (deploy/local/stack.py) reads of the prefill/decode pair it runs beside:
`VllmPair` (deploy/local/launch.py, real vLLM) and `StandinPair` (deploy/local/standin.py, stand-in
engines) both have this shape.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Protocol


class EngineSpecLike(Protocol):
    @property
    def role(self) -> Literal["prefill", "decode"]: ...


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
    """What the stack reads of its engines (deploy.local.launch.VllmPair, or StandinPair)."""

    @property
    def model_dir(self) -> Path: ...
    @property
    def prefill(self) -> Engine: ...
    @property
    def decode(self) -> Engine: ...
    @property
    def engines(self) -> tuple[Engine, Engine]: ...
