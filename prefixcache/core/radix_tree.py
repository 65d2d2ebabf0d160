"""RadixTree: cached prefixes as runs of blocks.

Each node holds a run of consecutive blocks of one prefix: their keys (chained hashes, or the caller's
precomputed ids), their KV block ids, and, with token verification on, their token bytes. A node's
children are keyed by the key of their first block. Every node except a root holds at least one block,
and a block's parent block is always cached (a path never breaks).

``pins`` counts the requests whose matched path runs through the node; ``last_access``/``created``/``hits``
feed the eviction policy. The tree changes nothing about pins or eviction by itself: PrefixCache drives it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

from prefixcache.core.hashing import TOKEN_BYTES, BlockHasher

_ids = itertools.count(1)


class Node:
    __slots__ = (
        "blocks",
        "children",
        "created",
        "hits",
        "id",
        "keep_until",
        "keys",
        "last_access",
        "parent",
        "pins",
        "tokens",
    )

    def __init__(self, parent: Node | None, keys: list, blocks: list[int], tokens: bytes | None, now: int) -> None:
        self.id = next(_ids)
        self.parent = parent
        self.keys = keys
        self.blocks = blocks
        self.tokens = tokens
        self.children: dict = {}
        self.pins = 0
        self.last_access = now
        self.created = now
        self.hits = 0
        self.keep_until = -math.inf  # retained until (cache clock); set by commit(..., keep_for=)

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        return f"Node(id={self.id}, blocks={self.blocks}, pins={self.pins}, last_access={self.last_access})"


class Step(NamedTuple):
    """One node of a matched path and how many of its leading blocks matched (immutable; a NamedTuple
    because walks make one per node on the hot path)."""

    node: Node
    matched: int


def _first_mismatch(a: Sequence, b: Sequence) -> int:
    """Length of the common prefix of two sequences (C-speed when equal)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # binary search on prefix equality: O(log n) slice compares
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class RadixTree:
    """The tree of one cache: one root per (mode, namespace)."""

    def __init__(
        self, block_size: int, hasher: BlockHasher, root_hash: Callable[[str], bytes], verify_tokens: bool
    ) -> None:
        self.block_size = block_size
        self.block_bytes = block_size * TOKEN_BYTES
        self.hasher = hasher
        self.root_hash = root_hash
        self.verify_tokens = verify_tokens
        self.roots: dict[tuple[str, str], Node] = {}

    # ---- roots -------------------------------------------------------------------------------------
    def root(self, mode: str, namespace: str) -> Node:
        """The root for ("tokens"|"keys", namespace); created empty on first use."""
        r = self.roots.get((mode, namespace))
        if r is None:
            key0 = self.root_hash(namespace) if mode == "tokens" else None
            r = self.roots[(mode, namespace)] = Node(None, [key0], [], None, 0)
        return r

    # ---- matching ----------------------------------------------------------------------------------
    def walk_tokens(self, root: Node, data: bytes, nblocks: int) -> list[Step]:
        """The longest cached path for the first ``nblocks`` blocks of token bytes ``data``. Changes nothing."""
        bb = self.block_bytes
        hasher = self.hasher
        path: list[Step] = []
        node, i = root, 0
        while i < nblocks:
            first = data[i * bb : (i + 1) * bb]
            child = node.children.get(hasher(node.keys[-1], first))
            if child is None:
                break
            take = min(len(child.blocks), nblocks - i)
            if child.tokens is not None:
                seg = data[i * bb : (i + take) * bb]
                if child.tokens.startswith(seg):
                    m = take
                else:
                    m = _first_mismatch(child.tokens, seg) // bb
            else:
                mine = [child.keys[0]]
                prev = child.keys[0]
                for j in range(i + 1, i + take):
                    prev = hasher(prev, data[j * bb : (j + 1) * bb])
                    mine.append(prev)
                m = _first_mismatch(child.keys, mine)
            if m == 0:  # hash collision on the first block, caught by verification
                break
            path.append(Step(child, m))
            i += m
            if m < len(child.blocks):
                break
            node = child
        return path

    def walk_keys(self, root: Node, keys: Sequence, nblocks: int) -> list[Step]:
        """The longest cached path for ``keys[:nblocks]`` (precomputed block ids). Changes nothing."""
        path: list[Step] = []
        node, i = root, 0
        while i < nblocks:
            child = node.children.get(keys[i])
            if child is None:
                break
            take = min(len(child.keys), nblocks - i)
            ck = child.keys
            if take == len(ck) and ck == keys[i : i + take]:
                m = take
            else:
                m = _first_mismatch(ck, keys[i : i + take])
            path.append(Step(child, m))
            i += m
            if m < len(ck):
                break
            node = child
        return path

    # ---- structure changes -------------------------------------------------------------------------
    def split(self, node: Node, at: int) -> Node:
        """Cut ``node`` after its first ``at`` blocks; returns the new head (``node`` keeps the tail).

        The head inherits the node's pins and times: every request pinning the node pins both halves.
        """
        assert 0 < at < len(node.blocks)
        parent = node.parent
        assert parent is not None
        bb = self.block_bytes
        head = Node(
            parent, node.keys[:at], node.blocks[:at], None if node.tokens is None else node.tokens[: at * bb], 0
        )
        head.pins, head.last_access, head.created, head.hits = node.pins, node.last_access, node.created, node.hits
        head.keep_until = node.keep_until
        parent.children[head.keys[0]] = head
        node.keys = node.keys[at:]
        node.blocks = node.blocks[at:]
        if node.tokens is not None:
            node.tokens = node.tokens[at * bb :]
        node.parent = head
        head.children[node.keys[0]] = node
        return head

    def add_child(self, parent: Node, keys: list, blocks: list[int], tokens: bytes | None, now: int) -> Node:
        """Hang a new run of blocks under ``parent``."""
        child = Node(parent, keys, blocks, tokens, now)
        assert keys[0] not in parent.children, "add_child over an existing child"
        parent.children[keys[0]] = child
        return child

    def drop_tail(self, node: Node, n: int) -> list[int]:
        """Remove the last ``n`` blocks of a leaf; unhook it when it empties. Returns the freed block ids in
        eviction order: the tail block first."""
        assert node.is_leaf and not node.is_root and 0 < n <= len(node.blocks)
        keep = len(node.blocks) - n
        freed = node.blocks[keep:][::-1]
        if keep == 0:
            assert node.parent is not None
            del node.parent.children[node.keys[0]]
            node.blocks = []
            node.keys = node.keys[:0]
        else:
            node.blocks = node.blocks[:keep]
            node.keys = node.keys[:keep]
            if node.tokens is not None:
                node.tokens = node.tokens[: keep * self.block_bytes]
        return freed

    def nodes(self) -> Iterator[Node]:
        """Every non-root node, parents before children."""
        stack = list(self.roots.values())
        while stack:
            n = stack.pop()
            if not n.is_root:
                yield n
            stack.extend(n.children.values())
