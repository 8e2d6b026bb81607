"""The OpenAI request surface: what a client request may carry and what of it goes on to the
engines (kvshuttle.gateway.openai.responses translates decode's answer back).

The engines only ever see `/v1/completions` with a token-id prompt, so parameters are copied
by allow-list: a client can never smuggle `kv_transfer_params` (or anything else that steers
the KV transfer) to an engine. What the gateway cannot honour faithfully through a
token-id completion (several choices, beam search, chat logprobs, prompt logprobs,
truncation, echo) is refused with a 400 naming the parameter, not silently changed. Tools are
the gateway's: rendered into the prompt by the chat template, forced calls constrained by the
JSON schema vLLM would use, and decode's output parsed (kvshuttle.gateway.parsing).

`cache_salt` is never forwarded as sent: the engines get the tenant's salt, which folds the
client's in (kvshuttle.gateway.prompts.salts), so a client can partition its own tenant's cache but never
reach another tenant's.

Text `stop` strings are passed through, with a cost: vLLM finds stop strings in its front end
and then *aborts* the request in the engine, and an aborted decode retains nothing, so the
conversation's next turn recomputes its whole prompt. Use `stop_token_ids` (or EOS) to keep
reuse; the log line says `stop_strings=true` for such turns.
"""

from __future__ import annotations

import json
import math
from array import array
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from kvshuttle.core.errors import InvalidArgument
from kvshuttle.core.limits import MAX_ID_LENGTH
from kvshuttle.core.names import check_id
from kvshuttle.gateway.errors import GatewayError
from kvshuttle.gateway.parsing import ToolRequest, parse_tool_request
from kvshuttle.gateway.prompts.chat_template import RESERVED_TEMPLATE_KWARGS
from kvshuttle.gateway.prompts.salts import client_salt_problem

Kind = Literal["chat", "completions"]

CONVERSATION_HEADER = "X-Conversation-ID"
# vLLM's request session id (a body `session_id` or this header; llm-d's `x-session-id` is the
# same header, HTTP names being case-insensitive): a conversation id for any client that sends one.
SESSION_HEADER = "X-Session-ID"
# Seconds the client expects before the conversation's next turn (a tool running, a user reading):
# the router may move the turn's KV next to the next prefill meanwhile (prefetch).
THINK_TIME_HEADER = "X-Kvshuttle-Expected-Think-Time"
# The most a think-time hint may say (a day).
MAX_THINK_TIME_S = 86_400.0

# Copied from the client's request to the decode engine as they are (vLLM validates them).
DECODE_PARAMS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "allowed_token_ids",
    "bad_words",
    "logit_bias",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "structured_outputs",
    "response_format",
    "priority",
    "user",
    "vllm_xargs",
    "length_penalty",
)
# What prefill gets of them: its one sampled token is thrown away, so only what is harmless.
# Never `stop` (a matched stop string aborts prefill: it would keep no KV for decode) nor
# `min_tokens` (more than max_tokens=1 is a validation error).
PREFILL_PARAMS = ("temperature", "top_p", "top_k", "min_p", "seed", "priority", "user")

# Accepted and not forwarded: either the gateway handles them, or they change nothing here.
_HANDLED = frozenset(
    {
        "model",
        "messages",
        "prompt",
        "stream",
        "stream_options",
        "max_tokens",
        "max_completion_tokens",
        "n",
        "return_token_ids",
        "conversation_id",
        "session_id",
        "chat_template_kwargs",
        "add_generation_prompt",
        "add_special_tokens",
        "tool_choice",
        "parallel_tool_calls",
        "metadata",
        "store",
        "service_tier",
        "request_id",
        "reasoning_effort",
        "include_reasoning",
        "best_of",
        "echo",
        "suffix",
        "logprobs",
        "top_logprobs",
        "tools",
        "documents",
        "continue_final_message",
        "use_beam_search",
        "truncate_prompt_tokens",
        "prompt_logprobs",
        "chat_template",
        "kv_transfer_params",
        "cache_salt",
    }
)


