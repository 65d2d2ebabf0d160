"""Hash-id traces and their loader.

A **trace** of Mooncake-style lines ``{"timestamp", "input_length", "output_length", "hash_ids"}`` (plain
  or ``.gz`` JSONL; kv-cache-tester lines add ``session``, ``trace_id``, ``agent``, ``block_size``).
  ``load_trace(path)`` returns a :class:`Trace`: a read-only sequence of :class:`TraceRequest`, stored
  column-wise (one flat int64 array of all hash ids) so a 94M-reference trace fits in memory.

Every problem with user input raises :class:`InputError`, whose message names the file, the line and the key.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO, Any, overload

import numpy as np
import orjson

from prefixcache.core import DEFAULT_NAMESPACE
from prefixcache.core.errors import InputError, shown
from prefixcache.workload.files import MiB, input_file
from prefixcache.workload.requests import finite_number

MOONCAKE_BLOCK_SIZE = 512  # the Mooncake traces' block size; lines may override it with "block_size"
TRACE_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".gz")
_TRACE_KEYS = {"timestamp", "input_length", "output_length", "hash_ids", "session", "trace_id", "agent", "block_size"}
MAX_LINE_CHARS = 64 * MiB  # a line longer than this is refused (a 1M-token prompt at block size 16 takes ~1 MiB)
INT64_END = 2**63  # lengths and hash ids are stored as int64
NO_TOKENS = "hash-id traces have no tokens; a model cannot replay them (use prefixcache simulate, plan or explain)"


# ---- traces ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TraceRequest:
    """One line of a hash-id trace. ``hash_ids[i]`` names block i together with everything before it."""

    hash_ids: tuple[int, ...]
    input_length: int
    output_length: int = 0
    timestamp: float = 0.0  # milliseconds
    namespace: str = DEFAULT_NAMESPACE  # the kv-tester "session", else "default"
    line: int = 0  # 1-based line in the file (0 when built in code)


class Trace(Sequence[TraceRequest]):
    """A loaded hash-id trace: a read-only sequence of TraceRequest, stored column-wise.

    ``ids`` is every request's hash ids back to back (int64) and ``offsets[i]:offsets[i+1]`` selects request
    i's; ``hash_ids(i)`` is that view. Bulk users (curves, benchmarks) should read the arrays directly.
    """

    def __init__(
        self,
        path: str,
        block_size: int,
        ids: np.ndarray,
        offsets: np.ndarray,
        input_length: np.ndarray,
        output_length: np.ndarray,
        timestamp: np.ndarray,
        namespace: list[str],
        lines: np.ndarray,
    ) -> None:
        self.path, self.block_size = path, block_size
        self.ids, self.offsets = ids, offsets
        self.input_length, self.output_length, self.timestamp = input_length, output_length, timestamp
        self.namespace, self.lines = namespace, lines

    def __len__(self) -> int:
        return len(self.input_length)

    @overload
    def __getitem__(self, i: int) -> TraceRequest: ...
    @overload
    def __getitem__(self, i: slice) -> Trace: ...
    def __getitem__(self, i: int | slice) -> TraceRequest | Trace:
        if isinstance(i, slice):
            return self.take(np.arange(len(self))[i])
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"request {i} out of range (trace has {len(self)})")
        return TraceRequest(
            tuple(self.hash_ids(i).tolist()),
            int(self.input_length[i]),
            int(self.output_length[i]),
            float(self.timestamp[i]),
            self.namespace[i],
            int(self.lines[i]),
        )

    def __iter__(self) -> Iterator[TraceRequest]:
        for i in range(len(self)):
            yield self[i]

    def hash_ids(self, i: int) -> np.ndarray:
        """Request i's hash ids (a view into ``ids``)."""
        return self.ids[self.offsets[i] : self.offsets[i + 1]]

    @property
    def num_blocks(self) -> int:
        """Block references in the whole trace."""
        return int(self.offsets[-1])

    def unique_blocks(self) -> int:
        """Distinct (namespace, hash id) pairs: the pool size at which nothing is ever evicted."""
        if len(set(self.namespace)) <= 1:
            return int(np.unique(self.ids).size)
        groups: dict[str, list[int]] = {}
        for i, ns in enumerate(self.namespace):
            groups.setdefault(ns, []).append(i)
        return sum(int(np.unique(np.concatenate([self.hash_ids(i) for i in idx])).size) for idx in groups.values())

    def take(self, index: np.ndarray) -> Trace:
        """A new trace holding requests ``index`` (in that order)."""
        index = np.asarray(index, dtype=np.int64)
        lens = np.diff(self.offsets)[index]
        offsets = np.zeros(len(index) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        ids = np.concatenate([self.hash_ids(int(i)) for i in index]) if len(index) else np.zeros(0, np.int64)
        return Trace(
            self.path,
            self.block_size,
            ids,
            offsets,
            self.input_length[index],
            self.output_length[index],
            self.timestamp[index],
            [self.namespace[int(i)] for i in index],
            self.lines[index],
        )

    def by_timestamp(self) -> Trace:
        """Requests stably sorted by timestamp (e.g. kv-tester sessions interleaved)."""
        return self.take(np.argsort(self.timestamp, kind="stable"))


def is_trace_path(path: str | Path) -> bool:
    """True when the file name says JSONL hash-id trace (``.jsonl``, ``.jsonl.gz``, ...)."""
    name = str(path).lower()
    return name.endswith(TRACE_SUFFIXES)


def _open_text(path: Path) -> IO[str]:
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _int_field(d: dict[str, Any], key: str, path: Path, line: int, *, required: bool, minimum: int = 0) -> int:
    if key not in d:
        if required:
            raise InputError(f"missing field {key!r}", path, line)
        return 0
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int) or not minimum <= v < INT64_END:
        raise InputError(f"{key} must be an integer >= {minimum} (and < 2**63), got {shown(v)}", path, line)
    return v


