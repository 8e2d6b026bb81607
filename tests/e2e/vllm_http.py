"""Minimal stdlib HTTP helpers for talking to a real vLLM server in tests (no client deps)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


class HttpError(AssertionError):
    """A non-2xx answer; the message holds the body."""


def _request(url: str, body: dict[str, Any]) -> urllib.request.Request:
    return urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )


def post_json(url: str, body: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    """POST `body`, return the decoded JSON answer."""
    try:
        with urllib.request.urlopen(_request(url, body), timeout=timeout) as resp:
            answer: dict[str, Any] = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise HttpError(f"{url}: HTTP {exc.code}: {exc.read().decode(errors='replace')}") from None
    return answer


def post_sse(url: str, body: dict[str, Any], timeout: float = 120.0) -> list[dict[str, Any]]:
    """POST a streaming request; the `data:` events in order, decoded, up to (not including) [DONE].

    Raises when the stream ends without `[DONE]` or carries an error event.
    """
    events: list[dict[str, Any]] = []
    try:
        with urllib.request.urlopen(_request(url, {**body, "stream": True}), timeout=timeout) as resp:
            for raw in resp:
                line = raw.decode().rstrip("\r\n")
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    return events
                event: dict[str, Any] = json.loads(data)
                if "error" in event and "choices" not in event:
                    raise HttpError(f"{url}: error event {event}")
                events.append(event)
    except urllib.error.HTTPError as exc:
        raise HttpError(f"{url}: HTTP {exc.code}: {exc.read().decode(errors='replace')}") from None
    raise HttpError(f"{url}: stream ended without [DONE] after {len(events)} events")


def finish_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events with a choice whose finish_reason is set."""
    return [e for e in events if any(c.get("finish_reason") is not None for c in e.get("choices") or ())]
