"""What the property tests share: real servers on their own event loop in a thread (hypothesis
drives sync tests; the servers keep one loop across examples), a full snapshot of a domain
object's state (every record and field, not counts), and the strategies that make near-valid and
hostile values."""

from __future__ import annotations

import array
import asyncio
import enum
import threading
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Future
from typing import Any, TypeVar

import grpc
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from kvshuttle.client.errors import KvshuttleRpcError

T = TypeVar("T")

# Deterministic and bounded: CI runs the same examples every time, in seconds.
FUZZ = settings(
    max_examples=60,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    database=None,
)
NEVER = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})


class LoopThread:
    """An event loop in a daemon thread; `run(coro)` runs a coroutine there and waits."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Awaitable[T], timeout: float = 30) -> T:
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]
        return future.result(timeout)

    def call(self, fn: Callable[[], T]) -> T:
        """`fn()` on the loop's thread, between its callbacks (a consistent view of its state)."""

        async def inside() -> T:
            return fn()

        return self.run(inside())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


def state_of(value: Any, _seen: set[int] | None = None) -> Any:
    """A plain, comparable copy of everything reachable from `value`'s fields."""
    seen = set() if _seen is None else _seen
    if value is None or isinstance(value, str | bytes | int | float | bool | enum.Enum):
        return value
    if isinstance(value, array.array):
        return (value.typecode, value.tobytes())
    if isinstance(value, np.ndarray):
        return (str(value.dtype), value.tobytes())
    if id(value) in seen:
        return "<cycle>"
    seen.add(id(value))
    if isinstance(value, Mapping):
        return sorted(((repr(k), state_of(v, seen)) for k, v in value.items()), key=lambda kv: kv[0])
    if isinstance(value, list | tuple):
        return [state_of(v, seen) for v in value]
    if isinstance(value, set | frozenset):
        return sorted(repr(state_of(v, seen)) for v in value)
    if isinstance(value, asyncio.Event | asyncio.Lock | asyncio.Task | asyncio.Future):
        return type(value).__name__
    fields: dict[str, Any] = {}
    for cls in type(value).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if hasattr(value, name):
                fields[name] = getattr(value, name)
    fields.update(getattr(value, "__dict__", {}))
    if not fields:
        return repr(type(value))
    return (type(value).__name__, sorted((k, state_of(v, seen)) for k, v in fields.items()))


# Calls made and their codes, over the session (printed at its end by tests/fuzz/conftest.py).
CALLS: dict[str, int] = {}


def outcome(call: Callable[[], Any]) -> grpc.StatusCode:
    """Make the call; its status code (OK when it returned). A status that should never be is
    raised as an AssertionError with the server's details."""
    code = _outcome(call)
    CALLS[code.name] = CALLS.get(code.name, 0) + 1
    return code


def _outcome(call: Callable[[], Any]) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as err:
        code = err.code()
        assert code not in NEVER, KvshuttleRpcError.from_rpc_error(err)
        return code
    return grpc.StatusCode.OK


# -- values -------------------------------------------------------------------------------------------


def mostly(valid: st.SearchStrategy[T], hostile: st.SearchStrategy[T]) -> st.SearchStrategy[T]:
    """Valid three times in four: a request with several fields still often gets past the first
    check, to the ones behind it."""
    return st.one_of(valid, valid, valid, hostile)


# Non-ASCII digits on purpose: a name takes ASCII digits only.
SEGMENT = mostly(
    st.sampled_from(["acme", "c1", "d0", "p0", "t"]),
    st.sampled_from(["x" * 129, "", "a/b", "é", "²", "\u0661", "\uff11", "-x"]),
)
GENERATION = mostly(
    st.sampled_from(["1", "2", "3"]), st.sampled_from(["0", "²", "99999999999999999999999", "-1"])
)
NAME = st.one_of(
    st.builds(lambda a, b: f"tenants/{a}/conversations/{b}", SEGMENT, SEGMENT),
    st.builds(lambda a, b, g: f"tenants/{a}/conversations/{b}/retentions/{g}", SEGMENT, SEGMENT, GENERATION),
    st.builds(lambda a: f"tenants/{a}", SEGMENT),
    st.builds(lambda a: f"nodes/{a}", SEGMENT),
    st.text(max_size=40),
)
UINT64 = mostly(st.integers(0, 70_000), st.sampled_from([2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1]))
UINT32 = mostly(st.integers(0, 70_000), st.sampled_from([2**31 - 1, 2**32 - 1]))
INT32 = mostly(st.integers(0, 200), st.sampled_from([-5, -(2**31), 2**31 - 1]))
SECONDS = mostly(st.integers(1, 300), st.sampled_from([-5, 0, -(2**62), 2**40, 2**62, 315_537_897_600]))
NANOS = mostly(st.just(0), st.sampled_from([-1, 1_000_000_000, 2**31 - 1, 999_999_999]))
TEXT = mostly(
    st.sampled_from(["", "m", "engine-d0", "127.0.0.1", "http://127.0.0.1:8000"]), st.text(max_size=300)
)
