"""Which exceptions of the Redis client are the store being unreachable (UNAVAILABLE) and which
stay what they are: a redis-py race is mapped by where it was raised, never by its type alone."""

from __future__ import annotations

from typing import Any

import pytest
import redis.exceptions

from kvshuttle.registry.store.redis.codec import raise_first_error, store_down


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


def test_a_refusal_a_cluster_pipeline_rewrote_is_still_the_store_refusing() -> None:
    """redis-py's ClusterPipeline puts "Command # N (...) of pipeline caused error:" and the
    original args before the code. (Its standalone pipeline loses the code altogether: redis-py
    6.4 writes the literal text "{exception.args}".)"""
    clustered = redis.exceptions.ResponseError(
        "Command # 2 (EVALSHA abc 1 k) of pipeline caused error: ('MASTERDOWN Link with MASTER is down',)"
    )
    assert store_down(clustered) == "MASTERDOWN"
    assert store_down(redis.exceptions.ResponseError("NOREPLICAS Not enough good replicas")) == "NOREPLICAS"
    assert store_down(redis.exceptions.ResponseError("WRONGTYPE Operation against a key")) is None


@pytest.mark.parametrize(
    "raised",
    [
        # _execute_command after its redirections ran out: MOVED after MOVED during a promotion.
        redis.exceptions.ClusterError("TTL exhausted."),
        # initialize(): rebuilding the slot map while the topology changes.
        redis.exceptions.RedisClusterException("All slots are not covered after query all startup_nodes."),
        redis.exceptions.RedisClusterException("startup_nodes could not agree on a valid slots cache"),
        redis.exceptions.RedisClusterException("Redis Cluster cannot be connected."),
    ],
)
def test_a_cluster_client_lost_in_a_failover_is_the_store_down(raised: Exception) -> None:
    assert store_down(raised) == type(raised).__name__


def test_a_cluster_command_built_wrongly_stays_a_bug() -> None:
    assert store_down(redis.exceptions.CrossSlotTransactionError("keys in different slots")) is None
    assert store_down(redis.exceptions.InvalidPipelineStack("bad stack")) is None


async def test_a_writing_pipeline_keeps_the_refusal_redis_answered(redis_client: Any) -> None:
    """A master short of in-sync replicas (min-replicas-to-write) refuses a pipeline's write with
    NOREPLICAS. Raised by redis-py's standalone pipeline its text is lost; read back with
    raise_on_error=False and raised as answered, it is the store refusing writes."""
    await redis_client.config_set("min-replicas-to-write", 1)
    try:
        pipe = redis_client.pipeline(transaction=False)
        pipe.execute_command("UNLINK", "k")
        with pytest.raises(redis.exceptions.ResponseError) as annotated:
            await pipe.execute()
        pipe = redis_client.pipeline(transaction=False)
        pipe.execute_command("UNLINK", "k")
        replies = await pipe.execute(raise_on_error=False)
        with pytest.raises(redis.exceptions.ResponseError) as answered:
            raise_first_error(replies)
    finally:
        await redis_client.config_set("min-replicas-to-write", 0)
    assert store_down(annotated.value) is None  # what the pipeline itself raises: unrecognisable
    assert store_down(answered.value) == "NOREPLICAS"
    raise_first_error([1, b"ok", None])  # nothing failed: nothing raised