@dataclass(slots=True)
class TurnRequest:
    """One client request, validated, in the gateway's terms."""

    kind: Kind
    model: str
    stream: bool
    include_usage: bool
    return_token_ids: bool
    conversation_id: str | None
    # To the decode engine (the client's sampling), and to prefill (PREFILL_PARAMS of them).
    decode_params: dict[str, Any]
    prefill_params: dict[str, Any]
    # chat: normalized messages for the template; completions: a text or a token-id prompt.
    messages: list[dict[str, Any]] = field(default_factory=list)
    add_generation_prompt: bool = True
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_special_tokens: bool = False
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    stop_strings: bool = False
    # The client's own `cache_salt` (checked as vLLM checks it): folded into the tenant's salt.
    cache_salt: str | None = None
    # chat: the request's tools and tool_choice; None without tools.
    tools: ToolRequest | None = None
    # chat: whether the answer carries the reasoning a reasoning parser split out (vLLM's).
    include_reasoning: bool = True
    # Body fields the gateway neither uses nor forwards (logged, not refused: OpenAI clients
    # send many that mean nothing to vLLM).
    ignored: list[str] = field(default_factory=list)


def _bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise GatewayError.invalid(f"'{key}' must be a boolean", key)
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def expected_think_time(header: str | None) -> float | None:
    """The X-Kvshuttle-Expected-Think-Time header's seconds; None when absent."""
    if header is None or header == "":
        return None
    try:
        seconds = float(header)
    except ValueError:
        seconds = math.nan
    if not 0 <= seconds <= MAX_THINK_TIME_S:  # NaN and infinities fail too
        raise GatewayError.invalid(
            f"the {THINK_TIME_HEADER} header must be seconds within 0..{MAX_THINK_TIME_S:g}",
            THINK_TIME_HEADER,
        )
    return seconds


def conversation_id(
    body: Mapping[str, Any], conversation_header: str | None, session_header: str | None = None
) -> str | None:
    """The conversation this request continues, in one precedence: kvshuttle's own (the body's
    `conversation_id`, which vLLM's multi-turn benchmark sends, or the X-Conversation-ID header),
    else the session id vLLM and llm-d read (the body's `session_id` or the X-Session-ID header,
    else `vllm_xargs.session_id`); None for none of them. A body field and its header that
    disagree are refused; kvshuttle's id wins over a session id (a client may send both for
    different hops)."""
    found = _id_pair(body, "conversation_id", conversation_header, CONVERSATION_HEADER)
    field = "conversation_id"
    if found is None:
        found = _id_pair(body, "session_id", session_header, SESSION_HEADER)
        field = "session_id"
    xargs = body.get("vllm_xargs")
    if found is None and isinstance(xargs, Mapping) and "session_id" in xargs:
        # vLLM's compatibility fallback for clients that pass it as an extra argument.
        found = _id_pair(xargs, "session_id", None, SESSION_HEADER)
        field = "vllm_xargs.session_id"
    if found is None:
        return None
    try:
        return check_id(found, field)
    except InvalidArgument as exc:
        raise GatewayError.invalid(
            f"invalid {field.replace('_', ' ')}: {exc.message.removeprefix(f'{field}: ')} "
            f"(1..{MAX_ID_LENGTH} characters of A-Z a-z 0-9 . _ ~ : -)",
            field,
            code="invalid_conversation_id",
        ) from None


def _id_pair(body: Mapping[str, Any], key: str, header: str | None, header_name: str) -> str | None:
    """The body's `key` (a string, or an integer read as its digits) or else the header; the
    two must agree when both are sent; "" counts as absent."""
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        if not _is_int(value):
            raise GatewayError.invalid(f"'{key}' must be a string", key)
        value = str(value)
    if header and value and header != value:
        raise GatewayError.invalid(f"'{key}' and the {header_name} header disagree", key)
    return value or header or None


def _refuse(body: Mapping[str, Any], key: str, ok: Any, why: str) -> None:
    value = body.get(key)
    if value is not None and value not in (ok, [], False):
        raise GatewayError.invalid(f"'{key}' is not supported by the kvshuttle gateway: {why}", key)


