"""The `kvshuttle` CLI against a FakeRegistry served by a real grpc.aio server."""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import re
import signal
import sys
from collections.abc import Callable, Iterator

import grpc
import pytest
from tests.client.fake_registry import FakeRegistry, closed_port
from tests.support.cli_runner import CliResult, arun_cli, run_cli

from kvshuttle.core.hashing import chain_hashes
from kvshuttle.registry.v1 import registry_service_pb2 as pb

CONVERSATION = "tenants/acme/conversations/c1"
RETENTION = f"{CONVERSATION}/retentions/3"

# Starting the CLI is a Python process importing grpc, protobuf and OpenTelemetry: a second or
# two here, tens of seconds on a loaded two-core machine (a full-suite run beside make demo). No
# promise is made about it, so the bound only keeps a hung test from stalling the run
# (pytest-timeout fails it after 180 s with every stack).
STARTED_WITHIN_S = 120
# The promise: Ctrl-C stops the CLI. It cancels its stream, closes its channel and exits the
# interpreter, a fraction of a second idle; the margin is the loaded machine's.
STOPPED_WITHIN_S = 45


def _no_traceback(result: CliResult) -> None:
    assert "Traceback" not in result.stderr
    assert "Traceback" not in result.stdout


async def test_nodes_table(fake: FakeRegistry) -> None:
    fake.add_node("nodes/d0", load=pb.NodeLoad(running_requests=2, kv_cache_usage=0.25, engine_healthy=True))
    fake.add_node("nodes/p0", role=pb.NODE_ROLE_PREFILL, retained_bytes=3 * 1024 * 1024, load=pb.NodeLoad())
    fake.add_node("nodes/p1", role=pb.NODE_ROLE_PREFILL)
    result = await arun_cli(["registry", "nodes"], registry=fake.address)
    assert result.exit_code == 0, result.stderr
    header, d0, p0, p1 = result.stdout.splitlines()
    assert header.split() == [
        "NAME",
        "ROLE",
        "MODEL",
        "ENGINE",
        "HTTP",
        "INCARNATION",
        "RETENTIONS",
        "RETAINED",
        "EXPIRES-IN",
        "LOAD",
    ]
    assert d0.split()[:3] == ["nodes/d0", "decode", "demo-model"]
    assert re.search(r"  in \d+\.\ds  ", d0)
    assert d0.endswith("run 2 wait 0 kv 25%")
    assert "3.0 MiB" in p0
    assert p0.endswith("unhealthy")
    assert p1.endswith(" -")  # no load reported yet
    assert header.index("ROLE") == d0.index("decode")  # columns line up


async def test_nodes_json_and_filters(fake: FakeRegistry) -> None:
    fake.add_node("nodes/d0")
    fake.add_node("nodes/p0", role=pb.NODE_ROLE_PREFILL)
    result = await arun_cli(["registry", "nodes", "--role", "prefill", "--json"], registry=fake.address)
    assert result.exit_code == 0, result.stderr
    doc = result.json()
    assert [n["name"] for n in doc["nodes"]] == ["nodes/p0"]
    assert doc["nodes"][0]["http_endpoint"] == "http://127.0.0.1:8000"  # snake_case field names
    assert doc["nodes"][0]["role"] == "NODE_ROLE_PREFILL"
    sent = fake.requests["ListNodes"][0]
    assert isinstance(sent, pb.ListNodesRequest)
    assert sent.role == pb.NODE_ROLE_PREFILL


async def test_global_options_work_before_and_after_the_command(fake: FakeRegistry) -> None:
    fake.add_node("nodes/d0")
    after = await arun_cli(["registry", "nodes", "--registry", fake.address, "--json"])
    before = await arun_cli(["--json", "registry", "nodes"], env={"KVSHUTTLE_REGISTRY_ADDR": fake.address})
    assert after.exit_code == before.exit_code == 0
    assert after.json() == before.json()


