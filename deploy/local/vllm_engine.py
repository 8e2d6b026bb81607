"""One real vLLM server (the CPU build) on this machine: `EngineSpec`, the exact command and
environment it starts with, and `VllmEngine`, the server in its own process group.

    engine = VllmEngine(EngineSpec("prefill", "prefill", model_dir, http, side, events, replay), log_dir)
    engine.start()                      # returns at once
    engine.wait_ready(progress=print)   # start-up milestones (deploy/local/milestones.py) as reached
    engine.url, engine.events_endpoint, engine.side_channel
    engine.stop()                       # the whole process group: API server, engine core, workers

Every engine runs NixlConnector (`kv_both`, `bidirectional_kv_xfer`) and publishes KV events (ZMQ
PUB bound on `tcp://*:PORT`, replay ROUTER beside it, topic `kv-events`). Facts behind the choices
are in deploy/vllm/README.md. A prefill/decode pair of them is deploy/local/launch.py's `VllmPair`.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final, Literal

from deploy.local.engine_pair import EngineEndpoints
from deploy.local.milestones import Milestone, MilestoneReader
from deploy.local.processes import die_with_parent, log_tail, stop_group, terminate_group
from deploy.local.vllm_venv import REPO_ROOT, vllm_python
from kvshuttle.agent.engine import parse_vllm_metrics

KV_EVENTS_TOPIC: Final = "kv-events"
HOST: Final = "127.0.0.1"

Role = Literal["prefill", "decode"]
# (engine name, seconds since its start, start-up milestone): each milestone once, as it is reached
Progress = Callable[[str, float, str], None]
# vLLM's API server asks for this many open files (vllm.utils.system_utils.set_ulimit) and, when
# the hard limit is lower, warns and keeps the soft limit where it was.
VLLM_NOFILE_TARGET: Final = 65535


class EngineDied(RuntimeError):
    """A vLLM server exited (or never became ready); the message ends with its log tail."""


def new_engine_id(name: str) -> str:
    """A fresh engine id. Prefill caches remote engines by id: a restarted engine needs a new one."""
    return f"{name}-{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class EngineSpec:
    """Everything one vLLM server is started with. `argv()` and `env()` are the exact command."""

    name: str
    role: Role
    model_dir: Path
    http_port: int
    side_channel_port: int  # NIXL handshake (VLLM_NIXL_SIDE_CHANNEL_PORT)
    kv_events_port: int  # ZMQ PUB
    kv_replay_port: int  # ZMQ ROUTER (replay from a sequence number)
    core: int | None = None  # CPU to pin (VLLM_CPU_OMP_THREADS_BIND); None: vLLM's "auto"
    engine_id: str = ""  # empty: f"{name}-{uuid8}", fresh for every spec
    served_model_name: str = "m"
    block_size: int = 32  # a multiple of 32 on the CPU build
    prefix_caching: bool = True
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE (whole GiB)
    max_model_len: int = 8192
    decoder_kv_blocks_ttl: int = 480  # seconds decode retains a finished request's blocks
    kv_recompute_threshold: int = 64  # prefill recomputes instead of reading fewer tokens (0: off)
    kv_lease_duration: int | None = None  # prefill-side lease; None: vLLM's default (30 s)
    host: str = HOST
    dev_mode: bool = True  # VLLM_SERVER_DEV_MODE: /reset_prefix_cache and friends
    prompt_tokens_details: bool = True  # usage.prompt_tokens_details.cached_tokens
    # NIXL's progress thread waits up to this long on UCX events instead of busy-polling a core
    # (kvshuttle plugin, deploy/vllm/README.md); None keeps NIXL's default spin.
    nixl_progress_delay_us: int | None = 1000
    # OTLP/gRPC collector ("http://host:4317") for vLLM's `llm_request` spans, each a child of
    # the trace context the request carries (the gateway's prefill or decode span); None: off.
    otlp_traces_endpoint: str | None = None
    extra_args: tuple[str, ...] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', not {self.role!r}")
        if not self.engine_id:
            object.__setattr__(self, "engine_id", new_engine_id(self.name))

    def renewed(self) -> EngineSpec:
        """The same spec with a fresh engine id (what a restart must use)."""
        return replace(self, engine_id=new_engine_id(self.name))

    def kv_transfer_config(self) -> dict[str, Any]:
        extra: dict[str, Any] = {
            "bidirectional_kv_xfer": True,
            "kv_recompute_threshold": self.kv_recompute_threshold,
            "decoder_kv_blocks_ttl": self.decoder_kv_blocks_ttl,
        }
        if self.kv_lease_duration is not None:
            extra["kv_lease_duration"] = self.kv_lease_duration
        config: dict[str, Any] = {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_both",
            "kv_buffer_device": "cpu",
            "engine_id": self.engine_id,
            "kv_connector_extra_config": extra,
        }
        if self.role == "prefill":  # a failed or declined read degrades to recompute, not HTTP 500
            config["kv_load_failure_policy"] = "recompute"
        return config

    def kv_events_config(self) -> dict[str, Any]:
        # vLLM binds the PUB/ROUTER sockets only when the endpoint has "*" (or "::", ipc://,
        # inproc://); with a plain host it connects, and subscribers hear nothing.
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.kv_events_port}",
            "replay_endpoint": f"tcp://*:{self.kv_replay_port}",
            "topic": KV_EVENTS_TOPIC,
        }

    def argv(self, python: Path | str) -> list[str]:
        # The `vllm` console script fails in the CPU build (its distribution is `vllm-cpu`).
        args = [
            str(python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.served_model_name,
            "--host",
            self.host,
            "--port",
            str(self.http_port),
            "--enforce-eager",  # ready in ~40 s instead of ~90 s
            "--dtype",
            "float32",
            "--max-model-len",
            str(self.max_model_len),
            "--block-size",
            str(self.block_size),
            "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching",
            "--kv-transfer-config",
            json.dumps(self.kv_transfer_config(), separators=(",", ":")),
            "--kv-events-config",
            json.dumps(self.kv_events_config(), separators=(",", ":")),
        ]
        if self.prompt_tokens_details:
            args.append("--enable-prompt-tokens-details")
        if self.otlp_traces_endpoint:
            args += ["--otlp-traces-endpoint", self.otlp_traces_endpoint]
        return [*args, *self.extra_args]

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env.update(
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            VLLM_TARGET_DEVICE="cpu",
            VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gib),
            VLLM_NIXL_SIDE_CHANNEL_HOST=self.host,
            VLLM_NIXL_SIDE_CHANNEL_PORT=str(self.side_channel_port),
            VLLM_CPU_OMP_THREADS_BIND="auto" if self.core is None else str(self.core),
            PYTHONUNBUFFERED="1",
        )
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        if self.nixl_progress_delay_us is not None:
            env["KVSHUTTLE_NIXL_PTHR_DELAY_US"] = str(self.nixl_progress_delay_us)
        if self.otlp_traces_endpoint:
            # vLLM names no service (its spans would read "unknown_service"): say which engine.
            env["OTEL_SERVICE_NAME"] = f"vllm-{self.name}"
        env.pop("VIRTUAL_ENV", None)  # the main venv's, if any: irrelevant to the vLLM python
        env.update(self.extra_env)
        return env


def raise_fd_limit(target: int = VLLM_NOFILE_TARGET) -> int:
    """Raise this process's open-file limit for the engines it starts (they inherit it); the soft.

    Only a hard limit below vLLM's target needs help: vLLM then leaves the soft limit as it was
    (1024 on many systems). Raising the hard limit needs CAP_SYS_RESOURCE; without it, the soft
    limit goes up to the hard one, and vLLM's ulimit warning remains (harmless at that limit).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard >= target:
        return soft  # vLLM raises its soft limit itself
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, target))
        return target
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return hard


