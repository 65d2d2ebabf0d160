"""The batch loop's waiting rule (engine.serve.batcher), on the real tiny model: a call that queued while a batch
ran waits, after that batch ends, for the callers coming back, and they leave together; greedy rows stay equal
to the bare model's."""

from __future__ import annotations

import asyncio
import time

from serve_testutil import bare_greedy

from engine.models import build_preset
from engine.serve.backend import load_wrapped
from engine.serve.batcher import Batcher
from engine.serve.protocol import Finished, GenerateCall

MODEL = "tiny"
WAIT_MS = 150  # wide against the 30 ms the caller takes to come back: timing noise stays inside
BLOCKER = 300  # tokens: the blocker runs far longer than the window


async def _collect(batcher: Batcher, call: GenerateCall) -> list[int]:
    tokens: list[int] = []
    async for item in batcher.stream(call):
        if isinstance(item, Finished):
            return tokens
        tokens += item
    raise AssertionError("the stream ended without a Finished")


def test_calls_queued_during_a_batch_wait_for_the_returning_callers():
    model, tok = build_preset(MODEL)
    pcm = load_wrapped(MODEL, max_cached_tokens=8_192, block_size=16)
    prompts = [list(tok(t).input_ids) for t in ("the blocker, a long one", "queued while it ran", "came back")]

    async def scenario() -> tuple[list[list[int]], list[int]]:
        batcher = Batcher(pcm, max_batch_size=8, batch_wait_ms=WAIT_MS)
        await batcher.start()
        try:
            blocker = asyncio.create_task(_collect(batcher, GenerateCall("b", tuple(prompts[0]), "", BLOCKER)))
            while batcher.running == 0:
                await asyncio.sleep(0.002)
            queued = asyncio.create_task(_collect(batcher, GenerateCall("q", tuple(prompts[1]), "", 6)))
            since = time.monotonic()
            first = await blocker  # the blocker's caller gets its answer and, 30 ms later, asks again
            # the queued call has waited longer than the window: by its arrival alone it would leave at once
            assert time.monotonic() - since > 2 * WAIT_MS / 1000, "the blocker ran too briefly to tell"
            await asyncio.sleep(0.03)
            back = asyncio.create_task(_collect(batcher, GenerateCall("r", tuple(prompts[2]), "", 6)))
            outs = [first, await queued, await back]
            sizes = [batcher.batches, batcher.batch_rows, batcher.largest_batch]
        finally:
            await batcher.stop()
        return outs, sizes

    outs, (batches, rows, largest) = asyncio.run(scenario())
    # the blocker alone, then the queued call and the returning one together (at once, it would have left alone)
    assert (batches, rows, largest) == (2, 3, 2)
    for p, out, n in zip(prompts, outs, (BLOCKER, 6, 6)):
        assert out == bare_greedy(model, p, n)