async def test_register_node_prints_incarnation(fake: FakeRegistry) -> None:
    argv = [
        "registry",
        "register-node",
        "d0",
        "--role",
        "decode",
        "--engine-id",
        "eng-1",
        "--http",
        "http://10.0.0.7:8000",
        "--side-channel",
        "10.0.0.7:5600",
        "--model",
        "m",
        "--block-size",
        "16",
        "--kv-bytes-per-token",
        "4096",
        "--label",
        "zone=a",
        "--label",
        "gpu=h200",
        "--ttl",
        "12",
    ]
    first = await arun_cli(argv, registry=fake.address)
    assert first.exit_code == 0, first.stderr
    assert "incarnation:    1" in first.stdout
    assert "labels:         gpu=h200, zone=a" in first.stdout
    second = await arun_cli([*argv, "--json"], registry=fake.address)
    node = second.json()  # the node itself
    assert (node["incarnation"], node["side_channel_port"]) == ("2", 5600)
    assert fake.nodes["nodes/d0"].labels == {"zone": "a", "gpu": "h200"}


async def test_heartbeat_and_deregister(fake: FakeRegistry) -> None:
    fake.add_node("nodes/d0")
    fake.add_retention(CONVERSATION, 3, "nodes/d0")
    beat = await arun_cli(
        ["registry", "heartbeat", "nodes/d0", "--incarnation", "1", "--ttl", "9"], registry=fake.address
    )
    assert beat.exit_code == 0, beat.stderr
    assert beat.stdout.startswith("nodes/d0 renewed, expires in ")
    stale = await arun_cli(["registry", "heartbeat", "d0", "--incarnation", "7"], registry=fake.address)
    assert stale.exit_code == 1
    assert stale.stderr.startswith("error: FAILED_PRECONDITION (NODE_INCARNATION_MISMATCH): ")
    gone = await arun_cli(["registry", "deregister", "d0"], registry=fake.address)
    assert gone.stdout == "nodes/d0 deregistered (1 retention removed)\n"


async def test_retentions_table_follows_all_pages(fake: FakeRegistry) -> None:
    fake.max_page_size = 2
    fake.add_node("nodes/d0")
    for i in range(5):
        fake.add_retention(f"tenants/acme/conversations/c{i}", i + 1, "nodes/d0", num_tokens=100 + i)
    result = await arun_cli(["registry", "retentions", "--tenant", "acme"], registry=fake.address)
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["NAME", "NODE", "GEN", "TOKENS", "BLOCKS", "STATE", "EXPIRES-IN"]
    assert len(lines) == 6
    assert lines[1].split()[:7] == [
        "tenants/acme/conversations/c0/retentions/1",
        "nodes/d0",
        "1",
        "100",
        "4",
        "active",
        "in",
    ]
    assert fake.calls["ListRetentions"] == 3
    one = await arun_cli(
        ["registry", "retentions", "--tenant", "acme", "--conversation", "c2", "--node", "d0", "--json"],
        registry=fake.address,
    )
    assert [r["num_tokens"] for r in one.json()["retentions"]] == [102]
    last = fake.requests["ListRetentions"][-1]
    assert isinstance(last, pb.ListRetentionsRequest)
    assert (last.parent, last.node) == ("tenants/acme/conversations/c2", "nodes/d0")


