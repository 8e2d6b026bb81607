"""`make demo-registry`: a registry, driven end to end through the `kvshuttle` CLI.

Starts a registry on a free loopback port, registers a decode node, stores two retentions
(what a decode engine keeps after a turn), watches the tenant's changes, claims one retention
(single use: a second claim is refused), shows a stale commit being fenced, lets the other
retention expire on the registry's timer, and stops everything it started (also on Ctrl-C).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent
RUN_DIR = Path(os.environ.get("KVSHUTTLE_DEMO_DIR", ".run/demo"))
TENANT = "demo"
# What a decode engine answers with bidirectional_kv_xfer on (vLLM 0.32 CPU build shape).
DECODE_PARAMS = {
    "do_remote_prefill": False,
    "do_remote_decode": True,
    "remote_block_ids": [[5, 6, 7, 8, 9, 10, 11, 12]],
    "remote_engine_id": "decode-0",
    "remote_request_id": "cmpl-8c2f-0",
    "remote_host": "127.0.0.1",
    "remote_port": 5601,
    "tp_size": 1,
    "dcp_size": 1,
    "pp_size": 1,
    "remote_num_tokens": 250,
    "remote_blocks_expiry_time": 81234.5,
    "transfer_mode": "pull",
}


def say(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m" if sys.stdout.isatty() else f"\n== {text}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Demo:
    def __init__(self) -> None:
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen[bytes]] = []
        RUN_DIR.mkdir(parents=True, exist_ok=True)

    def cli(self, *args: str, expect_ok: bool = True) -> str:
        cmd = [str(BIN / "kvshuttle"), "--registry", self.addr, "registry", *args]
        print("$ " + shlex.join(["kvshuttle", "registry", *args]), flush=True)
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
        sys.stdout.write(out.stdout)
        sys.stdout.write(out.stderr)
        if expect_ok and out.returncode != 0:
            raise SystemExit(f"demo: command failed with exit code {out.returncode}")
        if not expect_ok and out.returncode == 0:
            raise SystemExit("demo: command should have been refused")
        return out.stdout

    def put(
        self,
        conversation: str,
        *,
        tokens: int,
        seed: int,
        ttl: int,
        params: dict[str, object],
        expect_ok: bool = True,
    ) -> None:
        """Store what decode keeps after turn 1 (generation 1) of a conversation."""
        self.cli("put-retention", "--tenant", TENANT, "--conversation", conversation,
                 "--node", "nodes/decode-0", "--generation", "1", "--model", "demo-llama",
                 "--block-size", "32", "--random-tokens", str(tokens), "--seed", str(seed),
                 "--kv-transfer-params", json.dumps(params), "--ttl", str(ttl),
                 expect_ok=expect_ok)  # fmt: skip

    def start_registry(self) -> None:
        say(f"starting kvshuttle-registry on {self.addr}")
        env = dict(
            os.environ,
            KVSHUTTLE_REGISTRY_SERVER__LISTEN=self.addr,
            KVSHUTTLE_REGISTRY_TELEMETRY__LOG_FORMAT="json",
            KVSHUTTLE_REGISTRY_SERVER__GRACE_SECONDS="2",
        )
        log = (RUN_DIR / "registry.log").open("wb")
        self.registry = subprocess.Popen(
            [str(BIN / "kvshuttle-registry")], env=env, stdout=log, stderr=subprocess.STDOUT
        )
        self.procs.append(self.registry)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.registry.poll() is not None:
                raise SystemExit(f"demo: the registry exited; see {RUN_DIR / 'registry.log'}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    print(f"registry is up (log: {RUN_DIR / 'registry.log'})")
                    return
            time.sleep(0.1)
        raise SystemExit("demo: the registry did not start within 30 s")

    def start_watch(self) -> None:
        self.watch_log = RUN_DIR / "watch.log"
        self.watch = subprocess.Popen(
            [str(BIN / "kvshuttle"), "--registry", self.addr, "registry", "watch", "--tenant", TENANT],
            stdout=self.watch_log.open("wb"),
            stderr=subprocess.STDOUT,
        )
        self.procs.append(self.watch)
        time.sleep(0.5)

    def run(self) -> None:
        self.start_registry()
        self.start_watch()

        say("register the decode worker (its agent would do this and heartbeat every few seconds)")
        out = self.cli(
            "register-node",
            "nodes/decode-0",
            "--role",
            "decode",
            "--engine-id",
            "decode-0",
            "--http",
            "http://127.0.0.1:8001",
            "--side-channel",
            "127.0.0.1:5601",
            "--model",
            "demo-llama",
            "--block-size",
            "32",
            "--kv-bytes-per-token",
            "4096",
            "--ttl",
            "60",
            "--json",
        )
        incarnation = str(json.loads(out)["incarnation"])
        self.cli("nodes")

        say("turn 1 of two conversations finished: decode keeps their KV (retentions)")
        self.put("chat-1", tokens=250, seed=1, ttl=60, params=DECODE_PARAMS)
        short = DECODE_PARAMS | {
            "remote_block_ids": [[13, 14, 15, 16]],
            "remote_num_tokens": 100,
            "remote_request_id": "cmpl-91d0-0",
        }
        self.put("chat-2", tokens=100, seed=2, ttl=4, params=short)
        self.cli("retentions", "--tenant", TENANT)
        self.cli("get", f"tenants/{TENANT}/conversations/chat-1/retentions/1")

        say("turn 2 of chat-1: the router claims the retention (single use)")
        chat1 = f"tenants/{TENANT}/conversations/chat-1/retentions/1"
        self.cli("claim", chat1, "--holder", "turns/t-2")
        say("a second reader is refused")
        self.cli("claim", chat1, "--holder", "turns/t-2b", expect_ok=False)
        say("a late commit of an older turn is fenced")
        self.put("chat-1", tokens=250, seed=1, ttl=60, params=DECODE_PARAMS, expect_ok=False)

        say("chat-2's user is thinking; its retention lapses on the registry's timer")
        self.cli("heartbeat", "nodes/decode-0", "--incarnation", incarnation, "--ttl", "60")
        for left in range(5, 0, -1):
            print(f"  waiting {left}s ...", flush=True)
            time.sleep(1)
        self.cli("retentions", "--tenant", TENANT)
        self.cli("get", f"tenants/{TENANT}/conversations/chat-2/retentions/1", expect_ok=False)

        say("what a watcher of the tenant saw")
        time.sleep(0.3)
        self.watch.send_signal(signal.SIGINT)
        self.watch.wait(10)
        print(self.watch_log.read_text(), end="")

        say("stop the registry (SIGTERM: NOT_SERVING, drain, exit)")
        self.registry.send_signal(signal.SIGTERM)
        code = self.registry.wait(30)
        print(f"registry exited with code {code}")
        if code != 0:
            raise SystemExit(f"demo: the registry did not stop cleanly; see {RUN_DIR / 'registry.log'}")
        say("done")

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> None:
    demo = Demo()
    try:
        demo.run()
    except KeyboardInterrupt:
        print("\ninterrupted; stopping what the demo started", flush=True)
        raise SystemExit(130) from None
    finally:
        demo.stop()


if __name__ == "__main__":
    main()
