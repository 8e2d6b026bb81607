"""`make up`: a local kvshuttle to point your own client at, until Ctrl-C.

Starts what `make demo` starts (deploy/demo.py), then waits instead of running a session: a
prefill and a decode vLLM server (the CPU build from .venv-vllm, NixlConnector both ways) and
kvshuttle beside them (registry, router, one agent per engine with its DRAM pool, the gateway),
with parking and prefetch on. Once everything answers it prints the OpenAI base URL, the
registry's and the metrics' addresses, a `curl` line, a short OpenAI SDK snippet and the
`kvshuttle status` command, writes the same addresses as JSON (`--endpoints`), and stays up until
SIGINT or SIGTERM; then it stops everything it started and exits 0. A service or an engine that
dies stops the rest too (exit 1).

    python -m deploy.up [--model DIR] [--store memory|redis] [--gateway-port 8080] [--tool-call-parser P]
        [--otlp-endpoint http://HOST:4317]

`make up` passes MODEL, STORE, GATEWAY_PORT and TOOL_CALL_PARSER on as the defaults of these, and
OTLP_ENDPOINT as --otlp-endpoint (default: $KVSHUTTLE_OTLP_ENDPOINT): the services and both
engines export their spans there, one trace per turn (docs/operations/tracing.md).

`--model DIR` serves a model you bring: a local directory in Hugging Face layout (config.json,
tokenizer files, *.safetensors; nothing is downloaded). Without it, the built-in `small` test
model (random weights, built under .run/models in seconds). vLLM runs it in float32 on one core
per engine, so small models (up to a billion parameters or so) are what this machine serves.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import sys
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any, Final

from deploy.demo import DATA_PLANE, POOL_BYTES, PROFILE
from deploy.local.launch import VllmPair
from deploy.local.models import model_facts
from deploy.local.otlp import OTLP_ENDPOINT_ENV
from deploy.local.processes import free_ports
from deploy.local.redis import RedisDied, RedisNotInstalled, redis_server_binary
from deploy.local.stack import HOST, REGISTRY_STORES, KvshuttleStack
from deploy.local.vllm_engine import EngineDied
from deploy.local.vllm_venv import VllmNotInstalled, ensure_model
from kvshuttle.gateway.parsing import TOOL_PARSERS

RUN_DIR: Final = Path(".run/up")
DEFAULT_GATEWAY_PORT: Final = 8080
BUILT_IN_NAME: Final = "m"  # the name the demo and the built-in model's profile use
MAX_MODEL_LEN: Final = 8192
KV_CACHE_GIB: Final = 1
TOKENIZER_FILES: Final = ("tokenizer.json", "tokenizer.model", "vocab.json")


class PortInUse(RuntimeError):
    """The gateway's port is taken."""


class ModelDirError(ValueError):
    """--model names no usable Hugging Face model directory; the message says what is missing."""


def check_model_dir(path: Path) -> Path:
    """`path`, resolved, when it holds a config, a tokenizer and safetensors weights."""
    model = path.expanduser().resolve()
    if not model.is_dir():
        raise ModelDirError(f"--model {path}: not a directory")
    missing = []
    if not (model / "config.json").is_file():
        missing.append("config.json")
    if not any((model / name).is_file() for name in TOKENIZER_FILES):
        missing.append(f"a tokenizer ({' or '.join(TOKENIZER_FILES)})")
    if not any(model.glob("*.safetensors")):
        missing.append("weights (*.safetensors)")
    if missing:
        raise ModelDirError(f"--model {path}: missing {', '.join(missing)} (a Hugging Face model directory)")
    try:
        model_facts(model)
    except (KeyError, ValueError) as exc:
        raise ModelDirError(
            f"--model {path}: config.json lacks what vLLM and kvshuttle need: {exc}"
        ) from None
    return model


