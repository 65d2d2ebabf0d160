"""Random match / commit / release / clock steps against brute-force block-level models of the FIFO, LFU and
priority eviction policies (LRU too, with retention and namespaces it ignores), written from the documented
semantics, not from the core's code.

The reference keeps one record per cached block, keyed by (mode, namespace, whole prefix up to the block's
end): last access tick, creation tick, hit count, keep_until (None: never kept), pins and pool block id.
Every match and every commit is one tick. A match serves, hits, touches and pins the leading cached blocks
of the prompt (at most (n-1)//bs). A commit touches (no hit) the leading cached blocks of the committed
sequence and pins them, drops the request's old pins, evicts one block at a time until the new blocks fit
or nothing is evictable, caches what fits as new blocks (created now, no hits, pinned), then marks the first
keep_blocks (keep_tokens // bs) blocks of the request's cached path kept until clock() + keep_for (keep_for
defaults to the namespace's ``retain_namespace`` value; a mark only ever moves later). Evictable: unpinned
blocks with no cached child block. The victim is the minimum over ALL evictable blocks of its policy's key:

- lru: last access; fifo: creation tick; lfu: (hits, last access);
- priority: every block not retained at clock() (keep_until <= now) before any retained one; unretained by
  last access, retained by (keep_until, last access). A block kept until t is NOT retained at clock t.

Why this block-level model is the node-level cache: all blocks of one node share last access, creation,
hits, keep_until and pins. A node is born with one value of each; match and commit split the node where
their path ends and then touch/hit/pin whole nodes; retention splits where keep_blocks ends; a split copies
all of them to both halves. So the evictable nodes' tail blocks are exactly the model's evictable blocks,
with the same keys. Everything one tick touches or creates lies on one root path, and two childless blocks
never share a root path, so no two evictable blocks share a last access or a creation tick: every key above
is unique among evictable blocks (the model asserts it), so the core's tie-break by node id never decides.
The core evicts up to ``need`` blocks from its victim's tail at once; block by block, the block left at that
tail has the victim's key and stays the minimum, so the same blocks go. The retention test is evaluated at
each eviction on the current clock (which these machines only move forward), as the docs say.

Steps: requests (tokens or keys, one of 3 namespaces, fresh or a recent sequence cut and extended) that stay
live (up to 4) or run whole (match, commit, release); commits with keep_for / keep_tokens / keep_blocks;
retain_namespace; the fake clock moves before a request, by a step or landing EXACTLY on a pending expiry.
Compared after every step: every hit (cached tokens, block count, block ids), every CommitResult (first
block, cached blocks, not_cached, number of new ids), the cache's tree as a map block id -> (mode, namespace,
parent block id) against the model's prefixes (labelled by the ids the commits returned: the exact set of
cached prefixes), the stats counters, and check_integrity(). Four scripted runs of the same machine pin
the retention boundaries random runs reach only sometimes (expiry exactly at t, equal expiries, a shorter
keep, a split retained run).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, currently_in_test_context, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from prefixcache import CacheConfig, PrefixCache

Key = tuple[str, str, tuple[int, ...]]  # (mode, namespace, whole token prefix up to the block's end)

NAMESPACES = ("default", "a", "b")
MODES = ("tokens", "keys")
BASES = [(), (0, 0, 0, 0), (0, 1, 2, 0, 1, 2, 0, 1), (1, 1, 1, 1, 2, 2, 2, 2), (2,)]
KEEP_FORS = st.none() | st.sampled_from([0, 1, 2, 3, 2.5])  # binary fractions: clock sums stay exact


@dataclass
class Block:
    last_access: int
    created: int
    pins: int
    hits: int = 0
    keep_until: float | None = None
    block_id: int | None = None


def _retained(b: Block, now: float) -> bool:
    return b.keep_until is not None and b.keep_until > now


def _priority_key(b: Block, now: float) -> tuple:
    return (1, b.keep_until, b.last_access) if _retained(b, now) else (0, b.last_access)


VICTIM_KEYS: dict[str, Callable[[Block, float], tuple]] = {
    "lru": lambda b, now: (b.last_access,),
    "fifo": lambda b, now: (b.created,),
    "lfu": lambda b, now: (b.hits, b.last_access),
    "priority": _priority_key,
}


def _note(what: str) -> None:
    """A hypothesis event (coverage statistics); a no-op when a scripted test drives the machine by hand."""
    if currently_in_test_context():
        event(what)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Reference:
    """Brute-force block-level cache with one of the VICTIM_KEYS policies."""

    def __init__(self, policy: str, num_blocks: int, bs: int) -> None:
        self.victim_key = VICTIM_KEYS[policy]
        self.num_blocks, self.bs = num_blocks, bs
        self.blocks: dict[Key, Block] = {}
        self.pinned: dict[int, list[Key]] = {}  # request -> blocks it pins
        self.namespace_keep: dict[str, float] = {}
        self.tick = 0
        self.evicted = self.inserted = self.not_cached = 0
        self.lookups = self.hit_blocks = 0

    def run(self, mode: str, ns: str, tokens: tuple, nblocks: int) -> list[Key]:
        """The leading cached blocks of ``tokens`` (at most ``nblocks``)."""
        out: list[Key] = []
        for i in range(nblocks):
            k = (mode, ns, tokens[: (i + 1) * self.bs])
            if k not in self.blocks:
                break
            out.append(k)
        return out

    def served(self, mode: str, ns: str, tokens: tuple) -> list[Key]:
        return self.run(mode, ns, tokens, (len(tokens) - 1) // self.bs)

    def match(self, rid: int, mode: str, ns: str, tokens: tuple) -> list[Key]:
        self.tick += 1
        run = self.served(mode, ns, tokens)
        for k in run:
            b = self.blocks[k]
            b.last_access = self.tick
            b.hits += 1
            b.pins += 1
        self.pinned[rid] = run
        self.lookups += 1
        self.hit_blocks += len(run)
        return run

    def evictable(self) -> list[Key]:
        parents = {(m, ns, p[: -self.bs]) for m, ns, p in self.blocks}
        return [k for k, b in self.blocks.items() if b.pins == 0 and k not in parents]

    def evict_one(self, now: float) -> Key | None:
        """Drop the policy's victim among all evictable blocks; None when nothing is evictable."""
        keys = {k: self.victim_key(self.blocks[k], now) for k in self.evictable()}
        if not keys:
            return None
        victim = min(keys, key=keys.__getitem__)
        assert list(keys.values()).count(keys[victim]) == 1, f"model: tied victims at {keys[victim]}"
        if any(self.blocks[k].keep_until == now for k in keys):
            _note("eviction with an evictable block exactly at its expiry")
        if _retained(self.blocks[victim], now):
            _note("a retained block was evicted")
        del self.blocks[victim]
        self.evicted += 1
        return victim

    def commit(
        self, rid: int, mode: str, ns: str, seq: tuple, now: float, keep_for: float | None, keep_blocks: int | None
    ) -> tuple[list[Key], list[Key], int]:
        """Returns (cached run before, newly cached blocks, blocks not cached)."""
        self.tick += 1
        nb = len(seq) // self.bs
        run = self.run(mode, ns, seq, nb)
        for k in run:
            self.blocks[k].last_access = self.tick
            self.blocks[k].pins += 1
        for k in self.pinned[rid]:
            self.blocks[k].pins -= 1
        want = max(0, nb - len(run))
        free = self.num_blocks - len(self.blocks)
        while free < want and self.evict_one(now) is not None:
            free += 1
        fit = min(want, free)
        new = [(mode, ns, seq[: (i + 1) * self.bs]) for i in range(len(run), len(run) + fit)]
        for k in new:
            self.blocks[k] = Block(last_access=self.tick, created=self.tick, pins=1)
        self.inserted += fit
        self.not_cached += want - fit
        self.pinned[rid] = run + new
        if keep_for is None:
            keep_for = self.namespace_keep.get(ns)
        if keep_for is not None:
            until = now + float(keep_for)
            for k in (run + new)[:keep_blocks]:
                b = self.blocks[k]
                b.keep_until = until if b.keep_until is None else max(b.keep_until, until)
        return run, new, want - fit

    def release(self, rid: int) -> None:
        for k in self.pinned.pop(rid):
            self.blocks[k].pins -= 1

    def expiries_after(self, now: float) -> list[float]:
        return sorted({b.keep_until for b in self.blocks.values() if b.keep_until is not None and b.keep_until > now})

    def shape(self) -> dict[int, tuple[str, str, int | None]]:
        """block id -> (mode, namespace, the block id of its parent prefix, None at the root)."""
        out: dict[int, tuple[str, str, int | None]] = {}
        for (mode, ns, p), b in self.blocks.items():
            assert b.block_id is not None
            above = self.blocks[(mode, ns, p[: -self.bs])].block_id if len(p) > self.bs else None
            out[b.block_id] = (mode, ns, above)
        return out


