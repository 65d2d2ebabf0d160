"""One block's entry in a second-tier store: a fixed header, the block's token ids, its K/V bytes.

Header (little-endian, ``HEADER``): magic ``PCKV``, format version, flags (0), the binding's 16-byte digest (what computed
the KV: model, weights, dtype, block size, hash seed, layer shapes; see ``TierBinding``), the block's 16-byte
chained key, the token count, the K/V byte count, an xxh3_64 checksum over the token bytes and the K/V bytes,
and a write stamp (ns since the epoch). ``decode`` checks every field against what the reader expects, so a
torn, truncated, corrupted or foreign entry is refused (``EntryError`` says which check failed), never served.
K/V layout: for each layer with KV, K then V, each ``[heads, block_size, head_dim]`` in the pool's dtype.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import xxhash

if TYPE_CHECKING:
    from engine.kv_pool import LayerSpec

MAGIC = b"PCKV"
VERSION = 1
HEADER = struct.Struct("<4sHH16s16sIIQQ")  # magic, version, flags (0), binding, key, tokens, kv bytes, checksum, stamp
TOKEN_BYTES = 4  # int32 token ids
STAMP_BYTES = slice(HEADER.size - 8, HEADER.size)  # the write stamp within an entry


class EntryError(ValueError):
    """An entry that must not be served (its message says which check failed)."""


@dataclass(frozen=True)
class TierBinding:
    """What a tier's entries are bound to. Entries of another binding are never read (their store keys differ)
    and an entry whose header names another binding is refused."""

    model: str  # the wrapper's fingerprint: class, config, dtype
    weights: str  # a digest of sampled weight values (other weights: other KV)
    dtype: str
    item_size: int  # bytes per K/V element
    block_size: int
    hash_seed: int
    layers: tuple[tuple[int, int, int, int] | None, ...]  # per layer: K heads, K dim, V heads, V dim (None: no KV)
    # a hybrid model's recurrent-state snapshots (engine.hybrid): their tensors (layer, index, kind, shape, dtype)
    # and bytes; None: the entries hold K/V
    state: tuple[tuple[Any, ...], ...] | None = None
    state_bytes: int = 0

    @property
    def digest(self) -> bytes:
        return xxhash.xxh3_128_digest(repr(self).encode())

    @property
    def kv_bytes(self) -> int:
        """Payload bytes of one entry: the K/V of one block, or one recurrent-state snapshot."""
        if self.state is not None:
            return self.state_bytes
        per_token = sum(kh * kd + vh * vd for layer in self.layers if layer is not None for kh, kd, vh, vd in [layer])
        return per_token * self.item_size * self.block_size

    @property
    def entry_bytes(self) -> int:
        """Bytes of one entry: header, token ids, K/V."""
        return HEADER.size + self.block_size * TOKEN_BYTES + self.kv_bytes

    def describe(self) -> str:
        what = "recurrent states" if self.state is not None else "K/V"
        return f"{what} of model {self.model}, weights {self.weights}, {self.dtype}, block_size {self.block_size}"


def checksum(tokens: bytes | memoryview, kv: bytes | memoryview) -> int:
    h = xxhash.xxh3_64()
    h.update(tokens)
    h.update(kv)
    return h.intdigest()


def encode(binding: bytes, key: bytes, tokens: bytes, kv: bytes | memoryview) -> bytes:
    """The entry of one block (``tokens``: its int32 token bytes; ``kv``: its K/V bytes)."""
    n = len(tokens) // TOKEN_BYTES
    header = HEADER.pack(MAGIC, VERSION, 0, binding, key, n, len(kv), checksum(tokens, kv), time.time_ns())
    return b"".join((header, tokens, kv))


def encode_into(buf: memoryview, binding: bytes, key: bytes, tokens: bytes) -> None:
    """Write an entry's header and token ids into ``buf``, whose K/V bytes are in place after them already
    (``buf`` is one whole entry: ``HEADER.size + len(tokens) + kv bytes``). Changes ``buf``."""
    start = HEADER.size + len(tokens)
    buf[HEADER.size : start] = tokens
    kv = buf[start:]
    n = len(tokens) // TOKEN_BYTES
    HEADER.pack_into(buf, 0, MAGIC, VERSION, 0, binding, key, n, len(kv), checksum(tokens, kv), time.time_ns())


def decode(
    raw: bytes | memoryview, binding: bytes, key: bytes, tokens: bytes | memoryview, kv_bytes: int
) -> memoryview:
    """The K/V bytes of ``raw`` after checking it is the entry of block ``key`` under ``binding`` holding exactly
    ``tokens`` and ``kv_bytes`` of K/V with a matching checksum; raises ``EntryError`` otherwise."""
    view = memoryview(raw)
    if len(view) < HEADER.size:
        raise EntryError(f"truncated: {len(view)} bytes, shorter than the {HEADER.size}-byte header")
    magic, version, flags, b, k, n, nkv, check, _stamp = HEADER.unpack_from(view)
    if magic != MAGIC:
        raise EntryError(f"not an entry (magic {bytes(magic)!r})")
    if version != VERSION or flags != 0:
        raise EntryError(f"format version {version} (flags {flags}), this reader knows {VERSION} (flags 0)")
    if b != binding:
        raise EntryError("written for another model, dtype, block size or hash seed")
    if k != key:
        raise EntryError("stored under another block's key")
    tb = len(tokens)
    if n * TOKEN_BYTES != tb or nkv != kv_bytes:
        raise EntryError(f"holds {n} tokens and {nkv} K/V bytes, expected {tb // TOKEN_BYTES} and {kv_bytes}")
    end = HEADER.size + tb + nkv
    if len(view) != end:
        raise EntryError(f"{'truncated' if len(view) < end else 'overlong'}: {len(view)} bytes, expected {end}")
    stored_tokens = view[HEADER.size : HEADER.size + tb]
    kv = view[HEADER.size + tb : end]
    if checksum(stored_tokens, kv) != check:
        raise EntryError("checksum mismatch (corrupted bytes)")
    if stored_tokens != memoryview(tokens):
        raise EntryError("holds other token ids (a block-key collision)")
    return kv


def stamp(raw: bytes | memoryview) -> int:
    """The write stamp of an entry's header (0 when the header is unreadable)."""
    try:
        return int(HEADER.unpack_from(raw)[8])
    except struct.error:
        return 0


def layers_of(specs: Sequence[LayerSpec | None]) -> tuple[tuple[int, int, int, int] | None, ...]:
    """``TierBinding.layers`` from the pool's ``LayerSpec`` s."""
    return tuple(None if s is None else (*s.k_shape, *s.v_shape) for s in specs)
