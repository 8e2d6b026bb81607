"""The engine poller against vLLM's /health and /metrics on a real HTTP server (127.0.0.1)."""

from __future__ import annotations

import aiohttp
from tests.agent.engine_fakes import FakeEngineHttp

from kvshuttle.agent.engine import EnginePoller


async def test_a_change_of_the_engines_health_is_told_to_the_listeners_as_the_poll_sees_it() -> None:
    engine = FakeEngineHttp()
    await engine.start()
    told: list[bool] = []
    poller = EnginePoller(engine.url, interval=3600, timeout=5)
    poller.add_listener(told.append)
    try:
        async with aiohttp.ClientSession() as session:
            await poller.poll_once(session)  # the first healthy poll is a change
            await poller.poll_once(session)  # still healthy: nothing to tell
            assert told == [True]
            engine.health_status = 503  # vLLM's engine died
            await poller.poll_once(session)
            await poller.poll_once(session)
            engine.health_status = 200
            await poller.poll_once(session)
    finally:
        await engine.stop()
    assert told == [True, False, True]
    assert poller.state.healthy
