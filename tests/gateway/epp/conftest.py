"""The endpoint picker's cluster: a real registry and router, the picker in front (`c`: one
prefill and one decode node; `two`: two decode nodes, the router's ready list asked per pick)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tests.gateway.epp.envoy import TWO_DECODES, EppCluster, epp_fixture

from kvshuttle.gateway.prompts.tokenizer import ChatTokenizer


@pytest.fixture
async def c(model_dir: Path, chat_tokenizer: ChatTokenizer) -> AsyncIterator[EppCluster]:
    async for cluster in epp_fixture(model_dir, chat_tokenizer):
        yield cluster


@pytest.fixture
async def two(model_dir: Path, chat_tokenizer: ChatTokenizer) -> AsyncIterator[EppCluster]:
    async for cluster in epp_fixture(model_dir, chat_tokenizer, nodes=TWO_DECODES, ready_cache_s=0.0):
        yield cluster
