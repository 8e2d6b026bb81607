"""Connection settings, for the pydantic-settings object of any process that calls a kvshuttle
service (KVSHUTTLE_ROUTER_REGISTRY__ADDRESS, KVSHUTTLE_GATEWAY_ROUTER__ADDRESS, ...)."""

from __future__ import annotations

from pathlib import Path
from typing import Self

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator

from kvshuttle.client.channel import ChannelOptions, grpc_target


class ServiceConnection(BaseModel):
    """How a service or the gateway reaches another kvshuttle service, as configuration
    (mirrors ChannelOptions, which it builds)."""

    # One address, several replicas' "ip:port" joined by commas, or one DNS name that resolves
    # to every replica ("dns:///registry.kvshuttle:50051"): calls go round robin over those up.
    address: str
    # Deadline of one call, retries included (seconds).
    timeout: float = Field(default=2.0, gt=0)
    # Sends per call (first included) on UNAVAILABLE, for calls safe to repeat.
    max_attempts: int = Field(default=3, ge=1)
    tls: bool = False
    # PEM files: the CA of the registry's certificate; the router's certificate and key (mTLS).
    root_certificates: Path | None = None
    cert_chain: Path | None = None
    private_key: Path | None = None
    tls_server_name: str | None = None
    # Seconds between checks of those files: changed ones (a renewal) get a new channel for the
    # calls that follow (kvshuttle.client.channel). None: read once.
    tls_reload_interval: float | None = Field(default=10.0, gt=0)
    # This caller's bearer token (for a service that authenticates by tokens): inline, or a
    # file holding it (a mounted secret; read when the channel is built).
    token: SecretStr | None = None
    token_file: Path | None = None

    @field_validator("address")
    @classmethod
    def _target(cls, value: str) -> str:
        grpc_target(value)  # ValueError naming the fix for a list of host names
        return value

    @model_validator(mode="after")
    def _mtls_complete(self) -> Self:
        if (self.cert_chain is None) != (self.private_key is None):
            raise ValueError("cert_chain and private_key go together (mTLS)")
        if self.token is not None and self.token_file is not None:
            raise ValueError("token and token_file are alternatives")
        return self

    def bearer_token(self) -> str | None:
        if self.token_file is not None:
            return self.token_file.read_text().strip()
        return None if self.token is None else self.token.get_secret_value()

    def channel_options(self) -> ChannelOptions:
        return ChannelOptions(
            self.address,
            default_timeout=self.timeout,
            tls=self.tls,
            root_certificates=self.root_certificates,
            cert_chain=self.cert_chain,
            private_key=self.private_key,
            tls_server_name=self.tls_server_name,
            max_attempts=self.max_attempts,
            token=self.bearer_token(),
            tls_reload_interval=self.tls_reload_interval,
        )
