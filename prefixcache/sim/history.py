"""What earlier requests committed, indexed to say how far a new prompt shares a prefix with any of them,
with which request, and whether the prompt then departs from that request (a fork) or simply goes on past
where it ended (an extension). Token sequences only (hash-id traces carry no tokens); model-free.

The index is a tree of full-block prefixes named by a chained xxh3_128 hash that ignores the namespace, so
the same tokens committed in two namespaces are one node that records both namespaces. Each node keeps the
*continuations* committed after it, sorted: the next block's tokens, or the shorter tail a sequence ended
with. The longest token-granular common prefix of a prompt with every earlier sequence is then: follow full
blocks while their node exists, then compare the prompt's next block with its sorted neighbours among that
node's continuations (the longest common prefix with a sorted set of strings is reached at a neighbour).

``History.query`` changes nothing; ``History.add`` records a committed sequence. A caller that serves several
prompts at once (a batch) queries them all before adding any, as the cache matches them all before it
commits any.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from prefixcache.core.hashing import TOKEN_BYTES, chain_hashes, namespace_root, xxh3_hasher
from prefixcache.core.radix_tree import _first_mismatch

ROOT = 0  # node id of the empty prefix
RIVALS = 4  # continuations compared on each side of a fork (sharing as much, going on)
_HASHER = xxh3_hasher(0)
_ROOT_KEY = namespace_root("\x00prefixcache-history", 0)  # one chain for every namespace


@dataclass(frozen=True)
class Shared:
    """How a prompt relates to the sequences committed before it. Counts are from the prompt's start."""

    blocks_same: int  # leading full blocks committed before in the prompt's own namespace
    blocks_any: int  # leading full blocks committed before in any namespace (>= blocks_same)
    tokens: int  # the longest common prefix, in tokens, with any earlier sequence
    partner: int | None  # the request whose sequence that is (None: no earlier sequence)
    fork: bool  # the partner's sequence goes on past ``tokens`` with another token (else it ends there)
    rivals: tuple[int, ...] = ()  # with ``fork``: other requests that share as much and go on too (a few)


