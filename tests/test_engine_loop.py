"""The serving engine loop (engine/serve/engine_loop.py): an idle engine thread blocks on the engine's wake-up
event with no timeout (no timed poll) and is woken by a submit and by stop(); the cache_stats snapshot is fresh
once a request has finished; the loop's figures split its time into steps, between steps and idle."""

from __future__ import annotations

import asyncio
import threading

from engine import ModelRuntime, RuntimeConfig
from engine.serve.engine_loop import EngineLoop
from engine.serve.protocol import Finished, GenerateCall


class RecordingEvent(threading.Event):
    """A threading.Event that records the timeout of every wait."""

    def __init__(self) -> None:
        super().__init__()
        self.timeouts: list[float | None] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.timeouts.append(timeout)
        return super().wait(timeout)


def test_the_idle_loop_waits_on_the_wakeup_event_without_a_timeout() -> None:
    runtime = ModelRuntime.load("tiny", RuntimeConfig(max_cached_tokens=4096, block_size=16))
    engine = runtime.engine()
    assert engine is not None
    event = RecordingEvent()
    engine.wakeup = event
    loop = EngineLoop(runtime, engine)

    async def go() -> tuple[list[int], Finished]:
        await loop.start()
        while not loop.stats()["idle_waits"]:  # the thread found no work and went to sleep on the event
            await asyncio.sleep(0.01)
        ids: list[int] = []
        finished = None
        async for item in loop.stream(GenerateCall("r1", tuple(range(1, 40)), "default", 6)):
            if isinstance(item, Finished):
                finished = item
            else:
                ids += item
        assert finished is not None
        assert loop.cache_stats["lookups"] == runtime.cache_stats()["lookups"]  # refreshed as the request ended
        await loop.stop()  # stop() wakes the sleeping thread; it exits
        return ids, finished

    ids, finished = asyncio.run(go())
    assert len(ids) == finished.completion_tokens == 6
    assert loop._thread is not None and not loop._thread.is_alive()
    assert event.timeouts and all(t is None for t in event.timeouts)
    stats = loop.stats()
    assert stats["idle_waits"] >= 1 and stats["steps"] >= 6
    assert stats["idle_s"] >= 0.0 and stats["between_steps_s"] >= 0.0
