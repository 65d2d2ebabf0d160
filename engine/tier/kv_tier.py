"""KVTier: a second tier below the KV pool, on a store (``LmdbStore`` on disk, ``RedisStore`` shared).

Write policy: **write-through on commit**. Every block a commit puts into the pool is copied (at once, while
the caller holds the pool) and queued for the store; a writer thread encodes and writes it off the request's
path. Why not on eviction: a restarted process and the other processes of a shared tier only see what was
written, and a workload that fits the pool would never write at all; each block is written once either way
(a block the tier holds already is only refreshed). The queue is bounded in bytes: when it is full the write is
skipped and counted (``write_skipped``), never waited for.

Lookup: after the pool's match, ``lookup`` counts how many of the following chained block keys the tier holds
(the local index, a ``prefixcache.core.TierIndex`` with the same LRU the simulator replays; a shared tier asks
its server), ``load`` reads and checks those entries (``engine.tier.entry.decode``) and writes their K/V into
pool blocks the caller has just taken. A queued block is served from the queue. An entry that fails a check is
dropped from the tier and counted (``corrupt_blocks``); the blocks from it on are recomputed. A store that
fails (a full disk, a Redis server gone) is reported once with a ``TierWarning`` and counted; requests go on.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from engine.tier.entry import HEADER, EntryError, TierBinding, decode, encode_into
from engine.tier.lmdb_store import StoreError
from prefixcache.core.cache import OutOfBlocks, PrefixCache, RequestHandle
from prefixcache.core.hashing import TOKEN_DTYPE, extend_block_keys
from prefixcache.core.tier import TierIndex

log = logging.getLogger("prefixcache.tier")
MAX_QUEUE_BYTES = 512 << 20  # K/V bytes waiting for the writer; beyond this, writes are skipped
WRITE_BATCH_BYTES = 64 << 20  # bytes per store transaction
WRITER_NICE = 19  # the writer thread's nice value (Linux): it takes only CPU the forwards leave
RETRY_S = 5.0  # after a store failure, a shared tier is not asked again for this long
Tokens = Sequence[int] | npt.NDArray[np.integer[Any]]  # a request's token ids: a list, or the core's int32 array


class TierWarning(UserWarning):
    """The second tier could not do something (a store failed, an entry was refused, the budget was capped)."""


@dataclass
class TierCounters:
    """What the store side did (the index's own counters are ``KVTier.index.stats``)."""

    loaded_blocks: int = 0  # blocks read from the tier
    served_blocks: int = 0  # of those, blocks committed to the pool for a request (its cached tokens)
    corrupt_blocks: int = 0  # entries refused by a check (torn, truncated, corrupted, foreign)
    written_blocks: int = 0
    write_skipped: int = 0  # blocks not written: the queue was full, or the store was unavailable
    write_errors: int = 0  # blocks whose write failed (e.g. ENOSPC)
    read_errors: int = 0  # lookups or reads that failed on the store
    deleted_blocks: int = 0
    read_bytes: int = 0  # K/V bytes loaded into the pool
    read_s: float = 0.0  # time spent reading and checking them (a tier read rate: read_bytes / read_s)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


class KVTier:
    """The tier of one pool: ``store`` holds entries bound to ``binding``; ``capacity_blocks`` is the local
    index's budget (None: unlimited; ignored for a shared store, whose server keeps its own)."""

    def __init__(
        self,
        store: Any,
        binding: TierBinding,
        capacity_blocks: int | None,
        *,
        max_queue_bytes: int = MAX_QUEUE_BYTES,
        owns_store: bool = True,
    ) -> None:
        self.store = store
        self.owns_store = owns_store  # False: a second tier of entries on another tier's store (hybrid states)
        self.binding = binding
        self.prefix = binding.digest
        self.kv_bytes = binding.kv_bytes
        self.index: TierIndex | None = None if store.shared else TierIndex(capacity_blocks)
        self.counters = TierCounters()
        self.max_queue_bytes = max_queue_bytes
        self.last_error: str | None = None
        self._down_until = 0.0
        self._cv = threading.Condition()
        self._ops: deque[tuple[str, Any]] = deque()  # ("put", (key, tokens, rows, j)) | ("del", key)
        self._queued = 0  # K/V bytes in queued puts
        self._busy = False
        # key -> (token bytes, entry buffers, row) until written: row r of ``buf`` is a whole entry, its K/V from
        # ``kv_at`` on (copied there from the pool by ``save``; header and tokens written by the writer)
        self._pending: dict[bytes, tuple[bytes, torch.Tensor, int]] = {}
        self.kv_at = HEADER.size + binding.block_size * 4
        self._closed = False
        if store.capped and owns_store:
            self._warn(
                f"{store.name}: the tier budget of {store.requested_bytes:,} bytes exceeds the disk's free space; "
                f"capped to {store.max_bytes:,} bytes"
            )
        if store.readonly and owns_store:
            self._warn(f"{store.name}: the directory is read-only; serving the entries it holds, writing none")
        self._restore()
        self._thread = threading.Thread(target=self._run, name="prefixcache-tier-writer", daemon=True)
        self._thread.start()
        atexit.register(_flush_at_exit, weakref.ref(self))  # a script that never calls close() keeps its writes

    # ---- index ---------------------------------------------------------------------------------------------
    def _restore(self) -> None:
        """Fill the index with the keys the store holds for this binding (oldest first); delete any beyond the
        budget."""
        if self.index is None:
            return
        started = time.perf_counter()
        keys = self.store.scan(self.prefix)
        with self._cv:
            over = self.index.restore(keys)
            for key in over:
                self._ops.append(("del", key))
            self._cv.notify()
        self.restored_blocks = len(keys) - len(over)
        self.restore_s = time.perf_counter() - started
        if keys:
            log.info("%s: %d blocks ready in %.2f s", self.store.name, self.restored_blocks, self.restore_s)

    def rebind(self, binding: TierBinding) -> None:
        """Serve entries of ``binding`` from now on (the model's weights, dtype or device changed): waits for
        queued writes, forgets the index and restores it for the new binding."""
        self.flush()
        with self._cv:
            self.binding, self.prefix, self.kv_bytes = binding, binding.digest, binding.kv_bytes
            self._pending.clear()
            if self.index is not None:
                self.index.clear()
        self._restore()

    @property
    def num_blocks(self) -> int:
        """Blocks the local index holds (0 for a shared tier)."""
        return len(self.index) if self.index is not None else 0

    def _available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, exc: BaseException, what: str) -> None:
        """Note a store failure: warn (once per kind of failure and outage); a shared tier is then not asked
        for RETRY_S."""
        message = f"{what}: {exc}" if isinstance(exc, StoreError) else f"{what}: {type(exc).__name__}: {exc}"
        again = message == self.last_error and (not self.store.shared or not self._available())
        self.last_error = message
        if self.store.shared:
            self._down_until = time.monotonic() + RETRY_S
        if not again:
            self._warn(f"{message}; requests are served from the pool or recomputed meanwhile")

    @staticmethod
    def _warn(message: str) -> None:
        log.warning(message)
        warnings.warn(message, TierWarning, stacklevel=3)

    # ---- lookup and load -----------------------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes], start: int, stop: int) -> int:
        """How many blocks ``keys[start:stop]`` (in order, from ``start``) the tier can serve; refreshes the
        local index (see ``TierIndex.lookup``)."""
        if self.index is not None:
            with self._cv:
                return self.index.lookup(keys, start, stop)
        if start >= stop or not self._available():
            return 0
        try:
            have = self.store.contains([self.prefix + k for k in keys[start:stop]])
        except StoreError as exc:
            self.counters.read_errors += 1
            self._failed(exc, "lookup")
            return 0
        return next((i for i, h in enumerate(have) if not h), len(have))

    def holds(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether the tier holds each of ``keys`` (not a path: each on its own). Changes nothing."""
        if self.index is not None:
            with self._cv:
                return [k in self.index for k in keys]
        if not keys or not self._available():
            return [False] * len(keys)
        try:
            return list(self.store.contains([self.prefix + k for k in keys]))
        except StoreError as exc:
            self.counters.read_errors += 1
            self._failed(exc, "lookup")
            return [False] * len(keys)

    def fetch(self, keys: Sequence[bytes], tokens: Sequence[bytes]) -> torch.Tensor:
        """The checked K/V rows ``[k, kv_bytes]`` of the first ``k`` of ``keys`` (whose token bytes are ``tokens``)
        the tier could serve; the entry that stopped it (torn, foreign, gone) is dropped from the tier. Write
        them into pool blocks with ``write_rows``. Changes only the tier (refused entries)."""
        n = len(keys)
        rows = torch.empty((n, self.kv_bytes), dtype=torch.uint8)
        if n == 0:
            return rows
        started = time.perf_counter()
        todo: list[int] = []
        with self._cv:
            for i, key in enumerate(keys):
                held = self._pending.get(key)
                if held is None:
                    todo.append(i)
                else:
                    rows[i] = held[1][held[2], self.kv_at :]
        got = self._read(keys, tokens, todo, rows) if todo else n
        c = self.counters
        c.loaded_blocks += got
        c.read_bytes += got * self.kv_bytes
        c.read_s += time.perf_counter() - started
        return rows[:got]

    def _read(self, keys: Sequence[bytes], tokens: Sequence[bytes], todo: list[int], rows: torch.Tensor) -> int:
        """Read ``keys[i]`` for i in ``todo`` (ascending) from the store into ``rows``; returns the first index
        that could not be loaded (``len(keys)`` when all were), dropping that entry from the tier."""
        bad: list[tuple[int, str]] = []
        out = rows.numpy()

        def use(j: int, raw: Any) -> bool:
            i = todo[j]
            if raw is None:
                bad.append((i, "missing"))
                return False
            try:
                kv = decode(raw, self.prefix, keys[i], tokens[i], self.kv_bytes)
            except EntryError as exc:
                bad.append((i, str(exc)))
                return False
            out[i] = memoryview(kv)
            return True

        try:
            self.store.read([self.prefix + keys[i] for i in todo], use)
        except StoreError as exc:
            self.counters.read_errors += 1
            self._failed(exc, "read")
            return todo[0]
        if not bad:
            return len(keys)
        i, why = bad[0]
        with self._cv:
            if self.index is not None:
                self.index.discard(keys[i])
            if why != "missing":
                self.counters.corrupt_blocks += 1
                self._ops.append(("del", keys[i]))
                self._cv.notify()
        if why != "missing":
            self._warn(f"{self.store.name}: dropped the entry of block {keys[i].hex()}: {why}; recomputing it")
        return i

    # ---- the per-request protocol (``prefixcache.core.tier``), one path for the wrapper and the engine ------
    def keys_upto(self, keys: list[bytes], tokens: Tokens, namespace: str, upto: int) -> list[bytes]:
        """``keys`` (the chained block keys of ``tokens``' first blocks in ``namespace``, as the core computes them)
        extended to ``upto`` blocks, returned. Changes ``keys``."""
        b = self.binding
        return extend_block_keys(keys, tokens, namespace, b.block_size, b.hash_seed, upto)

    def load_after_match(
        self,
        cache: PrefixCache,
        pool: Any,
        handle: RequestHandle,
        tokens: Tokens,
        keys: list[bytes],
        matched: Sequence[int],
        limit: int,
        found: int | None = None,
    ) -> tuple[int, ...]:
        """Continue ``handle``'s pinned match (pool blocks ``matched``, the first blocks of ``tokens``) in the tier,
        up to ``limit`` blocks: the blocks found are loaded into blocks of the request's own, then committed to the
        tree by id (``cache.commit_blocks``, which moves the pin), so a failed load leaves nothing in the tree.
        Returns the pool ids of the blocks after ``matched`` now cached (empty: the tier had none, or the pool had
        no room). ``keys``: the request's keys so far (extended here). ``found``: the blocks a ``lookup`` just said
        the tier holds after ``matched`` (None: look them up here). Changes the cache and the pool."""
        bs, have = self.binding.block_size, len(matched)
        self.keys_upto(keys, tokens, handle.namespace, limit)
        if found is None:
            found = self.lookup(keys, have, limit)
        if found == 0:
            return ()
        rows = self.fetch(keys[have : have + found], block_tokens(tokens, bs, have, have + found))
        n = len(rows)
        while n:  # as many as the pool can take (all of them, unless it is nearly all pinned)
            try:
                ids = cache.allocate(handle, n)
                break
            except OutOfBlocks:
                n //= 2
        if n == 0:
            return ()
        try:
            write_rows(pool, rows[:n], ids, self.binding)
            res = cache.commit_blocks(handle, tokens[: (have + n) * bs], [*matched, *ids])
        except Exception as exc:  # nothing joined the tree; the blocks taken go back when the request ends
            self.counters.read_errors += 1
            self._failed(exc, "loading blocks into the pool")
            return ()
        self.counters.served_blocks += n
        return tuple(res.table[have:])

    def save_path(
        self, pool: Any, tokens: Tokens, namespace: str, keys: list[bytes], first: int, block_ids: Sequence[int]
    ) -> None:
        """Write through after a commit: the pool holds the path of ``tokens``' first ``first + len(block_ids)``
        blocks, of which blocks ``first..`` were just committed to pool ``block_ids``; queue those the tier lacks
        and refresh the whole path (``save``). ``keys``: the request's keys so far (extended here). A failure here is
        counted and warned about, never raised: the tier only ever saves work."""
        stop = first + len(block_ids)
        try:
            self.keys_upto(keys, tokens, namespace, stop)
            self.save(pool, keys[:stop], first, block_tokens(tokens, self.binding.block_size, first, stop), block_ids)
        except Exception as exc:  # the tier is best effort: the request and the pool go on without it
            self.counters.write_errors += len(block_ids)
            self._failed(exc, "queueing a write")

    # ---- write-through -------------------------------------------------------------------------------------
    def save(
        self, pool: Any, keys: Sequence[bytes], first: int, tokens: Sequence[bytes], block_ids: Sequence[int]
    ) -> None:
        """Hold the path ``keys`` (root first) that the pool now caches, whose blocks ``first..`` were just
        committed to pool ``block_ids`` (their token bytes ``tokens``): queue the new ones the tier lacks for the
        writer (copying their K/V now) and refresh the path (``TierIndex.add``: deepest first); evict beyond the
        budget. Skips (and counts) the writes when the queue is full or the store is unavailable."""
        if not keys or self.store.readonly:
            return
        index = self.index
        with self._cv:
            new = [j for j in range(len(block_ids)) if index is None or keys[first + j] not in index]
            skip = bool(new) and (
                self._queued + len(new) * self.kv_bytes > self.max_queue_bytes or not self._available()
            )
            if skip:
                self.counters.write_skipped += len(new)
                if index is not None:
                    lost = {keys[first + j] for j in new}
                    index.add([k for k in keys if k not in lost])
                return
        rows = None
        if new:
            rows = torch.empty((len(new), self.kv_at + self.kv_bytes), dtype=torch.uint8)
            read_rows(pool, [block_ids[j] for j in new], rows[:, self.kv_at :])
        with self._cv:
            for r, j in enumerate(new):
                assert rows is not None
                self._pending[keys[first + j]] = (tokens[j], rows, r)
                self._ops.append(("put", keys[first + j]))
            self._queued += len(new) * self.kv_bytes
            if index is not None:
                for old in index.add(list(keys)):
                    assert isinstance(old, bytes)
                    self._pending.pop(old, None)
                    self._ops.append(("del", old))
            self._cv.notify()

    def _run(self) -> None:
        """The writer: takes queued puts and deletes in order, a batch per transaction. It runs at the lowest
        CPU priority (Linux threads have their own nice value), so a forward never waits for it for a core."""
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        while True:
            with self._cv:
                while not self._ops and not self._closed:
                    self._cv.wait()
                if not self._ops and self._closed:
                    return
                puts: list[tuple[bytes, bytes | memoryview]] = []
                put_keys: list[bytes] = []
                deletes: list[bytes] = []
                size = 0
                while self._ops and size < WRITE_BATCH_BYTES:
                    op, key = self._ops.popleft()
                    if op == "del":
                        deletes.append(self.prefix + key)
                        continue
                    self._queued -= self.kv_bytes
                    held = self._pending.get(key)
                    if held is None:  # evicted from the tier before it was written
                        continue
                    tok, rows, r = held
                    entry = rows[r].numpy().data
                    encode_into(entry, self.prefix, key, tok)
                    puts.append((self.prefix + key, entry))
                    put_keys.append(key)
                    size += len(entry)
                self._busy = True
            try:
                self._write(puts, put_keys, deletes)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _write(self, puts: list[tuple[bytes, bytes | memoryview]], put_keys: list[bytes], deletes: list[bytes]) -> None:
        down = not self._available()
        try:
            if down:
                raise StoreError(f"{self.store.name}: unavailable, retrying later")
            self.store.write(puts, deletes)
        except Exception as exc:  # a full disk, a lost server: these blocks are not in the tier
            with self._cv:
                for key in put_keys:
                    self._pending.pop(key, None)
                    if self.index is not None:
                        self.index.discard(key)
                if down:
                    self.counters.write_skipped += len(put_keys)
                else:
                    self.counters.write_errors += len(put_keys)
            if not down:
                self._failed(exc, f"{self.store.name}: a write failed")
            return
        with self._cv:
            for key in put_keys:
                self._pending.pop(key, None)
            self.counters.written_blocks += len(put_keys)
            self.counters.deleted_blocks += len(deletes)

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every queued write is done (at most ``timeout`` seconds); True if it is."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._ops or self._busy:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cv.wait(left)
        return True

    def close(self) -> None:
        """Finish queued writes, stop the writer, close the store."""
        self.flush()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=10)
        if self.owns_store:
            self.store.close()

    def stats(self) -> dict[str, Any]:
        """The tier's counters (index and store side) and occupancy. Changes nothing."""
        with self._cv:
            d: dict[str, Any] = {f"tier_{k}": v for k, v in self.counters.as_dict().items()}
            if self.index is not None:
                d.update({f"tier_{k}": v for k, v in self.index.stats.as_dict().items()})
                d["tier_blocks"] = len(self.index)
                d["tier_capacity_blocks"] = self.index.capacity_blocks
            d["tier_queued_bytes"] = self._queued
            d["tier_store"] = self.store.name
            d["tier_entry_bytes"] = self.binding.entry_bytes
            d["tier_last_error"] = self.last_error
            return d


def _flush_at_exit(ref: weakref.ReferenceType[KVTier]) -> None:
    tier = ref()
    if tier is not None and not tier._closed:
        tier.flush(timeout=30.0)


def _layer_sides(pool: Any) -> list[torch.Tensor]:
    """The tensors an entry's payload is laid out from, each ``[heads, blocks, width]``: a KV pool's K and V of
    every layer; a recurrent-state pool's tensors (``engine.hybrid.states.StatePool``) as ``[1, slots, numel]``."""
    tensors = getattr(pool, "tensors", None)
    if tensors is not None:
        return [t.view(1, t.shape[0], -1) for t in tensors.values()]
    return [t for i in range(pool.num_layers) if (pair := pool.layer(i)) is not None for t in pair]


def read_rows(pool: Any, block_ids: Sequence[int], out: torch.Tensor) -> None:
    """Copy the payload of pool blocks (or state slots) ``block_ids`` into ``out`` (uint8 ``[n, kv_bytes]`` on the
    CPU, rows may be strided): per tensor one gather and one copy into place. Changes ``out``."""
    n = len(block_ids)
    with torch.inference_mode(False):
        idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=pool.device)
        at = 0
        for t in _layer_sides(pool):
            heads, _, width = t.shape
            size = heads * width * t.element_size()
            dst = out[:, at : at + size].view(t.dtype).view(n, heads, width)
            dst.copy_(t.index_select(1, idx).transpose(0, 1))
            at += size


def write_rows(pool: Any, rows: torch.Tensor, block_ids: Sequence[int], binding: TierBinding) -> None:
    """Write entry payload rows ``[n, kv_bytes]`` (uint8) into pool blocks (or state slots) ``block_ids``, each tensor
    from its bytes in its own dtype. Changes those blocks."""
    with torch.inference_mode(False):
        n = len(block_ids)
        raw = rows.to(pool.device)
        idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=pool.device)
        at = 0
        for t in _layer_sides(pool):
            heads, _, width = t.shape
            size = heads * width * t.element_size()
            part = raw[:, at : at + size].contiguous().view(t.dtype).reshape(n, heads, width).transpose(0, 1)
            t.index_copy_(1, idx, part)
            at += size


def block_tokens(tokens: Tokens, block_size: int, start: int, stop: int) -> list[bytes]:
    """The int32 token bytes of blocks ``start..stop-1`` of ``tokens``."""
    data = np.asarray(tokens[start * block_size : stop * block_size], dtype=TOKEN_DTYPE).tobytes()
    bb = block_size * TOKEN_DTYPE.itemsize
    return [data[i : i + bb] for i in range(0, len(data), bb)]
