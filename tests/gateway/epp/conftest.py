"""The endpoint picker's cluster: a real registry and router, the picker in front."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tests.gateway.epp.envoy import EppCluster, epp_fixture

from kvshuttle.gateway.prompts.tokenizer import ChatTokenizer


@pytest.fixture
async def c(model_dir: Path, chat_tokenizer: ChatTokenizer) -> AsyncIterator[EppCluster]:
    async for cluster in epp_fixture(model_dir, chat_tokenizer):
        yield cluster