def cache_shape(cache: PrefixCache) -> dict[int, tuple[str, str, int | None]]:
    """The cache's tree as block id -> (mode, namespace, parent block id), read from its roots and nodes."""
    out: dict[int, tuple[str, str, int | None]] = {}
    for (mode, ns), root in cache.tree.roots.items():
        stack: list[tuple[Any, int | None]] = [(root, None)]
        while stack:
            node, above = stack.pop()
            for b in node.blocks:
                assert int(b) not in out, f"block {b} cached twice"
                out[int(b)] = (mode, ns, above)
                above = int(b)
            stack.extend((child, above) for child in node.children.values())
    return out


@dataclass
class Live:
    handle: Any
    mode: str
    namespace: str
    prompt: tuple


def machine(
    policy: str,
    block_size: int,
    num_blocks: int,
    max_prompt: int = 14,
    modes: tuple[str, ...] = MODES,
    keep_all: float | None = None,
):
    """A state machine class comparing PrefixCache(eviction=``policy``) with Reference, requests in ``modes``.

    ``keep_all``: every commit keeps its whole path that long and the clock mostly stands still, so victims
    are often chosen among retained blocks only, with equal keep_until (the recency tie-break decides).
    """
    bs = block_size
    tail = st.lists(st.integers(0, 2), max_size=max_prompt)
    prompts = st.builds(lambda b, t: (b + tuple(t))[:max_prompt] or (0,), st.sampled_from(BASES), tail)
    # Often nothing more: a request that ends on a cached block touches it without a hit and without a new
    # child, which is where LRU, FIFO and LFU orders part.
    extras = st.just(()) | st.lists(st.integers(0, 2), max_size=2 * bs + 2).map(tuple)
    namespaces = st.sampled_from(NAMESPACES)
    modes_st = st.sampled_from(modes)
    agains = st.none() | st.integers(0, 15)
    waits = (st.none() | st.sampled_from([0.5, 1, 2])) if keep_all is None else st.sampled_from([None, None, None, 1])
    lands = st.none() | st.integers(0, 3)
    cuts = st.none() | st.integers(0, max_prompt)  # None: the whole earlier sequence
    keep_fors = KEEP_FORS if keep_all is None else st.just(keep_all)
    keep_counts = (st.none() | st.integers(0, 3)) if keep_all is None else st.none()
    keep_extras = st.integers(0, bs - 1)  # tokens mode: keep_tokens = keep_blocks * bs + keep_extra

    def keys_of(tokens: tuple, partial: bool) -> list[tuple]:
        """One key per block: the whole prefix up to the block's end (a partial last block too if asked)."""
        n = -(-len(tokens) // bs) if partial else len(tokens) // bs
        return [tokens[: (i + 1) * bs] for i in range(n)]

    class Machine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.clock = FakeClock()
            cfg = CacheConfig(num_blocks=num_blocks, block_size=bs, eviction=policy)
            self.cache = PrefixCache(cfg, clock=self.clock)
            self.ref = Reference(policy, num_blocks, bs)
            self.live: list[Live] = []
            self.history: list[tuple[str, str, tuple]] = []  # (mode, namespace, tokens) seen, for repeat visits

        def _move_clock(self, wait: float | None, land: int | None) -> None:
            """Advance the fake clock by ``wait``, or ``land`` it EXACTLY on a pending keep_until (from then on
            those blocks are no longer retained)."""
            times = self.ref.expiries_after(self.clock.now)
            if land is not None and times:
                self.clock.now = times[land % len(times)]
                _note("clock landed on an expiry")
            elif wait is not None:
                self.clock.now += wait

        def _pick(self, prompt: tuple, ns: str, mode: str, again: int | None, cut: int | None, extra: tuple) -> Live:
            """A fresh request, or (``again``) an earlier one's mode, namespace and tokens cut and extended."""
            if again is not None and self.history:
                mode, ns, seen = self.history[-1 - again % len(self.history)]  # 0: the latest
                prompt = (seen[:cut] + extra)[:max_prompt] or (0,)
            return Live(None, mode, ns, prompt)

        def _match(self, req: Live) -> None:
            mode, ns, prompt, n = req.mode, req.namespace, req.prompt, len(req.prompt)
            if mode == "tokens":
                m = self.cache.match(list(prompt), ns)
            else:
                m = self.cache.match_keys(keys_of(prompt, True), ns, max_blocks=(n - 1) // bs, num_tokens=n)
            run = self.ref.match(m.handle.id, mode, ns, prompt)
            assert m.cached_tokens == len(run) * bs and m.cached_blocks == len(run)
            assert m.block_ids == tuple(self.ref.blocks[k].block_id for k in run)
            _note(f"match: {'hit' if run else 'miss'}")
            req.handle = m.handle
            self.history.append((mode, ns, prompt))

        def _commit(
            self, req: Live, seq: tuple, keep_for: float | None, keep_blocks: int | None, keep_extra: int
        ) -> None:
            default = seq == req.prompt and (req.mode == "tokens" or len(seq) % bs == 0)
            if req.mode == "tokens":
                keep_tokens = None if keep_blocks is None else keep_blocks * bs + keep_extra
                r = self.cache.commit(
                    req.handle, None if default else list(seq), keep_for=keep_for, keep_tokens=keep_tokens
                )
            else:
                r = self.cache.commit_keys(
                    req.handle, None if default else keys_of(seq, False), keep_for=keep_for, keep_blocks=keep_blocks
                )
            evicted = self.ref.evicted
            run, new, not_cached = self.ref.commit(
                req.handle.id, req.mode, req.namespace, seq, self.clock.now, keep_for, keep_blocks
            )
            assert (r.first_block, len(r.block_ids), r.not_cached) == (len(run), len(new), not_cached)
            assert r.cached_blocks == len(run) + len(new)
            for k, b in zip(new, r.block_ids, strict=True):
                self.ref.blocks[k].block_id = int(b)
            _note(f"commit: evicted {'some' if self.ref.evicted > evicted else 'none'}")
            self.history.append((req.mode, req.namespace, seq))

        def _release(self, req: Live) -> None:
            self.cache.release(req.handle)
            self.ref.release(req.handle.id)

        @precondition(lambda self: len(self.live) < 4)
        @rule(
            wait=waits, land=lands, prompt=prompts, ns=namespaces, mode=modes_st, again=agains, cut=cuts, extra=extras
        )
        def match(self, wait, land, prompt, ns, mode, again, cut, extra):
            """A request arrives (after the clock moves) and stays live."""
            self._move_clock(wait, land)
            req = self._pick(prompt, ns, mode, again, cut, extra)
            self._match(req)
            self.live.append(req)

        @precondition(lambda self: self.live)
        @rule(
            i=st.integers(0, 3),
            extra=extras,
            other=st.none() | prompts,
            keep_for=keep_fors,
            keep_blocks=keep_counts,
            keep_extra=keep_extras,
        )
        def commit(self, i, extra, other, keep_for, keep_blocks, keep_extra):
            req = self.live[i % len(self.live)]
            seq = (req.prompt if other is None else other) + extra
            self._commit(req, seq, keep_for, keep_blocks, keep_extra)

        @precondition(lambda self: self.live)
        @rule(i=st.integers(0, 3))
        def release(self, i):
            self._release(self.live.pop(i % len(self.live)))

        @rule(
            wait=waits,
            land=lands,
            prompt=prompts,
            ns=namespaces,
            mode=modes_st,
            again=agains,
            cut=cuts,
            extra=extras,
            out=extras,
            keep_for=keep_fors,
            keep_blocks=keep_counts,
            keep_extra=keep_extras,
        )
        def serve(self, wait, land, prompt, ns, mode, again, cut, extra, out, keep_for, keep_blocks, keep_extra):
            """One whole request after the clock moves: match, commit the prompt plus ``out`` (its output), release."""
            self._move_clock(wait, land)
            req = self._pick(prompt, ns, mode, again, cut, extra)
            self._match(req)
            self._commit(req, req.prompt + out, keep_for, keep_blocks, keep_extra)
            self._release(req)

        @rule(ns=namespaces, keep_for=KEEP_FORS)
        def retain_namespace(self, ns, keep_for):
            self.cache.retain_namespace(ns, keep_for)
            if keep_for is None:
                self.ref.namespace_keep.pop(ns, None)
            else:
                self.ref.namespace_keep[ns] = keep_for

        @invariant()
        def agrees(self):
            self.cache.check_integrity()
            ref = self.ref
            assert self.cache.num_cached_blocks == len(ref.blocks)
            assert cache_shape(self.cache) == ref.shape()
            assert self.cache.num_active_requests == len(self.live)
            for mode, ns, tokens in self.history[-4:]:  # probe changes nothing: ask it about recent sequences
                if mode == "tokens":
                    assert self.cache.probe(list(tokens), ns) == len(ref.served(mode, ns, tokens)) * bs
            s = self.cache.stats
            counted = (s.lookups, s.hit_blocks, s.blocks_evicted, s.blocks_inserted, s.blocks_not_cached)
            assert counted == (ref.lookups, ref.hit_blocks, ref.evicted, ref.inserted, ref.not_cached)

    Machine.__name__ = f"{policy.capitalize()}{'' if keep_all is None else 'AllKept'}Block{bs}Machine"
    Machine.TestCase.settings = settings(
        max_examples=80, stateful_step_count=50, deadline=None, suppress_health_check=list(HealthCheck)
    )
    return Machine


TestFifoBlock1 = machine("fifo", 1, 10, max_prompt=6).TestCase
TestFifoBlock4 = machine("fifo", 4, 8).TestCase
TestLfuBlock1 = machine("lfu", 1, 10, max_prompt=6).TestCase
TestLfuBlock4 = machine("lfu", 4, 8).TestCase
TestPriorityBlock1 = machine("priority", 1, 10, max_prompt=6).TestCase
TestPriorityBlock4 = machine("priority", 4, 8).TestCase
TestPriorityAllKeptBlock4 = machine("priority", 4, 8, keep_all=1000).TestCase
TestLruRetentionIgnored = machine("lru", 1, 10, max_prompt=6).TestCase


# Scripted boundaries: the same machine and reference driven by hand through the exact situations that decide
# retention (block size 1, keys mode, one namespace); every step is compared with the reference by agrees(),
# and the hand-computed survivors confirm that each script reaches its boundary.


def _scripted(num_blocks: int) -> Any:
    return machine("priority", 1, num_blocks, modes=("keys",))()


def _serve(m: Any, at: float, token: int | tuple, keep_for: float | None = None) -> None:
    """One whole request for ``tokens`` (one block per token) at clock ``at``."""
    m.clock.now = at
    tokens = token if isinstance(token, tuple) else (token,)
    m.serve(None, None, tokens, "default", "keys", None, None, (), (), keep_for, None, 0)
    m.agrees()


def _touch(m: Any, at: float, tokens: tuple) -> None:
    """A request for ``tokens`` at clock ``at`` that matches and ends without committing."""
    m.clock.now = at
    m.match(None, None, tokens, "default", "keys", None, None, ())
    m.release(len(m.live) - 1)
    m.agrees()


def _cached(m: Any) -> set[tuple]:
    return {prefix for _mode, _ns, prefix in m.ref.blocks}


def test_kept_until_t_is_not_retained_at_t():
    for at, survivors in ((1.5, {(1,), (3,), (4,)}), (2, {(2,), (3,), (4,)})):  # (1) kept until 2, least recent
        m = _scripted(3)
        _serve(m, 0, 1, keep_for=2)
        _serve(m, 0, 2)
        _serve(m, 0, 3)
        _serve(m, at, 4)  # before 2: (2) goes, the least recent unretained; at 2 exactly: (1) goes
        assert _cached(m) == survivors


def test_retained_victims_with_equal_expiry_go_least_recent_first():
    m = _scripted(3)
    _serve(m, 0, 1, keep_for=5)
    _serve(m, 0, 2, keep_for=5)
    _serve(m, 0, 1, keep_for=5)  # (1), the older block, is used again
    _serve(m, 0, 3, keep_for=5)
    _serve(m, 0, 4, keep_for=5)  # everything is kept until 5: the least recent, (2), goes
    assert _cached(m) == {(1,), (3,), (4,)}


def test_a_shorter_keep_never_shortens_an_earlier_one():
    m = _scripted(3)
    _serve(m, 0, 1, keep_for=3)
    _serve(m, 1, 1, keep_for=0)  # asks to keep (1) until 1: it stays kept until 3
    _serve(m, 1, 2)
    _serve(m, 1, 3)
    _serve(m, 1, 4)  # (1) is retained: (2) goes, the least recent unretained
    assert _cached(m) == {(1,), (3,), (4,)}


def test_both_halves_of_a_split_keep_the_retention():
    m = _scripted(4)
    _serve(m, 0, (1, 2, 3), keep_for=5)  # one run of 3 blocks, kept until 5
    _serve(m, 0, 7, keep_for=5)
    _touch(m, 0, (1, 8))  # hits (1): the run splits into (1) and (1,2)(1,2,3); both halves kept until 5
    _serve(m, 0, (6, 5), keep_for=5)  # all kept: the least recent leaf, the run's tail, goes whole
    assert _cached(m) == {(1,), (7,), (6,), (6, 5)}
    _serve(m, 0, 4, keep_for=5)  # all kept until 5: (7) is less recent than (1)
    assert _cached(m) == {(1,), (6,), (6, 5), (4,)}
