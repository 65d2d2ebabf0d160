"""Extra key material per block: what besides its token ids changes a block's KV (the content of an image whose
placeholder tokens fall in it), folded into the token stream the cache sees.

Two different images behind the same placeholder ids must never share a block. The cache compares and hashes
token bytes (``radix_tree``, ``hashing``, the tiers); ``keyed_tokens`` turns a prompt's ids into its *key
stream*: every block that carries material has each of its ids XOR-ed with a 31-bit word drawn from
``xxh3_128(material)`` (a different word per position), the other blocks are left as they are. Everything that
keys on tokens (match, commit, token verification, chained hashes, tier keys, the simulator) then keys on the
material too, with no second code path. Same material at the same place: the same key stream, a hit. Other
material: the two blocks' keys are equal only if the 128-bit digests collide or, for ``block_size`` words of
31 bits, all of them do by chance; ``MIN_BLOCK_SIZE`` keeps that at >= 124 bits. The model is given the real
ids; the key stream exists only for the cache.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import xxhash

from prefixcache.core.checks import check_int
from prefixcache.core.hashing import as_token_array

MIN_BLOCK_SIZE = 4  # 4 x 31 bits of mask per block: below it a block's material is too weak a key
_WORDS_PER_DIGEST = 4  # one xxh3_128 digest gives four 32-bit words
_LOW31 = np.uint32(0x7FFFFFFF)


def block_material(spans: Sequence[tuple[int, int, bytes]], block_size: int) -> dict[int, bytes]:
    """The extra material of every block that media items touch: ``spans`` holds each item's placeholder range
    ``[start, stop)`` (token positions in the prompt) and its content id (bytes); a block's material lists, in
    order, every item whose range meets the block, with the item's start. Changes nothing."""
    block_size = check_int(block_size, "block_size", minimum=1)
    out: dict[int, bytearray] = {}
    for i, span in enumerate(spans):
        if not (isinstance(span, tuple) and len(span) == 3):
            raise TypeError(f"spans[{i}] must be (start, stop, content_id), got {span!r}")
        start, stop, cid = span
        start = check_int(start, f"spans[{i}] start", minimum=0)
        stop = check_int(stop, f"spans[{i}] stop", minimum=start + 1)
        if not isinstance(cid, (bytes, bytearray)) or not cid:
            raise TypeError(f"spans[{i}] content id must be non-empty bytes, got {type(cid).__name__}")
        for b in range(start // block_size, (stop - 1) // block_size + 1):
            out.setdefault(b, bytearray()).extend(start.to_bytes(8, "little") + bytes(cid))
    return {b: bytes(m) for b, m in out.items()}


def keyed_tokens(tokens: Any, material: Mapping[int, bytes], block_size: int, seed: int = 0) -> np.ndarray:
    """The key stream of ``tokens`` (see the module docstring): a new int32 array with the ids of every block
    ``b`` in ``material`` (block index -> non-empty bytes) masked by that material; ``tokens`` itself (as an
    int32 array) when ``material`` is empty. A block may run past the end (a prompt's last, partial block): its
    positions keep their masks when later tokens complete it. Raises ValueError for a block index outside the
    tokens, empty material, or a ``block_size`` below ``MIN_BLOCK_SIZE``. Changes nothing."""
    arr = as_token_array(tokens)
    if not material:
        return arr
    block_size = check_int(block_size, "block_size", minimum=1)
    if block_size < MIN_BLOCK_SIZE:
        raise ValueError(
            f"block_size {block_size} is too small to key blocks by their media content; use >= {MIN_BLOCK_SIZE}"
        )
    nblocks = -(-len(arr) // block_size)
    out: np.ndarray = arr.copy()
    view = out.view(np.uint32)
    reps = -(-block_size // _WORDS_PER_DIGEST)
    for b, m in material.items():
        b = check_int(b, "material block index", minimum=0, type_error=ValueError)
        if b >= nblocks:
            raise ValueError(f"material for block {b}, but the {len(arr)} tokens fill {nblocks} blocks")
        if not isinstance(m, (bytes, bytearray)) or not m:
            raise ValueError(f"material of block {b} must be non-empty bytes")
        digest = xxhash.xxh3_128_digest(bytes(m), seed)
        words = b"".join(xxhash.xxh3_128_digest(digest + j.to_bytes(4, "little"), seed) for j in range(reps))
        mask = np.frombuffer(words, dtype="<u4")[:block_size] & _LOW31
        lo = b * block_size
        hi = min(lo + block_size, len(arr))
        view[lo:hi] ^= mask[: hi - lo]
    return out