async def test_put_retention_hashes_random_tokens(fake: FakeRegistry) -> None:
    fake.add_node("nodes/d0")
    argv = [
        "registry",
        "put-retention",
        "--tenant",
        "acme",
        "--conversation",
        "c1",
        "--node",
        "d0",
        "--generation",
        "3",
        "--model",
        "demo-model",
        "--block-size",
        "16",
        "--random-tokens",
        "70",
        "--seed",
        "5",
        "--ttl",
        "30",
        "--kv-transfer-params",
        '{"do_remote_decode": true, "remote_engine_id": "engine-d0", "remote_num_tokens": 70, '
        '"remote_block_ids": [[1, 2, 3, 4, 5]]}',
        "--json",
    ]
    result = await arun_cli(argv, registry=fake.address)
    assert result.exit_code == 0, result.stderr
    sent = fake.requests["PutRetention"][0]
    assert isinstance(sent, pb.PutRetentionRequest)
    retention = sent.retention
    assert (sent.parent, retention.num_tokens, len(retention.block_hashes)) == (CONVERSATION, 70, 4)
    assert retention.kv_transfer_params.remote_engine_id == "engine-d0"
    assert retention.kv_transfer_params.remote_num_tokens == 70
    assert [len(g.block_ids) for g in retention.kv_transfer_params.remote_block_ids] == [5]
    assert retention.kv_bytes == 70 * 1024
    assert sent.ttl.seconds == 30 and sent.request_id
    assert result.json()["retention"]["name"] == RETENTION  # the whole PutRetentionResponse
    again = await arun_cli(argv, registry=fake.address)  # same seed, same tokens: same chain
    assert again.exit_code == 1
    assert "FENCING_GENERATION_STALE" in again.stderr
    assert fake.requests["PutRetention"][1].retention.block_hashes == retention.block_hashes  # type: ignore[attr-defined]


async def test_put_retention_with_token_ids_and_vllm_params(fake: FakeRegistry) -> None:
    fake.add_node("nodes/d0")
    tokens = list(range(1, 41))
    params = {"do_remote_decode": True, "remote_block_ids": [[7, 8]], "remote_port": 5601, "novel": "x"}
    argv = [
        "registry",
        "put-retention",
        "--tenant",
        "acme",
        "--conversation",
        "c1",
        "--node",
        "nodes/d0",
        "--generation",
        "1",
        "--model",
        "demo-model",
        "--block-size",
        "16",
    ]
    result = await arun_cli(
        [*argv, "--token-ids", ",".join(map(str, tokens)), "--kv-transfer-params", json.dumps(params)],
        registry=fake.address,
    )
    assert result.exit_code == 0, result.stderr
    assert "name:" in result.stdout and f"{CONVERSATION}/retentions/1" in result.stdout
    sent = fake.requests["PutRetention"][0]
    assert isinstance(sent, pb.PutRetentionRequest)
    assert list(sent.retention.block_hashes) == chain_hashes(tokens, 16)
    assert sent.retention.kv_transfer_params.remote_port == 5601
    assert sent.retention.kv_transfer_params.extra.fields["novel"].string_value == "x"
    assert fake.calls["GetNode"] == 1  # kv bytes default to tokens x the node's bytes per token
    assert sent.retention.kv_bytes == 40 * 1024


async def test_put_retention_usage_errors(fake: FakeRegistry) -> None:
    base = [
        "registry",
        "put-retention",
        "--tenant",
        "a",
        "--conversation",
        "c",
        "--node",
        "d0",
        "--generation",
        "1",
        "--model",
        "m",
        "--block-size",
        "16",
    ]
    for extra, message in [
        ([], "the following arguments are required: --kv-transfer-params"),
        (
            ["--kv-transfer-params", "{}"],
            "one of the arguments --token-ids --tokens-file --random-tokens is required",
        ),
        (["--token-ids", "1,x"], "token ids must be integers"),
        (["--token-ids", "1", "--kv-transfer-params", "[1]"], "expected a JSON object"),
        (["--token-ids", "1", "--kv-transfer-params", '{"remote_port": "p"}'], "--kv-transfer-params"),
    ]:
        result = await arun_cli([*base, *extra], registry=fake.address)
        assert result.exit_code == 2, (extra, result)
        assert message in result.stderr
        assert result.stderr.startswith("usage: kvshuttle registry put-retention")
        _no_traceback(result)
    assert fake.calls["PutRetention"] == 0


async def test_get_dispatches_on_the_name(fake: FakeRegistry) -> None:
    fake.add_node("nodes/d0")
    fake.add_retention(CONVERSATION, 3, "nodes/d0")
    node = await arun_cli(["registry", "get", "nodes/d0"], registry=fake.address)
    assert "engine:         engine-d0" in node.stdout
    retention = await arun_cli(["registry", "get", RETENTION, "--json"], registry=fake.address)
    assert retention.json()["generation"] == "3"
    conversation = await arun_cli(["registry", "get", CONVERSATION], registry=fake.address)
    assert conversation.exit_code == 0, conversation.stderr
    assert "fence generation: 3" in conversation.stdout
    assert "  name:" in conversation.stdout  # the live retention, indented
    unknown = await arun_cli(["registry", "get", "tenants/acme"], registry=fake.address)
    assert unknown.exit_code == 2
    assert "cannot tell what 'tenants/acme' names" in unknown.stderr
    _no_traceback(unknown)


