"""PrefixCache: the facade over radix tree + allocator + eviction policy.

One request's life: ``match`` (pins its longest cached prefix) -> the caller computes the rest ->
``commit`` (caches the request's full blocks, returns the new block ids the caller must fill before the
next ``match``) -> ``release`` (unpins). ``lookup`` wraps match/release in a ``with`` block so that every
exit path unpins. Not thread-safe: callers serialise (the engine holds a lock).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from prefixcache.core.allocator import BlockAllocator
from prefixcache.core.config import DEFAULT_NAMESPACE, CacheConfig
from prefixcache.core.eviction import POLICIES, EvictionPolicy
from prefixcache.core.hashing import TOKEN_BYTES, BlockHasher, as_token_array, chain_hashes, namespace_root, xxh3_hasher
from prefixcache.core.radix_tree import Node, RadixTree, Step
from prefixcache.core.stats import CacheStats


@dataclass(eq=False)
class RequestHandle:
    """A live request's hold on the cache: the path it pins. Made by match, ended by release."""

    id: int
    mode: str  # "tokens" | "keys"
    namespace: str
    terminal: Node  # the deepest pinned node (a root when nothing is pinned)
    prompt: Any = field(repr=False)  # token bytes or the key list given to match
    released: bool = False


@dataclass(frozen=True)
class MatchResult:
    """What ``match`` found: ``cached_tokens`` leading tokens are served by ``block_ids`` (in order)."""

    handle: RequestHandle
    cached_tokens: int
    block_ids: tuple[int, ...]

    @property
    def cached_blocks(self) -> int:
        return len(self.block_ids)


@dataclass(frozen=True)
class CommitResult:
    """What ``commit`` inserted: fill ``block_ids`` with the KV of blocks ``first_block ...`` of the sequence."""

    block_ids: tuple[int, ...]
    first_block: int
    cached_blocks: int  # blocks of the sequence cached now, from its start
    not_cached: int  # full blocks that did not fit in the pool


def _check_keep_for(keep_for: Any) -> float:
    if isinstance(keep_for, bool) or not isinstance(keep_for, (int, float)) or not keep_for >= 0:
        raise ValueError(f"keep_for must be a number of seconds >= 0, got {keep_for!r}")
    return float(keep_for)


