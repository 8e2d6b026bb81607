"""Fixtures of the gateway tests: the tiny model directory (made once) and the cluster."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from bench.emulator.http.tokenizer import make_tokenizer
from tests.gateway.helpers import Cluster, cluster_fixture
from tests.router.helpers import MODEL

from kvshuttle.gateway.config import ModelSettings
from kvshuttle.gateway.prompts.tokenizer import ChatTokenizer


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="session")
def chat_tokenizer(model_dir: Path) -> ChatTokenizer:
    return ChatTokenizer.load(MODEL, ModelSettings(tokenizer=model_dir), verify_fraction=1.0)


@pytest.fixture
async def c(model_dir: Path, chat_tokenizer: ChatTokenizer) -> AsyncIterator[Cluster]:
    async for cluster in cluster_fixture(model_dir, chat_tokenizer):
        yield cluster