def _text_parts(content: list[Any], index: int) -> list[str]:
    texts: list[str] = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
            continue
        if (
            not isinstance(part, dict)
            or part.get("type", "text") != "text"
            or not isinstance(part.get("text"), str)
        ):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise GatewayError.invalid(
                f"messages[{index}].content: only text parts are supported (got {kind!r})",
                f"messages[{index}].content",
            )
        texts.append(str(part["text"]))
    return texts


def normalize_messages(raw: Any, content_format: str) -> list[dict[str, Any]]:
    """Messages as vLLM hands them to the template (its "string" or "openai" content format):
    None content is "", text parts are joined with newlines (or kept as parts), assistant
    tool-call arguments are JSON-decoded, and only the fields vLLM keeps are kept."""
    if not isinstance(raw, list) or not raw:
        raise GatewayError.invalid("'messages' must be a non-empty list", "messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(raw):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise GatewayError.invalid(
                f"messages[{i}] must be an object with a string 'role'", f"messages[{i}]"
            )
        content = message.get("content")
        texts: list[str]
        if content is None:
            texts = []
        elif isinstance(content, str):
            texts = [content]
        elif isinstance(content, list):
            texts = _text_parts(content, i)
        else:
            raise GatewayError.invalid(
                f"messages[{i}].content must be a string or a list of parts", f"messages[{i}].content"
            )
        role = message["role"]
        parsed: dict[str, Any] = {"role": role}
        if content_format == "openai":
            parsed["content"] = [{"type": "text", "text": t} for t in texts]
        else:
            parsed["content"] = "\n".join(texts)
        if role == "assistant":
            calls = message.get("tool_calls")
            if isinstance(calls, list) and calls:
                parsed["tool_calls"] = [_tool_call(c, i) for c in calls]
            reasoning = message.get("reasoning", message.get("reasoning_content"))
            if isinstance(reasoning, str):
                parsed["reasoning"] = parsed["reasoning_content"] = reasoning
        elif role == "tool" and isinstance(message.get("tool_call_id"), str):
            parsed["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            parsed["name"] = message["name"]
        out.append(parsed)
    return out


def _tool_call(call: Any, index: int) -> dict[str, Any]:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise GatewayError.invalid(f"messages[{index}].tool_calls entries must be objects", "tool_calls")
    call = json.loads(json.dumps(call))  # a copy the template cannot reach back through
    function = call["function"]
    arguments = function.get("arguments")
    if isinstance(arguments, str) and arguments:
        try:
            decoded = json.loads(arguments)
        except json.JSONDecodeError:
            decoded = {}
        function["arguments"] = decoded if isinstance(decoded, dict) else {}
    elif not isinstance(arguments, dict):
        function["arguments"] = {}
    return dict(call)


def _prompt(body: Mapping[str, Any]) -> tuple[str | None, list[int] | None]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise GatewayError.invalid("'prompt' must not be empty", "prompt")
        return prompt, None
    if isinstance(prompt, list) and prompt and _token_ids(prompt):
        return None, list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise GatewayError.invalid(
            "a batch of prompts is not supported: send one prompt per request", "prompt"
        )
    raise GatewayError.invalid("'prompt' must be a string or a list of token ids", "prompt")


def _token_ids(values: list[Any]) -> bool:
    """Whether `values` are token ids: ints (bools excluded) in uint32 range. Checked by type
    and range in C (map, set; array's conversion, ~4x faster than min and max), not per
    element in Python: prompts run to 100k+ ids."""
    if set(map(type, values)) != {int}:
        return False
    try:
        array("I", values)  # 4-byte unsigned on every platform CPython supports here
    except OverflowError:
        return False
    return True


def _check_supported(body: Mapping[str, Any]) -> None:
    """Refuse what a token-id completion on two engines cannot honour faithfully."""
    if "kv_transfer_params" in body:
        raise GatewayError.invalid(
            "'kv_transfer_params' is set by the gateway, not by clients", "kv_transfer_params"
        )
    _refuse(body, "n", 1, "one choice per request (a turn keeps one sequence's KV)")
    _refuse(body, "best_of", 1, "one choice per request")
    _refuse(body, "use_beam_search", False, "beam search keeps several sequences")
    _refuse(
        body, "truncate_prompt_tokens", None, "the prompt's token ids are fixed before the engines see them"
    )
    _refuse(body, "prompt_logprobs", None, "decode reads the prompt's KV instead of computing it")
    _refuse(body, "echo", False, "the prompt is sent as token ids")
    _refuse(body, "suffix", "", "not supported by vLLM either")
    _refuse(body, "chat_template", None, "templates are configured per model")
    _refuse(body, "documents", None, "documents are not rendered")
    _refuse(body, "continue_final_message", False, "not implemented")


def _chat_fields(
    request: TurnRequest, body: Mapping[str, Any], content_format: str, tool_parser: str | None
) -> None:
    if body.get("logprobs") or body.get("top_logprobs"):
        raise GatewayError.invalid(
            "'logprobs' is not supported for chat by the kvshuttle gateway", "logprobs"
        )
    request.messages = normalize_messages(body.get("messages"), content_format)
    request.include_reasoning = _bool(body, "include_reasoning", True)
    request.tools = parse_tool_request(body, tool_parser=tool_parser)
    if request.tools is not None:
        extra = request.tools.decode_params()
        if "structured_outputs" in extra:
            # As vLLM: a forced call's JSON schema replaces the client's structured output.
            request.decode_params.pop("response_format", None)
        request.decode_params.update(extra)
    request.add_generation_prompt = _bool(body, "add_generation_prompt", True)
    request.add_special_tokens = _bool(body, "add_special_tokens", False)
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise GatewayError.invalid("'chat_template_kwargs' must be an object", "chat_template_kwargs")
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if reserved:
            raise GatewayError.invalid(
                f"'chat_template_kwargs' may not set {', '.join(reserved)}", "chat_template_kwargs"
            )
        request.template_kwargs = dict(kwargs)


def parse_request(
    kind: Kind,
    body: Any,
    *,
    models: Collection[str],
    default_max_tokens: int | None,
    content_format: Mapping[str, str],
    conversation_header: str | None = None,
    session_header: str | None = None,
    tool_parsers: Mapping[str, str | None] | None = None,
) -> TurnRequest:
    """Validate a /v1/chat/completions or /v1/completions body. Raises GatewayError (400, 404).
    The conversation: conversation_id(body, conversation_header, session_header)."""
    if not isinstance(body, dict):
        raise GatewayError.invalid("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise GatewayError.invalid("'model' is required", "model")
    if model not in models:
        raise GatewayError(
            404, f"The model '{model[:200]}' does not exist", param="model", code="model_not_found"
        )
    _check_supported(body)

    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise GatewayError.invalid("'stream_options' must be an object", "stream_options")
    include_usage = bool(stream and options and options.get("include_usage"))

    max_tokens = body.get("max_completion_tokens") if kind == "chat" else None
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = default_max_tokens
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
        raise GatewayError.invalid("'max_tokens' must be a positive integer", "max_tokens")

    decode = {key: body[key] for key in DECODE_PARAMS if body.get(key) is not None}
    if max_tokens is not None:
        decode["max_tokens"] = max_tokens
    stop = decode.get("stop")
    stop_strings = bool(stop) and isinstance(stop, str | list)
    prefill = {key: decode[key] for key in PREFILL_PARAMS if key in decode}

    request = TurnRequest(
        kind=kind,
        model=model,
        stream=stream,
        include_usage=include_usage,
        return_token_ids=_bool(body, "return_token_ids", False),
        conversation_id=conversation_id(body, conversation_header, session_header),
        decode_params=decode,
        prefill_params=prefill,
        stop_strings=stop_strings,
        ignored=sorted(k for k in body if k not in _HANDLED and k not in DECODE_PARAMS)[:20],
    )
    salt = body.get("cache_salt")
    if salt is not None:
        problem = client_salt_problem(salt)
        if problem is not None:
            raise GatewayError.invalid(f"'cache_salt' {problem}", "cache_salt")
        request.cache_salt = salt
    if kind == "chat":
        _chat_fields(request, body, content_format.get(model, "string"), (tool_parsers or {}).get(model))
    else:
        logprobs = body.get("logprobs")
        if logprobs is not None:
            decode["logprobs"] = logprobs
        request.add_special_tokens = _bool(body, "add_special_tokens", True)
        request.prompt_text, request.prompt_ids = _prompt(body)
    return request
