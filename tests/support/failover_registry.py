"""What the Redis failover tests drive: the registry process as the stack runs it
(`deploy.local.services.registry_service`, auth on, an admin's token) on a replicated Redis, an async
gRPC client to it that checks every failed call is UNAVAILABLE with the registry's ErrorInfo, and
where the figures go (.run/results, or $KVSHUTTLE_RESULTS_DIR: bench/results keeps a run's)."""

from __future__ import annotations

import contextlib
import json
import os
import platform
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
from deploy.local.processes import free_ports
from deploy.local.services import Service, grpc_ready, registry_service
from deploy.local.tokens import Tokens
from tests.support.redis_topology import wait_for
from tests.support.registry_messages import error_info, node, retention, seconds

from kvshuttle.registry.main import ERROR_DOMAIN
from kvshuttle.registry.v1 import registry_service_pb2 as pb
from kvshuttle.registry.v1 import registry_service_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(os.environ.get("KVSHUTTLE_RESULTS_DIR") or ROOT / ".run" / "results")
# Each RPC's deadline: a call the registry leaves unanswered that long fails the test (it must
# answer UNAVAILABLE instead).
CALL_TIMEOUT = 3.0


class Client:
    """An admin's async stub to the registry process, and every failed call's code and reason."""

    def __init__(self, addr: str, token: str, server_log: Path | None = None) -> None:
        self.server_log = server_log
        self.channel = grpc.aio.insecure_channel(addr)
        self.stub = pb_grpc.RegistryServiceStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),)
        self.errors: Counter[str] = Counter()

    async def register(self) -> None:
        request = pb.RegisterNodeRequest(node=node(), ttl=seconds(300))
        await self.stub.RegisterNode(request, timeout=CALL_TIMEOUT, metadata=self.metadata)

    async def put(self, conversation: str, generation: int) -> pb.PutRetentionResponse:
        request = pb.PutRetentionRequest(
            parent=conversation, retention=retention(generation), ttl=seconds(300)
        )
        response: pb.PutRetentionResponse = await self.stub.PutRetention(
            request, timeout=CALL_TIMEOUT, metadata=self.metadata
        )
        return response

    async def claim(self, name: str) -> pb.Retention:
        request = pb.ClaimRetentionRequest(name=name, holder="turns/t1", claim_ttl=seconds(10))
        response = await self.stub.ClaimRetention(request, timeout=CALL_TIMEOUT, metadata=self.metadata)
        return response.retention

    async def conversation(self, name: str) -> pb.Conversation:
        request = pb.GetConversationRequest(name=name)
        response = await self.stub.GetConversation(request, timeout=CALL_TIMEOUT, metadata=self.metadata)
        return response.conversation

    def failed(self, err: grpc.aio.AioRpcError) -> None:
        """A call that failed during the failover: it must be UNAVAILABLE, with ErrorInfo."""
        info = error_info(err)
        self.errors[f"{err.code().name}/{info.reason}"] += 1
        assert err.code() == grpc.StatusCode.UNAVAILABLE, (err.code(), err.details(), self._errors_logged())
        assert (info.reason, info.domain) == ("UNAVAILABLE", ERROR_DOMAIN)

    def _errors_logged(self) -> list[str]:
        """The registry's error-level log lines (an INTERNAL answer's traceback is in one)."""
        if self.server_log is None or not self.server_log.exists():
            return []
        errors = []
        for line in self.server_log.read_text(errors="replace").splitlines():
            try:
                if json.loads(line).get("level") == "error":
                    errors.append(line)
            except (ValueError, AttributeError):  # not a JSON object: a line from outside structlog
                continue
        return errors[-3:]


@contextlib.contextmanager
def registry_process(tmp: Path, redis_env: Mapping[str, str]) -> Iterator[tuple[Service, str, str]]:
    """The registry process on Redis (`redis_env`: the REDIS__* settings, unprefixed), serving
    gRPC: (service, address, admin token). Stopped on the way out."""
    (port,) = free_ports(1)
    addr = f"127.0.0.1:{port}"
    tokens = Tokens(tmp / "tokens")
    env = {"STORE": "redis", **redis_env, "TELEMETRY__LOG_FORMAT": "json"}
    service = registry_service(
        listen=addr, log_dir=tmp, auth=tokens.auth({"admin": {"role": "admin"}}), extra=env
    )
    service.start()
    try:

        def serving() -> bool:
            service.check()
            return grpc_ready(addr)

        wait_for("the registry to serve", serving)
        yield service, addr, tokens.token("admin")
    finally:
        service.stop()


@contextlib.asynccontextmanager
async def client_to(addr: str, token: str, server_log: Path | None = None) -> AsyncIterator[Client]:
    client = Client(addr, token, server_log)
    try:
        yield client
    finally:
        await client.channel.close()


def keep(mode: str, figures: Mapping[str, Any]) -> Path:
    """Write a run's figures to RESULTS/redis_failover-<mode>-<utc>.json; its path."""
    now = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    head = {"test": f"redis_failover ({mode})", "time": now, "python": platform.python_version()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"redis_failover-{mode}-{now}.json"
    out.write_text(json.dumps({**head, "cpus": os.cpu_count(), **figures}, indent=2) + "\n")
    return out


__all__ = ["CALL_TIMEOUT", "Client", "client_to", "keep", "registry_process"]