def history_keys(data: bytes, block_size: int) -> list[bytes]:
    """The namespace-free chained keys of every full block of ``data`` (int32 token bytes)."""
    return chain_hashes(_HASHER, _ROOT_KEY, data, block_size, 0, len(data) // (TOKEN_BYTES * block_size))


class History:
    """Every sequence committed so far (see the module docstring). ``block_size`` is the cache's."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._bb = block_size * TOKEN_BYTES
        self._nodes: dict[bytes, int] = {}  # chained key -> node id (ROOT has none)
        self._ns: list[str | set[str] | None] = [None]  # namespaces that committed through each node
        self._owner: list[int] = [-1]  # the first request that committed through each node
        self._cont: dict[int, tuple[list[bytes], list[int]]] = {}  # node -> sorted continuations, their requests
        self._seqs: dict[int, np.ndarray] = {}  # request -> its committed tokens
        self.namespaces: set[str] = set()
        self.tokens = 0  # tokens of every sequence added

    @property
    def num_nodes(self) -> int:
        """Full-block prefixes recorded, the root included."""
        return len(self._ns)

    def sequence(self, request: int) -> np.ndarray:
        """The tokens request ``request`` committed."""
        return self._seqs[request]

    # ---- reading ---------------------------------------------------------------------------------------
    def query(self, data: bytes, namespace: str, keys: list[bytes] | None = None) -> Shared:
        """How the prompt ``data`` (int32 token bytes) shares a prefix with earlier sequences. ``keys``: its
        ``history_keys`` if the caller has them (a longer sequence's keys are fine: only the prompt's full blocks
        are used). Changes nothing."""
        bb = self._bb
        nfull = len(data) // bb
        if keys is None:
            keys = history_keys(data, self.block_size)
        nodes = self._nodes
        path: list[int] = []
        for key in keys[:nfull]:
            nid = nodes.get(key)
            if nid is None:
                break
            path.append(nid)
        any_ = len(path)
        same = any_
        if any_ and (len(self.namespaces) > 1 or namespace not in self.namespaces):
            ns_of = self._ns
            same = 0
            for nid in path:
                ns = ns_of[nid]
                if ns != namespace and (not isinstance(ns, set) or namespace not in ns):
                    break
                same += 1
        node = path[-1] if path else ROOT
        base = any_ * self.block_size
        seg = data[any_ * bb : (any_ + 1) * bb]
        cont = self._cont.get(node)
        if not cont:  # every sequence through this prefix ended here (or there are none)
            owner = self._owner[node]
            return Shared(same, any_, base, owner if owner >= 0 else None, False)
        texts, reqs = cont
        pos = bisect.bisect_left(texts, seg)
        best = max(_first_mismatch(texts[k], seg) for k in (pos - 1, pos) if 0 <= k < len(texts)) // TOKEN_BYTES
        size = (best + 1) * TOKEN_BYTES  # a continuation that shares ``best`` tokens and goes on is this long
        going: list[int] = []  # the nearest continuations that share ``best`` tokens and go on, both sides
        ended = -1
        for step, start in ((-1, pos - 1), (1, pos)):
            k, found = start, 0
            while 0 <= k < len(texts) and found < RIVALS:
                text = texts[k]
                if _first_mismatch(text, seg) < best * TOKEN_BYTES:
                    break
                if len(text) >= size:
                    going.append(reqs[k])
                    found += 1
                elif ended < 0:
                    ended = reqs[k]
                k += step
        if not seg or not going:  # the prompt ends here, or every such sequence ends where it leaves them
            return Shared(same, any_, base + best, going[0] if going else ended, False)
        return Shared(same, any_, base + best, going[0], True, tuple(going[1:]))

    # ---- recording -------------------------------------------------------------------------------------
    def add(self, request: int, tokens: np.ndarray, namespace: str, keys: list[bytes] | None = None) -> list[int]:
        """Record that ``request`` committed ``tokens`` (int32) in ``namespace``; ``keys``: their ``history_keys``
        if the caller has them. Returns the node id of each full block (the path, root first)."""
        data = tokens.tobytes()
        bb = self._bb
        if keys is None:
            keys = history_keys(data, self.block_size)
        nodes, ns_of = self._nodes, self._ns
        self.namespaces.add(namespace)
        self._seqs[request] = tokens
        self.tokens += len(tokens)
        path: list[int] = []
        parent = ROOT
        for b, key in enumerate(keys):
            nid = nodes.get(key)
            if nid is None:
                nid = nodes[key] = len(ns_of)
                ns_of.append(namespace)
                self._owner.append(request)
                self._insert(parent, data[b * bb : (b + 1) * bb], request)
            else:
                ns = ns_of[nid]
                if ns != namespace:
                    if isinstance(ns, set):
                        ns.add(namespace)
                    else:
                        assert ns is not None
                        ns_of[nid] = {ns, namespace}
            path.append(nid)
            parent = nid
        tail = data[len(keys) * bb :]
        if tail:
            self._insert(parent, tail, request)
        return path

    def _insert(self, node: int, text: bytes, request: int) -> None:
        cont = self._cont.get(node)
        if cont is None:
            self._cont[node] = ([text], [request])
            return
        texts, reqs = cont
        pos = bisect.bisect_left(texts, text)
        if pos < len(texts) and texts[pos] == text:
            return  # the same continuation: its first request stays the one named
        texts.insert(pos, text)
        reqs.insert(pos, request)


# ---- content seen again after a divergence ------------------------------------------------------------------
_BASE = 0x9E3779B97F4A7C15  # odd: invertible modulo 2**64
_INV = pow(_BASE, -1, 1 << 64)
_POWERS: list[np.ndarray] = [np.ones(1, dtype=np.uint64), np.ones(1, dtype=np.uint64)]  # BASE**j, BASE**-j
SMALL = 4096  # windows up to this many are compared as Python sets (numpy's isin costs more below that)


def _powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """BASE**0..BASE**(n-1) and their inverses modulo 2**64 (grown and kept across calls)."""
    if len(_POWERS[0]) < n:
        size = max(n, 2 * len(_POWERS[0]))
        with np.errstate(over="ignore"):
            for k, base in enumerate((_BASE, _INV)):
                p = np.ones(size, dtype=np.uint64)
                p[1:] = np.cumprod(np.full(size - 1, base, dtype=np.uint64))
                _POWERS[k] = p
    return _POWERS[0][:n], _POWERS[1][:n]


def window_hashes(a: np.ndarray, k: int) -> np.ndarray:
    """A polynomial hash (mod 2**64) of every length-``k`` window of ``a`` (empty when shorter): equal windows
    have equal hashes. Changes nothing."""
    n = len(a)
    if n < k or k < 1:
        return np.zeros(0, dtype=np.uint64)
    powers, inverse = _powers(n)
    with np.errstate(over="ignore"):
        prefix = np.zeros(n + 1, dtype=np.uint64)
        np.cumsum(a.astype(np.uint64) * powers, dtype=np.uint64, out=prefix[1:])
        out: np.ndarray = (prefix[k:] - prefix[: n - k + 1]) * inverse[: n - k + 1]
    return out


def covered_by_runs(a: np.ndarray, b: np.ndarray, k: int, a_hashes: np.ndarray | None = None) -> int:
    """How many positions of ``a`` lie in a run of >= ``k`` consecutive tokens that also occurs somewhere in
    ``b`` (``a_hashes``: ``window_hashes(a, k)`` if the caller has them). Changes nothing."""
    if k < 1 or len(a) < k or len(b) < k:
        return 0
    ha = window_hashes(a, k) if a_hashes is None else a_hashes
    hb = window_hashes(b, k)
    if len(ha) + len(hb) <= SMALL:
        other = set(hb.tolist())
        hit = np.fromiter((h in other for h in ha.tolist()), dtype=bool, count=len(ha))
    else:
        hit = np.isin(ha, hb)
    if not hit.any():
        return 0
    return int(np.count_nonzero(np.convolve(hit, np.ones(k, dtype=np.int64))))