def check_port_free(port: int) -> None:
    """Before a minute of vLLM start-up: a gateway port in use is a clear error, not a dead gateway."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the gateway's server binds
        try:
            sock.bind((HOST, port))
        except OSError as exc:
            raise PortInUse(
                f"{HOST}:{port} is taken ({exc.strerror}): set GATEWAY_PORT to a free port"
            ) from None


def engine_profile(model: Path, served_name: str, kv_cache_gib: int) -> dict[str, Any]:
    """The router's cost profile: the demo's CPU one (deploy/profiles/cpu-small.toml), keyed by
    `served_name`, with the model's own KV size. Its prefill and link costs are the small
    model's; CommitTurn timings recalibrate both on the running stack."""
    profile: dict[str, Any] = tomllib.loads(PROFILE.read_text())["profile"][0]
    kv_bytes = model_facts(model, dtype="float32").kv_bytes_per_token
    engine = {**profile["engine"], "kv_capacity_tokens": kv_cache_gib * 2**30 // kv_bytes}
    return {**profile, "model": served_name, "kv_bytes_per_token": kv_bytes, "engine": engine}


def max_model_len(model: Path) -> int:
    """The demo's context, or less when the model's positions end sooner (vLLM refuses more)."""
    positions = model_facts(model).max_position_embeddings
    return min(MAX_MODEL_LEN, positions) if positions else MAX_MODEL_LEN


def endpoints(
    stack: KvshuttleStack, model: Path, served_name: str, metrics: dict[str, str]
) -> dict[str, Any]:
    """Every address a user or a tool needs, as written to --endpoints."""
    return {
        "openai_base_url": f"{stack.gateway_url}/v1",
        "model": served_name,
        "model_dir": str(model),
        "registry": stack.registry_addr,
        "registry_store": stack.registry_store,
        "router": stack.router_addr,
        "agents": list(stack.agent_addrs),
        "metrics": metrics,
        "admin_token_file": str(stack.admin_token_file),
        "logs": str(stack.work_dir.resolve()),
        "pid": os.getpid(),
    }


def status_command(info: dict[str, Any]) -> str:
    return shlex.join([
        "kvshuttle", "status", "--registry", info["registry"], "--token-file", info["admin_token_file"],
        "--gateway-metrics", info["metrics"]["gateway"],
    ])  # fmt: skip


def banner(info: dict[str, Any]) -> str:
    """What `make up` prints once ready: where everything is and how to try it."""
    base, model = info["openai_base_url"], info["model"]
    metrics = info["metrics"]
    body = json.dumps({
        "model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32,
        "conversation_id": "my-first-chat",
    })  # fmt: skip
    lines = [
        f"kvshuttle is up: model {model!r} ({info['model_dir']}), registry store {info['registry_store']}",
        "",
        f"  OpenAI base URL   {base}",
        f"  registry (gRPC)   {info['registry']}   admin token: {info['admin_token_file']}",
        f"  router (gRPC)     {info['router']}",
        *(f"  metrics           http://{addr}/metrics   ({name})" for name, addr in metrics.items()),
        f"  logs              {info['logs']}",
        "",
        "Try it with curl (the X-Kvshuttle-* response headers say what the turn reused):",
        f"  curl -sD - {base}/chat/completions -H 'Content-Type: application/json' -d '{body}'",
        "",
        "or with the OpenAI Python SDK (pip install openai); the same conversation_id on the next",
        "turn reuses this one's KV:",
        "  from openai import OpenAI",
        f'  client = OpenAI(base_url="{base}", api_key="unused")',
        '  messages = [{"role": "user", "content": "Hello!"}]',
        f'  reply = client.chat.completions.create(model="{model}", messages=messages, max_tokens=32,'
        ' extra_body={"conversation_id": "my-first-chat"})',
        "  print(reply.choices[0].message.content, reply.usage.prompt_tokens_details)",
        "",
        "The stack at a glance:",
        f"  {status_command(info)}",
        "",
        "Ctrl-C stops everything.",
    ]
    return "\n".join(lines)


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def serve(args: argparse.Namespace) -> int:
    """Start, print, wait for a signal or a death, stop. Signals raise KeyboardInterrupt."""
    run_dir: Path = args.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    if args.store == "redis":
        redis_server_binary()  # before a minute of vLLM start-up: RedisNotInstalled says what to install
    check_port_free(args.gateway_port)
    model = check_model_dir(args.model) if args.model else ensure_model("small")
    served_name = args.served_model_name or (BUILT_IN_NAME if args.model is None else model.name)
    # The built-in models' chat template and added tokens are Hermes-style (deploy/vllm/make_model.py).
    tool_parser = args.tool_call_parser or ("hermes" if args.model is None else None)
    print(f"starting vLLM prefill and decode on {model} (logs in {run_dir / 'vllm'}) ...", flush=True)
    pair = VllmPair(
        model,
        log_dir=run_dir / "vllm",
        served_model_name=served_name,
        block_size=32,
        prefill_prefix_caching=False,  # as the demo: prefill reads retained KV or recomputes
        kv_cache_gib=args.kv_cache_gib,
        max_model_len=max_model_len(model),
        start_timeout=args.start_timeout,
        otlp_traces_endpoint=args.otlp_endpoint,
        progress=lambda name, elapsed, step: print(f"  [{elapsed:3.0f} s] {name:<7} {step}", flush=True),
    )
    stack: KvshuttleStack | None = None
    try:
        pair.start()
        print("starting kvshuttle: registry, router, two agents with pools, gateway ...", flush=True)
        gateway_metrics = f"{HOST}:{free_ports(1)[0]}"
        extra_env = {
            **DATA_PLANE,
            "gateway": {**DATA_PLANE["gateway"], "TELEMETRY__METRICS_LISTEN": gateway_metrics},
        }
        model_settings = {"tokenizer": str(model)} | (
            {"tool_call_parser": tool_parser} if tool_parser else {}
        )
        extra_env["gateway"]["MODELS"] = json.dumps({served_name: model_settings})
        stack = KvshuttleStack(
            pair,
            work_dir=run_dir / "services",
            profile=engine_profile(model, served_name, args.kv_cache_gib),
            served_model_name=served_name,
            progress=lambda m: print(f"  {m}", flush=True),
            extra_env=extra_env,
            pool_bytes=POOL_BYTES,
            registry_store=args.store,
            gateway_port=args.gateway_port,
            otlp_endpoint=args.otlp_endpoint,
        )
        stack.start()
        if args.otlp_endpoint:
            print(f"tracing: every service and both engines export their spans to {args.otlp_endpoint}")
        metrics = {"gateway": gateway_metrics, **{n: f"{HOST}:{p}" for n, p in stack.metrics_ports.items()}}
        metrics |= {
            f"agent-{e.name}": f"{HOST}:{p}"
            for e, p in zip(pair.engines, stack.agent_metrics_ports, strict=True)
        }
        info = endpoints(stack, model, served_name, metrics)
        args.endpoints.parent.mkdir(parents=True, exist_ok=True)
        args.endpoints.write_text(json.dumps(info, indent=2) + "\n")
        print("\n" + banner(info) + "\n", flush=True)
        return watch(pair, stack)
    finally:
        # A second Ctrl-C must not cut the stop short and leave engines behind.
        for signum in _STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        print("stopping everything make up started ...", flush=True)
        if stack is not None:
            stack.stop()
        pair.stop()
        args.endpoints.unlink(missing_ok=True)
        print("stopped", flush=True)


def watch(pair: VllmPair, stack: KvshuttleStack) -> int:
    """Until a signal (KeyboardInterrupt) or until something it started dies (returns 1)."""
    while True:
        dead = [engine.name for engine in pair.engines if not engine.running]
        if dead:
            print(
                f"error: vLLM {', '.join(dead)} exited (logs in {pair.log_dir})", file=sys.stderr, flush=True
            )
            return 1
        try:
            for service in stack.services:
                service.check()
            if stack.redis is not None:
                stack.redis.check()
        except (RuntimeError, RedisDied) as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return 1
        time.sleep(1)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m deploy.up", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument(
        "--model",
        type=Path,
        default=os.environ.get("MODEL") or None,
        help="a local Hugging Face model directory (default: $MODEL, else the built-in small model)",
    )
    ap.add_argument(
        "--served-model-name", help="the OpenAI model name (default: m, or --model's folder name)"
    )
    ap.add_argument(
        "--tool-call-parser",
        default=os.environ.get("TOOL_CALL_PARSER") or None,
        help="the gateway's tool-call parser for --model (e.g. hermes; default: $TOOL_CALL_PARSER, else "
        "none: only named, 'required' and 'none' tool choices)",
    )
    ap.add_argument(
        "--store",
        choices=REGISTRY_STORES,
        default=os.environ.get("STORE") or "memory",
        help="where the registry keeps its state (default: $STORE, else memory); redis starts a local server",
    )
    ap.add_argument(
        "--gateway-port",
        type=int,
        default=int(os.environ.get("GATEWAY_PORT") or DEFAULT_GATEWAY_PORT),
        help=f"the gateway's port on {HOST} (default: $GATEWAY_PORT, else {DEFAULT_GATEWAY_PORT})",
    )
    ap.add_argument(
        "--otlp-endpoint",
        default=os.environ.get(OTLP_ENDPOINT_ENV) or None,
        help=f"OTLP/gRPC collector for the services' and engines' spans (default: ${OTLP_ENDPOINT_ENV})",
    )
    ap.add_argument("--kv-cache-gib", type=int, default=KV_CACHE_GIB, help="each engine's KV cache")
    ap.add_argument("--start-timeout", type=float, default=300.0, help="seconds vLLM may take to start")
    ap.add_argument("--run-dir", type=Path, default=RUN_DIR, help="logs, tokens and state")
    ap.add_argument(
        "--endpoints",
        type=Path,
        help="also write the addresses here as JSON (default: RUN_DIR/endpoints.json)",
    )
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.store not in REGISTRY_STORES:  # argparse checks choices on the command line only
        ap.error(f"$STORE={args.store!r}: choose from {', '.join(REGISTRY_STORES)}")
    if args.tool_call_parser and args.tool_call_parser not in TOOL_PARSERS:
        ap.error(
            f"--tool-call-parser {args.tool_call_parser!r}: choose from {', '.join(sorted(TOOL_PARSERS))}"
        )
    if not 0 < args.gateway_port < 65536:
        ap.error(f"--gateway-port {args.gateway_port}: not a TCP port")
    args.endpoints = args.endpoints or args.run_dir / "endpoints.json"
    # The caller's handlers come back on the way out (main also runs inside a test's process).
    previous = {signum: signal.signal(signum, _interrupt) for signum in _STOP_SIGNALS}
    try:
        return serve(args)
    except KeyboardInterrupt:
        return 0
    except (ModelDirError, PortInUse, VllmNotInstalled, RedisNotInstalled) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except (EngineDied, RedisDied, TimeoutError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


if __name__ == "__main__":
    sys.exit(main())
