"""Batcher: requests that wait together run as ONE batched contiguous cached ``generate`` (``engine.contiguous``).

It serves a model the continuous-batching engine cannot run (``ModelRuntime.engine_unsupported_reason``: no
``AttentionInterface`` dispatch, layers without KV of their own, attention sinks, a paged probe that differs), or
any model with ``--no-engine``.

Calls queue up on the event loop. The batch loop takes the oldest call and every other waiting call with the
same sampling settings, up to ``max_batch_size``, waiting for more to come until ``batch_wait_ms`` after the
oldest call's arrival or after the previous batch ended, whichever is later: the callers of the batch that just
ended (a chat's next turn, an agent's next step) come back within a few milliseconds, and without that wait
the calls that queued during a batch would leave alone and the two halves of the clients would alternate in
half-full batches. The batch runs on one worker thread, off the event loop: left-padded rows, one namespace
per row (each row served from its own cached prefix), ``max_new_tokens`` the largest asked for. A stopping criterion watches
every step: it streams each row's new token to its caller, stops a row at its EOS, its own ``max_tokens`` or
when its caller went away, so greedy rows come out exactly as they would one at a time.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from engine import contiguous
from engine.generate_checks import merged_config
from engine.media.inputs import ends_in_image, prepare
from engine.runtime import ModelRuntime, eos_ids
from engine.serve.protocol import Finished, GenerateCall, StreamItem

T = TypeVar("T")


@dataclass(eq=False)
class _Job:
    call: GenerateCall
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[StreamItem | BaseException] = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.monotonic)
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    cancelled: bool = False  # set on the event loop when the caller goes away; read by the worker

    def send(self, item: StreamItem | BaseException) -> None:
        """Hand ``item`` to the caller (thread-safe)."""
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


class _RowWatch(StoppingCriteria):
    """Per-row stop and stream: called by ``generate`` after every step with the sequences so far."""

    def __init__(self, jobs: list[_Job], eos: frozenset[int]) -> None:
        self.jobs = jobs
        self.eos = eos
        self.done = [False] * len(jobs)

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        last = input_ids[:, -1].tolist()
        sent: list[_Job] = []
        for r, job in enumerate(self.jobs):
            if self.done[r]:
                continue
            if job.cancelled:
                self.done[r], job.finish = True, "cancelled"
                continue
            tok = last[r]
            job.tokens.append(tok)
            sent.append(job)
            if tok in self.eos:
                self.done[r], job.finish = True, "stop"
            elif len(job.tokens) >= job.call.max_tokens:
                self.done[r], job.finish = True, "length"
        if sent:  # one wake-up of the event loop per step, not one per row
            sent[0].loop.call_soon_threadsafe(_deliver, [(job, [job.tokens[-1]]) for job in sent])
        return torch.tensor(self.done, dtype=torch.bool, device=input_ids.device)


def _deliver(items: list[tuple[_Job, list[int]]]) -> None:
    """On the event loop: hand each job its new tokens (the rows of one batch share one loop)."""
    for job, item in items:
        job.out.put_nowait(item)


class Batcher:
    """Serves ``GenerateCall``s on one ``ModelRuntime``'s contiguous cached generate, batching those that wait
    together.

    ``after_batch()`` runs on the worker thread after each batch, before its callers hear that they finished
    (the Ray replica publishes its cache events there, so the router knows a reply's blocks before the client
    can send its next turn). Use from one event loop: ``start``, ``stream`` (any number at once), ``stop``.
    """

    def __init__(
        self,
        runtime: ModelRuntime,
        *,
        max_batch_size: int = 8,
        batch_wait_ms: float = 5.0,
        after_batch: Callable[[], None] | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if batch_wait_ms < 0:
            raise ValueError(f"batch_wait_ms must be >= 0, got {batch_wait_ms}")
        self.runtime = runtime
        self.max_batch_size = max_batch_size
        self.batch_wait = batch_wait_ms / 1000
        self.after_batch = after_batch
        gc = runtime.model.generation_config
        self.eos = frozenset(eos_ids(gc))
        pad = gc.pad_token_id
        self.pad_id = pad if pad is not None else min(self.eos, default=0)
        self._pending: deque[_Job] = deque()
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="prefixcache-batch")
        self._closing = False
        self.batches = 0
        self.batch_rows = 0
        self.largest_batch = 0
        self.running = 0
        self._cache_stats: dict[str, Any] = runtime.cache_stats()

    # ---- lifecycle ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the batch loop on the running event loop."""
        self._wakeup = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="prefixcache-batcher")

    async def stop(self) -> None:
        """Finish every waiting and running call, then stop the loop and the worker thread."""
        self._closing = True
        if self._wakeup is not None:
            self._wakeup.set()
        if self._task is not None:
            await self._task
        self._executor.shutdown(wait=True)

    def run_exclusive(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn()`` on the worker thread, between batches, holding the runtime's lock (e.g. inspect the cache).
        Thread-safe."""

        def locked() -> T:
            with self.runtime.lock:
                return fn()

        return self._executor.submit(locked)

    # ---- figures -----------------------------------------------------------------------------------------
    @property
    def queue_length(self) -> int:
        return sum(not j.cancelled for j in self._pending)

    def stats(self) -> dict[str, Any]:
        """Queue and batch counters now. Changes nothing."""
        return {
            "queue_length": self.queue_length,
            "running": self.running,
            "batches": self.batches,
            "batch_rows": self.batch_rows,
            "max_batch_size": self.largest_batch,
        }

    @property
    def cache_stats(self) -> dict[str, Any]:
        """The runtime's ``cache_stats()`` as of the end of the last batch (never waits for a running one)."""
        return self._cache_stats

    # ---- calls -------------------------------------------------------------------------------------------
    async def stream(self, call: GenerateCall) -> AsyncGenerator[StreamItem, None]:
        """Queue ``call``; yield lists of new token ids as they come, then one ``Finished``.

        Closing the iterator early (the caller went away) stops the call's row at the next step.
        """
        if self._wakeup is None or self._closing:
            raise RuntimeError("the batcher is not running")
        job = _Job(call, asyncio.get_running_loop())
        self._pending.append(job)
        self._wakeup.set()
        finished = False
        try:
            while True:
                item = await job.out.get()
                tokens: list[int] = []
                while isinstance(item, list):  # coalesce the steps that came while the caller was busy
                    tokens += item
                    if job.out.empty():
                        break
                    item = job.out.get_nowait()
                if tokens:
                    yield tokens
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if isinstance(item, Finished):
                    finished = True
                    yield item
                    return
        finally:
            if not finished:
                job.cancelled = True

    # ---- the loop ----------------------------------------------------------------------------------------
    async def _loop(self) -> None:
        assert self._wakeup is not None
        loop = asyncio.get_running_loop()
        free_since = 0.0  # when the previous batch ended (monotonic seconds)
        while True:
            while self._pending and self._pending[0].cancelled:
                self._pending.popleft()
            if not self._pending:
                if self._closing:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            first = self._pending[0]
            deadline = max(first.arrived, free_since) + self.batch_wait
            while self._compatible(first) < self.max_batch_size and not self._closing:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), left)
                except asyncio.TimeoutError:
                    break
            batch = self._take(first)
            self.running = len(batch)
            try:
                await loop.run_in_executor(self._executor, self._run, batch)
            except Exception as exc:  # the batch failed: every caller hears it, the loop goes on
                for job in batch:
                    job.send(exc)
            except BaseException as exc:
                for job in batch:
                    job.send(RuntimeError(f"batch interrupted: {exc!r}"))
                raise
            finally:
                self.running = 0
                free_since = time.monotonic()

    def _compatible(self, first: _Job) -> int:
        key = first.call.sampling
        return sum(1 for j in self._pending if not j.cancelled and j.call.sampling == key)

    def _take(self, first: _Job) -> list[_Job]:
        """Remove and return up to max_batch_size live calls sampling like ``first``, oldest first."""
        key = first.call.sampling
        batch: list[_Job] = []
        keep: deque[_Job] = deque()
        size = 1 if first.call.media else self.max_batch_size  # a call with images runs alone
        for job in self._pending:
            if job.cancelled:
                continue
            if len(batch) < size and job.call.sampling == key and not (batch and job.call.media):
                batch.append(job)
            else:
                keep.append(job)
        self._pending = keep
        return batch

    def _run(self, jobs: list[_Job]) -> None:
        """Worker thread: one batched generate for ``jobs``; every job gets its tokens and a Finished."""
        calls = [j.call for j in jobs]
        width = max(len(c.prompt) for c in calls)
        ids = torch.full((len(calls), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(calls), width), dtype=torch.long)
        for r, c in enumerate(calls):
            ids[r, width - len(c.prompt) :] = torch.tensor(c.prompt, dtype=torch.long)
            mask[r, width - len(c.prompt) :] = 1
        watch = _RowWatch(jobs, self.eos)
        temperature, top_p = calls[0].sampling
        kwargs: dict[str, Any] = {
            "max_new_tokens": max(c.max_tokens for c in calls),
            "stopping_criteria": StoppingCriteriaList([watch]),
            "pad_token_id": self.pad_id,
            **(
                {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}
                if temperature > 0
                else {"do_sample": False}
            ),
        }
        self.batches += 1
        self.batch_rows += len(jobs)
        self.largest_batch = max(self.largest_batch, len(jobs))
        rt = self.runtime
        gc, reason = merged_config(rt.model, kwargs)
        if reason is not None:  # the batcher's own settings: a bug, not the caller's
            raise RuntimeError(f"the batcher's generate settings cannot use the cache: {reason}")
        media_in = {k: v.to(rt.device) for k, v in (calls[0].media or {}).items()}  # images: a batch of one
        ids_d, mask_d = ids.to(rt.device), mask.to(rt.device)
        with rt.lock:
            rt.follow()
            media, rest = None, kwargs
            if media_in and rt.pool is not None:
                fam = rt.image_family
                if fam is not None and set(media_in) <= {*fam.inputs, *fam.optional}:
                    media, rest = prepare(
                        rt.model, fam, ids_d, mask_d, {**kwargs, **media_in}, rt.block_size, rt.encoder_cache
                    )
            if media is not None and (ends_in_image(media, width) or not rt.check_images(ids_d, mask_d, media)):
                media = None
            if rt.pool is None or (media_in and media is None):
                # caching is off (a check at load failed on this install), or images it cannot key: the bare model
                bare = cast("Callable[..., Any]", rt.model.generate)  # (mypy sees nn.Module.__getattr__)
                bare(input_ids=ids.to(rt.device), attention_mask=mask.to(rt.device), **kwargs, **media_in)
                cached = [0] * len(calls)
            else:
                names, hints = [c.namespace for c in calls], [c.hints for c in calls]
                _, rows = contiguous.generate(rt, ids.to(rt.device), mask.to(rt.device), gc, names, rest, hints, media)
                cached = [row.cached_tokens for row in rows]
            self._cache_stats = rt.cache_stats()
        if self.after_batch is not None:
            self.after_batch()
        for r, job in enumerate(jobs):
            job.send(Finished(job.finish or "length", len(job.call.prompt), cached[r], len(job.tokens)))