def _check_count(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return value


def _ensure_namespace(namespace: str) -> str:
    if not isinstance(namespace, str):
        raise TypeError(f"namespace must be a str, got {type(namespace).__name__}")
    return namespace


class PrefixCache:
    """Maps cached prefixes to KV block ids; evicts least valuable unpinned leaves when full."""

    def __init__(
        self, config: CacheConfig, *, hasher: BlockHasher | None = None, clock: Callable[[], float] | None = None
    ) -> None:
        """``hasher`` replaces the seeded xxh3_128 block hash (a test seam for forced collisions).
        ``clock()`` is the time in seconds that retention (``keep_for``) is measured on; default
        time.monotonic (a trace replay passes the trace's clock)."""
        self.config = config
        self.clock: Callable[[], float] = clock or time.monotonic
        self._namespace_keep: dict[str, float] = {}
        self.block_size = config.block_size
        self._hasher = hasher or xxh3_hasher(config.hash_seed)
        self._policy_factory = POLICIES[config.eviction]
        self.reset()

    # ---- state ---------------------------------------------------------------------------------------
    def reset(self, *, keep_stats: bool = False) -> None:
        """Forget every cached block and live request; counters restart from zero unless ``keep_stats``."""
        c = self.config
        self.tree = RadixTree(c.block_size, self._hasher, partial(namespace_root, seed=c.hash_seed), c.verify_tokens)
        self.allocator = BlockAllocator(c.num_blocks)
        self.policy: EvictionPolicy = self._policy_factory(self.clock)
        if not keep_stats or not hasattr(self, "stats"):
            self.stats = CacheStats()
        self._live: dict[int, RequestHandle] = {}
        self._ids = itertools.count(1)
        self._clock = 0

    @property
    def num_blocks(self) -> int:
        return self.config.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def num_cached_blocks(self) -> int:
        return self.config.num_blocks - self.allocator.num_free

    @property
    def num_active_requests(self) -> int:
        return len(self._live)

    # ---- lookups -------------------------------------------------------------------------------------
    def match(self, tokens: Any, namespace: str = DEFAULT_NAMESPACE) -> MatchResult:
        """Find and PIN the longest cached prefix of ``tokens``; at least one token is always left uncached.

        Changes the cache: pins the matched path, refreshes its recency, may split a node, counts stats.
        """
        arr = as_token_array(tokens)
        n = len(arr)
        if n == 0:
            raise ValueError("tokens is empty: a prompt needs at least one token")
        data = arr.tobytes()
        root = self.tree.root("tokens", _ensure_namespace(namespace))
        path = self.tree.walk_tokens(root, data, (n - 1) // self.block_size)
        return self._finish_match("tokens", namespace, root, path, data, n, -(-n // self.block_size))

    def match_keys(
        self,
        keys: Sequence[Any],
        namespace: str = DEFAULT_NAMESPACE,
        *,
        max_blocks: int | None = None,
        num_tokens: int | None = None,
    ) -> MatchResult:
        """Like ``match`` for precomputed block keys (e.g. Mooncake ``hash_ids``): ``keys[i]`` names block i
        together with everything before it. Up to ``max_blocks`` (default all) may hit; ``num_tokens`` (default
        ``len(keys) * block_size``) is the prompt length used for token counts.
        """
        keys = list(keys)
        if not keys:
            raise ValueError("keys is empty: a request needs at least one block")
        nb = len(keys) if max_blocks is None else max(0, min(max_blocks, len(keys)))
        n = len(keys) * self.block_size if num_tokens is None else num_tokens
        root = self.tree.root("keys", _ensure_namespace(namespace))
        path = self.tree.walk_keys(root, keys, nb)
        return self._finish_match("keys", namespace, root, path, keys, n, len(keys))

    def probe(self, tokens: Any, namespace: str = DEFAULT_NAMESPACE) -> int:
        """How many leading tokens ``match`` would serve now. Changes nothing."""
        arr = as_token_array(tokens)
        if len(arr) == 0:
            return 0
        root = self.tree.roots.get(("tokens", _ensure_namespace(namespace)))
        if root is None:
            return 0
        path = self.tree.walk_tokens(root, arr.tobytes(), (len(arr) - 1) // self.block_size)
        return sum(s.matched for s in path) * self.block_size

    def _finish_match(
        self, mode: str, namespace: str, root: Node, path: list[Step], prompt: Any, n: int, nblocks: int
    ) -> MatchResult:
        terminal = self._split_last(path) if path else root
        self._clock += 1
        handle = RequestHandle(next(self._ids), mode, namespace, root, prompt)
        self._live[handle.id] = handle
        self._pin_path(handle, terminal)
        blocks: list[int] = []
        node = terminal
        hit_nodes = []
        while not node.is_root:
            hit_nodes.append(node)
            node = node.parent  # type: ignore[assignment]
        for node in reversed(hit_nodes):
            blocks.extend(node.blocks)
            node.last_access = self._clock
            node.hits += 1
        hit = len(blocks)
        cached_tokens = min(hit * self.block_size, n)
        s = self.stats
        s.lookups += 1
        s.prompt_tokens += n
        s.cached_tokens += cached_tokens
        s.lookup_blocks += nblocks
        s.hit_blocks += hit
        s.lookups_with_hit += hit > 0
        return MatchResult(handle, cached_tokens, tuple(blocks))

    def _split_last(self, path: list[Step]) -> Node:
        last = path[-1]
        if last.matched < len(last.node.blocks):
            return self.tree.split(last.node, last.matched)
        return last.node

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
        if tokens is None:
            data = handle.prompt
        else:
            data = as_token_array(tokens).tobytes()
        nblocks = len(data) // (TOKEN_BYTES * self.block_size)
        root = self.tree.root("tokens", handle.namespace)
        path = self.tree.walk_tokens(root, data, nblocks)
        bb = self.tree.block_bytes

        def make(start: int, stop: int, parent: Node) -> tuple[list, bytes | None]:
            keys = chain_hashes(self._hasher, parent.keys[-1], data, self.block_size, start, stop)
            toks = data[start * bb : stop * bb] if self.config.verify_tokens else None
            return keys, toks

        keep_blocks = None if keep_tokens is None else _check_count(keep_tokens, "keep_tokens") // self.block_size
        return self._insert(handle, root, path, nblocks, make, keep_for, keep_blocks)

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
        keys = handle.prompt if keys is None else list(keys)
        root = self.tree.root("keys", handle.namespace)
        path = self.tree.walk_keys(root, keys, len(keys))
        if keep_blocks is not None:
            keep_blocks = _check_count(keep_blocks, "keep_blocks")
        return self._insert(
            handle, root, path, len(keys), lambda a, b, parent: (keys[a:b], None), keep_for, keep_blocks
        )

    def retain_namespace(self, namespace: str, keep_for: float | None) -> None:
        """Default ``keep_for`` of every later commit in ``namespace`` (None: stop). Changes only that default."""
        if keep_for is None:
            self._namespace_keep.pop(_ensure_namespace(namespace), None)
        else:
            self._namespace_keep[_ensure_namespace(namespace)] = _check_keep_for(keep_for)

    def _insert(
        self,
        handle: RequestHandle,
        root: Node,
        path: list[Step],
        nblocks: int,
        make,
        keep_for: float | None = None,
        keep_blocks: int | None = None,
    ) -> CommitResult:
        if keep_for is None:
            keep_for = self._namespace_keep.get(handle.namespace)
        until = None if keep_for is None else self.clock() + _check_keep_for(keep_for)
        terminal = self._split_last(path) if path else root
        have = sum(s.matched for s in path)
        self._clock += 1
        old = handle.terminal
        self._pin_path(handle, terminal)  # pin the new path before letting go of the old one
        self._unpin_path(old)
        node = terminal
        while not node.is_root:
            node.last_access = self._clock
            node = node.parent  # type: ignore[assignment]
        want = nblocks - have
        new_ids: list[int] = []
        if want > 0:
            keys, toks = make(have, nblocks, terminal)
            if keys[0] in terminal.children:
                # Another run hangs under the same key: a hash collision that token verification caught in
                # the walk. Equal keys must mean equal prefixes, so the new blocks are not cached.
                fit = 0
            else:
                short = want - self.allocator.num_free
                if short > 0:
                    self._evict(short)
                fit = min(want, self.allocator.num_free)
            if fit > 0:
                new_ids = self.allocator.allocate(fit)
                if fit < want:
                    keys = keys[:fit]
                    toks = None if toks is None else toks[: fit * self.tree.block_bytes]
                # Always a new node, never appended to the request's leaf: its blocks are born now, with no hits
                # yet (what FIFO and LFU order by); the handle's pins move down to it.
                terminal = self.tree.add_child(terminal, keys, new_ids, toks, self._clock)
                terminal.pins = 1
            self.stats.blocks_inserted += fit
            self.stats.blocks_not_cached += want - fit
        handle.terminal = terminal
        if until is not None and keep_blocks != 0:
            self._retain(terminal, until, keep_blocks)
        return CommitResult(tuple(new_ids), have, have + len(new_ids), max(0, want - len(new_ids)))

    def _retain(self, terminal: Node, until: float, keep_blocks: int | None) -> None:
        """Mark the path to ``terminal`` (or its first ``keep_blocks`` blocks, splitting the node where that
        ends) to be kept until ``until``. The path is pinned, so no policy holds these nodes while they change."""
        path = []
        node = terminal
        while not node.is_root:
            path.append(node)
            node = node.parent  # type: ignore[assignment]
        depth = 0
        for node in reversed(path):
            if keep_blocks is not None and depth + len(node.blocks) > keep_blocks:
                if keep_blocks > depth:
                    self.tree.split(node, keep_blocks - depth).keep_until = max(node.keep_until, until)
                break
            node.keep_until = max(node.keep_until, until)
            depth += len(node.blocks)

    # ---- release -------------------------------------------------------------------------------------
    def release(self, handle: RequestHandle) -> None:
        """Unpin the request's path; its blocks become evictable. Raises if released already."""
        self._check_live(handle)
        self._unpin_path(handle.terminal)
        handle.released = True
        del self._live[handle.id]

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
    def _pin_path(self, handle: RequestHandle, terminal: Node) -> None:
        handle.terminal = terminal
        node = terminal
        policy = self.policy
        while not node.is_root:
            if node.pins == 0:
                policy.remove(node)
            node.pins += 1
            node = node.parent  # type: ignore[assignment]

    def _unpin_path(self, terminal: Node) -> None:
        node = terminal
        while not node.is_root:
            node.pins -= 1
            if node.pins == 0 and node.is_leaf:
                self.policy.add(node)
            node = node.parent  # type: ignore[assignment]

    def _evict(self, n: int) -> int:
        """Free up to ``n`` blocks from unpinned leaves, victim order per policy, tail first. Returns freed."""
        freed = 0
        policy, tree = self.policy, self.tree
        while freed < n:
            victim = policy.peek()
            if victim is None:
                break
            k = min(n - freed, len(victim.blocks))
            ids = tree.drop_tail(victim, k)
            self.allocator.decref(ids)
            freed += k
            if not victim.blocks:
                policy.remove(victim)
                parent = victim.parent
                if parent is not None and not parent.is_root and parent.pins == 0 and parent.is_leaf:
                    policy.add(parent)
        self.stats.blocks_evicted += freed
        return freed

    # ---- invariants ----------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError with a clear message if any invariant is broken. Changes nothing."""
        self.allocator.check_integrity()
        bs_bytes = self.tree.block_bytes
        expected_pins: dict[int, int] = {}
        for h in self._live.values():
            node = h.terminal
            while not node.is_root:
                expected_pins[node.id] = expected_pins.get(node.id, 0) + 1
                node = node.parent  # type: ignore[assignment]
        seen: set[int] = set()
        evictable = set()
        for node in self.tree.nodes():
            where = f"node {node.id}"
            if not node.blocks:
                raise AssertionError(f"{where} holds no blocks")
            if len(node.keys) != len(node.blocks):
                raise AssertionError(f"{where}: {len(node.keys)} keys for {len(node.blocks)} blocks")
            if node.tokens is not None and len(node.tokens) != len(node.blocks) * bs_bytes:
                raise AssertionError(f"{where}: token bytes do not cover its blocks")
            parent = node.parent
            assert parent is not None
            if parent.children.get(node.keys[0]) is not node:
                raise AssertionError(f"{where} is not its parent's child under its first key")
            if not parent.is_root and parent.last_access < node.last_access:
                raise AssertionError(f"{where} was used more recently than its parent {parent.id}")
            if node.pins != expected_pins.get(node.id, 0):
                raise AssertionError(
                    f"{where}: pins={node.pins}, live requests through it={expected_pins.get(node.id, 0)}"
                )
            for b in node.blocks:
                if b in seen:
                    raise AssertionError(f"block {b} is cached twice")
                seen.add(b)
                if self.allocator.refs[b] != 1:
                    raise AssertionError(f"cached block {b} has ref count {self.allocator.refs[b]}")
            if node.is_leaf and node.pins == 0:
                evictable.add(node.id)
        for root in self.tree.roots.values():
            if root.blocks or root.pins:
                raise AssertionError("a root holds blocks or pins")
        in_policy = {n.id for n in self.policy}
        if in_policy != evictable or len(self.policy) != len(evictable):
            raise AssertionError(f"evictable set {sorted(in_policy)} != unpinned leaves {sorted(evictable)}")
        free = self.allocator.num_free
        if free + len(seen) != self.config.num_blocks:
            raise AssertionError(f"free {free} + cached {len(seen)} != num_blocks {self.config.num_blocks}")
