"""Runs of KV block ids, without copying ids around.

A run (``BlockIds``) is the ids of consecutive blocks of a prefix, in order. It is one of:

* a ``range``: consecutive ids (what a fresh pool hands out): O(1) memory, O(1) slicing;
* an int64 ``array.array`` (``'q'``): a small run (under ``MIN_RUNS_IDS`` ids) gathered from several freed
  runs, joined by C-level copies; slicing copies (a few ids: cheaper than making a numpy view);
* an int64 numpy array: a large run gathered from more than ``MAX_PIECES`` freed runs; slicing makes views;
* ``Runs``: a few such pieces one after the other (a large allocation that spans up to ``MAX_PIECES`` freed
  runs), sliced piece by piece.

All of them take ``len``, iterate, and slice with ``[a:b]`` and ``[::-1]`` into a run again. Runs are never
written to once made (numpy arrays are shared as views), and a view is copied when it would keep alive an
array more than twice its size (``compact``), so what holds a run holds memory proportional to its length.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Iterator
from typing import TypeAlias

import numpy as np
import numpy.typing as npt

Piece: TypeAlias = "range | npt.NDArray[np.int64] | array[int]"  # array: typecode "q" (int64)
MAX_PIECES = 16
MIN_RUNS_IDS = 4096


class Runs:
    """Block ids as 2..MAX_PIECES non-empty pieces (ranges or arrays) one after the other. Immutable."""

    __slots__ = ("_len", "pieces")

    def __init__(self, pieces: tuple[Piece, ...], length: int) -> None:
        self.pieces = pieces
        self._len = length  # the sum of the pieces' lengths

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[int]:
        return itertools.chain.from_iterable(self.pieces)

    def __getitem__(self, key: slice) -> BlockIds:
        if not isinstance(key, slice):
            raise TypeError("Runs only slice (run[a:b], run[::-1])")
        start, stop, step = key.indices(self._len)
        if step == 1:
            return self if start == 0 and stop >= self._len else self._cut(start, stop)
        if step == -1:  # reversed(self[stop + 1 : start + 1])
            lo, hi = stop + 1, start + 1
            part = self if lo == 0 and hi == self._len else self._cut(lo, hi)
            if type(part) is Runs:
                return Runs(tuple([p[::-1] for p in reversed(part.pieces)]), part._len)
            return part[::-1]
        return ids_array(self)[key]

    def _cut(self, start: int, stop: int) -> BlockIds:
        out: list[Piece] = []
        at = 0
        for p in self.pieces:
            n = len(p)
            lo, hi = start - at, stop - at
            if hi <= 0:
                break
            if lo < n:
                out.append(p if lo <= 0 and hi >= n else p[max(lo, 0) : hi])
            at += n
        return make_ids(out)

    def __repr__(self) -> str:
        return f"Runs({list(self.pieces)!r})"


BlockIds: TypeAlias = "Piece | Runs"
EMPTY_IDS: BlockIds = range(0)


def compact(ids: BlockIds) -> BlockIds:
    """``ids``, or a copy of it when it is an array view of an array more than twice its size."""
    return ids if isinstance(ids, Runs) else compact_piece(ids)


def make_ids(pieces: list[Piece]) -> BlockIds:
    """The run made of ``pieces`` one after the other (empty ones dropped; see the module docstring for when
    they are copied into one array)."""
    kept: list[Piece] = []
    total = 0
    for p in pieces:
        n = len(p)
        if n:
            kept.append(p)
            total += n
    if len(kept) <= 1:
        return compact(kept[0]) if kept else EMPTY_IDS
    if total < MIN_RUNS_IDS:
        return _joined(kept)
    if len(kept) > MAX_PIECES:
        joined: npt.NDArray[np.int64] = np.concatenate([ids_array(p) for p in kept])
        return joined
    return Runs(tuple([compact_piece(p) for p in kept]), total)


def _joined(pieces: list[Piece]) -> array[int]:
    """The ids of ``pieces`` one after the other, as one int64 ``array.array``."""
    out = array("q")
    for p in pieces:
        if isinstance(p, np.ndarray):
            out.frombytes(p.astype(np.int64, copy=False).tobytes())  # in logical order, whatever its strides
        elif isinstance(p, range) and len(p) > 16:  # numpy writes a long range faster than iterating it
            out.frombytes(np.arange(p.start, p.stop, p.step, dtype=np.int64).tobytes())
        else:
            out.extend(p)
    return out


def compact_piece(p: Piece) -> Piece:
    """``compact`` for one piece."""
    if isinstance(p, np.ndarray):
        base = p.base
        if isinstance(base, np.ndarray) and base.size > 2 * p.size + 8:
            copy: npt.NDArray[np.int64] = p.copy()
            return copy
    return p


def pieces_of(ids: BlockIds) -> tuple[Piece, ...]:
    """The flat pieces of a run."""
    return ids.pieces if isinstance(ids, Runs) else (ids,)


def ids_array(ids: BlockIds) -> npt.NDArray[np.int64]:
    """A run as an int64 array (a copy unless it is one already)."""
    if isinstance(ids, range):
        return np.arange(ids.start, ids.stop, ids.step, dtype=np.int64)
    if isinstance(ids, Runs):
        return np.concatenate([ids_array(p) for p in ids.pieces])
    if isinstance(ids, array):
        copy: npt.NDArray[np.int64] = np.frombuffer(ids, dtype=np.int64).copy()
        return copy
    return ids


def ids_list(ids: BlockIds) -> list[int]:
    """A run as a list of Python ints."""
    if isinstance(ids, range):
        return list(ids)
    if isinstance(ids, Runs):
        return [b for p in ids.pieces for b in ids_list(p)]
    return ids.tolist()
