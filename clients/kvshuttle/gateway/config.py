"""The gateway's configuration: one object, from KVSHUTTLE_GATEWAY_* environment variables
(nested with "__"), e.g.

    KVSHUTTLE_GATEWAY_LISTEN=0.0.0.0:8080
    KVSHUTTLE_GATEWAY_ROUTER__ADDRESS=router:50061
    KVSHUTTLE_GATEWAY_ROUTER__ADDRESS=router-0.router:50061,router-1.router:50061,router-2.router:50061
    KVSHUTTLE_GATEWAY_ROUTER__AFFINITY=conversation         (the default for a list; or round_robin)
    KVSHUTTLE_GATEWAY_MODELS='{"Qwen/Qwen3-32B": "/models/qwen3-32b"}'
    KVSHUTTLE_GATEWAY_MODELS='{"qwen": {"tokenizer": "/models/qwen3-32b", "served_name": "Qwen/Qwen3-32B",
                               "tool_call_parser": "hermes", "reasoning_parser": "qwen3"}}'
    KVSHUTTLE_GATEWAY_API_KEYS='{"sk-...": "acme", "sk-...": "globex"}'    (key -> tenant; secret)
    KVSHUTTLE_GATEWAY_API_KEYS_FILE=/etc/kvshuttle/api-keys.json          (the same map, from a file)
    KVSHUTTLE_GATEWAY_ENGINES__PREFILL_TIMEOUT_S=120
    KVSHUTTLE_GATEWAY_ENGINES__REUSE_PREFILL_TIMEOUT_S=20
    KVSHUTTLE_GATEWAY_DEFAULT_MAX_TOKENS=1024

A model maps the name clients send to the directory holding its tokenizer.json (and
tokenizer_config.json / chat_template.jinja): the gateway tokenizes itself, exactly as the
engine would, so the token ids the router verifies are the ids vLLM computes.

Without API keys every request belongs to tenant "default"; with them, a request must carry
`Authorization: Bearer KEY` of a known key and belongs to that key's tenant.

Each tenant's requests reach vLLM with a cache salt of their own (kvshuttle.gateway.prompts.salts), an
HMAC under `KVSHUTTLE_GATEWAY_CACHE_SALT_KEY` (secret, at least 16 bytes). Set it in production,
the same on every replica; unset, each process draws a random key and warns (tenants stay
isolated, but KV is reused only within one gateway process).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvshuttle.client.channel import ChannelOptions, grpc_target
from kvshuttle.client.settings import ServiceConnection
from kvshuttle.core.errors import InvalidArgument
from kvshuttle.core.limits import MAX_PROMPT_TOKENS
from kvshuttle.core.names import check_id
from kvshuttle.gateway.parsing import REASONING_PARSERS, TOOL_PARSERS
from kvshuttle.serving.settings import TelemetrySettings

DEFAULT_TENANT = "default"


class ModelSettings(BaseModel):
    """One served model. A bare path in the environment stands for `{"tokenizer": path}`."""

    # Directory with tokenizer.json (tokenizer_config.json and chat_template.jinja optional).
    tokenizer: Path
    # The model name the engines serve and the router's profile is keyed by; None: the name
    # clients use.
    served_name: str | None = None
    # A chat template file that replaces the tokenizer's (as vLLM's --chat-template does; set
    # both to the same file).
    chat_template: Path | None = None
    # How message content reaches the template, as vLLM's --chat-template-content-format:
    # "string" (text parts joined with newlines; vLLM's choice for templates that print
    # message content) or "openai" (a list of {"type": "text", "text": ...} parts).
    content_format: Literal["string", "openai"] = "string"
    # Template variables every request gets (vLLM's --default-chat-template-kwargs); a
    # request's chat_template_kwargs override them.
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    # How a chat's earlier turns become token ids (docs/architecture/gateway.md, "History mode"):
    # "exact_tokens": an assistant message whose text is exactly the answer decode gave the
    # conversation's last turn carries decode's generated ids (the KV decode retained then
    # verifies whole); "retokenize": the whole chat is tokenized from its text every turn.
    history: Literal["exact_tokens", "retokenize"] = "exact_tokens"
    # How decode's output is parsed for tool calls, by vLLM's --tool-call-parser name
    # ("hermes", "llama3_json"); set, tool_choice "auto" works (vLLM's
    # --enable-auto-tool-choice). None: only "none", "required" and named tool choices.
    tool_call_parser: str | None = None
    # How decode's output is split into reasoning and content, by vLLM's --reasoning-parser
    # name ("deepseek_r1", "qwen3"); None: the whole output is content.
    reasoning_parser: str | None = None

    @field_validator("tool_call_parser")
    @classmethod
    def _known_tool_parser(cls, value: str | None) -> str | None:
        if value is not None and value not in TOOL_PARSERS:
            raise ValueError(f"unknown tool_call_parser {value!r}; known: {', '.join(sorted(TOOL_PARSERS))}")
        return value

    @field_validator("reasoning_parser")
    @classmethod
    def _known_reasoning_parser(cls, value: str | None) -> str | None:
        if value is not None and value not in REASONING_PARSERS:
            raise ValueError(
                f"unknown reasoning_parser {value!r}; known: {', '.join(sorted(REASONING_PARSERS))}"
            )
        return value


class EngineSettings(BaseModel):
    """HTTP calls to the vLLM engines the router places a turn on."""

    # Opening a connection to an engine.
    connect_timeout_s: float = Field(default=5.0, gt=0)
    # The whole prefill request (it computes the prompt, or reads it from a retention).
    prefill_timeout_s: float = Field(default=600.0, gt=0)
    # A reuse turn's prefill (it reads retained KV from another engine), bounded above by
    # prefill_timeout_s. vLLM 0.32 never answers a request whose KV holder died mid-read (it
    # stays "KV fetch in progress"): past this deadline, or on a 5xx / connection error, the
    # gateway closes the call (vLLM aborts it) and runs prefill once more on the same node as a
    # plain recompute (`fallback` on request.done, kvshuttle_gateway_reuse_fallbacks_total).
    reuse_prefill_timeout_s: float = Field(default=20.0, gt=0)
    # A non-streaming decode request, start to end.
    decode_timeout_s: float = Field(default=3600.0, gt=0)
    # Longest silence of a streaming decode between two chunks.
    decode_idle_timeout_s: float = Field(default=600.0, gt=0)
    # Open connections to all engines together (keep-alive pool).
    max_connections: int = Field(default=1024, ge=1)


class RouterConnection(ServiceConnection):
    """How the gateway reaches the router: one address, or several replicas.

    With several, `affinity` "conversation" (the default for a list) sends each conversation's
    turns to one replica, chosen by rendezvous hashing (kvshuttle.gateway.affinity), and to the
    next-ranked replica while that one does not answer; each address is a channel of its own,
    so the list may name hosts ("router-0.router:50061,router-1.router:50061", a StatefulSet's
    pods). "round_robin": one channel balancing every call over the replicas (an IP list or one
    "dns:///name:port"), as for any service. Affinity needs the replicas listed: one DNS name
    stands for a set the gateway does not see, so it is refused with "conversation"."""

    # "conversation" or "round_robin"; None: conversation with several addresses, else round robin.
    affinity: Literal["conversation", "round_robin"] | None = None
    # A replica that did not answer is passed over this long, doubled per failure in a row up
    # to failover_max_backoff_s; then the next call tries it again.
    failover_backoff_s: float = Field(default=1.0, gt=0)
    failover_max_backoff_s: float = Field(default=30.0, gt=0)

    @field_validator("address")
    @classmethod
    def _target(cls, value: str) -> str:
        """Checked with the affinity (a list for conversation affinity may name hosts)."""
        return value

    @model_validator(mode="after")
    def _addresses(self) -> Self:
        replicas = self.replicas()
        if replicas is None:
            grpc_target(self.address)  # ValueError naming the fix for a list of host names
        elif len(set(replicas)) != len(replicas) or not all(replicas):
            raise ValueError(f"router.address lists a replica twice or an empty one: {self.address!r}")
        elif any(":" not in r or "/" in r for r in replicas):
            raise ValueError(
                "router.address: conversation affinity needs each replica as host:port, "
                f"not a DNS resolver target (got {self.address!r}); list the replicas instead"
            )
        if self.failover_max_backoff_s < self.failover_backoff_s:
            raise ValueError("router: failover_max_backoff_s must be at least failover_backoff_s")
        return self

    def replicas(self) -> list[str] | None:
        """The addresses a conversation is routed among (conversation affinity), or None when
        calls go over one balanced channel (one address, or round_robin)."""
        addresses = [a.strip() for a in self.address.split(",")]
        if self.affinity == "round_robin" or (self.affinity is None and len(addresses) < 2):
            return None
        return addresses

    def replica_options(self, address: str) -> ChannelOptions:
        """One replica's channel: sent once per call, since the next replica is the retry."""
        return self.model_copy(update={"address": address, "max_attempts": 1}).channel_options()


