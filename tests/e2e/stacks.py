"""kvshuttle's services beside the session's vLLM pair (or a stand-in pair), as the e2e tests start them."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from deploy.local.engine_pair import EnginePair
from deploy.local.stack import KvshuttleStack

# Prefill dear, moving KV cheap: reuse wins whenever the prefix verifies (CPU-class engines).
PROFILE: dict[str, Any] = {
    "model": "m",
    "kv_bytes_per_token": 1024,
    "min_reuse_tokens": 64,
    "prefill": {"fixed_ms": 5.0, "per_token_ms": 0.2},
    "link": {"bandwidth_gb_s": 2.0, "fixed_ms": 1.0},
}

# Moving KV dear (20 ms a read) so that a short turn extends on its holder (POLICY__EXTEND__*);
# a prefill past 50 ms (about 225 tokens) stays on the prefill node, which then reads the
# holder's KV instead.
DEAR_LINK: dict[str, Any] = {**PROFILE, "link": {"bandwidth_gb_s": 2.0, "fixed_ms": 20.0}}
EXTEND_ENV = {"POLICY__EXTEND__ENABLED": "true", "POLICY__EXTEND__MAX_PREFILL_MS": "50"}


@contextmanager
def running_stack(
    pair: EnginePair,
    work_dir: Path,
    *,
    extra_env: Mapping[str, Mapping[str, str]] | None = None,
    pool_bytes: int = 0,
    profile: Mapping[str, Any] = PROFILE,
    otlp_endpoint: str | None = None,
) -> Iterator[KvshuttleStack]:
    """A started stack on `pair` with `profile` (agents with DRAM pools of `pool_bytes`, 0:
    none; every service's spans to `otlp_endpoint`, if given); stopped at the end, every service
    exiting 0."""
    s = KvshuttleStack(
        pair,
        work_dir=work_dir,
        profile=dict(profile),
        extra_env=extra_env,
        pool_bytes=pool_bytes,
        otlp_endpoint=otlp_endpoint,
    )
    s.start()
    try:
        yield s
    finally:
        codes = s.stop()
        assert all(code == 0 for code in codes.values()), (codes, s.work_dir)