def _hash_id_array(ids: list[Any], raw: str, path: Path, line: int) -> np.ndarray:
    """``hash_ids`` as an int64 array; InputError naming the first value that is not a 64-bit integer."""
    try:
        arr = np.asarray(ids)
    except (ValueError, TypeError, OverflowError):  # ragged nesting, e.g. [1, [2, 3]]
        arr = None
    ok = arr is not None and arr.dtype.kind == "i" and arr.ndim == 1
    if ok and ("true" in raw or "false" in raw):  # numpy reads [1, true] as [1, 1]
        ok = not any(isinstance(h, bool) for h in ids)
    if not ok:
        bad = next(
            (h for h in ids if isinstance(h, bool) or not isinstance(h, int) or not -INT64_END <= h < INT64_END), ids[0]
        )
        raise InputError(f"hash_ids must hold 64-bit integers, found {shown(bad)}", path, line)
    assert arr is not None
    return arr


def _checked_by_stdlib(
    raw: str, path: Path, lineno: int, block_size: int | None, bs_seen: int | None
) -> tuple[np.ndarray, int, int, int, float, str]:
    """``_check_line`` of the line as the stdlib's parser reads it, or InputError saying what is wrong with it.
    (Lines go through orjson first, about 4x faster; the stdlib also reads NaN and integers beyond 64 bits,
    which the checks then refuse by name.)"""
    too_deep = InputError("not a trace line (JSON nested too deeply)", path, lineno)
    try:
        d = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InputError(f"not valid JSON ({exc.msg}, column {exc.colno})", path, lineno) from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        raise InputError(f"not valid JSON ({exc})", path, lineno) from None
    except RecursionError:
        raise too_deep from None
    try:
        return _check_line(d, raw, path, lineno, block_size, bs_seen)
    except RecursionError:  # a value nested too deeply to show in a message
        raise too_deep from None


def _lines(f: IO[str], path: Path) -> Iterator[tuple[int, str]]:
    """(1-based line number, line) of a text file, refusing lines longer than MAX_LINE_CHARS."""
    for lineno, raw in enumerate(iter(partial(f.readline, MAX_LINE_CHARS), ""), 1):
        if len(raw) >= MAX_LINE_CHARS and not raw.endswith("\n"):
            raise InputError(f"line longer than {MAX_LINE_CHARS // MiB} MiB; not a trace?", path, lineno)
        yield lineno, raw


