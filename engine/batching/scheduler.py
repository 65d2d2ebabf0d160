"""The continuous-batching scheduler: which requests run in the next step, and how many tokens each.

One step is a flat batch under ``max_step_tokens``: first every running request that is decoding gets its one
token, then prefill chunks (at most ``max_chunk_tokens`` each) go to running requests still prefilling and to
waiting requests, which are admitted while the budget, ``max_running`` and the pool allow. Admission matches (and
pins) the request's longest cached prefix, so only the rest is computed. Who gets the prefill budget is
``prefill_order``: ``"shortest"`` (the default) gives it to the fewest uncached prompt tokens first, running and
waiting requests alike (a waiting one's from ``PrefixCache.probe``), so a short turn behind a long prompt gets its
first token after one chunk instead of after the whole prompt; a request passed over counts ``max_chunk_tokens``
fewer tokens for every step it was passed over, so a long one is never starved. ``"arrival"`` gives it to running
requests oldest first, then admits waiting ones in arrival order. The waiting queue is kept in arrival order;
when it is longer than ``lpm_queue`` it is taken longest cached prefix first (SGLang's LPM), so requests that
share a cached prefix run while it is hot. A waiting request that shares an uncached prefix (a block or more)
with a request being prefilled now waits for it: one computes the prefix, the other then finds it cached.

Blocks: each scheduled request gets the pool blocks its tokens need this step (``PrefixCache.allocate``, which
evicts unpinned cached blocks). When the pool runs short for a running request, the most recently admitted
running request is preempted: its computed full blocks are cached (and so survive unless evicted), its own blocks
freed, and it goes back to the front of the queue; resumed, it matches its blocks again and computes only what
was evicted. A waiting request never preempts a running one. With a window group (``prefixcache.core.windows``) a
request also holds window slots for the blocks its window reads this step (taken with its blocks, short slots
preempting the same way); the engine lets go of those that fall out of its window.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.batching.request import Request, Status
from engine.hybrid.store import HybridStates
from prefixcache.core.cache import OutOfBlocks, PrefixCache, RequestHandle
from prefixcache.core.snapshots import snapshot_points
from prefixcache.core.windows import OutOfWindowSlots

PREFILL_ORDERS = ("shortest", "arrival")


@dataclass(frozen=True)
class SchedulerConfig:
    """Step budget and admission limits (see the module docstring). At most ``min(max_running,
    max_step_tokens)`` requests run at once: each decodes one token every step."""

    max_step_tokens: int = 256  # 1024 was measured (docs/engine.md): chat TTFT p50 up by half, agent req/s level
    max_chunk_tokens: int = 256
    max_running: int = 32
    lpm_queue: int = 16
    share_wait: bool = True
    prefill_order: str = "shortest"  # "shortest" (fewest uncached tokens first, with aging) or "arrival"

    def __post_init__(self) -> None:
        if self.prefill_order not in PREFILL_ORDERS:
            raise ValueError(f"prefill_order must be one of {PREFILL_ORDERS}, got {self.prefill_order!r}")
        for name in ("max_step_tokens", "max_chunk_tokens", "max_running"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if isinstance(self.lpm_queue, bool) or not isinstance(self.lpm_queue, int) or self.lpm_queue < 0:
            raise ValueError(f"lpm_queue must be an int >= 0, got {self.lpm_queue!r}")


@dataclass
class Plan:
    """One step: ``work`` (request, tokens to compute) in batch order; requests preempted and failed meanwhile
    (with why: "cancelled", a message, or the exception raised while planning for that request)."""

    work: list[tuple[Request, int]]
    preempted: list[Request]
    failed: list[tuple[Request, str | Exception]]


class Scheduler:
    """Holds the waiting and running queues; ``schedule()`` plans the next step. Engine thread only."""

    def __init__(
        self,
        cache: PrefixCache,
        config: SchedulerConfig,
        preempt: Callable[[Request], None],
        admitted: Callable[[Request], None] = lambda req: None,
        hybrid: HybridStates | None = None,
    ) -> None:
        self.cache = cache
        self.hybrid = hybrid  # a hybrid model's states: admission restores a snapshot into a live slot
        self.config = config
        self.block_size = cache.block_size
        self._preempt = preempt  # caches a request's computed blocks and releases it (the engine's)
        self._admitted = admitted  # told of a request just matched (may move its ``computed`` back)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- planning ------------------------------------------------------------------------------------------
    def schedule(self) -> Plan:
        """Plan the next step. Changes the cache: pins admitted requests' prefixes and allocates blocks."""
        cfg = self.config
        plan = Plan([], [], [])
        budget = cfg.max_step_tokens
        # decoding requests first (one token each), then prefill chunks
        for req in [r for r in self.running if r.remaining <= 1]:
            budget -= self._run(req, plan, budget)
        prefilling = [r for r in self.running if r.remaining > 1]
        if cfg.prefill_order == "shortest":
            self._shortest_first(plan, budget, prefilling)
            return plan
        for req in prefilling:  # in admission order
            budget -= self._run(req, plan, budget)
        self._admit(plan, budget)
        return plan

    def _run(self, req: Request, plan: Plan, budget: int) -> int:
        """Plan a running request's next token or prefill chunk within ``budget``; returns the tokens planned (0:
        none: no budget, or it was preempted or failed meanwhile)."""
        if req.status is not Status.RUNNING or budget <= 0:  # preempted while planning this step
            return 0
        n = 1 if req.remaining == 1 else self._chunk(req, min(req.remaining, self.config.max_chunk_tokens, budget))
        if n <= 0:
            return 0
        try:
            if not self._blocks_for(req, n, plan):
                return 0
        except Exception as exc:  # this request's fault alone: it fails, the others are planned
            self._drop(req, plan, exc)
            return 0
        plan.work.append((req, n))
        return n

    def _shortest_first(self, plan: Plan, budget: int, prefilling: list[Request]) -> None:
        """``prefill_order="shortest"``: the prefill budget to running and waiting requests by fewest uncached
        prompt tokens, less ``max_chunk_tokens`` for every step each was passed over (ties: arrival order).
        Waiting requests are admitted as in ``_admit`` (the same checks); once the pool turns one away, no other
        is admitted this step."""
        cfg = self.config
        if len(self.waiting) > cfg.lpm_queue:
            self._longest_prefix_first()
        probe = self.cache.probe
        keyed: list[tuple[int, int, Request]] = [(r.remaining, 0, r) for r in prefilling]
        for r in self.waiting:
            uncached = 0 if r.cancelled else r.end - probe(r.tokens[: r.cache_limit], r.namespace)
            keyed.append((uncached, 1, r))
        keyed.sort(key=lambda x: (x[0] - x[2].passed_over * cfg.max_chunk_tokens, x[2].arrival))
        most = min(cfg.max_running, cfg.max_step_tokens)
        admitting = True
        for _, waiting, req in keyed:
            if not waiting:
                n = self._run(req, plan, budget)
            elif not req.cancelled and (not admitting or budget <= 0 or len(self.running) >= most):
                n = 0
            else:
                n, left = self._admit_one(req, plan, budget)
                if left:  # out of the queue now (a preemption later in this step may put it back)
                    self.waiting.remove(req)
                admitting = n >= 0
            if n > 0:
                budget -= n
            elif req.status is not Status.FINISHED:
                req.passed_over += 1

    def _admit_one(self, req: Request, plan: Plan, budget: int) -> tuple[int, bool]:
        """Admit waiting ``req`` for a first chunk within ``budget`` (cancelled, too big, sharing an uncached
        prefix with a prefilling request, failing: ``_admit``'s checks). Returns its tokens this step (0: none; -1:
        the pool is short, nothing changed) and whether it left the waiting queue (admitted, cancelled or failed);
        the caller takes it out of the queue."""
        if req.cancelled:
            plan.failed.append((req, "cancelled"))
            return 0, True
        if -(-len(req.tokens) // self.block_size) > self.cache.num_blocks:
            plan.failed.append((req, self._too_big_prompt(req)))
            return 0, True
        if self.config.share_wait and self._shares_uncached(req, plan):
            return 0, False
        try:
            n = self._start(req, plan, budget)
        except Exception as exc:  # e.g. its tier load or log-prob lookup: it fails, admission goes on
            self._drop(req, plan, exc)
            return 0, True
        return (n, True) if n else (-1, False)

    def _blocks_for(self, req: Request, n: int, plan: Plan) -> bool:
        """Give a running request the blocks for ``n`` more tokens, preempting newer running requests (or, last,
        itself) when the pool is short. False when ``req`` itself was preempted or failed."""
        need = self._blocks_needed(req, n)
        if need <= 0 and self.cache.windows is None:
            return True
        assert req.handle is not None
        while True:
            try:
                if need > 0:
                    req.table.extend(self.cache.allocate(req.handle, need))
                    need = 0
                self._window(req, n)
                return True
            except (OutOfBlocks, OutOfWindowSlots):
                victim = self._newest_running(excluding=None)
                if victim is None or (victim is req and len(self.running) == 1):
                    plan.failed.append((req, self._too_big(req)))
                    return False
                self._preempt_one(victim, plan)
                if victim is req:
                    return False

    def _window(self, req: Request, n: int) -> None:
        """With a window group: hold window slots for the blocks ``req``'s next ``n`` tokens read and write there
        (from the window of its last block boundary on). Raises ``OutOfWindowSlots`` when they cannot be had."""
        ws = self.cache.windows
        if ws is None or n <= 0:
            return
        assert req.handle is not None
        bs = self.block_size
        lo, hi = ws.first_block(req.computed // bs), -(-(req.computed + n) // bs)
        ws.give(("request", req.handle.id), req.table[lo:hi])

    def _blocks_needed(self, req: Request, n: int) -> int:
        bs = self.block_size
        return -(-(req.computed + n) // bs) - len(req.table)

    def _newest_running(self, excluding: Request | None) -> Request | None:
        for r in reversed(self.running):
            if r is not excluding and r.status is Status.RUNNING:
                return r
        return None

    def _preempt_one(self, req: Request, plan: Plan) -> None:
        self._preempt(req)
        self.running.remove(req)
        plan.work = [(r, n) for r, n in plan.work if r is not req]
        plan.preempted.append(req)
        self.waiting.appendleft(req)
        self.preemptions += 1

    def _too_big(self, req: Request) -> str:
        need = -(-(req.computed + 1) // self.block_size)
        return (
            f"the KV pool ({self.cache.num_blocks} blocks of {self.block_size} tokens) cannot hold this request's "
            f"{req.computed + 1} tokens ({need} blocks) even with nothing else running; raise max_cached_tokens"
        )

    def _admit(self, plan: Plan, budget: int) -> None:
        cfg = self.config
        if not self.waiting:
            return
        if len(self.waiting) > cfg.lpm_queue:
            self._longest_prefix_first()
        skipped: list[Request] = []
        most = min(cfg.max_running, cfg.max_step_tokens)  # every running request decodes a token each step
        while self.waiting and budget > 0 and len(self.running) < most:
            req = self.waiting.popleft()
            n, left = self._admit_one(req, plan, budget)
            if n < 0:  # the pool is short: it stays first
                self.waiting.appendleft(req)
                break
            if not left:  # it waits for a request prefilling what it shares
                skipped.append(req)
            budget -= n
        self.waiting.extendleft(reversed(skipped))

    def _chunk(self, req: Request, n: int) -> int:
        """A hybrid request's prefill chunk of up to ``n`` tokens ends at its next snapshot point inside it, else at
        the last block boundary inside it (unless it finishes the prompt), so that its state is at hand wherever
        the snapshot policy wants one; other requests take ``n``."""
        if self.hybrid is None or n <= 1:
            return n
        bs, start = self.block_size, req.computed
        end = start + n
        point = next((p * bs for p in req.state_points if start < p * bs < end), None)
        if point is not None:
            return point - start
        if end < req.end and end // bs > start // bs:
            return (end // bs) * bs - start
        return n

    def _match(self, req: Request) -> tuple[RequestHandle, list[int], int] | None:
        """Match and pin ``req``'s cached prefix: its handle, the pool blocks of the prefix and the tokens it
        serves. A hybrid model's request also takes a live state slot (None: every slot is taken; nothing changed)
        and is served only up to the deepest snapshot its KV reaches, the tier's included (``HybridStates.admit``:
        K/V blocks beyond it stay in its table, attended to but recomputed); the snapshot's state goes into its slot
        and its snapshot points are planned here."""
        hy, limit = self.hybrid, req.cache_limit
        if hy is None:
            m = self.cache.match(req.tokens[:limit], req.namespace)
            if self.cache.windows is not None:  # the window group's points, kept as the request passes them
                req.state_points = snapshot_points(
                    block_size=self.block_size,
                    restored=m.cached_blocks,
                    matched=m.handle.kv_blocks,
                    limit=limit,
                    prompt_blocks=(len(req.prompt) if not req.scoring else req.commit_limit) // self.block_size,
                    hints=req.snapshot_hints,
                )
            return m.handle, list(m.block_ids), m.cached_tokens
        slot = hy.take_live()
        if slot is None:
            return None
        try:
            a = hy.admit(self.cache, req.tokens, req.namespace, req.block_keys, limit)
            if a.slot is not None:
                hy.pool.copy(slot, a.slot)
        except BaseException:
            hy.give_back(slot)
            raise
        req.state_slot, req.has_state = slot, a.slot is not None
        bs = self.block_size
        req.tier_tokens = max(0, a.restored - a.match.cached_blocks) * bs
        prompt = len(req.prompt) if not req.scoring else req.commit_limit
        req.state_points = hy.points(
            restored=a.restored,
            matched=max(a.kv, len(a.blocks)),
            limit=limit,
            prompt_tokens=prompt,
            hints=req.snapshot_hints,
        )
        return a.match.handle, list(a.blocks), a.restored * bs

    def _start(self, req: Request, plan: Plan, budget: int) -> int:
        """Match, pin and allocate for ``req``'s first chunk; returns its tokens this step, or 0 (nothing changed)
        when the pool (or a hybrid model's state pool) is short."""
        matched = self._match(req)
        if matched is None:
            return 0
        handle, blocks, cached = matched
        req.handle, req.table, req.computed, req.committed = handle, blocks, cached, len(blocks)
        self._admitted(req)  # may load blocks from the tier (req.tier_tokens)
        if req.cached_tokens < 0:
            req.cached_tokens = req.computed if self.hybrid is not None else cached + req.tier_tokens
        n = 1 if req.remaining == 1 else self._chunk(req, min(req.remaining, self.config.max_chunk_tokens, budget))
        try:
            req.table.extend(self.cache.allocate(handle, max(0, self._blocks_needed(req, n))))
            self._window(req, n)
        except (OutOfBlocks, OutOfWindowSlots):
            self.cache.release(handle)
            if self.hybrid is not None and req.state_slot is not None:
                self.hybrid.give_back(req.state_slot)
            req.handle, req.table, req.computed, req.committed = None, [], 0, 0
            req.state_slot, req.has_state = None, False
            return 0
        req.status = Status.RUNNING
        self.running.append(req)
        plan.work.append((req, n))
        return n

    def _drop(self, req: Request, plan: Plan, error: Exception) -> None:
        """Take ``req`` out of this step and the queues: it failed with ``error`` (the engine finishes it)."""
        if req in self.running:
            self.running.remove(req)
        plan.work = [(r, n) for r, n in plan.work if r is not req]
        plan.failed.append((req, error))

    def _too_big_prompt(self, req: Request) -> str:
        need = -(-(len(req.tokens)) // self.block_size)
        return (
            f"the prompt needs {need} blocks of {self.block_size} tokens; the KV pool holds "
            f"{self.cache.num_blocks}: raise max_cached_tokens"
        )

    def _shares_uncached(self, req: Request, plan: Plan) -> bool:
        """Whether ``req`` shares at least one block it does not find cached with a request still prefilling
        (which will cache it): then ``req`` had better wait and find it cached."""
        prefilling = [r for r in self.running if r.remaining > 1 and r.namespace == req.namespace]
        if not prefilling:
            return False
        bs = self.block_size
        limit = req.cache_limit
        cached = self.cache.probe(req.tokens[:limit], req.namespace)
        for other in prefilling:
            common = _common_prefix(req.tokens, other.tokens, min(limit - 1, other.commit_limit))
            if (common // bs) * bs > cached:
                if self.hybrid is not None and common // bs * bs > other.computed:
                    # where they part is where a snapshot pays: the running one keeps its state there (its chunk
                    # planned for this step, if it runs past that point, ends there)
                    point = common // bs
                    other.state_points = sorted({*other.state_points, point})
                    plan.work = [
                        (r, point * bs - r.computed if r is other and r.computed < point * bs < r.computed + n else n)
                        for r, n in plan.work
                    ]
                return True
        return False

    def _longest_prefix_first(self) -> None:
        """Order the waiting queue by cached prefix length, longest first (ties: arrival order)."""
        probe = self.cache.probe
        keyed = [(-probe(r.tokens[: r.cache_limit], r.namespace), i, r) for i, r in enumerate(self.waiting)]
        keyed.sort(key=lambda x: (x[0], x[1]))
        self.waiting = deque(r for _, _, r in keyed)

    def finish(self, req: Request) -> None:
        """Take a finished request out of the running queue."""
        if req in self.running:
            self.running.remove(req)


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    i = 0
    step = 64
    while i < n:  # compare in slices (C-level list compares), then narrow down
        j = min(i + step, n)
        if a[i:j] == b[i:j]:
            i = j
            continue
        while i < j and a[i] == b[i]:
            i += 1
        return i
    return n
