"""Blocks a running request owns (``allocate``, ``commit_blocks``, ``borrowed_blocks``, ``release``), checked by a
random state machine against a brute-force model of what the cache must hold.

Requests run as the engine runs them: ``match`` a prompt (over a 3-token alphabet, so prompts share prefixes and
collide), the block table starts as the matched blocks; ``allocate`` appends blocks of its own; the request may
generate (append tokens); ``commit_blocks`` caches the full blocks it has computed (as many as its table covers),
then its table takes the tree's ids where the tree returned another one; ``release`` ends it. The model records,
per pool block, the (namespace, token prefix) whose KV a request wrote into it (a request writes its own blocks
when it commits them), and predicts every result from the tree's contents read before the call:

* ``match`` serves the longest run of cached blocks of the prompt (at most (n - 1) // block_size), with the ids
  the tree holds them under;
* ``commit_blocks`` walks the longest cached run of the committed blocks: those take the tree's ids (the request's
  own copies of them are duplicates, freed), the rest of its own blocks join the tree; nothing is evicted;
* ``allocate`` evicts exactly what it must (never a block a live request pins), hands out blocks that are neither
  cached nor held by any live request, or raises ``OutOfBlocks`` when free + unpinned cached blocks are too few
  (having evicted every unpinned block);
* ``release`` frees exactly the request's own blocks and evicts nothing.

Invariants after every rule: ``check_integrity()``; every cached block's recorded KV is its path's (namespace,
tokens), i.e. what the request that committed it wrote; free + cached + owned == num_blocks; each live request's
committed blocks are the tree's blocks for its tokens (pinned), its own blocks are its own, no block is held by
two requests. Block sizes 1-4, pools of 4-24 blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixcache import CacheConfig, PrefixCache
from prefixcache.core.cache import OutOfBlocks, RequestHandle
from prefixcache.core.hashing import TOKEN_DTYPE

NAMESPACES = ["a", "b"]
BASES = [(), (0, 0, 0, 0), (0, 1, 2, 0, 1, 2), (1, 1, 2, 2)]
prompts = st.builds(
    lambda b, t: (b + tuple(t))[:10] or (0,), st.sampled_from(BASES), st.lists(st.integers(0, 2), max_size=5)
)


@dataclass
class Live:
    handle: RequestHandle
    ns: str
    tokens: list[int]
    table: list[int]
    committed: int  # leading table entries that are the tree's blocks (pinned by this request)
    owned: set[int] = field(default_factory=set)


def tree_contents(cache: PrefixCache) -> dict[tuple, int]:
    """(namespace, token prefix up to and including the block) -> block id, for every cached block (read from the
    tree's nodes)."""
    bs = cache.block_size
    bb = cache.tree.block_bytes
    out: dict[tuple, int] = {}
    for node in cache.tree.nodes():
        chain = []
        n = node
        while n.parent is not None:
            chain.append(n)
            n = n.parent
        ns = n.namespace  # the root
        toks: list[int] = []
        for m in reversed(chain):
            toks.extend(np.frombuffer(m.token_view(bb), TOKEN_DTYPE).tolist())
        start = len(toks) - len(node.blocks) * bs
        for i, b in enumerate(list(node.blocks)):
            key = (ns, *toks[: start + (i + 1) * bs])
            assert key not in out, f"prefix {key} cached twice"
            out[key] = int(b)
    return out


class OwnedBlocks(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.live: list[Live] = []
        self.kv: dict[int, tuple] = {}  # pool block -> the (namespace, prefix) whose KV was written into it

    @initialize(bs=st.integers(1, 4), num_blocks=st.integers(4, 24))
    def setup(self, bs, num_blocks):
        self.bs, self.num_blocks = bs, num_blocks
        self.cache = PrefixCache(CacheConfig(num_blocks=num_blocks, block_size=bs))

    # ---- helpers ---------------------------------------------------------------------------------------------
    def prefix(self, ns: str, tokens: list[int], i: int) -> tuple:
        return (ns, *tokens[: (i + 1) * self.bs])

    def cached_run(self, tree: dict, ns: str, tokens: list[int], nblocks: int) -> list[int]:
        run = []
        for i in range(nblocks):
            b = tree.get(self.prefix(ns, tokens, i))
            if b is None:
                break
            run.append(b)
        return run

    def held(self, excluding: Live | None = None) -> set[int]:
        return {b for r in self.live if r is not excluding for b in r.table}

    def pinned(self) -> set[int]:
        return {b for r in self.live for b in r.table[: r.committed]}

    # ---- rules -----------------------------------------------------------------------------------------------
    @precondition(lambda self: len(self.live) < 3)
    @rule(prompt=prompts, ns=st.sampled_from(NAMESPACES))
    def match(self, prompt, ns):
        self._match(list(prompt), ns)

    @precondition(lambda self: 0 < len(self.live) < 3)
    @rule(i=st.integers(0, 3), extra=st.lists(st.integers(0, 2), max_size=3))
    def match_alike(self, i, extra):
        """A request with the same start as a running one (which may not have cached it yet: both compute it)."""
        r = self.live[i % len(self.live)]
        self._match(r.tokens[: len(r.tokens) - len(extra)] + extra or [0], r.ns)

    def _match(self, prompt: list[int], ns: str) -> None:
        tree = self.tree_now()
        m = self.cache.match(prompt, ns)
        run = self.cached_run(tree, ns, prompt, (len(prompt) - 1) // self.bs)
        assert list(m.block_ids) == run
        assert (m.cached_blocks, m.cached_tokens) == (len(run), len(run) * self.bs)
        for i, b in enumerate(run):  # never a wrong hit: the served block holds this prefix's KV
            assert self.kv[b] == self.prefix(ns, prompt, i)
        event(f"match: {'hit' if run else 'miss'}")
        self.live.append(Live(m.handle, ns, prompt, list(m.block_ids), len(run)))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 3), n=st.integers(0, 6))
    def allocate(self, i, n):
        self._allocate(self.live[i % len(self.live)], n)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 3))
    def allocate_needed(self, i):
        """What the engine asks for: blocks for every token of the request."""
        r = self.live[i % len(self.live)]
        self._allocate(r, max(0, -(-len(r.tokens) // self.bs) - len(r.table)))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 3))
    def step(self, i):
        """An engine step for one request: blocks for all its tokens, then cache every full block."""
        r = self.live[i % len(self.live)]
        self._allocate(r, max(0, -(-len(r.tokens) // self.bs) - len(r.table)))
        self._commit(r, 0)

    def _allocate(self, r: Live, n: int) -> bool:
        tree = self.tree_now()
        free = self.cache.num_free_blocks
        pinned = self.pinned()
        evictable = len(tree) - len(pinned)
        try:
            ids = self.cache.allocate(r.handle, n)
        except OutOfBlocks:
            assert n > free + evictable, f"OutOfBlocks for {n} with {free} free and {evictable} evictable"
            after = self.tree_now()
            assert set(after.values()) == pinned  # every unpinned block was evicted, and stays free
            assert self.cache.num_free_blocks == free + evictable
            event("allocate: out of blocks")
            return False
        assert n <= free + evictable
        assert len(ids) == n == len(set(ids))
        after = self.tree_now()
        assert after.items() <= tree.items()  # allocating only evicts
        assert len(tree) - len(after) == max(0, n - free)  # exactly what it must
        assert pinned <= set(after.values())
        assert not set(ids) & set(after.values()), "allocate handed out a cached block"
        assert not set(ids) & self.held(), "allocate handed out a block a live request holds"
        assert all(0 <= b < self.num_blocks for b in ids)
        event(f"allocate: {'evicted' if n > free else 'from free'}")
        r.table.extend(ids)
        r.owned.update(ids)
        return True

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 3), extra=st.lists(st.integers(0, 2), max_size=3))
    def generate(self, i, extra):
        self.live[i % len(self.live)].tokens.extend(extra)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 3), fewer=st.integers(0, 2))
    def commit_blocks(self, i, fewer):
        self._commit(self.live[i % len(self.live)], fewer)

    def _commit(self, r: Live, fewer: int) -> None:
        bs = self.bs
        computed = min(len(r.tokens), len(r.table) * bs)  # tokens whose K/V the request has written
        nblocks = max(r.committed, computed // bs - fewer)
        for j in range(r.committed, nblocks):  # the request writes its own blocks' KV
            assert r.table[j] in r.owned
            self.kv[r.table[j]] = self.prefix(r.ns, r.tokens, j)
        tree = self.tree_now()
        free = self.cache.num_free_blocks
        run = self.cached_run(tree, r.ns, r.tokens, nblocks)
        res = self.cache.commit_blocks(r.handle, r.tokens[: nblocks * bs], r.table)
        have = len(run)
        dups = [b for b, t in zip(r.table[:have], run) if b != t]
        assert list(res.table) == run + r.table[have:nblocks]
        assert (res.adopted, res.duplicates, res.not_cached) == (nblocks - have, len(dups), 0)
        assert all(b in r.owned for b in dups)
        assert self.cache.num_free_blocks == free + len(dups)  # duplicates freed, nothing evicted
        want = dict(tree)
        for j in range(have, nblocks):
            want[self.prefix(r.ns, r.tokens, j)] = r.table[j]
        assert self.tree_now() == want
        if nblocks > r.committed:
            event(f"commit_blocks: {'duplicates' if dups else 'no duplicates'}")
        r.owned.difference_update(r.table[have:nblocks])
        r.owned.difference_update(dups)
        r.table[:nblocks] = res.table
        r.committed = nblocks

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 3))
    def release(self, i):
        r = self.live.pop(i % len(self.live))
        tree = self.tree_now()
        free = self.cache.num_free_blocks
        self.cache.release(r.handle)
        assert self.cache.num_free_blocks == free + len(r.owned)
        assert self.tree_now() == tree

    @rule(n=st.integers(0, 8))
    def borrow(self, n):
        free = self.cache.num_free_blocks
        tree = self.tree_now()
        evictable = len(tree) - len(self.pinned())
        try:
            with self.cache.borrowed_blocks(n) as ids:
                assert len(ids) == n == len(set(ids))
                assert not set(ids) & set(self.tree_now().values())
                assert not set(ids) & self.held()
                self.cache.check_integrity()
        except OutOfBlocks:
            assert n > free + evictable
            event("borrow: out of blocks")
        else:
            assert n <= free + evictable
        assert self.cache.num_free_blocks + len(self.tree_now()) == free + len(tree)  # evicted blocks are free

    def tree_now(self) -> dict[tuple, int]:
        return tree_contents(self.cache)

    # ---- invariants ------------------------------------------------------------------------------------------
    @invariant()
    def consistent(self):
        if not hasattr(self, "cache"):
            return
        cache = self.cache
        cache.check_integrity()
        tree = self.tree_now()
        for key, b in tree.items():  # every cached block holds the KV of its path, as the request wrote it
            assert self.kv.get(b) == key, f"block {b} cached as {key} holds {self.kv.get(b)}"
        owned = [b for r in self.live for b in r.owned]
        assert len(owned) == len(set(owned)), "a block is owned by two live requests"
        assert not set(owned) & set(tree.values())
        assert cache.num_free_blocks + len(tree) + len(owned) == self.num_blocks
        assert cache.num_owned_blocks == len(owned)
        assert cache.num_active_requests == len(self.live)
        for r in self.live:
            assert set(r.handle.owned or ()) == r.owned
            for j in range(r.committed):
                assert tree.get(self.prefix(r.ns, r.tokens, j)) == r.table[j]
            assert set(r.table[r.committed :]) == r.owned
            assert not set(r.table) & (self.held(excluding=r) - self.pinned())


OwnedBlocks.TestCase.settings = settings(
    max_examples=50, stateful_step_count=50, deadline=None, suppress_health_check=list(HealthCheck)
)
TestOwnedBlocks = OwnedBlocks.TestCase


def test_two_requests_computing_the_same_blocks():
    """A and B miss on the same 2 blocks and both compute them; A caches first; B's copies are duplicates: B's table
    switches to A's ids, B's blocks go back to the free list, and a third request is served A's blocks."""
    cache = PrefixCache(CacheConfig(num_blocks=8, block_size=2))
    a = cache.match([5, 5, 6, 6, 1])
    b = cache.match([5, 5, 6, 6, 2])
    assert a.cached_tokens == b.cached_tokens == 0
    ta = cache.allocate(a.handle, 3)
    tb = cache.allocate(b.handle, 3)
    assert not set(ta) & set(tb)
    assert cache.num_free_blocks == 2 and cache.num_owned_blocks == 6
    ra = cache.commit_blocks(a.handle, [5, 5, 6, 6], ta)
    assert (ra.table, ra.adopted, ra.duplicates, ra.not_cached) == (tuple(ta[:2]), 2, 0, 0)
    rb = cache.commit_blocks(b.handle, [5, 5, 6, 6], tb)
    assert (rb.table, rb.adopted, rb.duplicates, rb.not_cached) == (tuple(ta[:2]), 0, 2, 0)
    assert cache.num_free_blocks == 4  # B's two copies freed
    assert cache.num_owned_blocks == 2  # each keeps its private last block
    assert set(b.handle.owned) == {tb[2]}
    cache.check_integrity()
    with cache.lookup([5, 5, 6, 6, 9]) as c:
        assert c.block_ids == tuple(ta[:2])
    cache.release(a.handle)
    cache.release(b.handle)
    assert cache.num_owned_blocks == 0 and cache.num_free_blocks == 6 and cache.num_cached_blocks == 2
    cache.check_integrity()


def test_allocate_evicts_only_unpinned_blocks_and_out_of_blocks_leaves_them_free():
    cache = PrefixCache(CacheConfig(num_blocks=6, block_size=1))
    for prompt in ([1, 2, 3], [7, 8, 9]):  # two cached paths of 3 blocks, unpinned
        m = cache.match(prompt)
        cache.commit_blocks(m.handle, prompt, cache.allocate(m.handle, 3))
        cache.release(m.handle)
    assert cache.num_free_blocks == 0 and cache.num_cached_blocks == 6
    keep = cache.match([1, 2, 3, 4])  # pins [1, 2, 3]
    pinned = set(keep.block_ids)
    assert len(pinned) == 3
    try:
        cache.allocate(keep.handle, 4)
    except OutOfBlocks:
        pass
    else:
        raise AssertionError("4 blocks cannot be had with 3 pinned in a pool of 6")
    cache.check_integrity()
    assert cache.num_free_blocks == 3 and cache.num_cached_blocks == 3  # [7, 8, 9] evicted, stays free
    got = cache.allocate(keep.handle, 3)
    assert not set(got) & pinned
    assert cache.probe([1, 2, 3, 4]) == 3
    cache.release(keep.handle)
    cache.check_integrity()
    assert cache.num_free_blocks == 3 and cache.num_owned_blocks == 0


def test_commit_blocks_refuses_to_move_the_pin_back():
    """Committing fewer blocks than the request already holds cached would unpin blocks its table still uses."""
    c = PrefixCache(CacheConfig(num_blocks=4, block_size=1))
    a = c.match([1, 2, 3, 4])
    t = c.allocate(a.handle, 3)
    c.commit_blocks(a.handle, [1, 2, 3], t)
    with pytest.raises(ValueError, match="would unpin"):
        c.commit_blocks(a.handle, [1], t)
    b = c.match([9])
    assert len(c.allocate(b.handle, 1)) == 1  # the one free block
    with pytest.raises(OutOfBlocks):  # a's three cached blocks stay pinned
        c.allocate(b.handle, 1)
    c.check_integrity()
    c.release(a.handle)
    c.release(b.handle)
    c.check_integrity()