def _check_line(
    d: Any, raw: str, path: Path, lineno: int, block_size: int | None, bs_seen: int | None
) -> tuple[np.ndarray, int, int, int, float, str]:
    """One parsed trace line, checked: (hash ids, input length, block size, output length, timestamp,
    namespace). ``bs_seen``: the earlier lines' block size. Raises InputError naming the file and line."""
    if not isinstance(d, dict):
        raise InputError(f"expected a JSON object, got {type(d).__name__}", path, lineno)
    if not d.keys() <= _TRACE_KEYS:
        bad = sorted(d.keys() - _TRACE_KEYS)[0]
        raise InputError(f"unknown key {shown(bad)}; known: {', '.join(sorted(_TRACE_KEYS))}", path, lineno)
    ids = d.get("hash_ids")
    if not isinstance(ids, list) or not ids:
        raise InputError("hash_ids must be a non-empty list of integers", path, lineno)
    n_in = _int_field(d, "input_length", path, lineno, required=True, minimum=1)
    bs = d.get("block_size", block_size or MOONCAKE_BLOCK_SIZE)
    if isinstance(bs, bool) or not isinstance(bs, int) or not 0 < bs < INT64_END:
        raise InputError(f"block_size must be a positive integer, got {shown(bs)}", path, lineno)
    if block_size is not None and bs != block_size:
        raise InputError(f"line says block_size {bs} but {block_size} was asked for", path, lineno)
    if bs_seen is not None and bs != bs_seen:
        raise InputError(f"block_size {bs} differs from earlier lines' {bs_seen}", path, lineno)
    if len(ids) != -(-n_in // bs) and len(ids) != n_in // bs:  # Mooncake: ceil; kv-tester: floor
        raise InputError(
            f"{len(ids)} hash_ids for input_length {n_in}: expected ceil({n_in}/{bs}) = {-(-n_in // bs)}"
            f" (block size {bs}; pass --block-size if the trace uses another)",
            path,
            lineno,
        )
    ts = d.get("timestamp", 0)
    if not finite_number(ts):
        raise InputError(f"timestamp must be a finite number, got {shown(ts)}", path, lineno)
    arr = _hash_id_array(ids, raw, path, lineno)
    session = d.get("session")
    out_len = _int_field(d, "output_length", path, lineno, required=False)
    return arr, n_in, bs, out_len, float(ts), DEFAULT_NAMESPACE if session is None else f"session-{session}"


def load_trace(path: str | Path, block_size: int | None = None) -> Trace:
    """Read a Mooncake-style JSONL trace (plain or .gz). Changes nothing.

    ``block_size``: tokens per hash id; default: each line's ``block_size`` field, else 512 (Mooncake).
    Checks every line: valid JSON object, known keys only, ``len(hash_ids) == ceil(input_length / block_size)``
    (Mooncake: the last, partial block has an id) or ``floor(...)`` (kv-cache-tester lists full blocks only).
    Raises InputError naming the file and line.
    """
    path = input_file(path, "trace file")
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0):
        raise InputError(f"block size must be a positive integer, got {block_size!r}", path)
    chunks: list[np.ndarray] = []
    lens: list[int] = []
    input_length: list[int] = []
    output_length: list[int] = []
    timestamp: list[float] = []
    namespace: list[str] = []
    lines: list[int] = []
    bs_seen: int | None = None
    fast_loads = orjson.loads
    try:
        with _open_text(path) as f:
            for lineno, raw in _lines(f, path):
                if not raw.strip():
                    continue
                try:
                    line = _check_line(fast_loads(raw), raw, path, lineno, block_size, bs_seen)
                except (orjson.JSONDecodeError, InputError, RecursionError):
                    # orjson refuses NaN, reads integers beyond 64 bits as floats and nests deeper than Python
                    # can show: the stdlib's reading of the line says exactly what is wrong with it
                    line = _checked_by_stdlib(raw, path, lineno, block_size, bs_seen)
                arr, n_in, bs_seen, out_len, ts, ns = line
                chunks.append(arr)
                lens.append(len(arr))
                input_length.append(n_in)
                output_length.append(out_len)
                timestamp.append(ts)
                namespace.append(ns)
                lines.append(lineno)
    except (OSError, EOFError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
        raise InputError(f"cannot read trace: {exc}", path) from None
    except UnicodeDecodeError as exc:
        raise InputError(f"not UTF-8 text ({exc.reason}); not a trace?", path) from None
    if not chunks:
        raise InputError("trace holds no requests", path)
    ids_arr = np.concatenate(chunks).astype(np.int64, copy=False)
    del chunks
    offsets = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    return Trace(
        str(path),
        bs_seen or MOONCAKE_BLOCK_SIZE,
        ids_arr,
        offsets,
        np.array(input_length, np.int64),
        np.array(output_length, np.int64),
        np.array(timestamp, np.float64),
        namespace,
        np.array(lines, np.int64),
    )


def trace_from_lists(
    hash_ids: Sequence[Sequence[int]],
    *,
    block_size: int = 16,
    input_length: Sequence[int] | None = None,
    timestamp: Sequence[float] | None = None,
    namespace: Sequence[str] | None = None,
    path: str = "<memory>",
) -> Trace:
    """A Trace built in code (tests, notebooks). ``input_length`` defaults to
    ``len(hash_ids[i]) * block_size``, ``timestamp`` to the request index (ms), ``namespace`` to "default"."""

    n = len(hash_ids)
    lens = [len(h) for h in hash_ids]
    if any(k == 0 for k in lens):
        raise ValueError("every request needs at least one hash id")
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    ids = np.array([x for h in hash_ids for x in h], dtype=np.int64)
    il = np.array(input_length if input_length is not None else [k * block_size for k in lens], dtype=np.int64)
    ts = np.array(timestamp if timestamp is not None else range(n), dtype=np.float64)
    ns = list(namespace) if namespace is not None else [DEFAULT_NAMESPACE] * n
    return Trace(
        path, block_size, ids, offsets, il, np.zeros(n, dtype=np.int64), ts, ns, np.arange(1, n + 1, dtype=np.int64)
    )