async def test_claim_renew_release(fake: FakeRegistry) -> None:
    fake.add_node("nodes/d0")
    fake.add_retention(CONVERSATION, 3, "nodes/d0")
    renewed = await arun_cli(["registry", "renew", RETENTION, "--ttl", "100"], registry=fake.address)
    assert renewed.stdout.startswith(f"{RETENTION} renewed, expires in 1m")
    claimed = await arun_cli(
        ["registry", "claim", RETENTION, "--holder", "me", "--claim-ttl", "5", "--json"],
        registry=fake.address,
    )
    assert claimed.exit_code == 0, claimed.stderr
    claim = claimed.json()["claim"]
    assert claim["holder"] == "me"
    refused = await arun_cli(["registry", "release", RETENTION], registry=fake.address)
    assert refused.exit_code == 1
    assert refused.stderr.startswith("error: FAILED_PRECONDITION (CLAIM_MISMATCH)")
    released = await arun_cli(
        ["registry", "release", RETENTION, "--claim-id", claim["claim_id"]], registry=fake.address
    )
    assert released.stdout == f"{RETENTION} released\n"


async def test_rpc_error_prints_one_line_and_exits_1(fake: FakeRegistry) -> None:
    result = await arun_cli(["registry", "get", RETENTION], registry=fake.address)
    assert result == CliResult(
        1, "", f"error: NOT_FOUND (RETENTION_NOT_FOUND): retention {RETENTION} not found\n"
    )


async def test_error_without_error_info(fake: FakeRegistry) -> None:
    fake.fail("ListNodes", grpc.StatusCode.INTERNAL)
    result = await arun_cli(["registry", "nodes"], registry=fake.address)
    assert result == CliResult(1, "", "error: INTERNAL: injected INTERNAL\n")


def test_unreachable_registry() -> None:
    address = f"127.0.0.1:{closed_port()}"
    result = run_cli(["registry", "nodes"], registry=address)
    assert result == CliResult(1, "", f"error: cannot reach the registry at {address} (UNAVAILABLE)\n")


async def test_slow_registry_names_the_deadline(fake: FakeRegistry) -> None:
    fake.delay["ListNodes"] = 2
    result = await arun_cli(["registry", "nodes", "--timeout", "0.2"], registry=fake.address)
    assert (
        result.stderr
        == f"error: the registry at {fake.address} did not answer within 0.2s (DEADLINE_EXCEEDED)\n"
    )


def test_usage_errors_exit_2() -> None:
    for argv in (
        [],
        ["registry"],
        ["registry", "claim", RETENTION],
        ["registry", "nodes", "--role", "nope"],
        ["registry", "watch"],
        ["registry", "nodes", "--timeout", "-1"],
        ["--cert", "c.pem", "registry", "nodes"],
    ):
        result = run_cli(argv)
        assert result.exit_code == 2, argv
        assert "usage: kvshuttle" in result.stderr
        _no_traceback(result)


def test_help_exits_0() -> None:
    result = run_cli(["registry", "--help"])
    assert result.exit_code == 0
    assert "put-retention" in result.stdout and result.stderr == ""


