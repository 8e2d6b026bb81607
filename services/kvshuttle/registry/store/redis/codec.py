"""The Redis store's plumbing (kvshuttle.registry.store.redis.store): how records are written to and read
from Redis hashes, the errors they become, and Redis not answering as UNAVAILABLE."""

from __future__ import annotations

import copy
import functools
import json
import re
import struct
import sys
from array import array
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, ParamSpec, TypeVar, cast

import redis.asyncio as aioredis
import redis.exceptions

from kvshuttle.core.errors import (
    KvshuttleError,
    Unavailable,
)
from kvshuttle.core.nodes import NodeLoad, NodeRole, NodeSpec
from kvshuttle.core.reasons import ErrorReason
from kvshuttle.registry.model import (
    ChangeKind,
    Claim,
    Holder,
    Node,
    Retention,
    Transcript,
)
from kvshuttle.registry.store.errors import (
    already_claimed,
    not_shareable,
    retention_claimed,
    retention_expired,
    retention_not_found,
)

BATCH = 256
MAX_BATCHES = 64
REMOVED_KINDS = {
    ChangeKind.RELEASED,
    ChangeKind.EXPIRED,
    ChangeKind.REPLACED,
    ChangeKind.NODE_LOST,
    ChangeKind.EVICTED,
}


def as_str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def time_arg(value: float) -> str:
    """A time as the scripts store it: the shortest repr that reads back to the same float."""
    return repr(float(value))


def pairs(flat: Sequence[Any]) -> dict[str, bytes]:
    return {as_str(flat[i]): flat[i + 1] for i in range(0, len(flat), 2)}


def holder_json(holder: Holder | None) -> str:
    if holder is None:
        return ""
    return json.dumps([holder.engine_id, holder.side_channel_host, holder.side_channel_port])


def _holder_of(raw: bytes | None) -> Holder | None:
    if not raw:
        return None
    engine, host, port = json.loads(raw)
    return Holder(engine, host, int(port))


# A transcript's record field: key length, digest length, answer chars, then the key, the digest
# and the token ids as little-endian uint32.
_TX_HEAD = struct.Struct("<IIQ")


def transcript_bytes(transcript: Transcript | None) -> bytes:
    """The record's `tx` field (b"" for none)."""
    if transcript is None:
        return b""
    ids = transcript.token_ids
    if ids.itemsize == 4 and sys.byteorder == "little":
        packed = ids.tobytes()
    else:
        packed = struct.pack(f"<{len(ids)}I", *ids)
    key, digest = transcript.lookup_key, transcript.answer_sha256
    return _TX_HEAD.pack(len(key), len(digest), transcript.answer_chars) + key + digest + packed


def _transcript_of(raw: bytes | None) -> Transcript | None:
    if not raw:
        return None
    key_len, digest_len, chars = _TX_HEAD.unpack_from(raw)
    start = _TX_HEAD.size
    key = bytes(raw[start : start + key_len])
    digest = bytes(raw[start + key_len : start + key_len + digest_len])
    body = raw[start + key_len + digest_len :]
    ids: array[int] = array("I")
    if ids.itemsize == 4 and sys.byteorder == "little":
        ids.frombytes(body)
    else:
        ids.extend(struct.unpack(f"<{len(body) // 4}I", body))
    return Transcript(key, ids, digest, chars)


def end_field(model: str, block_size: int, last_hash: int) -> bytes:
    """The tenant's chain-end index field of a chain's last hash (kvshuttle.registry.store.redis.keys)."""
    return b"%s\0%d\0%s" % (model.encode(), block_size, struct.pack("<Q", last_hash))


def key_field(model: str, lookup_key: bytes) -> bytes:
    """The tenant's transcript index field of a transcript's key."""
    return model.encode() + b"\0" + lookup_key


def lookup_args(record: Retention) -> list[str | bytes]:
    """The index and unindex scripts' ARGV for `record`: its name, its chain-end field, its
    transcript-key field and its prompt-end field (b"" for none)."""
    ends = [
        end_field(record.model, record.block_size, record.block_hashes[k - 1]) for k in record.lookup_blocks()
    ]
    end, prompt_end = [*ends, b"", b""][:2]
    key = b"" if record.transcript is None else key_field(record.model, record.transcript.lookup_key)
    return [record.name, end, key, prompt_end]


