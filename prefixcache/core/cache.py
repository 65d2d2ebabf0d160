"""PrefixCache: the facade over radix tree + allocator + eviction policy.

One request's life: ``match`` (pins its longest cached prefix) -> the caller computes the rest ->
``commit`` (caches the request's full blocks, returns the new block ids the caller must fill before the
next ``match``) -> ``release`` (unpins). ``lookup`` wraps match/release in a ``with`` block so that every
exit path unpins. Not thread-safe: callers serialise (the engine holds a lock).

Cost: every operation does O(nodes on the request's path) Python steps plus memcpy-like work on its token
bytes and block ids (no Python loop over a request's blocks); eviction is O(victim leaves). Memory is
proportional to what is cached, never to ``num_blocks``. Listeners (``subscribe``) see what is stored and
evicted; with none, nothing is computed for them.
"""

from __future__ import annotations

import itertools
import time
from array import array
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Any

import numpy as np
import numpy.typing as npt

from prefixcache.core.allocator import BlockAllocator
from prefixcache.core.block_ids import EMPTY_IDS, BlockIds, Runs, ids_array, ids_list
from prefixcache.core.checks import check_int, check_str
from prefixcache.core.config import DEFAULT_NAMESPACE, CacheConfig
from prefixcache.core.events import BlocksRemoved, BlocksStored, CacheCleared, CacheEvent, Listener, Subscribers
from prefixcache.core.eviction import POLICIES, EvictionPolicy
from prefixcache.core.hashing import (
    TOKEN_DTYPE,
    BlockHasher,
    as_token_array,
    chain_hashes,
    namespace_root,
    token_bytes,
    xxh3_hasher,
)
from prefixcache.core.radix_tree import Node, RadixTree, Root, Walk
from prefixcache.core.stats import CacheStats
from prefixcache.core.windows import WindowSlots


@dataclass(eq=False)
class RequestHandle:
    """A live request's hold on the cache: the path it pins. Made by match, ended by release."""

    id: int
    mode: str  # "tokens" | "keys"
    namespace: str
    terminal: Node | None  # the deepest pinned node (None when nothing is pinned)
    prompt: Any = field(repr=False)  # the validated int32 token array, or the key list, given to match
    released: bool = False
    # A commit of the prompt itself walks the very path match walked (to ``terminal``, ``matched_blocks``
    # blocks) while the tree's generation is still ``walked`` (-1: it may not, e.g. match stopped at max_blocks).
    walked: int = field(default=-1, repr=False)
    matched_blocks: int = field(default=0, repr=False)
    # blocks this request took with ``allocate`` and has not yet cached with ``commit_blocks`` (in flight:
    # neither free nor in the tree); ``release`` frees them. None until the first ``allocate``.
    owned: set[int] | None = field(default=None, repr=False)
    kv_blocks: int = field(default=0, repr=False)  # blocks the match found before a window group cut it


def _ids_tuple(runs: tuple[BlockIds, ...]) -> tuple[int, ...]:
    out: list[int] = []
    for run in runs:
        out.extend(ids_list(run))
    return tuple(out)


@dataclass(frozen=True)
class MatchResult:
    """What ``match`` found: ``cached_tokens`` leading tokens are served by ``block_ids`` (in order)."""

    handle: RequestHandle
    cached_tokens: int
    cached_blocks: int
    _runs: tuple[BlockIds, ...] = field(repr=False, compare=False)  # the matched nodes' block ids, in order

    @cached_property
    def block_ids(self) -> tuple[int, ...]:
        """The matched block ids in prompt order (built on first use)."""
        return _ids_tuple(self._runs)


@dataclass(frozen=True, init=False)
class CommitResult:
    """What ``commit`` inserted: fill ``block_ids`` with the KV of blocks ``first_block ...`` of the sequence."""

    first_block: int
    cached_blocks: int  # blocks of the sequence cached now, from its start
    not_cached: int  # full blocks that did not fit in the pool
    _new: BlockIds = field(repr=False, compare=False)

    def __init__(self, first_block: int, cached_blocks: int, not_cached: int, _new: BlockIds) -> None:
        # The fields go straight into the instance dict: the generated frozen __init__ sets each one through
        # object.__setattr__, twice the cost, and a replay makes one CommitResult per request.
        d = self.__dict__
        d["first_block"], d["cached_blocks"], d["not_cached"], d["_new"] = first_block, cached_blocks, not_cached, _new

    @cached_property
    def block_ids(self) -> tuple[int, ...]:
        """The newly cached block ids, in sequence order (built on first use)."""
        return _ids_tuple((self._new,))


@dataclass(frozen=True)
class BlockCommit:
    """What ``commit_blocks`` did: ``table`` is the request's block table for the full blocks committed, with the
    tree's ids where the tree already held a block (use these from now on); ``adopted`` own blocks went into the
    tree; ``duplicates`` own blocks held content the tree had already and were freed; ``not_cached`` own blocks
    stay the request's (no room in the tree: a hash collision)."""

    table: tuple[int, ...]
    adopted: int
    duplicates: int
    not_cached: int


class OutOfBlocks(MemoryError):
    """``allocate`` found fewer free blocks than asked for, even after evicting every unpinned block."""


