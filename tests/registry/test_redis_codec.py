"""Which exceptions of the Redis client are the store being unreachable (UNAVAILABLE) and which
stay what they are: a redis-py race is mapped by where it was raised, never by its type alone."""

from __future__ import annotations

from typing import Any

from kvshuttle.registry.store.redis.codec import store_down


def attribute_error_raised_in(filename: str) -> AttributeError:
    code = compile("def write(writer):\n    writer.writelines([])\n", filename, "exec")
    namespace: dict[str, Any] = {}
    exec(code, namespace)
    try:
        namespace["write"](None)
    except AttributeError as exc:
        return exc
    raise AssertionError("no AttributeError")


def test_a_connection_redis_py_closed_under_the_call_is_the_store_down() -> None:
    raised = attribute_error_raised_in("/venv/lib/python3.11/site-packages/redis/asyncio/connection.py")
    assert store_down(raised) == "ConnectionClosed"


def test_an_attribute_error_anywhere_else_stays_a_bug() -> None:
    ours = "/work/services/kvshuttle/registry/store/redis/claims.py"
    assert store_down(attribute_error_raised_in(ours)) is None
    assert store_down(attribute_error_raised_in("/venv/site-packages/redis/asyncio/cluster.py")) is None
    assert store_down(AttributeError("no traceback")) is None
