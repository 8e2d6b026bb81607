"""A prefill/decode pair of stand-in engines (bench/emulator/http/engine.py), each its own process,
shaped like `VllmPair` for what `KvshuttleStack` reads of it (`model_dir`, `prefill`, `decode`,
`engines`; each engine's `name`, `engine_id`, `url`, `side_channel`, `events_endpoint`,
`replay_endpoint`, `spec.role`), so the whole control plane runs as real processes over engines
that need no model and answer in configurable time:

    with StandinPair(ensure_model("tiny"), log_dir=work / "engines") as pair, \
            KvshuttleStack(pair, work_dir=work, profile=...) as stack:
        ...
        pair.expected(prompt, max_tokens)  # a clean recompute's output ids

Start-up takes about a second. Pools (NIXL parking) need a real engine's side channel: keep the
stack's `pool_bytes` at 0 over stand-ins.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self

from deploy.local.engine_pair import EngineEndpoints
from deploy.local.processes import free_ports, kill_process, stop_process
from deploy.local.vllm_engine import new_engine_id
from tokenizers import Tokenizer

from bench.emulator.http.completions import plain_vocabulary
from bench.emulator.http.config import HOST
from bench.emulator.http.kv import output_tokens
from kvshuttle.agent.engine import parse_vllm_metrics


@dataclass(frozen=True)
class StandinSpec:
    """One stand-in engine's command line (`argv`)."""

    name: str
    role: Literal["prefill", "decode"]
    model_dir: Path
    http_port: int
    side_channel_port: int
    kv_events_port: int
    kv_replay_port: int
    engine_id: str = ""
    served_model_name: str = "m"
    block_size: int = 32
    num_blocks: int = 4096
    max_model_len: int = 8192
    prefix_caching: bool = True
    prefill_us_per_token: float = 20.0
    decode_ms_per_token: float = 0.5
    read_us_per_block: float = 50.0
    kv_blocks_ttl: float = 480.0
    host: str = HOST
    # An engine profile file: profile-timed (bench/emulator/core/timing.py), `time_scale` x its times.
    profile: Path | None = None
    time_scale: float = 1.0
    otlp_traces_endpoint: str | None = None

    def __post_init__(self) -> None:
        if not self.engine_id:
            object.__setattr__(self, "engine_id", new_engine_id(self.name))

    def argv(self) -> list[str]:
        args = [sys.executable, "-m", "bench.emulator.http.engine", "--role", self.role,
                "--port", str(self.http_port), "--side-channel-port", str(self.side_channel_port),
                "--kv-events-port", str(self.kv_events_port), "--kv-replay-port", str(self.kv_replay_port),
                "--engine-id", self.engine_id, "--model-dir", str(self.model_dir),
                "--served-model-name", self.served_model_name, "--host", self.host,
                "--block-size", str(self.block_size), "--num-blocks", str(self.num_blocks),
                "--max-model-len", str(self.max_model_len),
                "--prefill-us-per-token", str(self.prefill_us_per_token),
                "--decode-ms-per-token", str(self.decode_ms_per_token),
                "--read-us-per-block", str(self.read_us_per_block),
                "--kv-blocks-ttl", str(self.kv_blocks_ttl), "--time-scale", str(self.time_scale)]  # fmt: skip
        if self.profile is not None:
            args += ["--profile", str(self.profile)]
        if self.otlp_traces_endpoint:
            args += ["--otlp-traces-endpoint", self.otlp_traces_endpoint]
        return args if self.prefix_caching else [*args, "--no-prefix-caching"]


class StandinEngineProcess(EngineEndpoints):
    """One stand-in engine process; its endpoints as VllmEngine names them."""

    spec: StandinSpec

    def __init__(self, spec: StandinSpec, log_dir: Path) -> None:
        self.spec = spec
        self.log_path = Path(log_dir) / f"{spec.engine_id}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.spec.argv(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)  # fmt: skip

    def ready(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            tail = self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""
            raise RuntimeError(f"stand-in {self.name} is not running; log tail:\n{tail}")
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=1) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def get_json(self, path: str) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=10) as response:
            got: dict[str, Any] = json.loads(response.read())
        return got

    def kv_cache_usage(self) -> float:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as response:
            usage = parse_vllm_metrics(response.read().decode()).kv_cache_usage
        return 0.0 if usage is None else usage

    def kill(self) -> None:
        """SIGKILL, as a crash ends it."""
        kill_process(self.proc)

    def stop(self, timeout: float = 10.0) -> int | None:
        return stop_process(self.proc, timeout)


