"""What kvshuttle's server interceptor costs per call (issue 21): the server process's CPU per
call of a trivial unary RPC on a real grpc.aio server on 127.0.0.1, in three setups:

- bare: grpc.aio with no interceptor (the floor of bench/grpc_floor.py, with a protobuf message);
- pass-through: an interceptor that only returns the handler (what grpc.aio's interceptor
  machinery costs by itself);
- interceptor: GrpcServer as the services configure it (RpcInterceptor with metrics, the
  canonical JSON line at info to /dev/null, spans with ids and no exporter), auth off;
- interceptor+auth: the same with an identity and its bearer token, every call authenticated
  and authorized.

    python -m bench.interceptor_cost [--calls 6000] [--concurrency 8] [--rounds 5]
    python -m bench.interceptor_cost --before /work/main   # also that tree's interceptor
    python -m bench.interceptor_cost --profile DIR   # also py-spy (--gil) each setup's server

Each server is a process of its own; the setups alternate for `rounds` rounds and the median of
each is reported (a shared machine's other load moves single runs); the profiles come from one
more round, not counted. The client's CPU is excluded: it is the same in every setup. With
`--before`, the interceptor setups run a second time with that checkout's services/ (e.g. the
main branch's, to compare a change in one run). Writes bench/results/interceptor_cost-<utc>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from google.rpc import error_details_pb2
from prometheus_client import CollectorRegistry

from bench.load import cpu_seconds
from bench.report import save
from kvshuttle.core.auth import Permission
from kvshuttle.serving.auth import Requirement
from kvshuttle.serving.logging import configure_logging
from kvshuttle.serving.server import GrpcServer
from kvshuttle.serving.settings import AuthSettings, Grant, ServerSettings, TelemetrySettings

_SERVICE = "kvshuttle.bench.v1.EchoService"
_METHOD = f"/{_SERVICE}/Echo"
# A generated message with a request_id (the interceptor puts it in the line).
_Request = error_details_pb2.RequestInfo
_TOKEN = "bench-token-0123456789abcdef"
SETUPS = ("bare", "pass-through", "interceptor", "interceptor+auth")


class _PassThrough(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        return await continuation(handler_call_details)


async def _echo(request: Any, _: Any) -> Any:
    return _Request(request_id=request.request_id, serving_data=request.serving_data)


def _add_echo(server: grpc.aio.Server) -> None:
    handler = grpc.method_handlers_generic_handler(
        _SERVICE,
        {
            "Echo": grpc.unary_unary_rpc_method_handler(
                _echo,
                request_deserializer=_Request.FromString,
                response_serializer=_Request.SerializeToString,
            )
        },
    )
    server.add_generic_rpc_handlers((handler,))


async def serve(setup: str) -> None:
    if setup in ("bare", "pass-through"):
        server = grpc.aio.server(interceptors=[_PassThrough()] if setup == "pass-through" else None)
        _add_echo(server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)  # to the measuring process
        await server.wait_for_termination()
        return
    telemetry = TelemetrySettings(log_level="info", log_format="json")
    auth = None
    if setup == "interceptor+auth":
        auth = AuthSettings(
            identities={"router": Grant(role="router")},  # type: ignore[arg-type]
            tokens={"router": _TOKEN},  # type: ignore[dict-item]
        )
    grpc_server = GrpcServer(
        ServerSettings(listen="127.0.0.1:0"),
        telemetry,
        service_name="bench",
        domain="bench.kvshuttle",
        register=_add_echo,
        service_names=[_SERVICE],
        registry=CollectorRegistry(),
        auth=auth,
        policy=lambda method, request: Requirement(Permission.BLOCKS_LOOKUP),
    )
    port = await grpc_server.start()
    print(port, flush=True)
    await asyncio.Event().wait()


async def measure(port: int, server_pid: int, calls: int, concurrency: int) -> dict[str, Any]:
    metadata = (("authorization", f"Bearer {_TOKEN}"),)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(
            _METHOD, request_serializer=_Request.SerializeToString, response_deserializer=_Request.FromString
        )
        request = _Request(request_id="req-0123456789", serving_data="x" * 200)

        async def worker(n: int) -> None:
            for _ in range(n):
                await call(request, metadata=metadata)

        await worker(200)  # warm-up: the connection, the first calls, the per-method caches
        server0, started = cpu_seconds(server_pid), time.monotonic()
        await asyncio.gather(*(worker(calls // concurrency) for _ in range(concurrency)))
        wall = time.monotonic() - started
        server = cpu_seconds(server_pid) - server0
    done = calls // concurrency * concurrency
    return {"calls_s": round(done / wall, 1), "server_cpu_us_per_call": round(server / done * 1e6, 1)}


def _run(variant: str, args: argparse.Namespace, profile: Path | None) -> dict[str, Any]:
    tree, _, setup = variant.rpartition(":")
    env = dict(os.environ)
    if tree:  # "before:interceptor": kvshuttle from that checkout, this bench module from here
        here = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join([f"{args.before}/services", f"{args.before}/clients", here])
    server = subprocess.Popen(
        [sys.executable, "-m", "bench.interceptor_cost", "--serve", setup],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    spy = None
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        if profile is not None:
            out = profile / f"{variant.replace('+', '-').replace(':', '-')}-gil.speedscope.json"
            py_spy = Path(sys.executable).parent / "py-spy"
            spy = subprocess.Popen(
                [str(py_spy), "record", "--gil", "-f", "speedscope", "-r", "500", "-o", str(out),
                 "-p", str(server.pid)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            time.sleep(1)  # attached before the calls start
        return asyncio.run(measure(port, server.pid, args.calls, args.concurrency))
    finally:
        if spy is not None:
            spy.send_signal(2)  # SIGINT: py-spy writes its profile and exits
            spy.wait()
        server.terminate()
        server.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=6000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--before", type=Path, help="a checkout whose interceptor to measure as well")
    ap.add_argument("--label", default="", help="saved with the figures (e.g. before, after)")
    ap.add_argument("--profile", type=Path, help="write py-spy speedscope profiles of the servers here")
    ap.add_argument("--serve", choices=SETUPS, help=argparse.SUPPRESS)  # a server process
    args = ap.parse_args()
    if args.serve:
        # The canonical lines are rendered and written as in production, to a sink.
        configure_logging(TelemetrySettings(log_format="json"), stream=open(os.devnull, "w"))  # noqa: SIM115
        asyncio.run(serve(args.serve))
        return
    started = datetime.now(UTC)
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    variants = [*SETUPS, *([f"before:{s}" for s in SETUPS[2:]] if args.before else [])]
    if args.profile is not None:
        for variant in variants:
            _run(variant, args, args.profile)
    runs: dict[str, list[dict[str, Any]]] = {variant: [] for variant in variants}
    for _ in range(args.rounds):
        for variant in variants:
            runs[variant].append(_run(variant, args, None))
    median = {v: statistics.median(x["server_cpu_us_per_call"] for x in runs[v]) for v in variants}
    added = {v: round(median[v] - median["bare"], 1) for v in variants[1:]}
    figures = {
        "label": args.label,
        "server_cpu_us_per_call": median,
        "interceptor_us_per_call": added,
        "interceptor_share": {v: round(added[v] / median[v], 3) for v in added},
        "runs": runs,
    }
    for v in variants:
        extra = (
            f"  +{added[v]:6.1f} us ({added[v] / median[v]:.0%} of the server's CPU)" if v in added else ""
        )
        print(f"{v:24s} server CPU {median[v]:6.1f} us/call{extra}  rounds: "
              f"{', '.join(str(x['server_cpu_us_per_call']) for x in runs[v])}")  # fmt: skip
    name = f"interceptor_cost-{args.label}" if args.label else None
    print(f"wrote {save('interceptor_cost', figures, args=args, name=name, utc=started)}")


if __name__ == "__main__":
    main()
