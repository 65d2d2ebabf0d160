"""Recurrent-state snapshots of hybrid models: which block boundaries hold one, and where a request restores.

A hybrid model (SSM / linear-attention layers beside attention layers) needs, besides the attention KV of a
prefix, its recurrent layers' state after that prefix. That state is fixed-size per sequence and cannot be split
into blocks, so it is kept as *snapshots* at a few block boundaries: snapshot ``b`` of a path is the state after
its first ``b`` blocks, keyed by block ``b - 1``'s chained key (which names the whole prefix, namespace
included). A request may be served only up to the deepest snapshot its KV match reaches; KV beyond it is
recomputed (or, on the engine, only attended to).

Which boundaries earn a snapshot (``snapshot_points``), for a request whose KV match covers ``matched`` blocks
and whose deepest snapshot on that path is ``restored``:

* the **divergence point** ``matched`` (when deeper than ``restored``): the prefix this request shares with
  earlier ones ends there, so the next request that shares it is served all of it (SGLang's branching point);
* the **re-send point** ``(limit - 1) // block_size`` of the cacheable prompt: the same prompt again (another
  sample, another choice of the same multiple-choice context) is served all a re-send can be;
* **hints**: token positions the caller knows prefixes diverge at (the end of each chat message: the system
  prompt's end is where two tenants' chats part), floored to a block, so the *second* request sharing a system
  prompt is served it (SGLang's and vLLM's need a third);
* every ``interval`` blocks (0: none), vLLM's retention interval, for long prompts with unknown structure;
* the **request end**: the last block boundary of what the request commits (prompt and reply), so a chat's next
  turn is served its whole history. The engine and the contiguous path keep the latest boundary state of each
  request and publish it when the request ends.

``SnapshotIndex`` holds the snapshots (key -> slot of a state pool) under a budget in snapshots, least recently
used first; restoring refreshes a snapshot. Model-free: it knows keys and slot numbers, not bytes. Not
thread-safe: callers serialise.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import asdict, dataclass

from prefixcache.core.checks import check_int


@dataclass
class SnapshotStats:
    """Running totals of one snapshot index. Mutated only by SnapshotIndex."""

    lookups: int = 0  # restore lookups
    restored: int = 0  # lookups that found a snapshot
    stored: int = 0  # snapshots put
    evicted: int = 0  # snapshots dropped for room
    dropped: int = 0  # snapshots dropped by their owner (superseded, or their blocks are gone)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class SnapshotIndex:
    """Snapshots by block key, each in one of ``capacity`` slots (numbered ``first_slot ..``), least recently
    used first."""

    def __init__(self, capacity: int, first_slot: int = 0) -> None:
        self.capacity = check_int(capacity, "capacity", minimum=1, type_error=ValueError)
        self.first_slot = check_int(first_slot, "first_slot", minimum=0, type_error=ValueError)
        self._lru: OrderedDict[Hashable, int] = OrderedDict()
        self._free = list(range(first_slot + capacity - 1, first_slot - 1, -1))
        self.stats = SnapshotStats()

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._lru

    def slot(self, key: Hashable) -> int | None:
        """The slot holding ``key``'s snapshot, or None. Changes nothing."""
        return self._lru.get(key)

    def deepest(self, keys: Sequence[Hashable], upto: int, *, touch: bool = True) -> tuple[int, int | None]:
        """The deepest snapshot among the first ``upto`` blocks of a path (``keys[b - 1]`` names snapshot ``b``):
        ``(b, slot)``, or ``(0, None)`` when there is none. With ``touch`` (a restore) refreshes the one found and
        counts a lookup; without, changes nothing."""
        if touch:
            self.stats.lookups += 1
        for b in range(min(upto, len(keys)), 0, -1):
            slot = self._lru.get(keys[b - 1])
            if slot is not None:
                if touch:
                    self._lru.move_to_end(keys[b - 1])
                    self.stats.restored += 1
                return b, slot
        return 0, None

    def put(self, key: Hashable) -> tuple[int, bool]:
        """A slot for ``key``'s snapshot, most recent now: ``(slot, fresh)``, ``fresh`` False when ``key`` was held
        already (its slot is returned and keeps its contents). Evicts the least recently used snapshot when
        full; the caller writes the state into a fresh slot."""
        lru = self._lru
        slot = lru.get(key)
        if slot is not None:
            lru.move_to_end(key)
            return slot, False
        if not self._free:
            _, freed = lru.popitem(last=False)
            self._free.append(freed)
            self.stats.evicted += 1
        slot = self._free.pop()
        lru[key] = slot
        self.stats.stored += 1
        return slot, True

    def drop(self, key: Hashable) -> bool:
        """Forget ``key``'s snapshot (its slot is free again); True if it was held."""
        slot = self._lru.pop(key, None)
        if slot is None:
            return False
        self._free.append(slot)
        self.stats.dropped += 1
        return True

    def clear(self) -> None:
        """Forget every snapshot (counters stay)."""
        self._lru.clear()
        self._free = list(range(self.first_slot + self.capacity - 1, self.first_slot - 1, -1))

    def check_integrity(self) -> None:
        """Raise AssertionError unless every slot is either free or held by exactly one key. Changes nothing."""
        held = list(self._lru.values())
        assert len(held) == len(set(held)), "a slot holds two snapshots"
        assert not set(held) & set(self._free), "a held slot is also free"
        everything = sorted(held + self._free)
        assert everything == list(range(self.first_slot, self.first_slot + self.capacity)), "slots leaked"


def snapshot_points(
    *,
    block_size: int,
    restored: int,
    matched: int,
    limit: int,
    prompt_blocks: int,
    hints: Iterable[int] = (),
    interval: int = 0,
) -> list[int]:
    """The block boundaries (ascending, each deeper than ``restored`` and at most ``prompt_blocks``) at which a
    request keeps a snapshot while it prefills its prompt (see the module docstring; the request end is the
    caller's, when it ends). ``matched``: its KV match in blocks; ``limit``: the tokens of its prompt a re-send
    could be served from (its cacheable prompt length); ``hints``: token positions where prefixes diverge;
    ``interval``: every so many blocks (0: none). Changes nothing."""
    points = set()
    if matched > restored:
        points.add(matched)
    if limit > 0:
        points.add((limit - 1) // block_size)
    for pos in hints:
        points.add(int(pos) // block_size)
    if interval > 0:
        points.update(range(interval, prompt_blocks + 1, interval))
    return sorted(b for b in points if restored < b <= prompt_blocks)
