"""Chained, seeded 128-bit block hashes and token-id validation.

``h_i = xxh3_128(h_{i-1} || tokens of block i, seed)``; ``h_{-1}`` is the namespace's root hash, so two
namespaces never produce the same chain. Token ids travel as little-endian int32 bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np
import xxhash

from prefixcache.core.checks import check_int, check_str

TOKEN_DTYPE = np.dtype("<i4")
TOKEN_BYTES = TOKEN_DTYPE.itemsize
_MAX_TOKEN = np.iinfo(TOKEN_DTYPE).max
_MIN = np.minimum.reduce


class BlockHasher(Protocol):
    """Turns (parent hash, block bytes) into the block's hash. A test seam: inject a weak one."""

    def __call__(self, parent: bytes, block: bytes) -> bytes: ...


def xxh3_hasher(seed: int) -> BlockHasher:
    """The default hasher: seeded xxh3_128 over parent digest || block bytes."""
    digest: Callable[..., bytes] = xxhash.xxh3_128_digest

    def h(parent: bytes, block: bytes) -> bytes:
        return digest(parent + block, seed)

    h.xxh3_seed = seed  # type: ignore[attr-defined]  # lets chain_hashes call xxh3 directly
    return h


def namespace_root(namespace: str, seed: int) -> bytes:
    """The chain's starting value for a namespace (tenant, LoRA adapter, model fingerprint)."""
    return xxhash.xxh3_128_digest(b"prefixcache-namespace\x00" + namespace.encode("utf-8"), seed)


def chain_hashes(
    hasher: BlockHasher, parent: bytes, data: bytes | memoryview, block_size: int, start: int, stop: int
) -> list[bytes]:
    """Hashes of blocks ``start..stop-1`` of ``data`` (token bytes), chained from ``parent``."""
    bb = block_size * TOKEN_BYTES
    out: list[bytes] = []
    append = out.append
    seed = getattr(hasher, "xxh3_seed", None)
    if seed is not None:  # the default hasher, inlined: one C call per block
        digest = xxhash.xxh3_128_digest
        for off in range(start * bb, stop * bb, bb):
            parent = digest(parent + data[off : off + bb], seed)
            append(parent)
        return out
    for off in range(start * bb, stop * bb, bb):
        parent = hasher(parent, bytes(data[off : off + bb]))
        append(parent)
    return out


def block_keys(
    tokens: Any, namespace: str, *, block_size: int, hash_seed: int = 0, max_blocks: int | None = None
) -> list[bytes]:
    """The chained keys (16-byte xxh3_128 digests) of the full blocks of ``tokens`` in ``namespace``, exactly
    as a PrefixCache with this ``block_size`` and ``hash_seed`` computes them (e.g. in ``BlocksStored`` events),
    at most ``max_blocks`` of them. For a router that mirrors caches. Changes nothing."""
    check_str(namespace, "namespace")
    block_size = check_int(block_size, "block_size", minimum=1)
    hash_seed = check_int(hash_seed, "hash_seed", minimum=0)
    data = as_token_array(tokens).tobytes()
    n = len(data) // (block_size * TOKEN_BYTES)
    if max_blocks is not None:
        n = min(n, check_int(max_blocks, "max_blocks", minimum=0))
    return chain_hashes(xxh3_hasher(hash_seed), namespace_root(namespace, hash_seed), data, block_size, 0, n)


def extend_block_keys(
    keys: list[bytes], tokens: Any, namespace: str, block_size: int, seed: int, upto: int
) -> list[bytes]:
    """``keys`` (the chained keys of the first full blocks of ``tokens`` in ``namespace``, as ``block_keys`` computes
    them; possibly none yet) extended to ``upto`` blocks and returned: a request computes its keys once, as far as
    it needs them. ``tokens``: a sequence of ints or an int array. Changes ``keys``."""
    have = len(keys)
    if upto <= have:
        return keys
    parent = keys[-1] if keys else namespace_root(namespace, seed)
    data = np.asarray(tokens[: upto * block_size], dtype=TOKEN_DTYPE).tobytes()
    keys.extend(chain_hashes(xxh3_hasher(seed), parent, data, block_size, have, upto))
    return keys