def tokenizer_paths(value: object) -> object:
    """A `models` setting's short form: {"name": "/path"} is {"name": {"tokenizer": "/path"}}
    (the gateway's, the endpoint picker's and the sidecar's)."""
    if isinstance(value, dict):
        return {k: {"tokenizer": v} if isinstance(v, str | Path) else v for k, v in value.items()}
    return value


def tenant_id(value: str) -> str:
    """A `tenant` setting checked as the API checks tenant ids (a settings error, not an RPC's)."""
    try:
        return check_id(value, "tenant")
    except InvalidArgument as exc:
        raise ValueError(exc.message) from None


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="KVSHUTTLE_GATEWAY_",
        env_nested_delimiter="__",
        extra="forbid",
        nested_model_default_partial_update=True,
        # A validation error must not print the API keys it was given.
        hide_input_in_errors=True,
    )

    # host:port of the OpenAI-compatible HTTP server.
    listen: str = "127.0.0.1:8080"
    router: RouterConnection = Field(default_factory=lambda: RouterConnection(address="127.0.0.1:50061"))
    engines: EngineSettings = Field(default_factory=EngineSettings)
    # Client-facing model name -> its tokenizer (at least one).
    models: dict[str, ModelSettings] = Field(default_factory=dict)
    # JSON object API key -> tenant id. Secret: logged as "**********".
    api_keys: SecretStr | None = None
    # A file holding the same JSON object (a mounted secret); merged with api_keys.
    api_keys_file: Path | None = None
    # HMAC key of the tenants' vLLM cache salts, at least 16 bytes; the same on every replica.
    # Secret. None: a random key per process (logged as a warning at startup).
    cache_salt_key: SecretStr | None = None
    # max_tokens of a request that sets none; None: the engine's default (up to the context).
    default_max_tokens: int | None = Field(default=None, ge=1)
    # Request bodies larger than this are refused (413).
    max_request_bytes: int = Field(default=32 * 2**20, ge=1024)
    # Prompts longer than this are refused (400) before any engine sees them.
    max_prompt_tokens: int = Field(default=MAX_PROMPT_TOKENS, ge=1)
    # On SIGTERM: /health answers 503 for drain_delay_s first (load balancers notice), then
    # the listener closes and in-flight requests get grace_seconds before they are cancelled
    # (their turns aborted).
    drain_delay_s: float = Field(default=0.0, ge=0)
    grace_seconds: float = Field(default=30.0, ge=0)
    # Token ids of chat-template segments (the text between special tokens) are cached, so a
    # conversation's earlier messages are not tokenized again every turn. Bytes of text and ids
    # kept per model (approximately); 0 turns the cache off.
    tokenizer_cache_bytes: int = Field(default=64 * 2**20, ge=0)
    # Fraction of cached tokenizations re-checked against a full tokenization off the request
    # path; a mismatch turns the cache off for that model and is logged as an error.
    tokenizer_verify_fraction: float = Field(default=0.01, ge=0, le=1)
    # A request with no conversation id: the router finds the conversation its prompt continues
    # within the tenant (or starts one), so it is retained and reused as one that names it;
    # False: such a request is plain P->D and nothing is retained.
    find_conversations: bool = True
    # Expected think time of a chat turn whose request declares tools, when the client sends no
    # X-Kvshuttle-Expected-Think-Time: an agent runs a tool (or its user reads) before the next
    # turn, time the router may use to prefetch the KV. None: only the header says.
    agent_think_time_s: float | None = Field(default=None, ge=0, le=86_400)
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)

    @field_validator("models", mode="before")
    @classmethod
    def _bare_paths(cls, value: object) -> object:
        return tokenizer_paths(value)

    @model_validator(mode="after")
    def _check(self) -> Self:
        if not self.models:
            raise ValueError("set models: a gateway without a model serves nothing")
        for name in self.models:
            if not name or len(name) > 256:
                raise ValueError(f"model name {name[:300]!r} must be 1..256 characters")
        self.tenant_keys()  # a malformed key map fails at startup, not on the first request
        if self.cache_salt_key is not None and len(self.cache_salt_key.get_secret_value().encode()) < 16:
            raise ValueError("cache_salt_key needs at least 16 bytes")
        return self

    def tenant_keys(self) -> dict[str, str]:
        """API key -> tenant, from api_keys and api_keys_file; empty when neither is set."""
        keys: dict[str, str] = {}
        sources: list[tuple[str, str]] = []
        if self.api_keys is not None:
            sources.append(("api_keys", self.api_keys.get_secret_value()))
        if self.api_keys_file is not None:
            sources.append(("api_keys_file", self.api_keys_file.read_text()))
        for source, text in sources:
            try:
                parsed = json.loads(text)
            except json.JSONDecodeError as exc:
                # The message would quote the secret; say where, not what.
                raise ValueError(f"{source}: not valid JSON (line {exc.lineno})") from None
            if not isinstance(parsed, dict):
                raise ValueError(f"{source}: must be a JSON object of API key -> tenant")
            for key, tenant in parsed.items():
                if not isinstance(key, str) or len(key) < 8:
                    raise ValueError(f"{source}: API keys must be strings of at least 8 characters")
                if not isinstance(tenant, str):
                    raise ValueError(f"{source}: tenants must be strings")
                try:
                    check_id(tenant, "tenant")
                except InvalidArgument as exc:
                    raise ValueError(f"{source}: tenant {tenant[:200]!r}: {exc.message}") from None
                keys[key] = tenant
        return keys

    def served_name(self, model: str) -> str:
        return self.models[model].served_name or model
