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

The engine is single-threaded: ``step()`` runs one step on the caller's thread; a serving thread (or an offline
batch, ``engine.batching.offline.run``) calls ``step()`` in a loop, and other threads only ``submit()`` and
``Request.cancel()``. The caller serialises the engine with anything else that uses the same cache and pool (the
runtime's lock). A fault fails only the requests it concerns (see ``step``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from engine.batching.logprob_store import TOP, PromptLogprobStore
from engine.batching.request import Request, RequestResult, Status
from engine.batching.sampling import sample
from engine.batching.scheduler import Plan, Scheduler, SchedulerConfig
from engine.hybrid.recurrent import Segment
from engine.hybrid.store import HybridStates
from engine.kv_pool import KVPool
from engine.paged.attention import Row, StepBatch
from engine.paged.runner import PagedRunner
from engine.tier.kv_tier import KVTier
from prefixcache.core.cache import PrefixCache

log = logging.getLogger("prefixcache.engine")


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
    # of attention: the C kernel's decode path (its seconds; the cached K/V bytes its queries read) and its prefill path
    # (its seconds; the FLOPs it computed), the in-place rates bench_engine_steps sets against the run's floor
    decode_path_s: float = 0.0
    decode_path_bytes: int = 0
    prefill_path_s: float = 0.0
    prefill_path_flops: int = 0
    linears_s: float = 0.0  # of which: the packed linears (0 where the model's linears are not packed)
    finish_s: float = 0.0  # after the forward: scoring, sampling, streaming, caching blocks, finishing
    faults: int = 0  # requests failed by an exception in their part of a step (not counting the forward's)

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
        fused: Any = None,
        tier: KVTier | None = None,
        hybrid: HybridStates | None = None,
    ) -> None:
        if cache.block_size != pool.block_size or cache.num_blocks != pool.num_blocks:
            raise ValueError("the cache and the pool disagree on block size or number of blocks")
        self.model = model
        self.cache = cache
        self.pool = pool
        self.config = config or SchedulerConfig()
        self.eos = frozenset(eos_token_ids)
        self.runner = PagedRunner(model, pool, use_kernel=use_kernel, states=None if hybrid is None else hybrid.pool)
        self.linears = linears  # PackedLinears or None
        self.fused = fused  # FusedOps or None
        self.tier = tier  # the second tier below the pool, or None
        self.hybrid = hybrid  # a hybrid model's recurrent states (engine.hybrid), or None
        self.scheduler = Scheduler(cache, self.config, self._preempt, self._admitted, hybrid)
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
        if self.hybrid is not None or self.cache.windows is not None:
            req.use_logprob_store = False  # prompt log-probs come from a recomputation (no state or window there)
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
        """Run one step (False when there was nothing to run).

        Faults stay with the requests they concern: an exception while admitting or allocating for a request,
        scoring, sampling or streaming its token, caching its blocks or finishing it fails that request (its sink
        hears the error; its blocks are released); one inside the forward fails the step's requests. The cache
        stays consistent (``check_integrity``) and the engine goes on. The tier never fails a request (its faults
        are counted and warned about)."""
        started = time.perf_counter()
        with self._incoming_lock:
            while self._incoming:
                self.scheduler.add(self._incoming.popleft())
        self._drop_cancelled()
        plan = self.scheduler.schedule()
        for req, why in plan.failed:
            if why == "cancelled":
                self._finish(req, "cancelled")
            else:
                self.stats.faults += isinstance(why, Exception)
                self._finish(req, "error", why)
        s = self.stats
        planned = time.perf_counter()
        s.schedule_s += planned - started
        if not plan.work:
            s.busy_s += planned - started
            return bool(plan.failed) or bool(plan.preempted)
        s.preemptions += len(plan.preempted)
        linears_before = self.linears.seconds if self.linears is not None else 0.0
        try:
            logits, spans, batch = self._forward(plan)
        except Exception as exc:
            for req, _ in plan.work:
                self._finish(req, "error", exc)
            s.busy_s += time.perf_counter() - started
            return True
        forwarded = time.perf_counter()
        s.forward_s += forwarded - planned
        s.attention_s += batch.attention_s
        s.decode_path_s += batch.decode_path_s
        s.decode_path_bytes += batch.decode_path_bytes
        s.prefill_path_s += batch.prefill_path_s
        s.prefill_path_flops += batch.prefill_path_flops
        if self.linears is not None:
            s.linears_s += self.linears.seconds - linears_before
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

    def _forward(self, plan: Plan) -> tuple[torch.Tensor, list[tuple[int, int, int]], StepBatch]:
        """One forward of the plan; returns the logits asked for, per work item (first scored row, scored rows,
        sampling row or -1), and the step's batch (its attention timings)."""
        rows: list[Row] = []
        ids: list[int] = []
        at: list[int] = []
        spans: list[tuple[int, int, int]] = []
        q = 0
        segments: list[Segment] = []
        for req, n in plan.work:
            start, stop = req.computed, req.computed + n
            rows.append(Row(q, n, stop, req.table, req.fresh_from))
            if req.state_slot is not None:
                segments.append(Segment(q, n, req.state_slot, req.has_state))
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
        with self.fast_paths(several_rows=len(rows) > 1):
            logits = self.runner.forward(batch, tokens, idx, segments)
        return logits.float(), spans, batch

    @contextlib.contextmanager
    def fast_paths(self, *, several_rows: bool) -> Iterator[None]:
        """Inside, the model runs as a step's forward does: its linears packed (``several_rows``: a step of several
        sequences, which may take the small-row kernel; a lone sequence keeps oneDNN, nn.Linear's bits) and its fusable
        ops fused. The model is as it was on exit."""
        with contextlib.ExitStack() as fast:
            if self.linears is not None:
                fast.enter_context(self.linears.active(several_rows=several_rows))
            if self.fused is not None:
                fast.enter_context(self.fused.active())
            yield

    def _advance(self, plan: Plan, logits: torch.Tensor, spans: list[tuple[int, int, int]]) -> None:
        """After the forward: move each request on, score, sample, stream, cache new full blocks, finish. A request
        whose part of this raises fails alone (``_fail``)."""
        s = self.stats
        samplers: list[tuple[Request, int]] = []
        for (req, n), (first, scored, sample_row) in zip(plan.work, spans):
            if req.remaining > 1 or not req.output:
                s.prefill_tokens += n
            else:
                s.decode_tokens += n
            req.computed += n
            req.has_state = req.state_slot is not None
            try:
                if scored:
                    self._score(req, logits[first : first + scored])
            except Exception as exc:
                self._fail(req, exc)
                continue
            if sample_row >= 0:
                samplers.append((req, sample_row))
        if samplers:
            now = time.monotonic()
            for (req, _), tok in zip(samplers, self._sample(samplers, logits)):
                if tok is None:
                    continue
                try:
                    req.tokens.append(tok)
                    req.output.append(tok)
                    if req.first_token_at is None:
                        req.first_token_at = now
                    if req.sink is not None:
                        req.sink.tokens([tok])
                except Exception as exc:
                    self._fail(req, exc)
        for req, _ in plan.work:
            if req.status is Status.FINISHED:
                continue
            try:
                before = req.committed
                self._cache_blocks(req)
                self._keep_state(req)
                self._keep_windows(req, before)
                reason = self._done(req)
            except Exception as exc:
                self._fail(req, exc)
                continue
            if reason is not None:
                self._finish(req, reason)

    def _sample(self, samplers: list[tuple[Request, int]], logits: torch.Tensor) -> list[int | None]:
        """The next token of each request of ``samplers`` (request, logits row), with its log-probs when it asks
        for them. All rows at once; when that raises, row by row from the same generator states, so only the
        requests whose own sampling raises fail (None for them) and the others draw what they would have."""
        reqs = [req for req, _ in samplers]
        rows = logits[[r for _, r in samplers]]
        params = [r.params for r in reqs if r.params is not None]
        gens = [r.generator for r in reqs]
        states = [None if g is None else g.get_state() for g in gens]
        picked: list[int | None]
        try:
            picked = list(sample(rows, params, gens))
        except Exception:
            picked = []
            for i, req in enumerate(reqs):
                g, state = gens[i], states[i]
                try:
                    if g is not None and state is not None:
                        g.set_state(state)
                    picked.append(sample(rows[i : i + 1], params[i : i + 1], [g])[0])
                except Exception as exc:
                    self._fail(req, exc)
                    picked.append(None)
        for i, req in enumerate(reqs):
            tok = picked[i]
            if tok is None or req.sample_logprobs is None:
                continue
            try:
                logp = torch.log_softmax(rows[i].float(), dim=-1)
                k = min(int(req.sample_logprobs), logp.shape[0])
                vals, top = torch.topk(logp, k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
                req.sampled_lp.append((float(logp[tok]), dict(zip(top.tolist(), vals.tolist()))))
            except Exception as exc:
                self._fail(req, exc)
                picked[i] = None
        return picked

    def _fail(self, req: Request, error: BaseException) -> None:
        """``req`` fails with ``error`` (a fault in its part of the step): it finishes as an error, its blocks
        released; the step goes on for the others."""
        self.stats.faults += 1
        log.warning("prefixcache engine: request %s failed: %r", req.id, error)
        self._finish(req, "error", error)

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
        if self.hybrid is None:  # (a hybrid model's admission loaded from the tier already)
            req.tier_tokens = 0
            if self.tier is not None and not req.use_logprob_store:
                self._from_tier(req)
        req.fresh_from = req.committed * self.cache.block_size  # positions with K/V in the table already
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
            start = len(res.table) - res.adopted
            self.tier.save_path(self.pool, req.tokens, req.namespace, req.block_keys, start, res.table[start:])

    def _keep_state(self, req: Request) -> None:
        """A hybrid request that ends a step on a block boundary whose blocks are cached keeps its state there as a
        snapshot (``prefixcache.core.snapshots``): a kept point stays; otherwise it is the request's latest, which
        supersedes (drops) its previous latest; the last one is the request-end snapshot."""
        hy = self.hybrid
        if hy is None or req.state_slot is None:
            return
        bs, c = self.cache.block_size, req.computed
        b = c // bs
        if c % bs or b == 0 or b > req.committed or b == req.state_latest:
            return
        keys = hy.keys(req.block_keys, req.tokens, req.namespace, b)
        hy.publish_slot(keys, b, req.tokens, req.state_slot)
        prev = req.state_latest
        if prev and prev not in req.state_points:
            hy.drop(keys[prev - 1])
        req.state_latest = b

    def _keep_windows(self, req: Request, before: int, *, end: bool = False) -> None:
        """With a window group: keep the points ``req`` planned that its cached blocks passed this step (``before``:
        its cached blocks before it; ``end``: also its request-end point), while it still holds their windows; then
        let go of the window slots of blocks that fell out of its window."""
        ws = self.cache.windows
        if ws is None or req.handle is None or req.handle.released:
            return
        points = [p for p in req.state_points if before < p <= req.committed]
        if end and req.committed:
            points.append(req.committed)
        for p in points:
            ws.keep_point(req.table, p, known_from=p)  # every window block is the request's: no new K/V
        gone = ws.first_block(req.computed // self.cache.block_size)
        if gone:
            ws.let_go(("request", req.handle.id), req.table[:gone])

    def _release_state(self, req: Request) -> None:
        """Give back a hybrid request's live state slot (it ended, or was preempted: it restores on resume)."""
        if self.hybrid is not None and req.state_slot is not None:
            self.hybrid.give_back(req.state_slot)
        req.state_slot, req.has_state = None, False

    def _from_tier(self, req: Request) -> None:
        """Load the blocks after ``req``'s match that the tier holds into the pool (``KVTier.load_after_match``);
        ``req.tier_tokens`` says how many tokens that served."""
        assert self.tier is not None and req.handle is not None
        limit = (req.cache_limit - 1) // self.cache.block_size
        ids = self.tier.load_after_match(
            self.cache, self.pool, req.handle, req.tokens, req.block_keys, req.table[: req.committed], limit
        )
        if ids:
            req.table.extend(ids)
            req.committed = len(req.table)
            req.computed = req.committed * self.cache.block_size
            req.tier_tokens = len(ids) * self.cache.block_size

    def _preempt(self, req: Request) -> None:
        """The scheduler's preemption: cache the computed full blocks (if that fails, they are recomputed on
        resume), release, back to waiting."""
        try:
            before = req.committed
            self._cache_blocks(req)
            self._keep_windows(req, before, end=True)  # so that it resumes from where it stopped
        except Exception as exc:
            log.warning("prefixcache engine: caching preempted request %s's blocks failed: %r", req.id, exc)
        if req.handle is not None and not req.handle.released:
            self.cache.release(req.handle)
        self._release_state(req)
        req.handle, req.table, req.computed, req.committed = None, [], 0, 0
        req.logprobs.clear()  # recomputed on resume (generated tokens and their log-probs stay)
        req.greedy.clear()
        req.top.clear()
        req.status = Status.WAITING
        req.preemptions += 1

    def _finish(self, req: Request, reason: str, error: Any = None) -> None:
        """End ``req``: cache its blocks (unless it failed; if caching fails, it fails), release it, tell its sink
        (whose own faults are logged, never raised)."""
        if req.status is Status.FINISHED:
            return
        try:
            if req.use_logprob_store and reason != "error" and len(req.logprobs) >= req.score_end - req.score_from:
                self.logprob_store.put(req.prompt, req.namespace, [0.0, *req.logprobs], [{}, *req.top])
            if req.handle is not None and not req.handle.released and reason != "error":
                before = req.committed
                self._cache_blocks(req)
                self._keep_windows(req, before, end=True)
        except Exception as exc:
            self.stats.faults += 1
            reason, error = "error", exc
        finally:
            if req.handle is not None and not req.handle.released:
                self.cache.release(req.handle)
            self._release_state(req)
            req.handle = None
            req.status = Status.FINISHED
            self.scheduler.finish(req)
            self.stats.finished += 1
        if isinstance(error, str):
            error = RuntimeError(error)
        k = req.top_logprobs
        top = tuple(dict(sorted(t.items(), key=lambda kv: -kv[1])[:k]) for t in req.top) if k else ()
        result = RequestResult(
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
            try:
                req.sink.finished(result)
            except Exception as exc:
                log.warning("prefixcache engine: request %s's sink failed on its result: %r", req.id, exc)

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
