"""Window groups: the layers of a model that read only the last tokens (sliding-window or chunked attention),
and which cache blocks still hold their KV.

A full-attention layer reads every earlier token, so a cached prefix needs its KV in every block. A layer with
a sliding window of ``W`` tokens reads, at position ``q``, only keys ``k > q - W``; a chunked layer (chunks of
``C`` tokens) reads only the keys of ``q``'s own chunk. A request served a prefix of ``p`` blocks therefore
needs, for such a group, only the blocks from ``WindowRule.first_block(p)`` to ``p``: the *window* of point
``p``. The rest of the group's KV is never read again by anything that extends that prefix.

``WindowSlots`` keeps the group's KV in a pool of its own, ``capacity`` slots of one block each, and maps a
cache block id to its slot (``table``; -1: none). A block keeps a slot while a *holder* needs it:

* a **point** (``keep_point``): a block boundary of a cached path where a later request may end its match (a
  chat's turn ends, the divergence point, the re-send point: ``prefixcache.core.snapshots.snapshot_points``);
  it holds its window's blocks, and points are dropped least recently used first when slots run out;
* a **live request** (``give`` / ``hold`` / ``let_go``, keyed by the request's id): the blocks inside its
  current window, released as they fall out of it.

A slot no one holds any more stays with its block, *idle* (its K/V still valid), until a slot is needed: then the
least recently idle one is taken first, and only then points are dropped. So while there is room a match may end
at any boundary whose window is still there (as vLLM's freed-but-hashed blocks serve), and under pressure the
points decide. ``offer`` gives new blocks idle slots without taking any from a point.

A match is served to the deepest point whose window blocks all have slots (``served``), so it is exact: the
blocks before the window are masked out by the layer's own rule, whatever their slot holds. Block ids freed by
the cache (evicted, or a request's own blocks given back) lose their slot at once (``forget``): a reused id
never inherits another block's KV. Model-free: it knows ids and slots, not bytes. Not thread-safe.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import numpy.typing as npt

from prefixcache.core.checks import check_int

KINDS = ("sliding", "chunked")
DEFAULT_WINDOW_SHARE = 0.25  # window-layer slots per full-layer block of a pool (the engine's and the planner's)
Ids = Sequence[int] | npt.NDArray[np.int64]  # a path's block ids


@dataclass(frozen=True)
class WindowRule:
    """What a group's layers read: ``kind`` "sliding" (the last ``tokens`` positions, the query's own included)
    or "chunked" (the query's chunk of ``tokens`` positions)."""

    kind: str
    tokens: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"WindowRule.kind must be one of {KINDS}, got {self.kind!r}")
        object.__setattr__(
            self, "tokens", check_int(self.tokens, "WindowRule.tokens", minimum=1, type_error=ValueError)
        )

    def first_token(self, position: int) -> int:
        """The first key position a query at ``position`` (and every later one) reads."""
        if self.kind == "sliding":
            return max(0, position - self.tokens + 1)
        return position // self.tokens * self.tokens

    def first_block(self, blocks: int, block_size: int) -> int:
        """The first block a request served ``blocks`` blocks needs: its window starts there."""
        return self.first_token(blocks * block_size) // block_size

    def max_blocks(self, block_size: int) -> int:
        """The most blocks one point's window spans."""
        if self.kind == "sliding":
            return -(-(self.tokens - 1) // block_size)
        return -(-self.tokens // block_size) + 1  # a chunk that starts inside a block


class OutOfWindowSlots(MemoryError):
    """``give`` found fewer free window slots than asked for, even after dropping every point it may."""


@dataclass
class WindowStats:
    """Running totals of one ``WindowSlots``. Mutated only by it."""

    points_kept: int = 0  # keep_point calls that kept (or refreshed) a point
    points_refused: int = 0  # keep_point calls with no room
    points_evicted: int = 0  # points dropped for room
    points_forgotten: int = 0  # points dropped because a block of their window left the cache
    cut_matches: int = 0  # served() calls that cut a match short
    cut_blocks: int = 0  # blocks those cuts took off

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class WindowSlots:
    """Window-group slots of the blocks of one cache (see the module docstring). ``num_blocks``: the cache's block
    ids are ``0 .. num_blocks - 1``."""

    def __init__(self, rule: WindowRule, block_size: int, capacity: int, num_blocks: int) -> None:
        if not isinstance(rule, WindowRule):
            raise TypeError(f"rule must be a WindowRule, got {type(rule).__name__}")
        self.rule = rule
        self.block_size = check_int(block_size, "block_size", minimum=1, type_error=ValueError)
        self.capacity = check_int(capacity, "capacity", minimum=1, type_error=ValueError)
        self.num_blocks = check_int(num_blocks, "num_blocks", minimum=1, type_error=ValueError)
        self.stats = WindowStats()
        self.reset()

    def reset(self, *, keep_stats: bool = True) -> None:
        """Drop every slot, point and hold (the cache was reset); counters restart unless ``keep_stats``."""
        if not keep_stats:
            self.stats = WindowStats()
        self.table: npt.NDArray[np.int64] = np.full(self.num_blocks, -1, dtype=np.int64)
        self._free = list(range(self.capacity - 1, -1, -1))
        self._holders: dict[int, set[Hashable]] = {}  # block -> its holders
        self._held: dict[Hashable, set[int]] = {}  # holder -> its blocks
        self._points: OrderedDict[Hashable, None] = OrderedDict()  # point holders, least recently used first
        self._idle: OrderedDict[int, None] = OrderedDict()  # blocks with a slot and no holder, oldest first

    # ---- reading ----------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Slots no block has."""
        return len(self._free)

    @property
    def num_idle(self) -> int:
        """Slots whose block no one holds (taken first when a slot is needed)."""
        return len(self._idle)

    @property
    def num_held(self) -> int:
        """Slots some point or request holds."""
        return self.capacity - len(self._free) - len(self._idle)

    @property
    def num_points(self) -> int:
        return len(self._points)

    def first_block(self, blocks: int) -> int:
        return self.rule.first_block(blocks, self.block_size)

    def slot(self, block: int) -> int | None:
        s = int(self.table[block])
        return None if s < 0 else s

    def translate(self, block_ids: Ids, missing: int) -> npt.NDArray[np.int64]:
        """The slots of ``block_ids``, ``missing`` for those without one. Changes nothing."""
        s = self.table[np.asarray(block_ids, dtype=np.int64)]
        return np.where(s < 0, missing, s)

    def served(self, block_ids: Ids, upto: int) -> int:
        """The deepest ``p <= upto`` whose window (blocks ``first_block(p) .. p - 1`` of the path ``block_ids``)
        holds slots everywhere; 0 always qualifies. Counts a cut. Changes nothing else."""
        upto = min(int(upto), len(block_ids))
        if upto <= 0:
            return 0
        have = self.table[np.asarray(block_ids[:upto], dtype=np.int64)] >= 0
        missing = np.flatnonzero(~have)
        p = upto
        while p > 0:
            i = int(np.searchsorted(missing, p)) - 1  # the last missing block before p
            if i < 0 or missing[i] < self.first_block(p):
                break
            p = int(missing[i])  # a point at or below the missing block; its window may still reach it
        if p < upto:
            self.stats.cut_matches += 1
            self.stats.cut_blocks += upto - p
        return p

    # ---- holding ----------------------------------------------------------------------------------------
    def give(self, holder: Hashable, block_ids: Iterable[int], *, evict: bool = True) -> list[int]:
        """Hold ``block_ids`` for ``holder``, giving a slot to each that has none (dropping least recently used
        points if ``evict``); returns the blocks that got a slot now (the caller must write their KV before the
        next match). All or nothing: raises ``OutOfWindowSlots`` and changes nothing when they cannot be had."""
        blocks = list(dict.fromkeys(int(b) for b in block_ids))
        need = [b for b in blocks if self.table[b] < 0]
        added = self._hold(holder, [b for b in blocks if self.table[b] >= 0])  # held now: not taken below
        if len(need) > self._spare():
            if evict:
                while len(need) > self._spare() and self._evict_one(spare=holder):
                    pass
            if len(need) > self._spare():
                self.let_go(holder, added)
                raise OutOfWindowSlots(
                    f"{len(need)} window slots needed, {self._spare()} free"
                    + (" after dropping every point" if evict else "")
                )
        for b in need:
            self.table[b] = self._take()
        self._hold(holder, need)
        return need

    def offer(self, block_ids: Iterable[int]) -> list[int]:
        """Give blocks without a slot one from the free or idle slots (never from a point or a request), left idle;
        returns those that got one (write their K/V). Changes the slots."""
        got: list[int] = []
        budget = self._spare()  # the idle slots of this call's own blocks are not taken again
        for b in dict.fromkeys(int(x) for x in block_ids):
            if budget <= 0:
                break
            if self.table[b] >= 0:
                continue
            self.table[b] = self._take()
            self._idle[b] = None
            got.append(b)
            budget -= 1
        return got

    def _spare(self) -> int:
        return len(self._free) + len(self._idle)

    def _take(self) -> int:
        """A slot for a block: a free one, else the oldest idle block's (which loses it)."""
        if self._free:
            return self._free.pop()
        b, _ = self._idle.popitem(last=False)
        s = int(self.table[b])
        self.table[b] = -1
        return s

    def hold(self, holder: Hashable, block_ids: Iterable[int]) -> None:
        """Hold blocks that have slots for ``holder`` (a request served them). Raises if one has none."""
        blocks = [int(b) for b in block_ids]
        lacking = [b for b in blocks if self.table[b] < 0]
        if lacking:
            raise ValueError(f"hold: blocks {lacking[:8]} have no window slot")
        self._hold(holder, blocks)

    def _hold(self, holder: Hashable, blocks: Iterable[int]) -> list[int]:
        """Add ``blocks`` to ``holder``'s; returns those it did not hold yet."""
        held = self._held.setdefault(holder, set())
        added = []
        for b in blocks:
            if b not in held:
                held.add(b)
                self._holders.setdefault(b, set()).add(holder)
                self._idle.pop(b, None)
                added.append(b)
        if not held:
            del self._held[holder]
        return added

    def let_go(self, holder: Hashable, block_ids: Iterable[int]) -> None:
        """``holder`` no longer needs ``block_ids`` (they fell out of its window); slots no one holds are freed."""
        held = self._held.get(holder)
        if not held:
            return
        for b in block_ids:
            b = int(b)
            if b in held:
                held.discard(b)
                self._unhold(b, holder)
        if not held:
            del self._held[holder]
            self._points.pop(holder, None)

    def drop(self, holder: Hashable) -> None:
        """Forget ``holder`` and everything it holds (a request ended; a point was dropped)."""
        for b in self._held.pop(holder, ()):
            self._unhold(b, holder)
        self._points.pop(holder, None)

    def _unhold(self, b: int, holder: Hashable) -> None:
        hs = self._holders[b]
        hs.discard(holder)
        if not hs:
            del self._holders[b]
            self._idle[b] = None  # its K/V stays valid until the slot is taken

    def held(self, holder: Hashable) -> frozenset[int]:
        return frozenset(self._held.get(holder, ()))

    # ---- points -----------------------------------------------------------------------------------------
    def keep_point(self, path: Ids, blocks: int, *, known_from: int = 0) -> list[int] | None:
        """Keep point ``blocks`` of the cached path ``path`` (its block ids): its window holds slots until the point
        is dropped. Returns the blocks that got a slot now (write their KV), or None when it is not kept: no room
        (nothing changes but dropped points), or a window block before ``known_from`` (where the caller's own KV
        starts: the request was served that many blocks) has no slot, so the caller does not have its KV. A
        point already kept is refreshed."""
        if blocks <= 0 or blocks > len(path):
            return []
        key = ("point", int(path[blocks - 1]))
        first = self.first_block(blocks)
        window = [int(b) for b in path[first:blocks]]
        if not window:  # the layers read nothing before the point: it is always complete
            return []
        if any(self.table[b] < 0 for b in window[: max(0, known_from - first)]):
            self.stats.points_refused += 1
            return None
        if key in self._points and self._held.get(key) == set(window):
            self._points.move_to_end(key)
            self.stats.points_kept += 1
            return []
        self.drop(key)
        try:
            new = self.give(key, window)
        except OutOfWindowSlots:
            self.stats.points_refused += 1
            return None
        self._points[key] = None
        self.stats.points_kept += 1
        return new

    def touch_point(self, path: Ids, blocks: int) -> None:
        """Refresh point ``blocks`` of ``path`` (a request was served it), if it is kept."""
        if blocks > 0:
            key = ("point", int(path[blocks - 1]))
            if key in self._points:
                self._points.move_to_end(key)

    def _evict_one(self, spare: Hashable) -> bool:
        """Drop the least recently used point other than ``spare``; False when there is none."""
        for key in self._points:
            if key != spare:
                self.drop(key)
                self.stats.points_evicted += 1
                return True
        return False

    def forget(self, block_ids: Iterable[int]) -> None:
        """The cache freed ``block_ids``: they lose their slots; points whose windows held them are dropped
        (incomplete), live holders just lose them. Changes the slots."""
        for b in block_ids:
            b = int(b)
            holders = self._holders.get(b)
            if not holders:
                if self._idle.pop(b, 0) is None:
                    self._free.append(int(self.table[b]))
                    self.table[b] = -1
                continue
            for h in list(holders):
                if h in self._points:
                    self.drop(h)
                    self.stats.points_forgotten += 1
                else:
                    self.let_go(h, (b,))
            if self._idle.pop(b, 0) is None:  # no holder left: its slot goes back
                self._free.append(int(self.table[b]))
                self.table[b] = -1

    def replace(self, own: int, tree: int) -> None:
        """A request's own block ``own`` turned out to hold what the cache's block ``tree`` holds (same tokens, same
        prefix: same K/V), and ``own`` is about to be freed: its holders hold ``tree`` instead, its points become
        ``tree``'s, and its slot (its window K/V) moves to ``tree`` if ``tree`` has none. Changes the slots."""
        own, tree = int(own), int(tree)
        holders = self._holders.get(own)
        if not holders:
            return
        if self.table[tree] < 0:  # the slot, and its K/V, go over whole
            self.table[tree], self.table[own] = self.table[own], -1
            self._holders[tree] = self._holders.pop(own)
            for h in self._holders[tree]:
                self._held[h].discard(own)
                self._held[h].add(tree)
        else:
            for h in list(holders):
                self._hold(h, (tree,))
                self.let_go(h, (own,))
        old = ("point", own)
        if old in self._points:
            blocks = self._held.pop(old, set())
            self._points.pop(old)
            new = ("point", tree)
            if new in self._points:  # the tree's own point: one is enough
                for b in blocks:
                    self._unhold(b, old)
            else:
                self._held[new] = blocks
                self._points[new] = None
                for b in blocks:
                    self._holders[b].discard(old)
                    self._holders[b].add(new)

    # ---- invariants -------------------------------------------------------------------------------------
    def check_integrity(self, live_blocks: npt.NDArray[np.int64] | None = None) -> None:
        """Raise AssertionError if the slots, holders and points disagree; with ``live_blocks`` (the cache's
        cached and in-flight ids), also if a slot belongs to a block the cache does not hold. Changes nothing."""
        used = self.table[self.table >= 0]
        if len(np.unique(used)) != len(used):
            raise AssertionError("a window slot is given to two blocks")
        if len(used) + len(self._free) != self.capacity or set(self._free) & set(used.tolist()):
            raise AssertionError(f"{len(used)} slots used + {len(self._free)} free != capacity {self.capacity}")
        slotted = set(np.flatnonzero(self.table >= 0).tolist())
        if set(self._idle) & set(self._holders):
            raise AssertionError("a block is both idle and held")
        if slotted != set(self._holders) | set(self._idle):
            raise AssertionError(
                f"blocks with slots {sorted(slotted)[:8]} are not those held or idle {sorted(self._holders)[:8]}"
            )
        for holder, blocks in self._held.items():
            if not blocks:
                raise AssertionError(f"holder {holder!r} holds nothing")
            for b in blocks:
                if holder not in self._holders.get(b, ()):
                    raise AssertionError(f"holder {holder!r} holds block {b}, which does not list it")
        for b, holders in self._holders.items():
            for h in holders:
                if b not in self._held.get(h, ()):
                    raise AssertionError(f"block {b} lists holder {h!r}, which does not hold it")
        for key in self._points:
            if key not in self._held:
                raise AssertionError(f"point {key!r} holds no blocks")
        if live_blocks is not None:
            stray = slotted - set(np.asarray(live_blocks).tolist())
            if stray:
                raise AssertionError(f"blocks {sorted(stray)[:8]} hold window slots but the cache does not hold them")