class StandinPair:
    """Prefill and decode stand-ins, started and stopped together. `restart()` gives both new
    engine ids and new ports, as `VllmPair.restart()` does (read the endpoints again)."""

    def __init__(
        self,
        model_dir: Path,
        *,
        log_dir: Path,
        served_model_name: str = "m",
        block_size: int = 32,
        num_blocks: int = 4096,
        max_model_len: int = 8192,
        prefill_us_per_token: float = 20.0,
        decode_ms_per_token: float = 0.5,
        read_us_per_block: float = 50.0,
        decoder_kv_blocks_ttl: float = 480.0,
        prefill_prefix_caching: bool = True,
        decode_prefix_caching: bool = True,
        profile: Path | None = None,
        time_scale: float = 1.0,
        otlp_traces_endpoint: str | None = None,
        start_timeout: float = 30.0,
    ) -> None:
        self.model_dir = Path(model_dir).resolve()
        self.log_dir = Path(log_dir)
        self.start_timeout = start_timeout
        self._common: dict[str, Any] = {
            "model_dir": self.model_dir, "served_model_name": served_model_name, "block_size": block_size,
            "num_blocks": num_blocks, "max_model_len": max_model_len,
            "prefill_us_per_token": prefill_us_per_token,
            "decode_ms_per_token": decode_ms_per_token, "read_us_per_block": read_us_per_block,
            "kv_blocks_ttl": decoder_kv_blocks_ttl, "profile": profile, "time_scale": time_scale,
            "otlp_traces_endpoint": otlp_traces_endpoint,
        }  # fmt: skip
        self._prefix_caching = {"prefill": prefill_prefix_caching, "decode": decode_prefix_caching}
        self.prefill, self.decode = self._engines()
        self.vocabulary = plain_vocabulary(Tokenizer.from_file(str(self.model_dir / "tokenizer.json")))[0]

    def _engines(
        self, ports: Sequence[int] | None = None
    ) -> tuple[StandinEngineProcess, StandinEngineProcess]:
        p = list(ports) if ports is not None else free_ports(8)

        def engine(role: Literal["prefill", "decode"], at: int) -> StandinEngineProcess:
            spec = StandinSpec(
                role,
                role,
                http_port=p[at],
                side_channel_port=p[at + 1],
                kv_events_port=p[at + 2],
                kv_replay_port=p[at + 3],
                prefix_caching=self._prefix_caching[role],
                **self._common,
            )
            return StandinEngineProcess(spec, self.log_dir)

        return engine("prefill", 0), engine("decode", 4)

    @property
    def engines(self) -> tuple[StandinEngineProcess, StandinEngineProcess]:
        return self.prefill, self.decode

    def expected(self, prompt: Sequence[int], max_tokens: int) -> list[int]:
        """The output ids of a clean recompute of `prompt` (KV computed from its own tokens)."""
        return output_tokens(prompt, max_tokens, self.vocabulary)

    def start(self) -> float:
        began = time.monotonic()
        try:
            for engine in self.engines:
                engine.start()
            while not all(engine.ready() for engine in self.engines):
                if time.monotonic() - began > self.start_timeout:
                    raise TimeoutError(f"stand-in engines not ready in {self.start_timeout:.0f} s")
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise
        return time.monotonic() - began

    def stop(self) -> None:
        for engine in self.engines:
            engine.stop()

    def restart(self, ports: Sequence[int] | None = None) -> float:
        """Both stopped, then started with new engine ids on new (or the given) ports."""
        self.stop()
        self.prefill, self.decode = self._engines(ports)
        return self.start()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