def _native(tokens: Any) -> bool:
    """Whether ``tokens`` is already what the cache stores: a 1-D C-contiguous little-endian int32 array."""
    return (
        type(tokens) is np.ndarray
        and tokens.dtype is TOKEN_DTYPE
        and tokens.ndim == 1
        and bool(tokens.flags.c_contiguous)
    )


def _check_sign(arr: np.ndarray, what: str) -> None:
    """Raise ValueError naming the first negative id of int32 ``arr`` (the only bad ids it can hold)."""
    if arr.size and _MIN(arr) < 0:
        bad = int(np.argmax(arr < 0))
        raise ValueError(f"{what}[{bad}] is {arr[bad]}; token ids must be >= 0")


def token_bytes(tokens: Any, what: str = "tokens") -> memoryview:
    """Validated token ids as a byte-format view of little-endian int32 (no copy when ``tokens`` is already
    a contiguous int32 array; the view must not outlive a change to it)."""
    data: memoryview = as_token_array(tokens, what).data.cast("B")
    return data


def as_token_array(tokens: Any, what: str = "tokens") -> np.ndarray:
    """Validate token ids and return them as a contiguous int32 array.

    Accepts a 1-D list/tuple/range of ints, a 1-D integer numpy array, or a 1-D integer CPU tensor.
    Raises TypeError or ValueError naming the problem and, for a bad id, its position.
    """
    if _native(tokens):  # the fast path: already what the cache stores
        _check_sign(tokens, what)
        return tokens  # type: ignore[no-any-return]
    if hasattr(tokens, "detach") and hasattr(tokens, "cpu"):  # a torch tensor, without importing torch
        tokens = tokens.detach().cpu().numpy()
    elif not isinstance(tokens, (np.ndarray, list, tuple, range)) and (
        isinstance(tokens, (str, bytes, bytearray, Mapping))
        or not (hasattr(tokens, "__len__") and hasattr(tokens, "__getitem__"))
    ):  # None, a number, a set, a dict, an iterator or generator: say what was given, not "shape ()"
        raise TypeError(
            f"{what} must be a 1-D sequence of integer token ids, got {type(tokens).__name__} "
            "(pass a list, tuple, numpy array or tensor)"
        )
    try:
        arr = np.asarray(tokens)
    except (ValueError, TypeError) as exc:  # ragged nesting
        raise TypeError(f"{what} must be a 1-D sequence of integer token ids: {exc}") from None
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        if arr.size == 0:
            return np.zeros(0, TOKEN_DTYPE)
        if arr.dtype.kind in "OUSb":  # mixed Python objects, strings or bools: name the first bad one
            items = arr.tolist()
            for i, t in enumerate(items):
                if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                    raise TypeError(f"{what}[{i}] is {t!r} ({type(t).__name__}); token ids must be integers")
                if not 0 <= t <= _MAX_TOKEN:
                    raise ValueError(f"{what}[{i}] is {t}; token ids must be in [0, 2**31)")
            arr = np.asarray(items, dtype=np.int64)  # ints that numpy kept as objects, all in range
        else:
            raise TypeError(f"{what} must hold integer token ids, got dtype {arr.dtype}")
    if arr.size:  # range checks the dtype does not already guarantee
        kind, size = arr.dtype.kind, arr.dtype.itemsize
        if kind == "i" and arr.min() < 0:
            bad = int(np.argmax(arr < 0))
            raise ValueError(f"{what}[{bad}] is {arr[bad]}; token ids must be >= 0")
        if (size > 4 or (kind == "u" and size == 4)) and arr.max() > _MAX_TOKEN:
            bad = int(np.argmax(arr > _MAX_TOKEN))
            raise ValueError(f"{what}[{bad}] is {arr[bad]}; token ids must be < 2**31")
    return np.ascontiguousarray(arr, dtype=TOKEN_DTYPE)