@dataclass(frozen=True)
class Divergence:
    """Why a prompt misses: ``cached_tokens`` is what ``match`` would serve now; ``common_tokens`` the longest
    common prefix, in tokens, of the prompt and any cached path of its namespace (it may end inside a block,
    and exceed ``cached_tokens``); ``cached_next`` the token ids of that cached path right after it (what the
    prompt would have needed to keep hitting; empty where the cached path ends)."""

    cached_tokens: int
    common_tokens: int
    cached_next: tuple[int, ...]


def _check_keep_for(keep_for: Any) -> float:
    if (
        isinstance(keep_for, (bool, np.bool_))
        or not isinstance(keep_for, (int, float, np.integer, np.floating))
        or not keep_for >= 0
    ):
        raise ValueError(f"keep_for must be a number of seconds >= 0, got {keep_for!r}")
    return float(keep_for)


class PrefixCache:
    """Maps cached prefixes to KV block ids; evicts least valuable unpinned leaves when full."""

    def __init__(
        self, config: CacheConfig, *, hasher: BlockHasher | None = None, clock: Callable[[], float] | None = None
    ) -> None:
        """``hasher`` replaces the seeded xxh3_128 block hash (a test seam for forced collisions; the tree then
        keys children by hash, which costs a hash per block it walks). ``clock()`` is the time in seconds that
        retention (``keep_for``) is measured on; default time.monotonic (a trace replay passes the trace's
        clock)."""
        if not isinstance(config, CacheConfig):
            raise TypeError(f"config must be a CacheConfig, got {type(config).__name__}")
        self.config = config
        self.clock: Callable[[], float] = clock or time.monotonic
        self._namespace_keep: dict[str, float] = {}
        self.block_size = config.block_size
        self._hash_keys = hasher is not None and getattr(hasher, "xxh3_seed", None) != config.hash_seed
        self._hasher: BlockHasher = hasher or xxh3_hasher(config.hash_seed)
        self._policy_factory = POLICIES[config.eviction]
        self._subscribers = Subscribers()
        self.windows: WindowSlots | None = None  # a window group's slots (``attach_windows``)
        self.reset()

    # ---- state ---------------------------------------------------------------------------------------
    def reset(self, *, keep_stats: bool = False) -> None:
        """Forget every cached block and live request; counters restart from zero unless ``keep_stats``.
        Listeners stay subscribed and get ``CacheCleared``. The old tree is taken apart (its memory returns at
        once), so nodes kept from it have no children."""
        c = self.config
        old: RadixTree | None = getattr(self, "tree", None)
        if old is not None:
            old.clear()
        self.tree = RadixTree(
            c.block_size,
            self._hasher,
            partial(namespace_root, seed=c.hash_seed),
            c.verify_tokens,
            self._hash_keys,
        )
        self.allocator = BlockAllocator(c.num_blocks)
        if self.windows is not None:
            self.windows.reset(keep_stats=keep_stats)
        self.policy: EvictionPolicy = self._policy_factory(self.clock)
        if not keep_stats or not hasattr(self, "stats"):
            self.stats = CacheStats()
        self._live: dict[int, RequestHandle] = {}
        self._ids = itertools.count(1)
        self._clock = 0
        if self._subscribers:
            self._subscribers.emit([CacheCleared()])

    def attach_windows(self, windows: WindowSlots | None) -> None:
        """Serve every match only as deep as ``windows`` (a window group: ``prefixcache.core.windows``) holds the
        window of its end, hold that window for the request while it lives, and take slots away from blocks
        this cache frees. Call on an empty cache. None detaches."""
        if windows is not None:
            if windows.num_blocks != self.config.num_blocks or windows.block_size != self.block_size:
                raise ValueError(
                    f"attach_windows: slots for {windows.num_blocks} blocks of {windows.block_size} tokens, the cache "
                    f"has {self.config.num_blocks} of {self.block_size}"
                )
            windows.reset()
        self.windows = windows

    def _free(self, ids: BlockIds) -> None:
        """Give ``ids`` back to the allocator (and take their window slots)."""
        if self.windows is not None:
            self.windows.forget(ids_list(ids))
        self.allocator.free(ids)

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(event)`` for every later ``BlocksStored`` / ``BlocksRemoved`` / ``CacheCleared``
        (see ``prefixcache.core.events``); returns the function that unsubscribes it. Changes no cached data."""
        return self._subscribers.add(listener)

    @property
    def num_blocks(self) -> int:
        return self.config.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the tree (not free, not in flight)."""
        used = self.config.num_blocks - self.allocator.num_free
        return used - self.num_owned_blocks if used else 0

    @property
    def num_active_requests(self) -> int:
        return len(self._live)

    @property
    def num_pinned_blocks(self) -> int:
        """Cached blocks that live requests pin (on their matched or committed paths); O(cached nodes). Idle: 0."""
        return sum(len(n.blocks) for n in self.tree.nodes() if n.pins)

    # ---- lookups -------------------------------------------------------------------------------------
    def match(self, tokens: Any, namespace: str = DEFAULT_NAMESPACE, *, max_blocks: int | None = None) -> MatchResult:
        """Find and PIN the longest cached prefix of ``tokens``, at most ``max_blocks`` blocks (default: all but at
        least one token, which is always left uncached).

        Changes the cache: pins the matched path, refreshes its recency, may split a node, counts stats. The
        request keeps ``tokens`` for ``commit`` without copying it when it already is a contiguous int32 array:
        don't change that array until the request is committed or released.
        """
        arr = as_token_array(tokens)
        n = len(arr)
        if n == 0:
            raise ValueError("tokens is empty: a prompt needs at least one token")
        check_str(namespace, "namespace")
        bs = self.block_size
        limit = (n - 1) // bs
        if max_blocks is not None:
            limit = min(limit, check_int(max_blocks, "max_blocks", minimum=0, type_error=ValueError))
        path = self.tree.walk_tokens(self.tree.roots.get(("tokens", namespace)), arr.data.cast("B"), limit)
        return self._finish_match("tokens", namespace, path, arr, n, -(-n // bs), limit, n // bs)

    def match_keys(
        self,
        keys: Sequence[Any],
        namespace: str = DEFAULT_NAMESPACE,
        *,
        max_blocks: int | None = None,
        num_tokens: int | None = None,
    ) -> MatchResult:
        """Like ``match`` for precomputed block keys (e.g. Mooncake ``hash_ids``): ``keys[i]`` names block i
        together with everything before it. Up to ``max_blocks`` (default all) may hit; ``num_tokens`` (an int
        >= 1, default ``len(keys) * block_size``) is the prompt length used for token counts.
        """
        keys, nb, n = self._keys_prompt(keys, namespace, max_blocks, num_tokens)
        path = self.tree.walk_keys(self.tree.roots.get(("keys", namespace)), keys, nb)
        return self._finish_match("keys", namespace, path, keys, n, len(keys), nb, len(keys))

    def serve_keys(
        self,
        keys: Sequence[Any],
        namespace: str = DEFAULT_NAMESPACE,
        *,
        num_tokens: int | None = None,
        keep_for: float | None = None,
    ) -> tuple[int, int, CommitResult]:
        """One whole request in one call (what a replay does): ``match_keys(keys, namespace, num_tokens=)``,
        ``commit_keys(handle, keep_for=)``, ``release(handle)``, with the very same effects (cache, stats,
        events), without their handle checks and match result. Returns the match's cached tokens and cached
        blocks, and the commit's result."""
        keys, nb, n = self._keys_prompt(keys, namespace, None, num_tokens, copy=False)
        path = self.tree.walk_keys(self.tree.roots.get(("keys", namespace)), keys, nb)
        handle, _runs, hit, cached_tokens = self._pin_match("keys", namespace, path, keys, n, nb, nb, nb)
        try:  # match walked every key and nothing changed since: the commit starts where the match ended
            until = self._until(namespace, keep_for)
            c = self._insert(handle, handle.terminal, hit, nb, keys, until, None)
        finally:
            self._release(handle)
        return cached_tokens, hit, c

    def _keys_prompt(
        self,
        keys: Sequence[Any],
        namespace: str,
        max_blocks: int | None,
        num_tokens: int | None,
        *,
        copy: bool = True,
    ) -> tuple[list[Any], int, int]:
        """Checked keys of a request: (the keys as a list, how many may hit, its prompt tokens). ``copy=False``:
        a list is used as it is (for a caller that keeps no reference to it past the call)."""
        if copy or type(keys) is not list:
            keys = list(keys)
        if not keys:
            raise ValueError("keys is empty: a request needs at least one block")
        check_str(namespace, "namespace")
        nb = len(keys)
        if max_blocks is not None:
            nb = min(check_int(max_blocks, "max_blocks", minimum=0, type_error=ValueError), nb)
        if num_tokens is None:
            n = len(keys) * self.block_size
        else:
            n = check_int(num_tokens, "num_tokens", minimum=1, type_error=ValueError)
        return keys, nb, n

    def probe(self, tokens: Any, namespace: str = DEFAULT_NAMESPACE) -> int:
        """How many leading tokens ``match`` would serve now. Changes nothing."""
        data = token_bytes(tokens)
        check_str(namespace, "namespace")
        if len(data) == 0:
            return 0
        n = len(data) // TOKEN_DTYPE.itemsize
        path = self.tree.walk_tokens(self.tree.roots.get(("tokens", namespace)), data, (n - 1) // self.block_size)
        if self.windows is not None and path.blocks:
            served = self.windows.served(self._path_ids(path.node)[: path.blocks], path.blocks)
            return served * self.block_size
        return path.blocks * self.block_size

    def divergence(self, tokens: Any, namespace: str = DEFAULT_NAMESPACE, *, context: int = 16) -> Divergence:
        """Where ``tokens`` leaves the cached paths of ``namespace`` (see ``Divergence``): token granular (block
        granular with an injected hasher and verify_tokens off); ``cached_next`` has at most ``context`` ids and
        follows the most recently used branch where cached paths fork. Changes nothing."""
        data = token_bytes(tokens)
        check_str(namespace, "namespace")
        context = check_int(context, "context", minimum=0)
        n = len(data) // TOKEN_DTYPE.itemsize
        root = self.tree.roots.get(("tokens", namespace))
        served = 0
        if n:
            walk = self.tree.walk_tokens(root, data, (n - 1) // self.block_size)
            served = walk.blocks
            if self.windows is not None and served:
                served = self.windows.served(self._path_ids(walk.node)[:served], served)
        common, following = self.tree.nearest(root, data, context)
        nxt = tuple(np.frombuffer(following, TOKEN_DTYPE).tolist())
        return Divergence(served * self.block_size, common // TOKEN_DTYPE.itemsize, nxt)

    def _finish_match(
        self, mode: str, namespace: str, path: Walk, prompt: Any, n: int, nblocks: int, limit: int, full: int
    ) -> MatchResult:
        """Pin and count the matched ``path`` (walked over at most ``limit`` blocks; a commit of the prompt walks
        ``full`` blocks)."""
        handle, runs, hit, cached_tokens = self._pin_match(mode, namespace, path, prompt, n, nblocks, limit, full)
        return MatchResult(handle, cached_tokens, hit, tuple(runs))

    def _pin_match(
        self, mode: str, namespace: str, path: Walk, prompt: Any, n: int, nblocks: int, limit: int, full: int
    ) -> tuple[RequestHandle, list[BlockIds], int, int]:
        """``_finish_match`` without the result: (the handle, its path's block ids, cached blocks and tokens)."""
        terminal = self._split_last(path)
        kv_hit = -1
        if self.windows is not None and terminal is not None:  # served only where the window group is complete
            terminal, kv_hit = self._window_terminal(terminal)
        self._clock += 1
        clock = self._clock
        handle = RequestHandle(next(self._ids), mode, namespace, terminal, prompt)
        self._live[handle.id] = handle
        runs: list[BlockIds] = []
        hit = 0
        policy = self.policy
        node = terminal
        while node is not None and node.parent is not None:  # pin, refresh, count a hit: one step per node
            if node.pins == 0 and not node.children:  # an unpinned leaf is evictable (and only such a node)
                policy.remove(node)
            node.pins += 1
            node.last_access = clock
            node.hits += 1
            blocks = node.blocks
            runs.append(blocks)
            hit += len(blocks)
            node = node.parent
        runs.reverse()
        if kv_hit < 0 and (hit < limit or limit == full):  # the walk stopped where a walk of all ``full`` blocks
            handle.walked, handle.matched_blocks = self.tree.generation, hit  # stops too (a cut one does not)
        handle.kv_blocks = max(kv_hit, hit)
        if self.windows is not None and hit:
            self._hold_window(handle, runs, hit)
        cached_tokens = min(hit * self.block_size, n)
        s = self.stats
        s.lookups += 1
        s.prompt_tokens += n
        s.cached_tokens += cached_tokens
        s.lookup_blocks += nblocks
        s.hit_blocks += hit
        s.lookups_with_hit += hit > 0
        return handle, runs, hit, cached_tokens

    def _window_terminal(self, terminal: Node) -> tuple[Node | None, int]:
        """The node a match ending at ``terminal`` is served to: the deepest point of its path whose window the
        window group holds (splitting the node it falls inside), and the path's blocks before the cut."""
        ws = self.windows
        assert ws is not None
        nodes: list[Node] = []
        node: Node | None = terminal
        while node is not None and node.parent is not None:
            nodes.append(node)
            node = node.parent
        nodes.reverse()
        path = np.concatenate([ids_array(n.blocks) for n in nodes])
        total = len(path)
        p = ws.served(path, total)
        if p == total:
            return terminal, total
        depth = 0
        for n in nodes:
            nb = len(n.blocks)
            if depth + nb >= p:
                if p == depth:
                    return n.parent if n.parent is not None and n.parent.parent is not None else None, total
                return (n if depth + nb == p else self.tree.split(n, p - depth)), total
            depth += nb
        return None, total  # pragma: no cover - p <= total

    def _hold_window(self, handle: RequestHandle, runs: list[BlockIds], hit: int) -> None:
        """The request holds the window of its match's end while it lives; that point is refreshed."""
        ws = self.windows
        assert ws is not None
        path = np.concatenate([ids_array(r) for r in runs]) if len(runs) > 1 else ids_array(runs[0])
        ws.hold(("request", handle.id), path[ws.first_block(hit) : hit])
        ws.touch_point(path, hit)

    def _split_last(self, path: Walk) -> Node | None:
        """The terminal of a walked path: its last node, split where the match ends inside it."""
        node = path.node
        if node is not None and path.matched < len(node.blocks):
            return self.tree.split(node, path.matched)
        return node

    def _walked(self, path: Walk) -> tuple[Node | None, int]:
        """The terminal of a walked path (splitting its last node where the match ends) and its blocks."""
        return self._split_last(path), path.blocks

    # ---- commit --------------------------------------------------------------------------------------
    def commit(
        self,
        handle: RequestHandle,
        tokens: Any = None,
        *,
        keep_for: float | None = None,
        keep_tokens: int | None = None,
    ) -> CommitResult:
        """Cache the full blocks of ``tokens`` (default: the prompt given to ``match``), e.g. prompt + output.

        Changes the cache: inserts new blocks (evicting unpinned leaves as needed; when the pool cannot make
        room, only a prefix is cached), and moves the handle's pin to the whole cached path. The caller must
        write the KV of the returned blocks before the next ``match``. ``keep_for`` (seconds; default: the
        namespace's, see ``retain_namespace``) marks the cached path to be kept until ``clock() + keep_for``:
        the "priority" policy evicts it only when nothing else is evictable. ``keep_tokens`` limits that to
        the full blocks of the first ``keep_tokens`` tokens (e.g. just the system prompt).
        """
        self._check_live(handle)
        if handle.mode != "tokens":
            raise ValueError(f"request {handle.id} was matched by keys; use commit_keys")
        prompt = handle.prompt
        data = prompt.data.cast("B") if tokens is None else token_bytes(tokens)
        keep_blocks = None
        if keep_tokens is not None:
            keep_blocks = check_int(keep_tokens, "keep_tokens", minimum=0, type_error=ValueError) // self.block_size
        until = self._until(handle.namespace, keep_for)
        nblocks = len(data) // self.tree.block_bytes
        if tokens is None and handle.walked == self.tree.generation:
            terminal, have = handle.terminal, handle.matched_blocks
        else:
            path = self.tree.walk_tokens(self.tree.roots.get(("tokens", handle.namespace)), data, nblocks)
            terminal, have = self._walked(path)
        return self._insert(handle, terminal, have, nblocks, data, until, keep_blocks)

    def commit_keys(
        self,
        handle: RequestHandle,
        keys: Sequence[Any] | None = None,
        *,
        keep_for: float | None = None,
        keep_blocks: int | None = None,
    ) -> CommitResult:
        """``commit`` for precomputed keys (default: the keys given to ``match_keys``); ``keep_blocks`` limits
        ``keep_for`` to the first blocks."""
        self._check_live(handle)
        if handle.mode != "keys":
            raise ValueError(f"request {handle.id} was matched by tokens; use commit")
        if keep_blocks is not None:
            keep_blocks = check_int(keep_blocks, "keep_blocks", minimum=0, type_error=ValueError)
        until = self._until(handle.namespace, keep_for)
        if keys is None and handle.walked == self.tree.generation:
            keys = handle.prompt
            terminal, have = handle.terminal, handle.matched_blocks
        else:
            keys = handle.prompt if keys is None else list(keys)
            terminal, have = self._walked(
                self.tree.walk_keys(self.tree.roots.get(("keys", handle.namespace)), keys, len(keys))
            )
        return self._insert(handle, terminal, have, len(keys), keys, until, keep_blocks)

    # ---- blocks owned by a running request (the engine, whose pool is the KV of running requests) -------------
    @property
    def num_owned_blocks(self) -> int:
        """Blocks live requests hold in flight (allocated, not in the tree)."""
        return sum(len(h.owned) for h in self._live.values() if h.owned)

    def allocate(self, handle: RequestHandle, n: int) -> list[int]:
        """Give the live request ``handle`` ``n`` blocks of its own to write KV into, evicting unpinned leaves as
        needed. They are in flight (neither free nor cached) until ``commit_blocks`` caches them or ``release``
        frees them. Raises ``OutOfBlocks`` if even evicting every unpinned block frees too few (the blocks it
        evicted stay free; the cache stays consistent)."""
        self._check_live(handle)
        n = check_int(n, "n", minimum=0, type_error=ValueError)
        if n == 0:
            return []
        free = self.allocator.num_free
        if n > free:
            events: list[CacheEvent] | None = [] if self._subscribers else None
            free += self._evict(n - free, events)
            if events:
                self._subscribers.emit(events)
            if n > free:
                raise OutOfBlocks(f"asked for {n} blocks, {free} free after evicting every unpinned block")
        ids = ids_list(self.allocator.allocate(n))
        if handle.owned is None:
            handle.owned = set()
        handle.owned.update(ids)
        return ids

    @contextmanager
    def borrowed_blocks(self, n: int) -> Iterator[list[int]]:
        """``n`` blocks (evicting unpinned ones as needed) to use as scratch space inside the ``with`` block, freed
        on exit however it exits; nothing is matched or counted. Raises ``OutOfBlocks`` if they cannot be had."""
        handle = RequestHandle(next(self._ids), "tokens", DEFAULT_NAMESPACE, None, None)
        self._live[handle.id] = handle
        try:
            yield self.allocate(handle, n)
        finally:
            self._release(handle)

    def commit_blocks(
        self, handle: RequestHandle, tokens: Any, block_ids: Sequence[int], *, keep_for: float | None = None
    ) -> BlockCommit:
        """Cache the full blocks of ``tokens`` (the request's sequence so far) whose KV is already in the pool:
        ``block_ids[i]`` holds block i, either a block the request matched or took with ``allocate``. Nothing is
        copied: own blocks join the tree by id. Where the tree already holds a block of that content (another
        request cached it meanwhile), the tree's id wins and the request's copy is freed; ``BlockCommit.table``
        says which ids to use from now on. Moves the handle's pin to the whole cached path (the request keeps
        running). Changes the cache."""
        self._check_live(handle)
        if handle.mode != "tokens":
            raise ValueError(f"request {handle.id} was matched by keys; commit_blocks takes tokens")
        data = token_bytes(tokens)
        nblocks = len(data) // self.tree.block_bytes
        if len(block_ids) < nblocks:
            raise ValueError(f"commit_blocks: {len(block_ids)} block ids for {nblocks} full blocks of tokens")
        owned = handle.owned or set()
        pinned = self._path_blocks(handle.terminal)
        if nblocks < pinned:
            raise ValueError(
                f"commit_blocks: request {handle.id} holds {pinned} cached blocks; committing {nblocks} would unpin "
                "blocks its table still uses (commit the whole sequence so far)"
            )
        root = self.tree.roots.get(("tokens", handle.namespace))
        terminal, have = self._walked(self.tree.walk_tokens(root, data, nblocks))
        tree_ids = self._path_ids(terminal)
        dups = [int(b) for b, t in zip(block_ids[:have], tree_ids) if int(b) != t]
        own = [int(b) for b in block_ids[have:nblocks]]
        stray = [b for b in dups + own if b not in owned]
        if stray:
            raise ValueError(f"commit_blocks: blocks {stray[:8]} are neither the tree's nor request {handle.id}'s own")
        until = self._until(handle.namespace, keep_for)
        res = self._insert(handle, terminal, have, nblocks, data, until, None, own=own)
        adopted = len(res._new)
        owned.difference_update(own[:adopted])
        if dups:
            owned.difference_update(dups)
            if self.windows is not None:  # a running request's window K/V of a duplicate lives on in the tree's
                for b, t in zip(block_ids[:have], tree_ids):
                    if int(b) != t:
                        self.windows.replace(int(b), t)
            self._free(np.asarray(dups, dtype=np.int64))
        return BlockCommit((*tree_ids, *own[:adopted]), adopted, len(dups), len(own) - adopted)

    def path_blocks(self, handle: RequestHandle) -> list[int]:
        """The block ids of the path ``handle`` pins (its match, or after a commit its whole cached path)."""
        self._check_live(handle)
        return self._path_ids(handle.terminal)

    @staticmethod
    def _path_blocks(terminal: Node | None) -> int:
        """Blocks on the path from the root to ``terminal``."""
        n, node = 0, terminal
        while node is not None and node.parent is not None:
            n += len(node.blocks)
            node = node.parent
        return n

    def _path_ids(self, terminal: Node | None) -> list[int]:
        """The block ids of the path from the root to ``terminal``, in order."""
        runs: list[BlockIds] = []
        node = terminal
        while node is not None and node.parent is not None:
            runs.append(node.blocks)
            node = node.parent
        out: list[int] = []
        for run in reversed(runs):
            out.extend(ids_list(run))
        return out

    def retain_namespace(self, namespace: str, keep_for: float | None) -> None:
        """Default ``keep_for`` of every later commit in ``namespace`` (None: stop). Changes only that default."""
        check_str(namespace, "namespace")
        if keep_for is None:
            self._namespace_keep.pop(namespace, None)
        else:
            self._namespace_keep[namespace] = _check_keep_for(keep_for)

    def _until(self, namespace: str, keep_for: float | None) -> float | None:
        if keep_for is None:
            keep_for = self._namespace_keep.get(namespace)
        return None if keep_for is None else self.clock() + _check_keep_for(keep_for)

    def _first_key(self, mode: str, namespace: str, parent: Node | None, source: Any, at: int) -> Hashable:
        """The key, under ``parent`` (None: the namespace's root), of a new run starting at block ``at``."""
        if mode == "keys":
            key: Hashable = source[at]
            return key
        tree = self.tree
        first = bytes(source[at * tree.block_bytes : (at + 1) * tree.block_bytes])
        if not self._hash_keys:
            return first
        parent_hash = tree.last_hash(parent) if parent is not None else tree.root_hash(namespace)
        return self._hasher(parent_hash, first)

    def _insert(
        self,
        handle: RequestHandle,
        terminal: Node | None,
        have: int,
        nblocks: int,
        source: Any,
        until: float | None,
        keep_blocks: int | None,
        own: Sequence[int] | None = None,
    ) -> CommitResult:
        """Cache blocks ``have..nblocks`` of ``source`` under ``terminal`` (the end of its cached path, ``have``
        blocks long), moving the handle's pins onto that path. ``own``: the request's own (filled) blocks for
        them, used instead of allocating (the caller takes the adopted ones out of ``handle.owned``)."""
        mode, namespace, tree = handle.mode, handle.namespace, self.tree
        handle.walked = -1
        self._clock += 1
        old = handle.terminal
        if terminal is old:  # the handle pins this path already: only its recency moves
            self._touch_path(terminal)
        else:
            self._pin_path(terminal)  # pin the new path before letting go of the old one
            handle.terminal = terminal
            self._unpin_path(old)
        want = nblocks - have
        events: list[CacheEvent] | None = [] if self._subscribers else None
        new_ids = EMPTY_IDS
        if want > 0:
            key = self._first_key(mode, namespace, terminal, source, have)
            if terminal is not None:
                siblings = terminal.children
            else:
                root = tree.roots.get((mode, namespace))
                siblings = root.children if root is not None else {}
            if key in siblings:
                # Another run hangs under the same key: a hash collision that token verification caught in
                # the walk. Equal keys must mean equal prefixes, so the new blocks are not cached.
                fit = 0
            elif own is not None:
                fit = want
            else:
                free = self.allocator.num_free
                if want > free:
                    free += self._evict(want - free, events)
                fit = min(want, free)
            if fit > 0:
                new_ids = self.allocator.allocate(fit) if own is None else array("q", own)
                parent = terminal if terminal is not None else tree.root(mode, namespace)  # after evicting
                if mode == "tokens":
                    bb = tree.block_bytes
                    toks = bytes(source[have * bb : (have + fit) * bb])
                    node = tree.add_child(parent, key, new_ids, toks, None, self._clock)
                else:
                    node = tree.add_child(parent, key, new_ids, None, source[have : have + fit], self._clock)
                # Always a new node, never appended to the request's leaf: its blocks are born now, with no hits
                # yet (what FIFO and LFU order by); the handle's pins move down to it.
                node.pins = 1
                handle.terminal = terminal = node
                if events is not None:
                    events.append(self._stored_event(namespace, mode, parent, node))
            self.stats.blocks_inserted += fit
            self.stats.blocks_not_cached += want - fit
        if until is not None and keep_blocks != 0 and terminal is not None:
            self._retain(terminal, until, keep_blocks)
        if events:
            self._subscribers.emit(events)
        return CommitResult(have, have + len(new_ids), want - len(new_ids) if want > 0 else 0, new_ids)

    def _retain(self, terminal: Node, until: float, keep_blocks: int | None) -> None:
        """Mark the path to ``terminal`` (or its first ``keep_blocks`` blocks, splitting the node where that
        ends) to be kept until ``until``. The path is pinned, so no policy holds these nodes while they change."""
        path = []
        node: Node | None = terminal
        while node is not None and node.parent is not None:
            path.append(node)
            node = node.parent
        depth = 0
        for node in reversed(path):
            if keep_blocks is not None and depth + len(node.blocks) > keep_blocks:
                if keep_blocks > depth:
                    self.tree.split(node, keep_blocks - depth).keep_until = max(node.keep_until, until)
                break
            node.keep_until = max(node.keep_until, until)
            depth += len(node.blocks)

    # ---- events --------------------------------------------------------------------------------------
    def _stored_event(self, namespace: str, mode: str, parent: Node, node: Node) -> BlocksStored:
        """The BlocksStored of a node just hung under ``parent`` (computes, and caches, its chained hashes)."""
        if mode == "keys":
            assert node._keys is not None
            parent_key = None if parent.parent is None else parent.keys[-1]
            return BlocksStored(namespace, mode, parent_key, tuple(node._keys), None)
        tree = self.tree
        view = node.token_view(tree.block_bytes)
        chain_parent = tree.last_hash(parent)
        keys = chain_hashes(self._hasher, chain_parent, view, self.block_size, 0, len(node.blocks))
        node.first_hash, node.last_hash = keys[0], keys[-1]
        tokens = tuple(np.frombuffer(view, TOKEN_DTYPE).tolist())
        return BlocksStored(namespace, mode, None if parent.parent is None else chain_parent, tuple(keys), tokens)

    def _removed_event(self, node: Node, keep: int) -> BlocksRemoved:
        """The BlocksRemoved for dropping ``node``'s blocks from ``keep`` on (computed before they go)."""
        root: Node = node
        while root.parent is not None:
            root = root.parent
        assert isinstance(root, Root)
        if node._keys is not None:
            keys: list[Any] = node._keys[keep:]
        else:
            keys = self.tree.block_hashes(node, keep)
        return BlocksRemoved(root.namespace, root.mode, tuple(keys))

    # ---- release -------------------------------------------------------------------------------------
    def release(self, handle: RequestHandle) -> None:
        """Unpin the request's path; its blocks become evictable. Raises if released already."""
        self._check_live(handle)
        self._release(handle)

    def _release(self, handle: RequestHandle) -> None:
        if self.windows is not None:
            self.windows.drop(("request", handle.id))
        self._unpin_path(handle.terminal)
        handle.released = True
        del self._live[handle.id]
        if handle.owned:
            owned, handle.owned = handle.owned, None
            self._free(np.fromiter(owned, dtype=np.int64, count=len(owned)))

    @contextmanager
    def lookup(self, tokens: Any, namespace: str = DEFAULT_NAMESPACE) -> Iterator[MatchResult]:
        """``match`` whose pin is released when the block exits, however it exits."""
        m = self.match(tokens, namespace)
        try:
            yield m
        finally:
            if not m.handle.released:
                self.release(m.handle)

    def _check_live(self, handle: RequestHandle) -> None:
        if not isinstance(handle, RequestHandle):
            raise TypeError(f"expected the handle of a MatchResult, got {type(handle).__name__}")
        if handle.released:
            raise ValueError(f"request {handle.id} was already released")
        if self._live.get(handle.id) is not handle:
            raise ValueError(f"request {handle.id} does not belong to this cache (or the cache was reset)")

    # ---- pins and eviction ---------------------------------------------------------------------------
    def _pin_path(self, terminal: Node | None) -> None:
        """Pin the path to ``terminal`` and refresh its recency (one tick: the current ``_clock``)."""
        node = terminal
        policy, clock = self.policy, self._clock
        while node is not None and node.parent is not None:
            if node.pins == 0 and not node.children:  # an unpinned leaf is evictable (and only such a node)
                policy.remove(node)
            node.pins += 1
            node.last_access = clock
            node = node.parent

    def _touch_path(self, terminal: Node | None) -> None:
        """Refresh the recency of the path to ``terminal`` (one tick: the current ``_clock``), pins unchanged."""
        node = terminal
        clock = self._clock
        while node is not None and node.parent is not None:
            node.last_access = clock
            node = node.parent

    def _unpin_path(self, terminal: Node | None) -> None:
        node = terminal
        while node is not None and node.parent is not None:
            node.pins -= 1
            if node.pins == 0 and not node.children:
                self.policy.add(node)
            node = node.parent

    def _evict(self, n: int, events: list[CacheEvent] | None) -> int:
        """Free up to ``n`` blocks: victim leaves in policy order, each losing its needed tail (freed in the
        leaf's order) in one step; a leaf that empties is unhooked (its parent may become a victim, an empty root
        is dropped). Returns the number freed."""
        freed = 0
        policy, tree = self.policy, self.tree
        while freed < n:
            victim = policy.peek()
            if victim is None:
                break
            assert isinstance(victim, Node)
            nb = len(victim.blocks)
            k = min(n - freed, nb)
            if events is not None:
                events.append(self._removed_event(victim, nb - k))
            self._free(tree.drop_tail(victim, k))
            freed += k
            if k == nb:
                policy.remove(victim)
                parent = victim.parent
                assert parent is not None
                if parent.parent is None:
                    tree.drop_root_if_empty(parent)
                elif parent.pins == 0 and not parent.children:
                    policy.add(parent)
        self.stats.blocks_evicted += freed
        return freed

    # ---- invariants ----------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError with a clear message if any invariant is broken. Changes nothing.

        O(cached nodes) plus numpy work on the cached block ids, plus re-hashing the blocks of nodes whose
        hashes are cached (none on the default path without listeners)."""
        tree = self.tree
        bb = tree.block_bytes
        expected_pins: dict[int, int] = {}
        for h in self._live.values():
            node = h.terminal
            while node is not None and node.parent is not None:
                expected_pins[node.id] = expected_pins.get(node.id, 0) + 1
                node = node.parent
        for (mode, namespace), root in tree.roots.items():
            if not isinstance(root, Root) or (root.mode, root.namespace) != (mode, namespace):
                raise AssertionError(f"roots[{mode!r}, {namespace!r}] is not that namespace's root")
            if not root.children:
                raise AssertionError(f"namespace {namespace!r} ({mode}) keeps an empty root")
            if len(root.blocks) or root.pins:
                raise AssertionError("a root holds blocks or pins")
        runs: list[npt.NDArray[np.int64]] = []
        evictable: set[int] = set()
        expected_first: dict[int, bytes] = {}
        expected_last: dict[int, bytes] = {}

        def chain_of(node: Node) -> None:
            """Fill expected_first/last for ``node`` and its ancestors (tokens mode), from the namespace root."""
            todo: list[Node] = []
            n: Node | None = node
            while n is not None and n.parent is not None and n.id not in expected_last:
                todo.append(n)
                n = n.parent
            assert n is not None
            h = expected_last[n.id] if n.parent is not None else tree.root_hash(n.namespace)  # type: ignore[attr-defined]
            for m in reversed(todo):
                hs = chain_hashes(self._hasher, h, m.token_view(bb), self.block_size, 0, len(m.blocks))
                expected_first[m.id], expected_last[m.id] = hs[0], hs[-1]
                h = hs[-1]

        for node in tree.nodes():
            where = f"node {node.id}"
            nb = len(node.blocks)
            if not nb:
                raise AssertionError(f"{where} holds no blocks")
            b = node.blocks
            if not (
                isinstance(b, (range, Runs))
                or (isinstance(b, array) and b.typecode == "q")
                or (isinstance(b, np.ndarray) and b.dtype == np.int64 and b.ndim == 1)
            ):
                raise AssertionError(f"{where}: block ids are not a range, Runs, or 1-D int64 array")
            parent = node.parent
            assert parent is not None
            if parent.children.get(node.key) is not node:
                raise AssertionError(f"{where} is not its parent's child under its key")
            if node.tokens is not None:
                if len(node.tokens) < node.tok_start + nb * bb or node.tok_start < 0:
                    raise AssertionError(f"{where}: token bytes do not cover its blocks")
                if node.first_hash is not None or node.last_hash is not None or self._hash_keys:
                    chain_of(node)
                    if node.first_hash is not None and node.first_hash != expected_first[node.id]:
                        raise AssertionError(f"{where}: cached first-block hash is stale")
                    if node.last_hash is not None and node.last_hash != expected_last[node.id]:
                        raise AssertionError(f"{where}: cached last-block hash is stale")
                key = expected_first[node.id] if self._hash_keys else bytes(node.token_view(bb)[:bb])
                if node.key != key:
                    raise AssertionError(f"{where}: its key is not its first block's")
            else:
                if node._keys is None or len(node._keys) != nb:
                    raise AssertionError(f"{where}: {len(node._keys or [])} keys for {nb} blocks")
                if node.key != node._keys[0]:
                    raise AssertionError(f"{where}: its key is not its first block's")
            if parent.parent is not None and parent.last_access < node.last_access:
                raise AssertionError(f"{where} was used more recently than its parent {parent.id}")
            if node.pins != expected_pins.get(node.id, 0):
                raise AssertionError(
                    f"{where}: pins={node.pins}, live requests through it={expected_pins.get(node.id, 0)}"
                )
            runs.append(ids_array(node.blocks))
            if not node.children and node.pins == 0:
                evictable.add(node.id)
        cached = np.concatenate(runs) if runs else ids_array(EMPTY_IDS)
        uniq, counts = np.unique(cached, return_counts=True)
        if len(uniq) != len(cached):
            raise AssertionError(f"block {int(uniq[np.argmax(counts > 1)])} is cached twice")
        in_flight = [b for h in self._live.values() if h.owned for b in h.owned]
        flying = np.asarray(in_flight, dtype=np.int64)
        if len(np.unique(flying)) != len(flying):
            raise AssertionError("a block is owned by two live requests")
        if len(flying) and np.isin(flying, cached).any():
            raise AssertionError(f"block {int(flying[np.isin(flying, cached)][0])} is both cached and in flight")
        self.allocator.check_integrity(np.concatenate((cached, flying)), single_owner=True)
        if self.windows is not None:
            self.windows.check_integrity(np.concatenate((cached, flying)))
        in_policy = {n.id for n in self.policy}
        if in_policy != evictable or len(self.policy) != len(evictable):
            raise AssertionError(f"evictable set {sorted(in_policy)} != unpinned leaves {sorted(evictable)}")
        free = self.allocator.num_free
        if free + len(cached) + len(flying) != self.config.num_blocks:
            raise AssertionError(
                f"free {free} + cached {len(cached)} + in flight {len(flying)} != num_blocks {self.config.num_blocks}"
            )
