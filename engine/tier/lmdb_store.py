"""LmdbStore: a second tier on local disk, in an LMDB environment (one directory).

Why LMDB: reads are memory-mapped (an entry is read in place, no copy through a file API), every write is an
ACID transaction (a process killed mid-write leaves the last committed state, never a torn entry), and many
processes may read while one writes at a time (LMDB's own lock). Two sub-databases: ``entries`` (store key ->
entry bytes, see ``engine.tier.entry``) and ``stamps`` (store key -> 8-byte write stamp), written in one
transaction, so a restart lists the keys in write order without touching the entries. A store key is the
binding's digest followed by the block's chained key: another model's entries are never even looked at.
Writes are not fsync'ed per transaction (``sync=False``): a killed process loses nothing committed; a power
loss may drop the last transactions, which the cache recomputes.
"""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from engine.tier.entry import STAMP_BYTES

STAMP = struct.Struct("<Q")
MAP_SLACK = 64 << 20  # B-tree pages and the lock table beyond the entries' own bytes
FREE_SHARE = 0.9  # at most this share of the disk's free space (plus what the store holds) becomes the budget


class StoreError(RuntimeError):
    """A tier store that cannot be opened or used; the message names the store and the cause."""


class LmdbStore:
    """Entries in the LMDB environment at ``path`` (created if missing), at most about ``max_bytes``."""

    shared = False

    def __init__(self, path: str | os.PathLike[str], max_bytes: int) -> None:
        self.path = Path(path)
        self.name = f"disk cache {self.path}"
        try:
            import lmdb
        except ImportError as exc:  # pragma: no cover - the [tier] extra installs it
            raise StoreError("a disk tier needs the lmdb package: pip install 'prefixcache[tier]'") from exc
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"{self.name}: cannot create the directory ({exc.strerror or exc})") from exc
        held = sum(f.stat().st_size for f in self.path.glob("*.mdb"))
        free = shutil.disk_usage(self.path).free
        self.requested_bytes = max_bytes
        self.max_bytes = max_bytes
        room = int((free + held) * FREE_SHARE)
        if max_bytes > room:
            self.max_bytes = room  # the caller warns: see ``capped``
        self.readonly = not os.access(self.path, os.W_OK)
        try:
            self.env = lmdb.open(
                str(self.path),
                map_size=max(self.max_bytes + self.max_bytes // 8 + MAP_SLACK, held),
                max_dbs=2,
                sync=False,
                readonly=self.readonly,
                lock=not self.readonly,
                readahead=False,
            )
            self._entries = self.env.open_db(b"entries", create=not self.readonly)
            self._stamps = self.env.open_db(b"stamps", create=not self.readonly)
        except lmdb.Error as exc:
            raise StoreError(f"{self.name}: cannot open the LMDB store ({exc})") from exc

    @property
    def capped(self) -> bool:
        """True when the requested budget exceeded the disk's free space and was lowered to ``max_bytes``."""
        return self.max_bytes < self.requested_bytes

    def scan(self, prefix: bytes) -> list[bytes]:
        """The keys under ``prefix`` (without it), oldest write first. Reads only the stamps."""
        found: list[tuple[int, bytes]] = []
        n = len(prefix)
        with self.env.begin(db=self._stamps) as txn:
            cur = txn.cursor()
            if cur.set_range(prefix):
                for key, value in cur:
                    if not key.startswith(prefix):
                        break
                    found.append((STAMP.unpack(value)[0] if len(value) == STAMP.size else 0, bytes(key[n:])))
        found.sort()
        return [k for _, k in found]

    def read(self, keys: Sequence[bytes], use: Callable[[int, Any], bool]) -> None:
        """Call ``use(i, entry)`` for ``keys[i]`` in order inside one read transaction (``entry``: a buffer valid
        only during the call, or None when absent), until ``use`` returns False."""
        with self.env.begin(db=self._entries, buffers=True) as txn:
            for i, key in enumerate(keys):
                if not use(i, txn.get(key)):
                    break

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        with self.env.begin(db=self._stamps) as txn:
            return [txn.get(k) is not None for k in keys]

    def write(self, puts: Sequence[tuple[bytes, bytes]], deletes: Sequence[bytes]) -> None:
        """Delete ``deletes`` then put ``puts`` (store key, entry), in one transaction. Raises OSError or
        an lmdb error (e.g. ``MapFullError``, ENOSPC) with nothing of it applied."""
        with self.env.begin(write=True) as txn:
            for key in deletes:
                txn.delete(key, db=self._entries)
                txn.delete(key, db=self._stamps)
            for key, entry in puts:
                txn.put(key, entry, db=self._entries)
                txn.put(key, entry[STAMP_BYTES], db=self._stamps)

    def iter_entries(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        """(key without prefix, entry bytes) under ``prefix`` (for checks and tests)."""
        n = len(prefix)
        with self.env.begin(db=self._entries) as txn:
            cur = txn.cursor()
            if cur.set_range(prefix):
                for key, value in cur:
                    if not key.startswith(prefix):
                        break
                    yield bytes(key[n:]), bytes(value)

    def close(self) -> None:
        self.env.close()
