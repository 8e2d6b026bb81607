"""Many stand-in engines (bench/emulator/http/engine.py) in one process and one event loop: the
emulated vLLM cluster a cluster-scale benchmark runs against.

    python -m bench.emulator.http.cluster --profile deploy/profiles/qwen3-32b-h200-tp2.toml \
        --prefill 8 --decode 8 --time-scale 0.1 [--model-dir DIR] [--out endpoints.json]

Once every engine listens it prints its endpoints as one JSON line (and writes them to `--out`),
then serves until SIGINT or SIGTERM:

    {"model": "Qwen/Qwen3-32B", "profile": "...toml", "time_scale": 0.1, "block_size": 16,
     "engines": [{"name": "prefill-0", "role": "prefill", "engine_id": "prefill-0-1a2b3c4d",
                  "url": "http://127.0.0.1:P", "side_channel": "127.0.0.1:S",
                  "kv_events": "tcp://127.0.0.1:E", "kv_replay": "tcp://127.0.0.1:R"}, ...]}

Each engine has its own ports (picked at start), block pool, scheduler and link (the reads it
makes share it). Without `--profile` they answer at once, as in a test (`in_process_config`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self

from deploy.local.vllm_engine import new_engine_id
from deploy.profiles.schema import EngineProfile

from bench.emulator.http.config import StandinConfig, engine_profile, in_process_config, with_profile
from bench.emulator.http.engine import StandinEngine
from bench.emulator.http.tokenizer import make_tokenizer

__all__ = ["StandinCluster", "main"]


class StandinCluster:
    """`prefill` + `decode` engines in the running event loop, started and stopped together.
    `overrides`: StandinConfig fields every engine gets (kv_blocks_ttl, prefix_caching, ...)."""

    def __init__(
        self,
        model_dir: Path,
        *,
        prefill: int,
        decode: int,
        profile: EngineProfile | None = None,
        time_scale: float = 1.0,
        served_model_name: str | None = None,
        **overrides: Any,
    ) -> None:
        self.profile = profile
        self.time_scale = time_scale
        self.model = served_model_name or (profile.model if profile else "m")
        roles: tuple[Literal["prefill", "decode"], ...] = ("prefill", "decode")
        self.engines: list[StandinEngine] = []
        self.names: list[str] = []
        for role, index in ((r, i) for r, n in zip(roles, (prefill, decode), strict=True) for i in range(n)):
            name = f"{role}-{index}"
            self.names.append(name)
            config = in_process_config(
                role,
                new_engine_id(name),
                model_dir,
                served_model_name=self.model,
                time_scale=time_scale,
                **overrides,
            )
            self.engines.append(StandinEngine(with_profile(config, profile) if profile else config))

    def of_role(self, role: Literal["prefill", "decode"]) -> list[StandinEngine]:
        return [engine for engine in self.engines if engine.config.role == role]

    async def start(self) -> None:
        try:
            await asyncio.gather(*(engine.start() for engine in self.engines))
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        await asyncio.gather(*(engine.stop() for engine in self.engines))

    def endpoints(self) -> dict[str, Any]:
        """What a benchmark reads to find the engines (the module's doc shows it)."""
        first: StandinConfig | None = self.engines[0].config if self.engines else None
        return {
            "model": self.model,
            "time_scale": self.time_scale,
            "block_size": first.block_size if first else None,
            "engines": [
                {
                    "name": name,
                    "role": engine.config.role,
                    "engine_id": engine.config.engine_id,
                    "url": engine.url,
                    "side_channel": f"{engine.config.host}:{engine.side_channel_port}",
                    "kv_events": engine.events_endpoint,
                    "kv_replay": engine.replay_endpoint,
                }
                for name, engine in zip(self.names, self.engines, strict=True)
            ],
        }

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.emulator.http.cluster", description=__doc__)
    ap.add_argument("--profile", type=Path, help="an engine profile (deploy/profiles); none: flat costs")
    ap.add_argument("--profile-model", help="which of the file's profiles (default: its only one)")
    ap.add_argument("--prefill", type=int, default=1)
    ap.add_argument("--decode", type=int, default=1)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--model-dir", type=Path, default=Path(".run/models/standin"),
                    help="its tokenizer.json (made if missing: bench.emulator.http.tokenizer)")  # fmt: skip
    ap.add_argument("--served-model-name", help="default: the profile's model")
    ap.add_argument("--kv-blocks-ttl", type=float, default=480.0)
    ap.add_argument("--out", type=Path, help="also write the endpoints JSON here")
    args = ap.parse_args(argv)
    if not (args.model_dir / "tokenizer.json").exists():
        make_tokenizer(args.model_dir)
    profile = engine_profile(args.profile, args.profile_model) if args.profile else None

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        cluster = StandinCluster(
            args.model_dir,
            prefill=args.prefill,
            decode=args.decode,
            profile=profile,
            time_scale=args.time_scale,
            served_model_name=args.served_model_name,
            kv_blocks_ttl=args.kv_blocks_ttl,
        )
        async with cluster:
            endpoints = {**cluster.endpoints(), "profile": str(args.profile) if args.profile else None}
            text = json.dumps(endpoints)
            if args.out:
                args.out.write_text(text + "\n")
            print(text, flush=True)
            await stop.wait()

    asyncio.run(run())


if __name__ == "__main__":
    main()
