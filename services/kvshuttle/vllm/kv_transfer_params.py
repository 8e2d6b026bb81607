"""vLLM's `kv_transfer_params` JSON object <-> kvshuttle.vllm.v1.KvTransferParams.

Known fields map one to one; every other key goes into `extra` and comes back out unchanged,
so a newer vLLM's fields pass through kvshuttle untouched, bounded in keys and bytes
(`check_extra`, kvshuttle.core.limits). vLLM reads every field with
`.get()`, so JSON null and an absent key are the same to it: null becomes an unset field,
and an unset field is left out of the dict.
"""

from __future__ import annotations

from array import array
from typing import Any

from google.protobuf import json_format

from kvshuttle.core.errors import InvalidArgument
from kvshuttle.core.limits import MAX_KV_TRANSFER_PARAMS_EXTRA_BYTES, MAX_KV_TRANSFER_PARAMS_EXTRA_KEYS
from kvshuttle.vllm.v1.kv_transfer_params_pb2 import BlockIdList, KvTransferParams

_BOOL = ("do_remote_prefill", "do_remote_decode")
_STR = ("remote_engine_id", "remote_request_id", "remote_host", "transfer_mode")
_UINT = (
    "remote_port",
    "tp_size",
    "dcp_size",
    "pp_size",
    "remote_num_tokens",
    "remote_registration_generation",
    "remote_prefill_cached_tokens",
)
_FLOAT = ("remote_blocks_expiry_time",)
_KNOWN = frozenset((*_BOOL, *_STR, *_UINT, *_FLOAT, "remote_block_ids"))
_UINT32_MAX = 2**32 - 1


def _block_groups(value: Any, field: str) -> list[list[int]]:
    # vLLM sends one list per KV-cache group; older versions sent one flat list.
    if not isinstance(value, list):
        raise InvalidArgument(field, "must be a list")
    groups = value if value and all(isinstance(g, list) for g in value) else [value]
    for group in groups:
        if not isinstance(group, list) or not _uint32s(group):
            raise InvalidArgument(field, "block ids must be non-negative integers")
    return groups


def _uint32s(values: list[Any]) -> bool:
    """Whether `values` are ints (bools excluded) in uint32 range: by type and range in C (map,
    set, array's conversion), not per element in Python: a long sequence has thousands of
    block ids."""
    if not values:
        return True
    if set(map(type, values)) != {int}:
        return False
    try:
        array("I", values)  # 4-byte unsigned on every platform CPython supports here
    except OverflowError:
        return False
    return True


def from_vllm(params: dict[str, Any], field: str = "kv_transfer_params") -> KvTransferParams:
    """Parse vLLM's dict. Raises InvalidArgument naming the bad key."""
    if not isinstance(params, dict):
        raise InvalidArgument(field, "must be a JSON object")
    msg = KvTransferParams()
    extra: dict[str, Any] = {}
    for key, value in params.items():
        path = f"{field}.{key}"
        if key not in _KNOWN:
            extra[key] = value
            continue
        if value is None:
            continue
        if key in _BOOL:
            if not isinstance(value, bool):
                raise InvalidArgument(path, "must be a boolean")
            setattr(msg, key, value)
        elif key in _STR:
            if not isinstance(value, str):
                raise InvalidArgument(path, "must be a string")
            setattr(msg, key, value)
        elif key in _UINT:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgument(path, "must be a non-negative integer")
            if key != "remote_registration_generation" and value > _UINT32_MAX:
                raise InvalidArgument(path, "out of range")
            setattr(msg, key, value)
        elif key in _FLOAT:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidArgument(path, "must be a number")
            setattr(msg, key, float(value))
        else:
            for group in _block_groups(value, path):
                msg.remote_block_ids.append(BlockIdList(block_ids=group))
    if extra:
        if len(extra) > MAX_KV_TRANSFER_PARAMS_EXTRA_KEYS:
            raise InvalidArgument(
                f"{field}.extra",
                f"more than {MAX_KV_TRANSFER_PARAMS_EXTRA_KEYS} fields kvshuttle does not know",
            )
        try:
            msg.extra.update(extra)
        except (ValueError, TypeError) as exc:
            raise InvalidArgument(field, f"unsupported value in an unknown field: {exc}") from exc
        check_extra(msg, field)
    return msg


def check_extra(msg: KvTransferParams, field: str) -> None:
    """`extra` (the fields kvshuttle passes through unread) within its bounds: at most
    MAX_KV_TRANSFER_PARAMS_EXTRA_KEYS keys and MAX_KV_TRANSFER_PARAMS_EXTRA_BYTES serialized.
    InvalidArgument naming `{field}.extra` otherwise."""
    if not msg.HasField("extra"):
        return
    if len(msg.extra.fields) > MAX_KV_TRANSFER_PARAMS_EXTRA_KEYS:
        raise InvalidArgument(
            f"{field}.extra", f"more than {MAX_KV_TRANSFER_PARAMS_EXTRA_KEYS} fields kvshuttle does not know"
        )
    if msg.extra.ByteSize() > MAX_KV_TRANSFER_PARAMS_EXTRA_BYTES:
        raise InvalidArgument(
            f"{field}.extra",
            f"fields kvshuttle does not know take more than {MAX_KV_TRANSFER_PARAMS_EXTRA_BYTES} bytes",
        )


def to_vllm(msg: KvTransferParams) -> dict[str, Any]:
    """The dict vLLM takes: the two flags always, other fields only when set, `extra` merged."""
    out: dict[str, Any] = {key: getattr(msg, key) for key in _BOOL}
    if msg.remote_block_ids:
        out["remote_block_ids"] = [list(g.block_ids) for g in msg.remote_block_ids]
    for key in (*_STR, *_UINT, *_FLOAT):
        if msg.HasField(key):  # type: ignore[arg-type]
            out[key] = getattr(msg, key)
    if msg.HasField("extra"):
        for key, value in json_format.MessageToDict(msg.extra).items():
            out.setdefault(key, _restore_ints(value))
    return out


def _restore_ints(value: Any) -> Any:
    # google.protobuf.Struct stores numbers as doubles; give integral ones back as ints so
    # vLLM sees the same JSON it sent.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _restore_ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_restore_ints(v) for v in value]
    return value
