"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with an HTTP status.

What reaches a client, by cause:

| cause | status | type | code |
|---|---|---|---|
| malformed request, bad parameter or conversation id | 400 | invalid_request_error | invalid_request, ... |
| missing or unknown API key | 401 | authentication_error | invalid_api_key |
| unknown model | 404 | invalid_request_error | model_not_found |
| body too large | 413 | invalid_request_error | request_too_large |
| router RESOURCE_EXHAUSTED | 429 | rate_limit_error | the router's reason |
| router UNAVAILABLE (no live engine, stopping, unreachable) | 503 | server_error | the reason |
| router DEADLINE_EXCEEDED, engine timeout | 504 | server_error | timeout / engine_timeout |
| engine refused the parameters (HTTP 400/413/422) | 400 | invalid_request_error | engine_rejected |
| engine failed (5xx, connection, malformed answer) | 502 | server_error | engine_error |
| router failed otherwise | 502 | server_error | router_error |
| the gateway itself | 500 | server_error | internal_error |

A router UNAVAILABLE or DEADLINE_EXCEEDED reaches the client only for a model no plan ever
placed: otherwise the turn runner serves the turn plain P->D on the model's last placement.
"""

from __future__ import annotations

from typing import Any

__all__ = ["GatewayError", "RouterFailure", "engine_error", "router_error"]

_MAX_MESSAGE = 500


class GatewayError(Exception):
    """A request that ends in an OpenAI-style error response."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def invalid(cls, message: str, param: str | None = None, code: str = "invalid_request") -> GatewayError:
        return cls(400, message, param=param, code=code)


class RouterFailure(Exception):
    """A failed router call, as the turn sees it: the gRPC status's code name ("NOT_FOUND"),
    the server's ErrorInfo reason and the field an INVALID_ARGUMENT names, with no gRPC type
    (kvshuttle.gateway.turns.router_port makes them from the client's errors)."""

    def __init__(
        self, code: str, message: str = "", *, reason: str | None = None, field: str | None = None
    ) -> None:
        super().__init__(code, message)
        self.code = code
        self.message = message
        self.reason = reason
        self.field = field


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MAX_MESSAGE else text[: _MAX_MESSAGE - 1] + "…"


def router_error(err: RouterFailure) -> GatewayError:
    """A failed router call as what the client sees."""
    reason = (err.reason or err.code).lower()
    message = _short(err.message) or err.code
    if err.code == "INVALID_ARGUMENT":
        return GatewayError(400, message, param=err.field, code=reason)
    if err.code == "RESOURCE_EXHAUSTED":
        return GatewayError(429, message, type_="rate_limit_error", code=reason)
    if err.code == "UNAVAILABLE":
        return GatewayError(503, f"service unavailable: {message}", type_="server_error", code=reason)
    if err.code == "DEADLINE_EXCEEDED":
        return GatewayError(504, "the router did not answer in time", type_="server_error", code="timeout")
    if err.code == "NOT_FOUND":
        return GatewayError(404, message, code=reason)
    return GatewayError(502, f"router error: {err.code}", type_="server_error", code="router_error")


def engine_message(body: Any) -> str:
    """The message of a vLLM error body ({"error": {...}} or the older {"object": "error", ...})."""
    if isinstance(body, dict):
        inner = body.get("error")
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            return str(inner["message"])
        if isinstance(inner, str):
            return inner
        if isinstance(body.get("message"), str):
            return str(body["message"])
    return ""


def engine_error(role: str, status: int | None, detail: str = "") -> GatewayError:
    """What the client sees when the `role` ("prefill" / "decode") engine failed.

    `status` None: no HTTP answer (connection refused or reset, malformed body)."""
    detail = _short(detail)
    if status in (400, 413, 422):
        # vLLM validated our request: the client's parameters (max_tokens beyond the context,
        # a bad sampling value) or the prompt's length. Say so as a client error.
        return GatewayError(400, detail or f"the {role} engine rejected the request", code="engine_rejected")
    if status == 429:
        return GatewayError(429, detail or f"the {role} engine is overloaded", type_="rate_limit_error")
    what = f"HTTP {status}" if status is not None else "no valid answer"
    message = f"{role} engine failed ({what})" + (f": {detail}" if detail else "")
    return GatewayError(502, message, type_="server_error", code="engine_error")


def engine_timeout(role: str) -> GatewayError:
    return GatewayError(
        504, f"the {role} engine did not answer in time", type_="server_error", code="engine_timeout"
    )
