"""The production gRPC probe (deploy/kubernetes/image/grpc_probe.py), run as the kubelet runs
it (a process) against a real kvshuttle server: SERVING is 0, anything else 1, over plaintext
and over mTLS with a client certificate the server's CA signed."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry
from tests.tls import make_certs, needs_openssl

from kvshuttle.serving.server import GrpcServer
from kvshuttle.serving.settings import AuthSettings, ServerSettings, TelemetrySettings

PROBE = Path(__file__).resolve().parents[2] / "deploy/kubernetes/image/grpc_probe.py"


def server(settings: ServerSettings) -> GrpcServer:
    return GrpcServer(
        settings,
        TelemetrySettings(),
        service_name="kvshuttle-probe-test",
        domain="test.kvshuttle",
        register=lambda _: None,
        service_names=["kvshuttle.test.v1.Nothing"],
        registry=CollectorRegistry(),
        auth=AuthSettings(),
    )


async def probe(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(PROBE), *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    _, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, err.decode()


async def test_plaintext_serving_then_stopped() -> None:
    srv = server(ServerSettings(listen="127.0.0.1:0"))
    port = await srv.start()
    try:
        assert await probe(f"127.0.0.1:{port}") == (0, "")
        code, err = await probe(f"127.0.0.1:{port}", "--service", "kvshuttle.test.v1.Unknown")
        assert code == 1 and "NOT_FOUND" in err
    finally:
        await srv.stop()
    code, err = await probe(f"127.0.0.1:{port}", "--timeout", "1")
    assert code == 1 and "UNAVAILABLE" in err


@needs_openssl
async def test_mtls_needs_the_client_certificate(tmp_path: Path) -> None:
    await asyncio.to_thread(make_certs, tmp_path)
    srv = server(
        ServerSettings(
            listen="127.0.0.1:0",
            tls_cert_file=tmp_path / "server.pem",
            tls_key_file=tmp_path / "server.key",
            tls_client_ca_file=tmp_path / "ca.pem",
        )
    )
    port = await srv.start()
    address = f"127.0.0.1:{port}"
    ca = ["--ca", str(tmp_path / "ca.pem")]
    try:
        assert await probe(
            address, *ca, "--cert", str(tmp_path / "client.pem"), "--key", str(tmp_path / "client.key")
        ) == (0, "")
        code, err = await probe(address, *ca, "--timeout", "1")  # no client certificate: refused
        assert code == 1 and err.startswith(f"grpc_probe: {address}: UNAVAILABLE"), err
        code, _ = await probe(address, "--timeout", "1")  # plaintext, as the kubelet's own probe
        assert code == 1
        code, err = await probe(address, *ca, "--cert", str(tmp_path / "client.pem"))
        assert code == 2 and "go together" in err
    finally:
        await srv.stop()
