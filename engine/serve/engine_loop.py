"""EngineLoop: serves ``GenerateCall``s on a ``ModelRuntime``'s continuous-batching engine.

One thread steps the engine while it has work (holding the runtime's lock for each step) and, when it has none,
blocks on the engine's wake-up event (set by a submit, a cancel, ``run_exclusive`` and ``stop``: no timed poll).
A call becomes an engine request as soon as it arrives: it joins the next step, whatever is running, and streams
its tokens as they come (all the tokens of one step reach the event loop in one wake-up). A caller that goes away
cancels its request: the engine stops it at the next step, caching its blocks and unpinning them.
``after_step(finished)`` runs on the engine thread after each step, before the callers of requests that
finished in it hear so (the Ray replica publishes its cache events there, so the router knows a reply's blocks
before the client can send its next turn).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from engine.batching.engine import Engine
from engine.batching.request import Request, RequestResult
from engine.batching.sampling import SamplingParams
from engine.runtime import ModelRuntime
from engine.serve.protocol import Finished, GenerateCall, PromptLogprobs, StreamItem
from engine.serve.stop_strings import StopStrings

T = TypeVar("T")
log = logging.getLogger("prefixcache")
CACHE_STATS_EVERY_S = 0.25  # the cache_stats snapshot is refreshed at most this often (and when a request ends)


class _CallSink:
    """An engine request's reports, buffered on the engine thread and handed to the caller's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, out: asyncio.Queue[Any], buffer: list[Any], call: GenerateCall):
        self.loop = loop
        self.out = out
        self.buffer = buffer
        self.call = call

    def tokens(self, ids: list[int]) -> None:
        self.buffer.append((self, list(ids)))

    def finished(self, result: RequestResult) -> None:
        if result.finish_reason == "error":
            err = result.error if isinstance(result.error, BaseException) else RuntimeError(str(result.error))
            self.buffer.append((self, err))
            return
        prompt_lp = None
        if self.call.prompt_logprobs is not None:
            prompt_lp = PromptLogprobs(result.logprobs, result.top)
        self.buffer.append(
            (
                self,
                Finished(
                    result.finish_reason,
                    result.prompt_tokens,
                    result.cached_tokens,
                    result.completion_tokens,
                    prompt_logprobs=prompt_lp,
                    sample_logprobs=result.sample_logprobs,
                ),
            )
        )


def _deliver(items: list[tuple[_CallSink, Any]]) -> None:
    """On the event loop: hand each call its items of one step."""
    for sink, item in items:
        sink.out.put_nowait(item)


def request_for(
    call: GenerateCall, namespace: str, sink: Any, decode: Callable[[list[int]], str] | None = None
) -> Request:
    """The engine request of an app call (``namespace``: the cache namespace, fingerprint included; ``decode``:
    token ids to reply text, needed for the call's stop strings)."""
    params = None  # max_tokens 0: score the prompt only
    if call.max_tokens:
        params = SamplingParams(
            max_tokens=call.max_tokens,
            temperature=call.temperature,
            top_p=call.top_p if call.temperature > 0 else 1.0,
            top_k=call.top_k if call.temperature > 0 else 0,
            seed=call.seed,
            stop_token_ids=call.stop_token_ids,
            ignore_eos=call.ignore_eos,
        )
    req = Request(call.request_id, list(call.prompt), namespace, params, sink=sink, snapshot_hints=call.hints)
    if call.prompt_logprobs is not None:
        req.score_from = 1
        req.top_logprobs = call.prompt_logprobs
        req.use_logprob_store = True
    if call.logprobs is not None:
        req.sample_logprobs = call.logprobs
    if call.stop and params is not None:
        if decode is None:
            raise ValueError("a call with stop strings needs a decode function (the model's tokenizer)")
        req.stop_check = StopStrings(call.stop, decode)
    return req