def spec_json(spec: NodeSpec) -> str:
    return json.dumps(
        {
            "name": spec.name,
            "role": spec.role.value,
            "engine_id": spec.engine_id,
            "http_endpoint": spec.http_endpoint,
            "side_channel_host": spec.side_channel_host,
            "side_channel_port": spec.side_channel_port,
            "agent_endpoint": spec.agent_endpoint,
            "model": spec.model,
            "block_size": spec.block_size,
            "kv_bytes_per_token": spec.kv_bytes_per_token,
            "labels": dict(spec.labels),
        }
    )


def _spec_of(raw: bytes) -> NodeSpec:
    d = json.loads(raw)
    d["role"] = NodeRole(d["role"])
    return NodeSpec(**d)


def load_json(load: NodeLoad) -> str:
    return json.dumps(
        [load.running_requests, load.waiting_requests, load.kv_cache_usage, load.engine_healthy]
    )


def _load_of(raw: bytes) -> NodeLoad:
    running, waiting, usage, healthy = json.loads(raw)
    return NodeLoad(int(running), int(waiting), float(usage), bool(healthy))


def node_of(h: dict[str, bytes]) -> Node:
    return Node(
        spec=_spec_of(h["spec"]),
        incarnation=int(h["inc"]),
        register_time=float(h["rt"]),
        expire_at=float(h["exp"]),
        load=_load_of(h["load"]),
        retained_bytes=int(h.get("rb", b"0")),
        retention_count=int(h.get("count", b"0")),
    )


def _shared_of(raw: bytes | None) -> tuple[Claim, ...]:
    """The record's `sh` field: its shared claims (as lua/lib/retention.lua writes them)."""
    if not raw:
        return ()
    return tuple(
        Claim(cid, holder, float(ctime), float(cexp), lease_expire_at=float(lease))
        for cid, holder, ctime, cexp, lease in json.loads(raw)
    )


def retention_of(h: dict[str, bytes]) -> Retention:
    claim = None
    if "cid" in h:
        claim = Claim(
            as_str(h["cid"]),
            as_str(h["chold"]),
            float(h["ctime"]),
            float(h["cexp"]),
            lease_expire_at=float(h["clease"]),
        )
    hashes: array[int] = array("Q")
    hashes.frombytes(h["bh"])
    return Retention(
        name=as_str(h["name"]),
        node=as_str(h["node"]),
        generation=int(h["gen"]),
        model=as_str(h["model"]),
        block_size=int(h["bs"]),
        num_tokens=int(h["nt"]),
        block_hashes=hashes,
        kv_transfer_params=bytes(h["kp"]),
        kv_bytes=int(h["kvb"]),
        pin_expire_at=float(h["pin"]) if "pin" in h else None,
        create_time=float(h["ct"]),
        expire_at=float(h["exp"]),
        claim=claim,
        holder=_holder_of(h.get("holder")),
        transcript=_transcript_of(h.get("tx")),
        prompt_blocks=int(h.get("pb", b"0")),
        shared=_shared_of(h.get("sh")),
    )


def conversation_of(name: str) -> str:
    return name.rsplit("/", 2)[0]


def tenant_of(name: str) -> str:
    return name.split("/", 2)[1]


def claim_error(name: str, out: Sequence[Any]) -> KvshuttleError:
    """A renew's or a claim's refusal, from its script's {'err', REASON} reply."""
    reason = as_str(out[1])
    if reason == "RETENTION_NOT_FOUND":
        return retention_not_found(name)
    if reason == "RETENTION_CLAIMED":
        return retention_claimed(name)
    if reason == "RETENTION_ALREADY_CLAIMED":
        return already_claimed(name)
    if reason == "RETENTION_NOT_SHAREABLE":
        return not_shareable(name)
    return retention_expired(name)


