"""Local launcher for real vLLM (the CPU build): one prefill/decode pair on this machine.

Importable from the main venv (it needs neither vLLM nor torch: vLLM runs in its own venv, made by
`deploy/vllm/install.sh`; deploy/local/vllm_venv.py) and runnable as a script:

    python deploy/local/launch.py pair --size small [--block-size 32] [--no-prefix-caching-on-prefill]
    python deploy/local/launch.py model --size small

`pair` starts P (core 0) and D (core 1), prints every endpoint as one JSON object on stdout, waits
for Ctrl-C/SIGTERM and stops both (their whole process groups). Start-up milestones (weights
loaded, KV cache sized, NIXL ready, ready; deploy/local/milestones.py) go to stderr. With
`--otlp-traces-endpoint URL` (default: $KVSHUTTLE_OTLP_ENDPOINT) both export their request spans
to that OTLP/gRPC collector (docs/operations/tracing.md).

From Python::

    with VllmPair(ensure_model("tiny"), log_dir=Path(".run/vllm")) as pair:
        pair.prefill.url, pair.decode.url, pair.describe()
        pair.restart()  # both engines: new engine ids, new ports

Each engine is a `VllmEngine` (deploy/local/vllm_engine.py: its command, environment and
lifecycle).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Final, Self

if __package__ in (None, ""):  # run as a script: make `deploy.local` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from deploy.local.models import SIZES, model_facts
from deploy.local.otlp import OTLP_ENDPOINT_ENV
from deploy.local.processes import free_ports, log_tail
from deploy.local.vllm_engine import EngineDied, EngineSpec, Progress, VllmEngine
from deploy.local.vllm_venv import DEFAULT_MODEL_ROOT, REPO_ROOT, VllmNotInstalled, ensure_model

DEFAULT_LOG_DIR: Final = REPO_ROOT / ".run" / "vllm"


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
        otlp_traces_endpoint: str | None = None,
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
            "otlp_traces_endpoint": otlp_traces_endpoint,
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
                        + "\n".join(f"{e.log_path}:\n{log_tail(e.log_path)}" for e in slow)
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
    pair.add_argument(
        "--otlp-traces-endpoint",
        default=os.environ.get(OTLP_ENDPOINT_ENV) or None,
        help=f"OTLP/gRPC collector for vLLM's request spans (default: ${OTLP_ENDPOINT_ENV})",
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
        otlp_traces_endpoint=args.otlp_traces_endpoint,
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