class EngineLoop:
    """Runs ``runtime``'s engine on a thread of its own. Use from one event loop: ``start``, ``stream`` (any number
    at once), ``stop``."""

    def __init__(
        self, runtime: ModelRuntime, engine: Engine, *, after_step: Callable[[bool], None] | None = None
    ) -> None:
        self.runtime = runtime
        self.engine = engine
        self.after_step = after_step
        self._exclusive: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._buffer: list[tuple[_CallSink, Any]] = []
        self._cache_stats: dict[str, Any] = runtime.cache_stats()
        self._cache_stats_at = time.monotonic()
        self._idle_s = 0.0  # the thread waiting for work
        self._between_s = 0.0  # the thread's Python between steps: cache_stats, after_step, handing out tokens
        self._idle_waits = 0
        tokenizer = runtime.tokenizer
        self._decode: Callable[[list[int]], str] | None = None
        if tokenizer is not None:
            self._decode = lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True))

    # ---- lifecycle ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the engine thread."""
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="prefixcache-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Let every waiting and running call finish, then stop the thread."""
        self._closing = True
        self.engine.wakeup.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    def run_exclusive(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn()`` on the engine thread between steps (e.g. inspect the cache). Thread-safe."""
        fut: Future[T] = Future()
        if self._thread is None or not self._thread.is_alive():
            try:
                with self.runtime.lock:
                    fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)
            return fut
        self._exclusive.put((fn, fut))
        self.engine.wakeup.set()
        return fut

    # ---- figures -----------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Queue and step counters now. Changes nothing."""
        s = self.engine.stats
        return {
            "queue_length": self.engine.num_waiting,
            "running": self.engine.num_running,
            "steps": s.steps,
            "step_tokens": s.step_tokens,
            "step_requests": s.step_requests,
            "prefill_tokens": s.prefill_tokens,
            "decode_tokens": s.decode_tokens,
            "preemptions": s.preemptions,
            "largest_step": s.largest_step,
            "most_requests": s.most_requests,
            "requests_finished": s.finished,
            "busy_s": s.busy_s,
            "schedule_s": s.schedule_s,
            "forward_s": s.forward_s,
            "attention_s": s.attention_s,
            "linears_s": s.linears_s,
            "decode_path_s": s.decode_path_s,
            "decode_path_bytes": s.decode_path_bytes,
            "prefill_path_s": s.prefill_path_s,
            "prefill_path_flops": s.prefill_path_flops,
            "finish_s": s.finish_s,
            "idle_s": self._idle_s,
            "between_steps_s": self._between_s,
            "idle_waits": self._idle_waits,
        }

    @property
    def cache_stats(self) -> dict[str, Any]:
        """The runtime's ``cache_stats()`` as of the end of a recent step (never waits for a running one): taken
        after a step in which a request finished, when the engine goes idle, and otherwise at most every
        ``CACHE_STATS_EVERY_S``."""
        return self._cache_stats

    # ---- calls -------------------------------------------------------------------------------------------
    async def stream(self, call: GenerateCall) -> AsyncGenerator[StreamItem, None]:
        """Queue ``call``; yield lists of new token ids as they come, then one ``Finished``. Closing the iterator
        early (the caller went away) cancels the request at the next step."""
        if self._thread is None or self._closing:
            raise RuntimeError("the engine loop is not running")
        out: asyncio.Queue[Any] = asyncio.Queue()
        sink = _CallSink(asyncio.get_running_loop(), out, self._buffer, call)
        req = request_for(call, self.runtime.namespace(call.namespace), sink, self._decode)
        self.engine.submit(req)
        finished = False
        try:
            while True:
                item = await out.get()
                tokens: list[int] = []
                while isinstance(item, list):  # coalesce the steps that came while the caller was busy
                    tokens += item
                    if out.empty():
                        break
                    item = out.get_nowait()
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
                req.cancel()
                self.engine.wakeup.set()

    # ---- the thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while True:
            self._run_exclusive()
            if not engine.has_work() and self._exclusive.empty():
                if self._closing:
                    return
                self._wait_for_work()
                continue
            finished_before = engine.stats.finished
            with self.runtime.lock:
                try:
                    engine.step()  # a request's own fault fails that request inside the step
                except Exception as exc:  # a fault of the step as a whole (planning): fail everyone, keep serving
                    log.exception("prefixcache serve: an engine step failed; failing its requests")
                    engine.abort_all(RuntimeError(f"engine step failed: {exc!r}"))
                stepped = time.monotonic()
                finished = engine.stats.finished > finished_before
                if finished or stepped - self._cache_stats_at >= CACHE_STATS_EVERY_S:
                    self._refresh_cache_stats(stepped)
            if self.after_step is not None:
                try:
                    self.after_step(finished)
                except Exception:  # e.g. publishing cache events to the router: the replica keeps serving
                    log.exception("prefixcache serve: after_step failed")
            self._flush()
            self._between_s += time.monotonic() - stepped

    def _wait_for_work(self) -> None:
        """Block until a submit, cancel, ``run_exclusive`` or ``stop`` sets the engine's wake-up event (no timeout:
        an idle thread costs nothing). The cache_stats snapshot is brought up to date first."""
        wakeup = self.engine.wakeup
        idle_from = time.monotonic()
        with self.runtime.lock:
            self._refresh_cache_stats(idle_from)
        wakeup.clear()
        if not self.engine.has_work() and self._exclusive.empty() and not self._closing:
            self._idle_waits += 1
            wakeup.wait()
        self._idle_s += time.monotonic() - idle_from

    def _refresh_cache_stats(self, now: float) -> None:
        """Take a new cache_stats snapshot (the caller holds the runtime's lock)."""
        self._cache_stats = self.runtime.cache_stats()
        self._cache_stats_at = now

    def _flush(self) -> None:
        """Hand this step's items to their event loops (one wake-up per loop)."""
        if not self._buffer:
            return
        items, self._buffer[:] = list(self._buffer), []
        by_loop: dict[int, tuple[asyncio.AbstractEventLoop, list[Any]]] = {}
        for sink, item in items:
            by_loop.setdefault(id(sink.loop), (sink.loop, []))[1].append((sink, item))
        for loop, group in by_loop.values():
            with contextlib.suppress(RuntimeError):  # that event loop is closed: nobody is listening
                loop.call_soon_threadsafe(_deliver, group)

    def _run_exclusive(self) -> None:
        while True:
            try:
                fn, fut = self._exclusive.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                with self.runtime.lock:
                    fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)
