"""The exec probe of a kvshuttle gRPC service that serves TLS: Kubernetes' native `grpc` probe
speaks plaintext only, so with mTLS the kubelet runs this inside the container instead. It asks
grpc.health.v1 Check over (m)TLS with the container's own certificate and exits 0 when the
service answers SERVING, 1 otherwise (NOT_SERVING while it drains, no answer, a TLS failure).

    python3 grpc_probe.py 127.0.0.1:50051 --ca /run/tls/ca.crt --cert /run/tls/tls.crt \
        --key /run/tls/tls.key --server-name kvshuttle-registry

Without --ca it speaks plaintext (what the native probe does, for a check by hand).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="grpc_probe.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("address", help="host:port of the service")
    ap.add_argument("--service", default="", help='the health service name ("": the server as a whole)')
    ap.add_argument("--ca", type=Path, help="PEM file of the CA that signed the server's certificate")
    ap.add_argument("--cert", type=Path, help="this container's certificate (mTLS)")
    ap.add_argument("--key", type=Path, help="its private key")
    ap.add_argument("--server-name", help="the name the server's certificate is checked against")
    ap.add_argument("--timeout", type=float, default=2.0, help="seconds (default 2)")
    return ap


def _channel(args: argparse.Namespace) -> grpc.Channel:
    if args.ca is None:
        return grpc.insecure_channel(args.address)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=args.ca.read_bytes(),
        private_key=None if args.key is None else args.key.read_bytes(),
        certificate_chain=None if args.cert is None else args.cert.read_bytes(),
    )
    options = [] if args.server_name is None else [("grpc.ssl_target_name_override", args.server_name)]
    return grpc.secure_channel(args.address, credentials, options=options)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if (args.cert is None) != (args.key is None):
        print("grpc_probe: --cert and --key go together", file=sys.stderr)
        return 2
    try:
        with _channel(args) as channel:
            check = channel.unary_unary(
                "/grpc.health.v1.Health/Check",
                request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                response_deserializer=health_pb2.HealthCheckResponse.FromString,
            )
            answer = check(health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
    except grpc.RpcError as err:
        print(f"grpc_probe: {args.address}: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    except OSError as err:  # a certificate file that cannot be read
        print(f"grpc_probe: {err}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
    if answer.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"grpc_probe: {args.address}: {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