# Log lines after which a server never becomes ready although its process lives on (the NIXL
# handshake listener thread dies on a port clash and the engine waits for it forever).
FATAL_LOG_MARKERS: Final = (
    "Exception in thread nixl_handshake_listener",
    "zmq.error.ZMQError: Address already in use",
    "EngineCore failed to start",
)


class VllmEngine(EngineEndpoints):
    """One vLLM API server (plus its engine-core and worker processes) in its own process group."""

    spec: EngineSpec

    def __init__(self, spec: EngineSpec, log_dir: Path) -> None:
        self.spec = spec
        self.log_dir = Path(log_dir)
        self.log_path = self.log_dir / f"{spec.engine_id}.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._started_at = 0.0
        self._log_scanned = 0
        self.ready_after_s: float | None = None
        self._milestones = MilestoneReader(spec.block_size)
        self._new_milestones: list[Milestone] = []

    def kv_cache_usage(self) -> float:
        """The fraction of its KV cache in use now (`vllm:kv_cache_usage_perc` on /metrics)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as response:
            usage = parse_vllm_metrics(response.read().decode()).kv_cache_usage
        if usage is None:
            raise EngineDied(f"{self.name}'s /metrics has no vllm:kv_cache_usage_perc")
        return usage

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def describe(self) -> dict[str, Any]:
        """JSON-able: every endpoint and setting a gateway, agent or test needs."""
        s = self.spec
        return {
            "name": s.name,
            "role": s.role,
            "engine_id": s.engine_id,
            "url": self.url,
            "served_model_name": s.served_model_name,
            "model_dir": str(s.model_dir),
            "kv_events_endpoint": self.events_endpoint,
            "kv_events_replay_endpoint": self.replay_endpoint,
            "kv_events_topic": KV_EVENTS_TOPIC,
            "side_channel_host": s.host,
            "side_channel_port": s.side_channel_port,
            "block_size": s.block_size,
            "prefix_caching": s.prefix_caching,
            "max_model_len": s.max_model_len,
            "decoder_kv_blocks_ttl": s.decoder_kv_blocks_ttl,
            "kv_recompute_threshold": s.kv_recompute_threshold,
            "core": s.core,
            "nixl_progress_delay_us": s.nixl_progress_delay_us,
            "pid": self.pid,
            "log": str(self.log_path),
        }

    # lifecycle
    def start(self) -> None:
        """Start the server; returns at once (see `wait_ready`)."""
        if self.running:
            raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        argv = self.spec.argv(vllm_python())
        raise_fd_limit()
        # PDEATHSIG fires when the starting *thread* ends: arm it only from the main thread.
        on_main_thread = threading.current_thread() is threading.main_thread()
        with self.log_path.open("ab") as log:
            log.write(f"# {json.dumps(argv)}\n".encode())
            log.flush()
            self._log_scanned = log.tell()  # scan this start's lines only
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.spec.env(),
                cwd=str(REPO_ROOT),
                start_new_session=True,  # own process group: stop() reaches engine core + workers
                preexec_fn=die_with_parent if on_main_thread else None,  # noqa: PLW1509
            )
        self._started_at = time.monotonic()
        self.ready_after_s = None
        self._milestones = MilestoneReader(self.spec.block_size)
        self._new_milestones = self._milestones.started(self._proc.pid, str(self.log_path))

    def take_milestones(self) -> list[Milestone]:
        """Start-up milestones reached since the last call (`poll_ready` reads them from the log)."""
        taken, self._new_milestones = self._new_milestones, []
        return taken

    def _scan_log(self) -> str | None:
        """Reads the lines completed since the last call: notes milestones; the first fatal line."""
        try:
            with self.log_path.open("rb") as fh:
                fh.seek(self._log_scanned)
                new = fh.read()
        except OSError:
            return None
        complete = new[: new.rfind(b"\n") + 1]  # a partial last line waits for the next call
        self._log_scanned += len(complete)
        elapsed = time.monotonic() - self._started_at
        fatal = None
        for line in complete.decode(errors="replace").splitlines():
            self._new_milestones += self._milestones.feed(line, elapsed)
            if fatal is None and any(marker in line for marker in FATAL_LOG_MARKERS):
                fatal = line
        return fatal

    def poll_ready(self) -> bool:
        """One /health probe. True when ready; `EngineDied` (with the log tail) when it exited."""
        if self._proc is None:
            raise RuntimeError(f"{self.name} was not started")
        if self.ready_after_s is not None:
            return True
        rc = self._proc.poll()
        if rc is not None:
            raise EngineDied(f"{self.name} exited with {rc}; {self.log_path}:\n{log_tail(self.log_path)}")
        fatal = self._scan_log()
        if fatal is not None:
            raise EngineDied(
                f"{self.name} failed ({fatal.strip()}); {self.log_path}:\n{log_tail(self.log_path)}"
            )
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                ok = bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            ok = False  # the port opens only once the engine is ready
        if ok:
            self.ready_after_s = time.monotonic() - self._started_at
            self._new_milestones += self._milestones.ready(self.url, self.ready_after_s)
        return ok

    def wait_ready(
        self, timeout: float = 300.0, progress: Progress | None = None, interval: float = 0.5
    ) -> float:
        """Block until /health answers 200; returns seconds since start. Raises `EngineDied`."""
        deadline = time.monotonic() + timeout
        while True:
            ready = self.poll_ready()
            if progress is not None:
                for milestone in self.take_milestones():
                    progress(self.name, milestone.elapsed_s, milestone.text)
            if ready:
                break
            if time.monotonic() > deadline:
                tail = log_tail(self.log_path)
                raise EngineDied(f"{self.name} not ready after {timeout:.0f} s; {self.log_path}:\n{tail}")
            time.sleep(interval)
        assert self.ready_after_s is not None
        return self.ready_after_s

    def terminate(self) -> None:
        """Send SIGTERM to the whole process group (non-blocking; see `stop`)."""
        if self._proc is not None:
            terminate_group(self._proc)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after `timeout`; returns when none is left."""
        if self._proc is None:
            return
        pgid = self._proc.pid
        left = stop_group(self._proc, timeout)
        self._proc = None
        self.ready_after_s = None
        if left:
            raise RuntimeError(f"{self.name}: processes {left} of group {pgid} survived SIGKILL")
