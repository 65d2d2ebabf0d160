"""Engine: continuous batching over a KV pool that holds the running requests' keys and values.

```
add(request) -> waiting queue -> Scheduler.schedule(): a flat step under a token budget
   -> PagedRunner.forward: the step's new tokens in one forward, attention reading the pool via block tables
   -> per request: sample the next token (or score the chunk), stream it, cache newly full blocks BY ID
   -> finished: cache its full blocks, release (unpin; its remaining own blocks are freed)
```

A request's block table is the cached blocks it matched (shared with every request that matched them, pinned
while it runs) followed by blocks of its own. After every step its newly completed full blocks join the radix
tree by id (``PrefixCache.commit_blocks``: no copy), so a request arriving next step finds them cached; a block
the tree already had is swapped for the tree's copy. Only a request's last, partly filled block stays private.

The engine is single-threaded: ``step()`` runs one step on the caller's thread, ``run_until_done()`` loops; a
serving thread calls ``step()`` in a loop and other threads only ``submit()`` and ``Request.cancel()``.
The caller serialises the engine with anything else that uses the same cache and pool (the wrapper's lock).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from engine.batching.logprob_store import TOP, PromptLogprobStore
from engine.batching.request import Finished, Request, Status
from engine.batching.sampling import sample
from engine.batching.scheduler import Plan, Scheduler, SchedulerConfig
from engine.kv_pool import KVPool
from engine.paged.attention import Row
from engine.paged.runner import PagedRunner
from engine.tier.kv_tier import KVTier, block_tokens, extend_keys, write_rows
from prefixcache.core.cache import OutOfBlocks, PrefixCache


@dataclass
class EngineStats:
    """Counters since the engine was made."""

    steps: int = 0
    step_tokens: int = 0  # tokens computed in all steps
    step_requests: int = 0  # requests in all steps (step_requests / steps: the mean batch)
    decode_tokens: int = 0
    prefill_tokens: int = 0
    finished: int = 0
    preemptions: int = 0
    largest_step: int = 0
    most_requests: int = 0  # most requests in one step
    busy_s: float = 0.0  # time inside step(), split below
    schedule_s: float = 0.0  # planning: admission, matching, allocation, preemption
    forward_s: float = 0.0  # the model's forward (building the batch included)
    attention_s: float = 0.0  # of which: attention over the pool
    finish_s: float = 0.0  # after the forward: scoring, sampling, streaming, caching blocks, finishing

    def as_dict(self) -> dict[str, float]:
        return dict(vars(self))


class Engine:
    """Runs requests over ``cache`` (which must index ``pool``'s blocks) and ``model`` through ``runner``."""

    def __init__(
        self,
        model: Any,
        cache: PrefixCache,
        pool: KVPool,
        *,
        config: SchedulerConfig | None = None,
        eos_token_ids: tuple[int, ...] = (),
        use_kernel: bool = True,
        linears: Any = None,
        tier: KVTier | None = None,
    ) -> None:
        if cache.block_size != pool.block_size or cache.num_blocks != pool.num_blocks:
            raise ValueError("the cache and the pool disagree on block size or number of blocks")
        self.model = model
        self.cache = cache
        self.pool = pool
        self.config = config or SchedulerConfig()
        self.eos = frozenset(eos_token_ids)
        self.runner = PagedRunner(model, pool, use_kernel=use_kernel)
        self.linears = linears  # PackedLinears or None
        self.tier = tier  # the second tier below the pool, or None
        self.scheduler = Scheduler(cache, self.config, self._preempt, self._admitted)
        self.logprob_store = PromptLogprobStore(cache.block_size, pool.num_blocks, cache.config.hash_seed)
        self.stats = EngineStats()
        self.vocab_size = int(model.config.get_text_config(decoder=True).vocab_size)
        self._incoming: deque[Request] = deque()
        self._incoming_lock = threading.Lock()
        self.wakeup = threading.Event()  # set by submit(): a serving loop may sleep on it when idle

    # ---- requests ----------------------------------------------------------------------------------------
    def submit(self, req: Request) -> Request:
        """Queue ``req`` (thread-safe). Its tokens must be valid ids of the model's vocabulary."""
        bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token {bad} of request {req.id} is id {req.tokens[bad]}, not in [0, {self.vocab_size})")
        if not req.tokens:
            raise ValueError(f"request {req.id} has no tokens")
        if req.scoring and not 1 <= req.score_from < len(req.tokens):
            raise ValueError(
                f"request {req.id}: score_from must be in [1, {len(req.tokens) - 1}], got {req.score_from}"
            )
        if req.params is not None:
            req.generator = req.params.generator(self.pool.device)
        with self._incoming_lock:
            self._incoming.append(req)
        self.wakeup.set()
        return req

    def has_work(self) -> bool:
        return bool(self._incoming) or self.scheduler.has_work()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self._incoming)

    # ---- the step ----------------------------------------------------------------------------------------
    def step(self) -> bool:
        """Run one step (False when there was nothing to run). Exceptions inside the forward fail the step's
        requests (they hear the error) and leave the cache consistent; the engine goes on."""
        started = time.perf_counter()
        with self._incoming_lock:
            while self._incoming:
                self.scheduler.add(self._incoming.popleft())
        self._drop_cancelled()
        plan = self.scheduler.schedule()
        for req, why in plan.failed:
            self._finish(req, "cancelled" if why == "cancelled" else "error", None if why == "cancelled" else why)
        s = self.stats
        planned = time.perf_counter()
        s.schedule_s += planned - started
        if not plan.work:
            s.busy_s += planned - started
            return bool(plan.failed) or bool(plan.preempted)
        s.preemptions += len(plan.preempted)
        try:
            logits, spans, attention_s = self._forward(plan)
        except Exception as exc:
            for req, _ in plan.work:
                self._finish(req, "error", exc)
            s.busy_s += time.perf_counter() - started
            return True
        forwarded = time.perf_counter()
        s.forward_s += forwarded - planned
        s.attention_s += attention_s
        self._advance(plan, logits, spans)
        s.finish_s += time.perf_counter() - forwarded
        n = sum(k for _, k in plan.work)
        s.steps += 1
        s.step_tokens += n
        s.step_requests += len(plan.work)
        s.largest_step = max(s.largest_step, n)
        s.most_requests = max(s.most_requests, len(plan.work))
        s.busy_s += time.perf_counter() - started
        return True

    def run_until_done(self, *, progress: Any = None) -> None:
        """Step until every submitted request has finished; ``progress(finished_count)`` after each step."""
        while self.has_work():
            self.step()
            if progress is not None:
                progress(self.stats.finished)

    def _forward(self, plan: Plan) -> tuple[torch.Tensor, list[tuple[int, int, int]], float]:
        """One forward of the plan; returns the logits asked for, per work item (first scored row, scored rows,
        sampling row or -1), and the seconds spent in attention."""
        rows: list[Row] = []
        ids: list[int] = []
        at: list[int] = []
        spans: list[tuple[int, int, int]] = []
        q = 0
        for req, n in plan.work:
            start, stop = req.computed, req.computed + n
            rows.append(Row(q, n, stop, req.table, req.fresh_from))
            ids.extend(req.tokens[start:stop])
            first = len(at)
            if req.score_from:  # logits of the scored positions that fall in this chunk
                at.extend(range(q + max(start, req.score_from - 1) - start, q + min(stop, req.score_end - 1) - start))
            scored = len(at) - first
            sample_row = -1
            if not req.scoring and stop == req.end:  # the prompt (or the last token) is done: sample
                sample_row = len(at)
                at.append(q + n - 1)
            spans.append((first, scored, sample_row))
            q += n
        batch = self.runner.batch(rows)
        device = self.pool.device
        idx = torch.tensor(at, dtype=torch.long)
        tokens = torch.tensor(ids, dtype=torch.long, device=device)
        if self.linears is not None:
            with self.linears.active():
                logits = self.runner.forward(batch, tokens, idx)
        else:
            logits = self.runner.forward(batch, tokens, idx)
        return logits.float(), spans, batch.attention_s

    def _advance(self, plan: Plan, logits: torch.Tensor, spans: list[tuple[int, int, int]]) -> None:
        """After the forward: move each request on, score, sample, stream, cache new full blocks, finish."""
        s = self.stats
        samplers: list[tuple[Request, int]] = []
        for (req, n), (first, scored, sample_row) in zip(plan.work, spans):
            if req.remaining > 1 or not req.output:
                s.prefill_tokens += n
            else:
                s.decode_tokens += n
            req.computed += n
            if scored:
                self._score(req, logits[first : first + scored])
            if sample_row >= 0:
                samplers.append((req, sample_row))
        if samplers:
            rows = logits[[r for _, r in samplers]]
            params = [r.params for r, _ in samplers if r.params is not None]
            picked = sample(rows, params, [r.generator for r, _ in samplers])
            want_lp = [i for i, (r, _) in enumerate(samplers) if r.sample_logprobs is not None]
            if want_lp:
                logp = torch.log_softmax(rows[want_lp], dim=-1)
                for j, i in enumerate(want_lp):
                    req = samplers[i][0]
                    k = min(int(req.sample_logprobs or 0), logp.shape[1])
                    vals, top = torch.topk(logp[j], k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
                    req.sampled_lp.append((float(logp[j, picked[i]]), dict(zip(top.tolist(), vals.tolist()))))
            now = time.monotonic()
            for (req, _), tok in zip(samplers, picked):
                req.tokens.append(tok)
                req.output.append(tok)
                if req.first_token_at is None:
                    req.first_token_at = now
                if req.sink is not None:
                    req.sink.tokens([tok])
        for req, _ in plan.work:
            self._cache_blocks(req)
            reason = self._done(req)
            if reason is not None:
                self._finish(req, reason)

    def _score(self, req: Request, logits: torch.Tensor) -> None:
        """Record the log-probabilities of the tokens these logits predict (the next ones to score)."""
        logp = torch.log_softmax(logits, dim=-1)
        first = req.score_from + len(req.logprobs)
        targets = torch.tensor(req.tokens[first : first + logp.shape[0]], dtype=torch.long, device=logp.device)
        req.logprobs.extend(logp.gather(1, targets[:, None])[:, 0].tolist())
        req.greedy.extend((logp.argmax(dim=-1) == targets).tolist())
        k = TOP if req.use_logprob_store else req.top_logprobs
        if k:
            vals, idx = torch.topk(logp, min(k, logp.shape[1]), dim=-1)
            for v, i in zip(vals.tolist(), idx.tolist()):
                req.top.append(dict(zip(i, v)))

    def _admitted(self, req: Request) -> None:
        """The scheduler matched ``req`` (``computed`` = its cached tokens): continue the match in the tier (its
        blocks are loaded into own blocks and committed); for a request that takes its cached tokens' log-probs
        from the store, take them, and rewind to the first position the store lacks (those positions are
        recomputed for their logits; their K/V stay where they are)."""
        req.tier_tokens = 0
        if self.tier is not None and not req.use_logprob_store:
            self._from_tier(req)
        req.fresh_from = req.computed
        if not (req.score_from and req.use_logprob_store) or req.logprobs:
            return
        bs = self.cache.block_size
        entries = self.logprob_store.lookup(req.tokens, req.namespace, req.computed // bs)
        covered = max(len(entries) * bs, 1)  # tokens 1 .. covered-1 have their log-probs
        for b, entry in enumerate(entries):
            for i in range(b * bs, (b + 1) * bs):
                if i == 0:
                    continue
                lp, top = entry.logprobs[i - b * bs], entry.top[i - b * bs]
                req.logprobs.append(lp)
                req.top.append(top)
                req.greedy.append(bool(top) and max(top.values()) <= lp)
        req.computed = min(req.computed, covered - 1)

    def _done(self, req: Request) -> str | None:
        """Why ``req`` stops now, or None."""
        if req.cancelled:
            return "cancelled"
        if req.scoring:
            return "stop" if req.computed >= req.end else None
        if not req.output or req.remaining > 1:
            return None
        tok, p = req.output[-1], req.params
        assert p is not None
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos):
            return "stop"
        if req.stop_check is not None and req.stop_check(req.output):
            return "stop"
        if len(req.output) >= p.max_tokens:
            return "length"
        return None

    # ---- blocks ------------------------------------------------------------------------------------------
    def _cache_blocks(self, req: Request) -> None:
        """Put ``req``'s newly completed full blocks (up to its commit limit) into the tree by id (and, written
        through, into the tier)."""
        bs = self.cache.block_size
        full = min(req.computed, req.commit_limit) // bs
        if full <= req.committed or req.handle is None:
            return
        res = self.cache.commit_blocks(req.handle, req.tokens[: full * bs], req.table)
        req.table[: len(res.table)] = res.table
        req.committed = len(res.table)
        if self.tier is not None:  # the path the pool holds (its new blocks written, the rest refreshed)
            stop = len(res.table)
            start = stop - res.adopted
            extend_keys(req.tier_keys, req.tokens, req.namespace, bs, self.cache.config.hash_seed, stop)
            self.tier.save(
                self.pool, req.tier_keys[:stop], start, block_tokens(req.tokens, bs, start, stop), res.table[start:stop]
            )

    def _from_tier(self, req: Request) -> None:
        """Load the blocks after ``req``'s match that the tier holds into own blocks and commit them (the protocol
        of ``prefixcache.core.tier``); ``req.tier_tokens`` says how many tokens that served."""
        tier, bs = self.tier, self.cache.block_size
        assert tier is not None and req.handle is not None
        p, limit = req.computed // bs, (req.cache_limit - 1) // bs
        extend_keys(req.tier_keys, req.tokens, req.namespace, bs, self.cache.config.hash_seed, limit)
        t = tier.lookup(req.tier_keys, p, limit)
        if t == 0:
            return
        rows = tier.fetch(req.tier_keys[p : p + t], block_tokens(req.tokens, bs, p, p + t))
        if len(rows) == 0:
            return
        try:
            ids = self.cache.allocate(req.handle, len(rows))
        except OutOfBlocks:
            return
        write_rows(self.pool, rows, ids, tier.binding)
        req.table.extend(ids)
        res = self.cache.commit_blocks(req.handle, req.tokens[: (p + len(ids)) * bs], req.table)
        req.table[: len(res.table)] = res.table
        req.committed = len(res.table)
        req.computed = req.committed * bs
        req.tier_tokens = req.computed - p * bs

    def _preempt(self, req: Request) -> None:
        """The scheduler's preemption: cache the computed full blocks, release, back to waiting."""
        self._cache_blocks(req)
        if req.handle is not None and not req.handle.released:
            self.cache.release(req.handle)
        req.handle, req.table, req.computed, req.committed = None, [], 0, 0
        req.logprobs.clear()  # recomputed on resume (generated tokens and their log-probs stay)
        req.greedy.clear()
        req.top.clear()
        req.status = Status.WAITING
        req.preemptions += 1

    def _finish(self, req: Request, reason: str, error: Any = None) -> None:
        """End ``req``: cache its blocks (unless it failed), release it, tell its sink."""
        if req.status is Status.FINISHED:
            return
        try:
            if req.use_logprob_store and reason != "error" and len(req.logprobs) >= req.score_end - req.score_from:
                self.logprob_store.put(req.prompt, req.namespace, [0.0, *req.logprobs], [{}, *req.top])
            if req.handle is not None and not req.handle.released:
                if reason != "error":
                    self._cache_blocks(req)
                self.cache.release(req.handle)
        finally:
            req.handle = None
            req.status = Status.FINISHED
            self.scheduler.finish(req)
            self.stats.finished += 1
            if isinstance(error, str):
                error = RuntimeError(error)
            k = req.top_logprobs
            top = tuple(dict(sorted(t.items(), key=lambda kv: -kv[1])[:k]) for t in req.top) if k else ()
            result = Finished(
                reason,
                len(req.prompt),
                max(req.cached_tokens, 0),
                len(req.output),
                tuple(req.output),
                tuple(req.logprobs),
                tuple(req.greedy),
                top,
                error,
                tuple(req.sampled_lp),
            )
            if req.sink is not None:
                req.sink.finished(result)

    def _drop_cancelled(self) -> None:
        for req in [r for r in self.scheduler.running if r.cancelled]:
            self._finish(req, "cancelled")
        if any(r.cancelled for r in self.scheduler.waiting):
            for req in [r for r in self.scheduler.waiting if r.cancelled]:
                self.scheduler.waiting.remove(req)
                self._finish(req, "cancelled")

    def abort_all(self, error: BaseException) -> None:
        """Fail every request (e.g. the cache was dropped under them); they hear ``error``."""
        with self._incoming_lock:
            pending = list(self._incoming)
            self._incoming.clear()
        for req in [*self.scheduler.running, *self.scheduler.waiting, *pending]:
            self._finish(req, "error", error)
        self.scheduler.running.clear()
        self.scheduler.waiting.clear()
