"""The batch loop's waiting rule (engine.serve.batcher), on the real tiny model: a call that queued while a batch
ran waits, after that batch ends, for the callers coming back, and they leave together; greedy rows stay equal
to the bare model's."""

from __future__ import annotations

import asyncio
import time

import pytest
from serve_testutil import bare_greedy

from engine import ModelRuntime, RuntimeConfig, UncachedCallWarning, contiguous
from engine.models import build_preset
from engine.serve.batcher import Batcher
from engine.serve.protocol import Finished, GenerateCall

MODEL = "tiny"
WAIT_MS = 150  # wide against the 30 ms the caller takes to come back: timing noise stays inside
BLOCKER = 1200  # tokens: the blocker runs far longer than the window, on a fast host too


async def _collect(batcher: Batcher, call: GenerateCall) -> list[int]:
    tokens: list[int] = []
    async for item in batcher.stream(call):
        if isinstance(item, Finished):
            return tokens
        tokens += item
    raise AssertionError("the stream ended without a Finished")


def test_calls_queued_during_a_batch_wait_for_the_returning_callers():
    model, tok = build_preset(MODEL)
    runtime = ModelRuntime.load(MODEL, RuntimeConfig(max_cached_tokens=8_192, block_size=16))
    prompts = [list(tok(t).input_ids) for t in ("the blocker, a long one", "queued while it ran", "came back")]

    async def scenario() -> tuple[list[list[int]], list[int]]:
        batcher = Batcher(runtime, max_batch_size=8, batch_wait_ms=WAIT_MS)
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


def test_mixed_limits_batch_cap_and_sampling_groups(monkeypatch):
    """Calls queued together: at most ``max_batch_size`` per batch, oldest first; in a mixed batch each row gets
    exactly its own max_tokens of the bare model's greedy tokens (never one more); calls whose top_p differ never
    share a batch, and each batch samples with its own calls' settings."""
    model, tok = build_preset(MODEL)
    runtime = ModelRuntime.load(MODEL, RuntimeConfig(max_cached_tokens=8_192, block_size=16))
    seen: list[dict] = []
    generate = contiguous.generate

    def recording(rt, input_ids, attention_mask, gc, names, kwargs, hints=None, media=None):
        seen.append({k: kwargs.get(k) for k in ("max_new_tokens", "top_p", "temperature", "do_sample")})
        seen[-1]["rows"] = input_ids.shape[0]
        return generate(rt, input_ids, attention_mask, gc, names, kwargs, hints, media)

    monkeypatch.setattr(contiguous, "generate", recording)
    prompts = [list(tok(t).input_ids) for t in ("mixed limits one", "two, a longer prompt", "three")]
    limits = [2, 7, 3]

    async def scenario() -> tuple[list[list[int]], list[int], int]:
        batcher = Batcher(runtime, max_batch_size=2, batch_wait_ms=50)
        await batcher.start()
        try:
            greedy = [GenerateCall(f"g{i}", tuple(p), "", n) for i, (p, n) in enumerate(zip(prompts, limits))]
            outs = await asyncio.gather(*(_collect(batcher, c) for c in greedy))
            sampled = [
                GenerateCall(f"s{i}", tuple(prompts[0]), "", 4, temperature=0.8, top_p=top_p)
                for i, top_p in enumerate((0.9, 0.5, 0.9))
            ]
            lengths = [len(o) for o in await asyncio.gather(*(_collect(batcher, c) for c in sampled))]
            largest = batcher.largest_batch
        finally:
            await batcher.stop()
        return list(outs), lengths, largest

    outs, lengths, largest = asyncio.run(scenario())
    for p, out, n in zip(prompts, outs, limits):
        assert out == bare_greedy(model, p, n)
        assert len(out) == n  # the tiny model emits no EOS this early, so every row runs to its limit
    assert largest == 2
    # the greedy calls: the oldest two together (the longer limit drives generate), then the third alone
    assert [(s["rows"], s["max_new_tokens"], s["do_sample"]) for s in seen[:2]] == [(2, 7, False), (1, 3, False)]
    # the sampled calls: top_p 0.9 twice together, then top_p 0.5 alone, each with its own settings
    assert sorted((s["rows"], s["top_p"], s["temperature"]) for s in seen[2:]) == [(1, 0.5, 0.8), (2, 0.9, 0.8)]
    assert all(n <= 4 for n in lengths)


def test_a_runtime_whose_check_at_load_failed_is_served_uncached(monkeypatch):
    """serve on a model whose cached path failed its check on this install: the batcher (the engine is off too)
    runs the bare model's generate, replies equal the bare model's, nothing is cached."""
    from engine import path_check

    model, tok = build_preset(MODEL)
    monkeypatch.setattr(path_check, "contiguous_reason", lambda rt: "a difference this release shows (simulated)")
    with pytest.warns(UncachedCallWarning, match="simulated"):
        runtime = ModelRuntime(model, RuntimeConfig(max_cached_tokens=1_024, block_size=16))
    assert runtime.pool is None and runtime.engine() is None
    prompt = list(tok("the same prompt twice").input_ids)

    async def scenario() -> list[list[int]]:
        batcher = Batcher(runtime, max_batch_size=4, batch_wait_ms=1)
        await batcher.start()
        try:
            return [await _collect(batcher, GenerateCall(f"c{i}", tuple(prompt), "", 5)) for i in range(2)]
        finally:
            await batcher.stop()

    for out in asyncio.run(scenario()):
        assert out == bare_greedy(model, prompt, 5)
    assert runtime.cache_stats()["cached_tokens"] == 0
