"""The load bench's per-turn account of the control plane (issue 21): what each service did per
turn, read from its own structlog JSON lines, and (optionally) sampling profiles of each service
process taken with py-spy while the steps run.

    account = LogAccount({"registry": path, ...}); account.mark()
    ... a step ...
    account.per_turn(turns)  # {"log_lines": {...}, "rpcs": {"registry": {"PutRetention <- router": 1.0}}}

An RPC is one `rpc.done` line (the server interceptor writes exactly one per call, with the
caller's identity), so `rpcs` is every call the service served, by method and caller.

    wire = WireAccount({"registry": metrics_url, ...}); wire.mark()
    ... a step ...
    wire.per_turn(turns)  # {"registry": {"PutRetention": {"request": 812.0, "response": 95.0}}}

Bytes per RPC: the serialized request and response bytes each service received and sent per
turn, by method (kvshuttle_rpc_{request,response}_bytes_total from its /metrics; every RPC of a
turn is served by the router or a registry, so theirs cover them all).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from urllib.request import urlopen

from prometheus_client.parser import text_string_to_metric_families


class LogAccount:
    """Counts the lines each service's log gained since `mark()`."""

    def __init__(self, logs: dict[str, Path]) -> None:
        self._logs = logs
        self._offsets: dict[str, int] = {}

    def mark(self) -> None:
        self._offsets = {name: path.stat().st_size for name, path in self._logs.items()}

    def per_turn(self, turns: int) -> dict[str, dict[str, object]]:
        lines: dict[str, float] = {}
        rpcs: dict[str, dict[str, float]] = {}
        for name, path in self._logs.items():
            with path.open("rb") as f:
                f.seek(self._offsets.get(name, 0))
                new = f.read().splitlines()
            calls: Counter[str] = Counter()
            for raw in new:
                try:
                    line = json.loads(raw)
                except ValueError:
                    continue
                if line.get("event") == "rpc.done":
                    calls[f"{line.get('method')} <- {line.get('caller', '?')}"] += 1
            lines[name] = round(len(new) / max(turns, 1), 2)
            if calls:
                rpcs[name] = {k: round(v / max(turns, 1), 3) for k, v in sorted(calls.items())}
        return {"log_lines": dict(lines), "rpcs": dict(rpcs)}


_WIRE = {"kvshuttle_rpc_request_bytes": "request", "kvshuttle_rpc_response_bytes": "response"}


class WireAccount:
    """Serialized RPC bytes per turn by service and method, from each service's /metrics."""

    def __init__(self, urls: dict[str, str]) -> None:
        self._urls = urls
        self._marked: dict[tuple[str, str, str], float] = {}

    def _read(self) -> dict[tuple[str, str, str], float]:
        totals: dict[tuple[str, str, str], float] = {}
        for name, url in self._urls.items():
            with urlopen(url, timeout=10) as response:
                text = response.read().decode()
            for family in text_string_to_metric_families(text):
                side = _WIRE.get(family.name)
                if side is None:
                    continue
                for sample in family.samples:
                    if sample.name.endswith("_total"):
                        totals[(name, sample.labels["method"], side)] = sample.value
        return totals

    def mark(self) -> None:
        self._marked = self._read()

    def per_turn(self, turns: int) -> dict[str, dict[str, dict[str, float]]]:
        out: dict[str, dict[str, dict[str, float]]] = {}
        for (name, method, side), value in sorted(self._read().items()):
            delta = value - self._marked.get((name, method, side), 0.0)
            if delta:
                out.setdefault(name, {}).setdefault(method, {})[side] = round(delta / max(turns, 1), 1)
        return out


class Profiles:
    """py-spy recording each process (speedscope JSON, on-CPU samples only) until `stop()`.
    With `gil`, only samples of a thread holding the GIL: Python's own work, without the waits at
    a syscall that on-CPU samples also catch on a busy machine (a process preempted there)."""

    def __init__(self, out: Path, pids: dict[str, int], *, rate: int = 200, gil: bool = False) -> None:
        exe = shutil.which("py-spy", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
        if exe is None:
            raise RuntimeError("--profile needs py-spy (pip install py-spy; the dev extras have it)")
        out.mkdir(parents=True, exist_ok=True)
        suffix = "-gil" if gil else ""
        self.paths = {name: out / f"{name}{suffix}.speedscope.json" for name in pids}
        self._procs = [
            subprocess.Popen(
                [
                    exe,
                    "record",
                    "--pid",
                    str(pid),
                    "--rate",
                    str(rate),
                    # The --gil profiles of issue 21 were taken so: pausing the process per sample.
                    "--gil" if gil else "--nonblocking",
                    "--format",
                    "speedscope",
                    "--output",
                    str(self.paths[name]),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for name, pid in pids.items()
        ]

    def stop(self) -> None:
        for proc in self._procs:
            proc.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        for proc in self._procs:
            proc.wait(timeout=60)
