"""`make up` as a user meets it (issue 23): the module `make up` runs, started as a subprocess
with MODEL= a local Hugging Face directory (the tiny test model's), then the official OpenAI
Python SDK chats twice in one conversation (`conversation_id` in `extra_body`) and the second turn
reuses the first's KV (the gateway's headers, `usage.prompt_tokens_details.cached_tokens`, and
`kvshuttle status`); then SIGINT, and every process it started is gone."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from deploy.local.processes import free_ports
from deploy.up import banner
from openai import OpenAI
from tests.support.cli_runner import run_cli

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
# vLLM's start (two engines on two cores) and the services'; the module's own limit is 300 s.
READY_WITHIN_S = 420
STOPPED_WITHIN_S = 120
# Long enough a prompt that reading it beats recomputing it (the profile's min_reuse_tokens: 64).
SYSTEM = "You are a careful assistant for a team that runs inference servers. " * 12


def _processes() -> dict[int, tuple[int, str, str]]:
    """Every live process: pid -> (parent pid, start time, state), from /proc."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # comm may hold spaces and parentheses
        found[int(entry.name)] = (int(fields[1]), fields[19], fields[0])
    return found


def _descendants(root: int) -> set[tuple[int, str]]:
    """(pid, start time) of every process under `root`: the start time tells a reused pid apart."""
    table = _processes()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add((child, table[child][1]))
            todo.append(child)
    return found


def _still_running(started: set[tuple[int, str]]) -> set[int]:
    table = _processes()
    return {pid for pid, start in started if pid in table and table[pid][1] == start and table[pid][2] != "Z"}


def _wait_for_endpoints(up: subprocess.Popen[str], path: Path) -> dict[str, Any]:
    deadline = time.monotonic() + READY_WITHIN_S
    while not path.exists():
        if up.poll() is not None:
            said = up.stdout.read() if up.stdout else ""
            pytest.fail(f"make up exited with {up.returncode} before it was ready:\n{said}")
        if time.monotonic() > deadline:
            pytest.fail(f"make up not ready in {READY_WITHIN_S} s")
        time.sleep(0.5)
    info: dict[str, Any] = json.loads(path.read_text())
    return info


def test_make_up_serves_the_openai_sdk_with_reuse_and_stops_everything_on_ctrl_c(
    vllm_model: Path, tmp_path: Path
) -> None:
    gateway_port = free_ports(1)[0]
    endpoints = tmp_path / "endpoints.json"
    argv = [
        sys.executable,
        "-m",
        "deploy.up",
        "--run-dir",
        str(tmp_path / "run"),
        "--endpoints",
        str(endpoints),
    ]
    env = {**os.environ, "MODEL": str(vllm_model), "GATEWAY_PORT": str(gateway_port), "STORE": "memory"}
    up = subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    started: set[tuple[int, str]] = set()
    try:
        info = _wait_for_endpoints(up, endpoints)
        started = _descendants(up.pid)
        assert info["openai_base_url"] == f"http://127.0.0.1:{gateway_port}/v1"
        assert info["model"] == vllm_model.name  # MODEL='s folder name is the served name

        # What the banner tells a user to run, as printed: the curl line, the SDK's five lines.
        printed = banner(info).splitlines()
        curl = next(line.strip() for line in printed if line.strip().startswith("curl "))
        answered = subprocess.run(
            ["bash", "-c", curl], capture_output=True, text=True, timeout=300, check=True
        )
        assert "x-kvshuttle-decision:" in answered.stdout.lower(), answered.stdout
        assert json.loads(answered.stdout.split("\n\n", 1)[1])["usage"]["prompt_tokens"] > 0
        start = printed.index("  from openai import OpenAI")
        snippet = "\n".join(line.strip() for line in printed[start : start + 5])
        with contextlib.redirect_stdout(io.StringIO()) as said:
            exec(snippet, {})
        assert "cached_tokens=" in said.getvalue()

        client = OpenAI(base_url=info["openai_base_url"], api_key="unused", max_retries=0, timeout=300)
        messages: list[Any] = [
            {"role": "system", "content": SYSTEM},
            {
                "role": "user",
                "content": "Why does reusing a conversation's KV cache shorten the time to first token?",
            },
        ]
        turns = []
        for _ in range(2):
            raw = client.chat.completions.with_raw_response.create(
                model=info["model"],
                messages=messages,
                max_tokens=16,
                temperature=0,
                extra_body={"conversation_id": "sdk-chat"},
            )
            reply = raw.parse()
            turns.append((raw.headers, reply))
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": "Say it again, shorter."},
            ]
        (first_headers, first), (second_headers, second) = turns
        assert first_headers["x-kvshuttle-decision"] == "recompute"
        assert second_headers["x-kvshuttle-decision"] == "reuse", dict(second_headers)
        reused = int(second_headers["x-kvshuttle-reused-tokens"])
        assert first.usage is not None and second.usage is not None
        assert reused > first.usage.prompt_tokens // 2  # most of turn 1's prompt and answer
        details = second.usage.prompt_tokens_details
        assert details is not None and details.cached_tokens == reused

        token_file, gateway_metrics = info["admin_token_file"], info["metrics"]["gateway"]
        argv = ["status", "--json", "--token-file", token_file, "--gateway-metrics", gateway_metrics]
        status = run_cli(argv, registry=info["registry"])
        assert status.exit_code == 0, status.stderr
        doc = status.json()
        decisions = {(d["decision"], d["reason"]): d["turns"] for d in doc["turns"]["decisions"]}
        assert sum(n for (d, _), n in decisions.items() if d == "reuse") >= 1, decisions
        assert doc["turns"]["reused_tokens"] == reused
        conversation = "tenants/default/conversations/sdk-chat"
        last = next(t for t in doc["last_turns"] if t["conversation"] == conversation)
        assert last["turn"] == 2
        assert {n["name"]: n["health"] for n in doc["nodes"]} == {
            "nodes/prefill": "healthy",
            "nodes/decode": "healthy",
            "nodes/prefill-pool": "healthy",
            "nodes/decode-pool": "healthy",
        }
        assert len(doc["pools"]) == 2 and all(p["capacity_bytes"] > 0 for p in doc["pools"])
        # The registry, router, two agents, gateway and both engines' process trees.
        assert len(started) >= 7, started
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
        try:
            out, _ = up.communicate(timeout=STOPPED_WITHIN_S)
        except subprocess.TimeoutExpired:
            up.kill()  # its services and engines die with it (PR_SET_PDEATHSIG)
            out, _ = up.communicate()
            pytest.fail(f"make up did not stop within {STOPPED_WITHIN_S} s of SIGINT:\n{out}")
    assert up.returncode == 0, out
    assert "OpenAI base URL" in out and 'extra_body={"conversation_id"' in out
    assert "Traceback" not in out
    deadline = time.monotonic() + 30  # the engines' workers, reparented, are reaped by init
    while (left := _still_running(started)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"still running after make up stopped: {sorted(left)}"
    assert not endpoints.exists()
