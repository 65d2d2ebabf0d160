"""Random match / commit / release / reset against a brute-force block-level LRU model written independently.

The reference keeps one record per cached block, keyed by its namespace and the whole token prefix up to and
including the block: (last access tick, pin count, pool block id). Every match and every commit is one tick.
A match touches and pins the leading cached blocks of the prompt (at most (n-1)//bs); a commit touches the
leading cached blocks of the committed sequence, moves the request's pins onto them, then evicts the least
recently used unpinned block without a cached child (ties: deeper first; namespaces share the pool) until
the new blocks fit or nothing is evictable, and caches what fits. Every hit, every commit result, every
``divergence`` and the exact set of cached pool block ids are compared after every step; a listener mirrors
the cache from its events and must hold exactly the reference's blocks under their ``block_keys``; only
namespaces holding blocks have a root; check_integrity() runs after every step. Small pools make allocations
span several freed runs; block size 1 makes every token a block.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from prefixcache import CacheConfig, PrefixCache
from prefixcache.core import BlocksRemoved, BlocksStored, CacheCleared, block_keys

NAMESPACES = ["default", "t1", "t2"]
BASES = [(), (0, 0, 0, 0), (0, 1, 2, 0, 1, 2, 0, 1), (1, 1, 1, 1, 2, 2, 2, 2), (2,)]


@dataclass
class Block:
    time: int
    pins: int
    block_id: int = -1


class Reference:
    """Brute-force block-level LRU over token prefixes."""

    def __init__(self, num_blocks: int, bs: int) -> None:
        self.num_blocks, self.bs = num_blocks, bs
        self.blocks: dict[tuple, Block] = {}  # (namespace, *prefix) -> its record
        self.pinned: dict[int, list[tuple]] = {}  # request -> blocks it pins
        self.tick = 0
        self.evicted = 0
        self.inserted = 0

    def prefixes(self, ns: str, tokens: tuple, nblocks: int) -> list[tuple]:
        return [(ns, *tokens[: (i + 1) * self.bs]) for i in range(nblocks)]

    def cached_run(self, ns: str, tokens: tuple, nblocks: int) -> list[tuple]:
        run = []
        for p in self.prefixes(ns, tokens, nblocks):
            if p not in self.blocks:
                break
            run.append(p)
        return run

    def served(self, ns: str, tokens: tuple) -> list[tuple]:
        return self.cached_run(ns, tokens, (len(tokens) - 1) // self.bs)

    def match(self, rid: int, ns: str, tokens: tuple) -> list[tuple]:
        self.tick += 1
        run = self.served(ns, tokens)
        for p in run:
            self.blocks[p].time = self.tick
            self.blocks[p].pins += 1
        self.pinned[rid] = run
        return run

    def has_child(self, p: tuple) -> bool:
        return any(len(q) == len(p) + self.bs and q[: len(p)] == p for q in self.blocks)

    def commit(self, rid: int, ns: str, tokens: tuple) -> tuple[list[tuple], list[tuple], int]:
        """Returns (cached run before, newly cached blocks, blocks not cached)."""
        self.tick += 1
        nb = len(tokens) // self.bs
        run = self.cached_run(ns, tokens, nb)
        for p in run:
            self.blocks[p].time = self.tick
            self.blocks[p].pins += 1
        for p in self.pinned[rid]:
            self.blocks[p].pins -= 1
        want = nb - len(run)
        free = self.num_blocks - len(self.blocks)
        while free < want:
            leaves = [p for p, b in self.blocks.items() if b.pins == 0 and not self.has_child(p)]
            if not leaves:
                break
            victim = min(leaves, key=lambda p: (self.blocks[p].time, -len(p)))
            del self.blocks[victim]
            self.evicted += 1
            free += 1
        fit = min(want, free)
        new = self.prefixes(ns, tokens, nb)[len(run) : len(run) + fit]
        for p in new:
            self.blocks[p] = Block(self.tick, 1)
        self.inserted += fit
        self.pinned[rid] = run + new
        return run, new, want - fit

    def release(self, rid: int) -> None:
        for p in self.pinned.pop(rid):
            self.blocks[p].pins -= 1

    def reset(self, keep_stats: bool) -> None:
        self.blocks.clear()
        self.pinned.clear()
        if not keep_stats:
            self.evicted = self.inserted = 0

    def common(self, ns: str, tokens: tuple) -> int:
        """Longest common prefix, in tokens, of ``tokens`` with any cached path of ``ns``."""
        best = 0
        for p in self.blocks:
            if p[0] == ns:
                q = p[1:]
                n = 0
                while n < min(len(q), len(tokens)) and q[n] == tokens[n]:
                    n += 1
                best = max(best, n)
        return best


class Mirror:
    """The cache as a listener sees it: (namespace, mode, key) of every block, from events alone."""

    def __init__(self) -> None:
        self.keys: set[tuple] = set()

    def __call__(self, event: object) -> None:
        if isinstance(event, BlocksStored):
            assert event.parent is None or (event.namespace, event.mode, event.parent) in self.keys
            self.keys.update((event.namespace, event.mode, k) for k in event.keys)
        elif isinstance(event, BlocksRemoved):
            self.keys.difference_update((event.namespace, event.mode, k) for k in event.keys)
        else:
            assert isinstance(event, CacheCleared)
            self.keys.clear()


def machine(block_size: int, num_blocks: int, mode: str = "tokens", verify: bool = True, max_prompt: int = 14):
    """A state machine class comparing PrefixCache (``mode`` "tokens" or "keys") with Reference."""
    bs = block_size
    tail = st.lists(st.integers(0, 2), max_size=max_prompt)
    prompts = st.builds(lambda b, t: (b + tuple(t))[:max_prompt] or (0,), st.sampled_from(BASES), tail)
    extras = st.lists(st.integers(0, 2), max_size=2 * bs + 2).map(tuple)

    def keys_of(tokens: tuple, partial: bool) -> list[tuple]:
        """One key per block: the whole prefix up to the block's end (a partial last block too if asked)."""
        n = -(-len(tokens) // bs) if partial else len(tokens) // bs
        return [tokens[: (i + 1) * bs] for i in range(n)]

    class Machine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            cfg = CacheConfig(num_blocks=num_blocks, block_size=bs, verify_tokens=verify)
            self.cache = PrefixCache(cfg)
            self.mirror = Mirror()
            self.cache.subscribe(self.mirror)
            self.ref = Reference(num_blocks, bs)
            self.live: list[tuple[object, tuple]] = []  # (handle, prompt)

        @precondition(lambda self: len(self.live) < 4)
        @rule(prompt=prompts, ns=st.sampled_from(NAMESPACES))
        def match(self, prompt, ns):
            if mode == "tokens":
                m = self.cache.match(list(prompt), ns)
            else:
                n = len(prompt)
                m = self.cache.match_keys(keys_of(prompt, True), ns, max_blocks=(n - 1) // bs, num_tokens=n)
            run = self.ref.match(m.handle.id, ns, prompt)
            assert m.cached_tokens == len(run) * bs
            assert m.block_ids == tuple(self.ref.blocks[p].block_id for p in run)
            event(f"match: {'hit' if run else 'miss'}")
            self.live.append((m.handle, prompt))

        @precondition(lambda self: self.live)
        @rule(i=st.integers(0, 3), extra=extras, other=st.none() | prompts)
        def commit(self, i, extra, other):
            handle, prompt = self.live[i % len(self.live)]
            seq = (prompt if other is None else other) + extra
            default = seq == prompt and (mode == "tokens" or len(prompt) % bs == 0)
            if mode == "tokens":
                r = self.cache.commit(handle, None if default else list(seq))
            else:
                r = self.cache.commit_keys(handle, None if default else keys_of(seq, False))
            evicted = self.ref.evicted
            run, new, not_cached = self.ref.commit(handle.id, handle.namespace, seq)
            assert (r.first_block, len(r.block_ids), r.not_cached) == (len(run), len(new), not_cached)
            assert r.cached_blocks == len(run) + len(new)
            for p, b in zip(new, r.block_ids):
                self.ref.blocks[p].block_id = b
            event(f"commit: evicted {'some' if self.ref.evicted > evicted else 'none'}")
            event(f"commit: {'some' if r.not_cached else 'no'} blocks did not fit")

        @precondition(lambda self: self.live)
        @rule(i=st.integers(0, 3))
        def release(self, i):
            handle, _ = self.live.pop(i % len(self.live))
            self.cache.release(handle)
            self.ref.release(handle.id)

        @rule(keep_stats=st.booleans(), when=st.integers(0, 9))
        def reset(self, keep_stats, when):
            if when:  # rarely: most runs should build up a full pool
                return
            self.cache.reset(keep_stats=keep_stats)
            self.ref.reset(keep_stats)
            self.live.clear()
            event("reset")

        if mode == "tokens":

            @rule(prompt=prompts, ns=st.sampled_from(NAMESPACES))
            def probe(self, prompt, ns):
                assert self.cache.probe(list(prompt), ns) == len(self.ref.served(ns, prompt)) * bs

            @rule(prompt=prompts, ns=st.sampled_from(NAMESPACES), context=st.integers(0, 5))
            def divergence(self, prompt, ns, context):
                d = self.cache.divergence(list(prompt), ns, context=context)
                assert d.cached_tokens == len(self.ref.served(ns, prompt)) * bs
                assert d.common_tokens == self.ref.common(ns, prompt)
                ext = (ns, *prompt[: d.common_tokens], *d.cached_next)
                assert len(d.cached_next) <= context
                assert not d.cached_next or any(p[: len(ext)] == ext for p in self.ref.blocks)

        @invariant()
        def agrees(self):
            self.cache.check_integrity()
            ref = self.ref
            assert self.cache.num_cached_blocks == len(ref.blocks)
            cached_ids = {b for node in self.cache.tree.nodes() for b in node.blocks}
            assert cached_ids == {blk.block_id for blk in ref.blocks.values()}
            assert self.cache.num_active_requests == len(self.live)
            s = self.cache.stats
            assert (s.blocks_evicted, s.blocks_inserted) == (ref.evicted, ref.inserted)
            assert set(self.cache.tree.roots) == {(mode, p[0]) for p in ref.blocks}  # empty namespaces cost nothing

        @invariant()
        def mirrored(self):
            if mode == "tokens":
                expected = {(p[0], mode, block_keys(list(p[1:]), p[0], block_size=bs)[-1]) for p in self.ref.blocks}
            else:
                expected = {(p[0], mode, tuple(p[1:])) for p in self.ref.blocks}
            assert self.mirror.keys == expected

    Machine.TestCase.settings = settings(
        max_examples=120, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
    )
    return Machine


TestTokensBlock1 = machine(1, 6, max_prompt=8).TestCase
TestTokensBlock4 = machine(4, 8).TestCase
TestTokensBlock4NoVerify = machine(4, 10, verify=False).TestCase
TestKeysBlock1 = machine(1, 7, mode="keys", max_prompt=8).TestCase
TestKeysBlock4 = machine(4, 8, mode="keys").TestCase