_P = ParamSpec("_P")
_T = TypeVar("_T")
# Redis not answering (down, restarting, loading its AOF, past the client's timeout), or
# answering that it takes no writes now: a replica (READONLY: a demoted master, or a client still
# on the old address), a master short of in-sync replicas (NOREPLICAS, min-replicas-to-write), a
# Cluster slot without a master (CLUSTERDOWN, MASTERDOWN, or redis-py's own SlotNotCoveredError)
# or being moved (TRYAGAIN). The registry is unavailable, which its callers degrade around, never
# an internal error. Each is refused before the script's first write: it ran whole or not at all.
_STORE_DOWN = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.SlotNotCoveredError,
)
# A Cluster client that could not find where to send the call while the topology changes: its
# redirections ran out (ClusterError "TTL exhausted": MOVED after MOVED during a promotion), or
# rebuilding its slot map failed (RedisClusterException: no startup node answered, the nodes
# disagree on the slots, or the slots are not all covered yet). Nothing was written. The
# RedisClusterException subclasses that mean a command this code built wrongly stay bugs.
_TOPOLOGY_IN_FLUX = (redis.exceptions.ClusterError, redis.exceptions.RedisClusterException)
_BUILT_WRONG = (redis.exceptions.CrossSlotTransactionError, redis.exceptions.InvalidPipelineStack)
# Refusals redis-py has no class for: a ResponseError whose message starts with the code (a
# pipeline rewrites the message: "Command # N (...) of pipeline caused error: CODE ..." from a
# standalone client, "...: ('CODE ...',)" from a Cluster client).
_REFUSED_CODES = ("NOREPLICAS", "MASTERDOWN")
_PIPELINE_REFUSAL = re.compile(r"of pipeline caused error: (?:\(['\"])?(" + "|".join(_REFUSED_CODES) + r")\b")


def _closed_under_the_call(exc: Exception) -> bool:
    """redis-py 6's asyncio connection writing to a socket another task closed meanwhile (its
    Cluster client resets every connection when one node fails, and with a socket timeout the
    write awaits): an AttributeError raised in redis-py's connection module, nowhere else."""
    if not isinstance(exc, AttributeError) or exc.__traceback__ is None:
        return False
    tb = exc.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    return Path(tb.tb_frame.f_code.co_filename).parts[-3:] == ("redis", "asyncio", "connection.py")


def store_down(exc: Exception) -> str | None:
    """What to call `exc` in the answer when it is one of the above (Redis's addresses and
    message stay out of it), else None."""
    if isinstance(exc, _STORE_DOWN):
        return type(exc).__name__
    if isinstance(exc, _TOPOLOGY_IN_FLUX) and not isinstance(exc, _BUILT_WRONG):
        return type(exc).__name__
    if _closed_under_the_call(exc):
        return "ConnectionClosed"
    if isinstance(exc, redis.exceptions.ResponseError):
        if str(exc).startswith(_REFUSED_CODES):
            return str(exc).split(" ", 1)[0]
        if refused := _PIPELINE_REFUSAL.search(str(exc)):
            return refused.group(1)
    return None


def raise_first_error(replies: Sequence[Any]) -> None:
    """A pipeline's first failed command, raised as Redis answered it. A pipeline that raises
    itself (redis-py's standalone one, 6.4) replaces the answer's text with a literal
    "{exception.args}", so a refusal such as NOREPLICAS could no longer be told from a bug:
    writing pipelines execute with raise_on_error=False and raise through this instead."""
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply


def reachable(method: Callable[_P, Coroutine[Any, Any, _T]]) -> Callable[_P, Coroutine[Any, Any, _T]]:
    """`method`, with Redis not answering or not taking writes raised as Unavailable
    (UNAVAILABLE): the operation's script either ran whole on the server or not at all; a retry
    under its request id is safe."""

    @functools.wraps(method)
    async def call(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        try:
            return await method(*args, **kwargs)
        except Exception as exc:
            what = store_down(exc)
            if what is None:
                raise
            raise Unavailable(
                f"the registry's Redis did not answer or took no writes ({what}): retry",
                reason=ErrorReason.UNAVAILABLE,
            ) from None

    return call


# A standalone or Sentinel-discovered master (aioredis.Redis) or a Cluster (every script and
# MULTI-less pipeline here is Cluster-safe: each script's keys share one hash slot).
RedisClient = aioredis.Redis | aioredis.RedisCluster


def scripting(client: RedisClient) -> aioredis.Redis:
    """redis-py types register_script for Redis only; a RedisCluster's works the same (EVALSHA
    routed by its keys' slot)."""
    return cast("aioredis.Redis", client)


def copy_retention(retention: Retention) -> Retention:
    """A snapshot callers may keep (the store never mutates a record it handed out)."""
    return copy.copy(retention)
