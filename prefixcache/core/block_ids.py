"""Runs of KV block ids, without copying ids around.

A run (``BlockIds``) is the ids of consecutive blocks of a prefix, in order. It is one of:

* a ``range``: consecutive ids (what a fresh pool hands out): O(1) memory, O(1) slicing;
* an int64 numpy array (ids gathered from freed runs): slicing makes views;
* ``Runs``: a few such pieces one after the other (an allocation that spans several freed runs), sliced
  piece by piece; past ``MAX_PIECES`` pieces they are copied into one array.

All three take ``len``, iterate, and slice with ``[a:b]`` and ``[::-1]`` into a run again. Runs are never
written to once made (arrays are shared as views), and a view is copied when it would keep alive an array
more than twice its size (``compact``), so what holds a run holds memory proportional to its length.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import numpy.typing as npt

Piece = range | npt.NDArray[np.int64]
MAX_PIECES = 16


class Runs:
    """Block ids as 2..MAX_PIECES non-empty pieces (ranges or arrays) one after the other. Immutable."""

    __slots__ = ("_len", "pieces")

    def __init__(self, pieces: tuple[Piece, ...]) -> None:
        self.pieces = pieces
        self._len = sum(len(p) for p in pieces)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[int]:
        return itertools.chain.from_iterable(self.pieces)  # type: ignore[arg-type]

    def __getitem__(self, key: slice) -> BlockIds:
        if not isinstance(key, slice):
            raise TypeError("Runs only slice (run[a:b], run[::-1])")
        start, stop, step = key.indices(self._len)
        if step == -1:  # reversed(self[stop + 1 : start + 1])
            part = self[stop + 1 : start + 1]
            if isinstance(part, Runs):
                return Runs(tuple(p[::-1] for p in reversed(part.pieces)))
            return part[::-1]
        if step != 1:
            return ids_array(self)[key]
        out: list[Piece] = []
        at = 0
        for p in self.pieces:
            n = len(p)
            lo, hi = max(start - at, 0), min(stop - at, n)
            if lo < hi:
                out.append(p if lo == 0 and hi == n else p[lo:hi])
            at += n
            if at >= stop:
                break
        return make_ids(out)

    def __repr__(self) -> str:
        return f"Runs({list(self.pieces)!r})"


BlockIds = Piece | Runs
EMPTY_IDS: BlockIds = range(0)


def compact(ids: BlockIds) -> BlockIds:
    """``ids``, or a copy of it when it is an array view of an array more than twice its size."""
    if isinstance(ids, np.ndarray):
        base = ids.base
        if base is not None and isinstance(base, np.ndarray) and base.size > 2 * ids.size + 8:
            return ids.copy()
    return ids


def make_ids(pieces: list[Piece]) -> BlockIds:
    """The run made of ``pieces`` one after the other (empty ones dropped; copied into one array past
    MAX_PIECES)."""
    pieces = [p for p in pieces if len(p)]
    if not pieces:
        return EMPTY_IDS
    if len(pieces) == 1:
        return compact(pieces[0])
    if len(pieces) > MAX_PIECES:
        return np.concatenate([ids_array(p) for p in pieces])
    return Runs(tuple(compact_piece(p) for p in pieces))


def compact_piece(p: Piece) -> Piece:
    out = compact(p)
    assert not isinstance(out, Runs)
    return out


def pieces_of(ids: BlockIds) -> tuple[Piece, ...]:
    """The flat pieces of a run."""
    return ids.pieces if isinstance(ids, Runs) else (ids,)


def ids_array(ids: BlockIds) -> npt.NDArray[np.int64]:
    """A run as an int64 array (a copy unless it is one already)."""
    if isinstance(ids, range):
        return np.arange(ids.start, ids.stop, ids.step, dtype=np.int64)
    if isinstance(ids, Runs):
        return np.concatenate([ids_array(p) for p in ids.pieces])
    return ids


def ids_list(ids: BlockIds) -> list[int]:
    """A run as a list of Python ints."""
    if isinstance(ids, range):
        return list(ids)
    if isinstance(ids, Runs):
        return [b for p in ids.pieces for b in ids_list(p)]
    return ids.tolist()  # type: ignore[no-any-return]