async def test_watch_prints_a_line_per_change(fake: FakeRegistry) -> None:
    fake.watch_events = [
        pb.WatchRetentionsResponse(
            change=change,
            retention=pb.Retention(name=RETENTION, node="nodes/d0", generation=3, num_tokens=500),
        )
        for change in (pb.RETENTION_CHANGE_PUT, pb.RETENTION_CHANGE_CLAIMED)
    ]
    fake.watch_events[0].change_time.GetCurrentTime()
    result = await arun_cli(["registry", "watch", "--tenant", "acme"], registry=fake.address)
    assert result.exit_code == 0, result.stderr
    put, claimed = result.stdout.splitlines()
    assert put.split()[1:4] == ["put", RETENTION, "node=nodes/d0"]
    assert "tokens=500" in put
    assert claimed.split()[:2] == ["-", "claimed"]
    as_json = await arun_cli(["registry", "watch", "--node", "d0", "--json"], registry=fake.address)
    assert [e["change"] for e in as_json.json_lines()] == ["RETENTION_CHANGE_PUT", "RETENTION_CHANGE_CLAIMED"]
    sent = fake.requests["WatchRetentions"][-1]
    assert isinstance(sent, pb.WatchRetentionsRequest)
    assert (sent.parent, sent.node) == ("", "nodes/d0")


async def test_lookup(fake: FakeRegistry) -> None:
    tokens = list(range(100, 164))
    chain = chain_hashes(tokens, 16)
    fake.block_index = {"nodes/p0": chain[:3], "nodes/p1": chain[:1]}
    result = await arun_cli(
        ["registry", "lookup", "--model", "m", "--block-size", "16", "--token-ids", json.dumps(tokens)],
        registry=fake.address,
    )
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "prefix: 4 full blocks of 16 (64 tokens)"
    assert [line.split() for line in lines[2:]] == [["nodes/p0", "3", "48"], ["nodes/p1", "1", "16"]]


def _to_a_grpc_thread(process: asyncio.subprocess.Process) -> None:
    """SIGINT to one of the CLI's threads besides its main one, with tgkill(2) (kill() of a
    thread id may go to the main thread)."""
    threads = [int(t) for t in os.listdir(f"/proc/{process.pid}/task") if int(t) != process.pid]
    assert threads, "the CLI runs no thread besides its main one"
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.tgkill(process.pid, min(threads), signal.SIGINT) == 0, ctypes.get_errno()


@pytest.fixture
def sigint_as_a_terminal_gives_it() -> Iterator[None]:
    """The CLI starts with SIGINT's default, as from a terminal, however this suite was started:
    a shell's background job (`make test &`, a runner without job control) ignores SIGINT, its
    children inherit that, and a CLI started ignoring SIGINT rightly keeps ignoring it. A Python
    handler here is not inherited across exec: the child gets the default."""
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize(
    "interrupt",
    [lambda process: process.send_signal(signal.SIGINT), _to_a_grpc_thread],
    ids=["to-the-process", "to-a-grpc-thread"],
)
@pytest.mark.usefixtures("sigint_as_a_terminal_gives_it")
async def test_console_entry_point_ctrl_c_exits_130_quietly(
    fake: FakeRegistry, interrupt: Callable[[asyncio.subprocess.Process], None]
) -> None:
    """Ctrl-C stops a watch on an idle stream. The kernel may hand a process's SIGINT to any of
    its threads (grpc runs several): a plain Python handler then waits for the main thread to run
    Python code, asleep in epoll, and the CLI did not stop. The signal must wake the loop."""
    fake.hold_watch_open = True
    env = {**os.environ, "KVSHUTTLE_REGISTRY_ADDR": fake.address}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvshuttle.cli.main",
        "registry",
        "watch",
        "--tenant",
        "acme",
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        await asyncio.wait_for(fake.watch_started.wait(), timeout=STARTED_WITHIN_S)
        interrupt(process)
        stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=STOPPED_WITHIN_S)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 130
    assert (stdout.decode(), stderr.decode()) == ("", "")


async def test_console_entry_point_exit_status(fake: FakeRegistry) -> None:
    env = {**os.environ, "KVSHUTTLE_REGISTRY_ADDR": fake.address}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvshuttle.cli.main",
        "registry",
        "get",
        "nodes/nope",
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, stderr = await asyncio.wait_for(process.communicate(), timeout=STARTED_WITHIN_S)
    assert process.returncode == 1
    assert stderr.decode() == "error: NOT_FOUND (NODE_NOT_FOUND): node nodes/nope not found\n"
