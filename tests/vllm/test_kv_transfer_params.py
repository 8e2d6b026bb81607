"""vLLM's kv_transfer_params dict <-> KvTransferParams: known fields typed, unknown ones kept."""

from __future__ import annotations

import pytest

from kvshuttle.core.errors import InvalidArgument
from kvshuttle.core.limits import MAX_KV_TRANSFER_PARAMS_EXTRA_KEYS
from kvshuttle.vllm.kv_transfer_params import check_extra, from_vllm, to_vllm
from kvshuttle.vllm.v1.kv_transfer_params_pb2 import KvTransferParams


def test_kv_transfer_params_round_trip() -> None:
    vllm = {
        "do_remote_prefill": False,
        "do_remote_decode": True,
        "remote_block_ids": [[1, 2, 3, 4]],
        "remote_engine_id": "eng",
        "remote_request_id": "cmpl-1",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
        "remote_num_tokens": 500,
        "remote_blocks_expiry_time": None,
        "transfer_mode": "pull",
        "remote_prefill_cached_tokens": 0,
        "from_the_future": {"a": [1, 2.5], "b": None},
    }
    params = from_vllm(vllm)
    assert params.remote_port == 5600
    assert not params.HasField("remote_blocks_expiry_time")
    assert params.HasField("remote_prefill_cached_tokens")
    assert "from_the_future" in params.extra.fields
    expected = {k: v for k, v in vllm.items() if v is not None}
    assert to_vllm(params) == expected


def test_kv_transfer_params_flat_block_list_and_errors() -> None:
    assert [list(g.block_ids) for g in from_vllm({"remote_block_ids": [5, 6]}).remote_block_ids] == [[5, 6]]
    with pytest.raises(InvalidArgument, match="remote_port"):
        from_vllm({"remote_port": "not a port"})
    with pytest.raises(InvalidArgument, match="remote_block_ids"):
        from_vllm({"remote_block_ids": [[1], "x"]})


def test_seen_on_the_cpu_build_round_trips() -> None:
    # P's turn-1 answer as the CPU build of vLLM 0.32 returned it (DESIGN.md).
    seen = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[1, 2, 3, 4]],
        "remote_engine_id": "e-p",
        "remote_request_id": "cmpl-1",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": 500,
        "remote_blocks_expiry_time": None,
        "transfer_mode": "pull",
        "remote_prefill_cached_tokens": 0,
    }
    assert to_vllm(from_vllm(seen)) == {k: v for k, v in seen.items() if v is not None}


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"do_remote_decode": "yes"}, "kv_transfer_params.do_remote_decode"),
        ({"remote_num_tokens": -1}, "kv_transfer_params.remote_num_tokens"),
        ({"remote_port": 2**40}, "kv_transfer_params.remote_port"),
        ({"remote_blocks_expiry_time": "soon"}, "kv_transfer_params.remote_blocks_expiry_time"),
        ({"remote_block_ids": [[-1]]}, "kv_transfer_params.remote_block_ids"),
        ({"remote_block_ids": [[1, 2**32]]}, "kv_transfer_params.remote_block_ids"),
        ({"remote_block_ids": [[1, True]]}, "kv_transfer_params.remote_block_ids"),
        ({"remote_block_ids": [[1, 2.0]]}, "kv_transfer_params.remote_block_ids"),
        ({"remote_block_ids": [1, "2"]}, "kv_transfer_params.remote_block_ids"),
    ],
)
def test_malformed_fields_are_named(params: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        from_vllm(params)
    assert err.value.field == field


@pytest.mark.parametrize(
    "unknown",
    [{f"novel_{i}": i for i in range(33)}, {"novel": "x" * 5000}, {"novel": [list(range(400))] * 4}],
    ids=["33 keys", "5000 bytes", "nested"],
)
def test_fields_kvshuttle_does_not_know_are_bounded(unknown: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument) as err:
        from_vllm({"do_remote_decode": True, **unknown}, "decode_kv_transfer_params")
    assert err.value.field == "decode_kv_transfer_params.extra"
    within = {f"novel_{i}": "v" * 100 for i in range(MAX_KV_TRANSFER_PARAMS_EXTRA_KEYS)}
    assert to_vllm(from_vllm(within)) == {"do_remote_decode": False, "do_remote_prefill": False, **within}


def test_check_extra_holds_a_message_to_the_same_bounds() -> None:
    msg = KvTransferParams()
    msg.extra.update({f"k{i}": i for i in range(MAX_KV_TRANSFER_PARAMS_EXTRA_KEYS + 1)})
    with pytest.raises(InvalidArgument) as err:
        check_extra(msg, "retention.kv_transfer_params")
    assert err.value.field == "retention.kv_transfer_params.extra"
    check_extra(KvTransferParams(), "retention.kv_transfer_params")  # no extra at all
