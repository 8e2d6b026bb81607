"""Start-up milestones of one vLLM 0.32 server, read from its log: what a person starting it needs.

A vLLM start logs hundreds of lines (banners, config dumps, deprecation and performance warnings)
that say little to someone watching it come up. `MilestoneReader` maps the few lines that mark
progress to short milestones and reports each once; every other line is ignored (it stays in the
log file). `VllmEngine` (vllm_engine.py) feeds it each new log line and adds the two milestones
no log line marks reliably: the process start and readiness (`/health` answers 200).

    reader = MilestoneReader(block_size=32)
    for line in log_lines:
        for milestone in reader.feed(line, elapsed_s):
            print(f"[{milestone.elapsed_s:3.0f} s] {milestone.text}")
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final


@dataclass(frozen=True)
class Milestone:
    key: str  # stable: "started", "engine_core", "weights", "kv_cache", "nixl", "ready"
    text: str  # for people, e.g. "weights loaded (0.21 GiB, 1.00 s)"
    elapsed_s: float  # since the engine's process started


# Lines of vLLM 0.32.0 (CPU build), as logged by the API server, engine core and worker.
ENGINE_CORE: Final = re.compile(r"Initializing a V1 LLM engine \(v([^)\s]+)\)")
CHECKPOINT_SIZE: Final = re.compile(r"Checkpoint size: ([\d.]+) GiB")
WEIGHTS_LOADED: Final = re.compile(r"Loading weights took ([\d.]+) seconds")
KV_CACHE_GIB: Final = re.compile(r"Explicitly set \(([\d.]+)/[\d.]+\) GiB for KV cache")
KV_CACHE_TOKENS: Final = re.compile(r"KV cache size: ([\d,]+) tokens")
NIXL_BACKEND: Final = re.compile(r"NIXL INFO .* Backend (\w+) was instantiated")
# Logged by the connector's scheduler side, created after the worker registered its KV caches.
NIXL_READY: Final = re.compile(r"Initializing NIXL Scheduler")


class MilestoneReader:
    """Log lines in, milestones out, each milestone at most once (a restart needs a new reader)."""

    def __init__(self, block_size: int | None = None) -> None:
        self.block_size = block_size
        self._seen: set[str] = set()
        self._checkpoint_gib: str | None = None
        self._kv_cache_gib: str | None = None
        self._nixl_backend: str | None = None

    def feed(self, line: str, elapsed_s: float) -> list[Milestone]:
        """The milestones `line` completes (none for almost every line)."""
        if m := CHECKPOINT_SIZE.search(line):
            self._checkpoint_gib = m[1]
        elif m := KV_CACHE_GIB.search(line):
            self._kv_cache_gib = m[1]
        elif m := NIXL_BACKEND.search(line):
            self._nixl_backend = m[1]
        elif m := ENGINE_CORE.search(line):
            return self._once("engine_core", f"engine core starting (vLLM {m[1]})", elapsed_s)
        elif m := WEIGHTS_LOADED.search(line):
            facts = []
            if self._checkpoint_gib:  # vLLM rounds to 0.01 GiB: the test models show 0.00
                gib = float(self._checkpoint_gib)
                facts.append(f"{self._checkpoint_gib} GiB" if gib else "< 0.01 GiB")
            facts.append(f"{float(m[1]):.2f} s")
            return self._once("weights", f"weights loaded ({', '.join(facts)})", elapsed_s)
        elif m := KV_CACHE_TOKENS.search(line):
            tokens = int(m[1].replace(",", ""))
            facts = [f"{tokens:,} tokens"]
            if self.block_size:
                facts[0] += f" = {tokens // self.block_size:,} blocks of {self.block_size}"
            if self._kv_cache_gib:
                facts.append(f"{self._kv_cache_gib} GiB")
            return self._once("kv_cache", f"KV cache sized ({', '.join(facts)})", elapsed_s)
        elif NIXL_READY.search(line):
            backend = f" ({self._nixl_backend})" if self._nixl_backend else ""
            return self._once("nixl", f"NIXL connector ready{backend}", elapsed_s)
        return []

    def started(self, pid: int, log: str) -> list[Milestone]:
        return self._once("started", f"process started (pid {pid}; full log {log})", 0.0)

    def ready(self, url: str, elapsed_s: float) -> list[Milestone]:
        return self._once("ready", f"ready (HTTP up at {url})", elapsed_s)

    def _once(self, key: str, text: str, elapsed_s: float) -> list[Milestone]:
        if key in self._seen:
            return []
        self._seen.add(key)
        return [Milestone(key, text, elapsed_s)]
