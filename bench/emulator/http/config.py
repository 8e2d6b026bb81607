"""The stand-in engine's configuration (bench/emulator/http/engine.py): from its command line, or for
an engine in a test's own event loop. With an engine profile (deploy/profiles) the engine is
profile-timed (bench/emulator/core/timing.py) and the profile sets its block size, pool size and
recompute threshold; without one it takes the flat per-token costs below."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

from deploy.profiles.schema import EngineProfile, ProfileError, load_engine_profiles

from bench.emulator.core.engine import CoreConfig
from kvshuttle.router.cost import LinkModel

HOST: Final = "127.0.0.1"


@dataclass(frozen=True)
class StandinConfig:
    role: Literal["prefill", "decode"]
    port: int
    side_channel_port: int
    kv_events_port: int
    kv_replay_port: int
    engine_id: str
    model_dir: Path
    served_model_name: str = "m"
    host: str = HOST
    block_size: int = 32
    num_blocks: int = 4096
    max_model_len: int = 8192
    prefix_caching: bool = True
    prefill_us_per_token: float = 20.0
    decode_ms_per_token: float = 0.5
    read_us_per_block: float = 50.0
    kv_blocks_ttl: float = 480.0
    kv_lease_s: float = 30.0
    kv_recompute_threshold: int = 64
    # vLLM's NixlConnector kv_load_failure_policy: a failed READ is recomputed, or fails the request.
    kv_load_failure_policy: Literal["recompute", "fail"] = "recompute"
    profile: EngineProfile | None = None
    # Every modelled or configured duration (compute, reads, TTLs) times this: 0.1 runs ten times
    # faster than the profile's hardware.
    time_scale: float = 1.0
    # OTLP/gRPC collector for vLLM's `llm_request` spans (bench/emulator/http/tracing.py); None: off.
    otlp_traces_endpoint: str | None = None
    # vLLM's OffloadingConnector: a CPU tier of this many blocks (0: none), loaded back over PCIe.
    host_blocks: int = 0
    pcie_gb_s: float = 50.0

    def core(self, side_channel_port: int) -> CoreConfig:
        """The engine core's configuration (bench/emulator/core/engine.py), its side channel on
        `side_channel_port` (picked at start for port 0)."""
        return CoreConfig(
            engine_id=self.engine_id,
            role=self.role,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            profile=self.profile,
            prefix_caching=self.prefix_caching,
            host_blocks=self.host_blocks,
            pcie=LinkModel(bandwidth_gb_s=self.pcie_gb_s, fixed_ms=0.0) if self.host_blocks else None,
            kv_blocks_ttl=self.kv_blocks_ttl,
            kv_lease_s=self.kv_lease_s,
            kv_recompute_threshold=self.kv_recompute_threshold,
            kv_load_failure_policy=self.kv_load_failure_policy,
            host=self.host,
            side_channel_port=side_channel_port,
            prefill_us_per_token=self.prefill_us_per_token,
            decode_ms_per_token=self.decode_ms_per_token,
            read_us_per_block=self.read_us_per_block,
            time_scale=self.time_scale,
        )


def with_profile(config: StandinConfig, profile: EngineProfile) -> StandinConfig:
    """`config` profile-timed: the profile's block size, pool and recompute threshold."""
    return dataclasses.replace(
        config,
        profile=profile,
        block_size=profile.engine.block_size,
        num_blocks=profile.engine.kv_capacity_blocks,
        kv_recompute_threshold=profile.min_reuse_tokens,
    )


def engine_profile(path: Path, model: str | None = None) -> EngineProfile:
    """The profile of `model` in the file (None: its only one); ProfileError if there is none."""
    profiles = load_engine_profiles(path)
    chosen = [p for p in profiles if model is None or p.model == model]
    if len(chosen) != 1:
        raise ProfileError(f"{path}: {len(chosen)} profiles for model {model!r}; name one of them")
    return chosen[0]


def in_process_config(
    role: Literal["prefill", "decode"], engine_id: str, model_dir: Path, **overrides: Any
) -> StandinConfig:
    """An engine for a test's (or a bench's) own event loop: every port picked at start, and no
    simulated compute, read or decode time (it answers at once)."""
    instant = {"prefill_us_per_token": 0.0, "decode_ms_per_token": 0.0, "read_us_per_block": 0.0}
    return StandinConfig(role, 0, 0, 0, 0, engine_id, model_dir, **{**instant, **overrides})


def config_from_argv(argv: Sequence[str] | None = None, *, description: str = "") -> StandinConfig:
    """The configuration `python -m bench.emulator.http.engine` is given (see its usage there)."""
    ap = argparse.ArgumentParser(prog="python -m bench.emulator.http.engine", description=description)
    ap.add_argument("--role", choices=("prefill", "decode"), required=True)
    for name in ("port", "side-channel-port", "kv-events-port", "kv-replay-port"):
        ap.add_argument(f"--{name}", type=int, required=True)
    ap.add_argument("--engine-id", required=True)
    ap.add_argument("--model-dir", type=Path, required=True, help="its tokenizer.json: the output vocabulary")
    ap.add_argument("--served-model-name", default="m")
    ap.add_argument("--host", default=HOST)
    ap.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false")
    ap.add_argument("--kv-load-failure-policy", choices=("recompute", "fail"), default="recompute")
    ap.add_argument("--profile", type=Path, help="an engine profile (deploy/profiles): profile-timed")
    ap.add_argument("--profile-model", help="which of the file's profiles (default: its only one)")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument(
        "--otlp-traces-endpoint", help="export vLLM's llm_request spans to this OTLP/gRPC collector"
    )
    for name, kind, default in (
        ("block-size", int, 32), ("num-blocks", int, 4096), ("max-model-len", int, 8192),
        ("prefill-us-per-token", float, 20.0), ("decode-ms-per-token", float, 0.5),
        ("read-us-per-block", float, 50.0), ("kv-blocks-ttl", float, 480.0), ("kv-lease-s", float, 30.0),
        ("kv-recompute-threshold", int, 64), ("host-blocks", int, 0), ("pcie-gb-s", float, 50.0),
    ):  # fmt: skip
        ap.add_argument(f"--{name}", type=kind, default=default)
    args = vars(ap.parse_args(argv))
    path, model = args.pop("profile"), args.pop("profile_model")
    config = StandinConfig(**args)
    return config if path is None else with_profile(config, engine_profile(path, model))
