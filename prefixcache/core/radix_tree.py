"""RadixTree: cached prefixes as runs of blocks.

Each node holds a run of consecutive blocks of one prefix: their KV block ids (``BlockIds``: a range, an int64
array or a few of those, see ``block_ids``) and, in tokens mode, their token ids as little-endian int32 bytes
(``block_size`` tokens per block: ``tokens[tok_start : tok_start + blocks * block_bytes]``, a window of a
buffer that split halves and evicted tails share until a node holds less than half of it) or, in keys mode,
the caller's block keys (a list). A node's ``children`` dict maps the key of each child's
first block to the child (the same object as the child's ``key``):

* tokens mode, default hasher: the first block's token bytes. Under one parent, the chained hash of a child's
  first block is a function of those bytes alone (the parent's chain is shared), so with a collision-free
  hash the two keys select the same child; the tree uses the bytes and computes no hash at all.
* tokens mode, an injected hasher (a test seam, e.g. one that collides on purpose): the chained hash of the
  first block, so hash collisions behave as DESIGN.md describes (a collision is caught by token verification
  or, with ``verify_tokens`` off, served).
* keys mode: the caller's key of the first block.

Matching inside a node compares token bytes (``common_prefix``: galloping ``startswith`` on zero-copy views,
memcmp-like), or, with an injected hasher and ``verify_tokens`` off, the blocks' hashes.

Hashes (tokens mode) are computed lazily and cached per node: ``first_hash`` (its first block's chained hash)
and ``last_hash`` (its last block's); any block's hash is chained from its node's first hash, a node's first
from its parent's last, a root's last is the namespace's root value. Nothing on the default match / commit /
release / evict path hashes; hashes are computed for events, ``keys``, and the injected-hasher mode.

Every node except a root holds at least one block, a block's parent block is always cached (a path never
breaks), and a root exists only while it has children (an empty namespace costs nothing; its root is
recreated on demand). ``pins`` counts the requests whose matched path runs through the node;
``last_access``/``created``/``hits``/``keep_until`` feed the eviction policy. The tree changes nothing about
pins or eviction by itself: PrefixCache drives it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, NamedTuple

from prefixcache.core.block_ids import EMPTY_IDS, BlockIds, compact, ids_list
from prefixcache.core.hashing import TOKEN_BYTES, BlockHasher, chain_hashes

_ids = itertools.count(1)


class Node:
    __slots__ = (
        "_keys",
        "blocks",
        "children",
        "created",
        "first_hash",
        "hits",
        "id",
        "keep_until",
        "key",
        "last_access",
        "last_hash",
        "parent",
        "pins",
        "tok_start",
        "tokens",
    )

    def __init__(
        self,
        parent: Node | None,
        key: Hashable,
        blocks: BlockIds,
        tokens: bytes | None,
        keys: list[Any] | None,
        now: int,
        tok_start: int = 0,
    ) -> None:
        self.id = next(_ids)
        self.parent = parent
        self.key = key  # this node's key in parent.children
        self.blocks = blocks
        self.tokens = tokens  # tokens mode: a buffer holding the blocks' token bytes from tok_start on
        self.tok_start = tok_start
        self._keys = keys  # keys mode: the caller's keys of the blocks
        self.first_hash: bytes | None = None  # tokens mode, lazily: chained hash of the first block
        self.last_hash: bytes | None = None  # ... and of the last (a root: the namespace's root value)
        self.children: dict[Hashable, Node] = {}
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

    def token_view(self, block_bytes: int) -> memoryview:
        """This node's token bytes (tokens mode), without copying."""
        assert self.tokens is not None
        return memoryview(self.tokens)[self.tok_start : self.tok_start + len(self.blocks) * block_bytes]

    @property
    def keys(self) -> list[Any]:
        """The keys of this node's blocks: the caller's (keys mode) or their chained hashes (tokens mode,
        computed on demand). For inspection and tests; O(blocks) hashing in tokens mode."""
        if self._keys is not None:
            return self._keys
        node: Node = self
        while node.parent is not None:
            node = node.parent
        assert isinstance(node, Root)
        return node.tree.block_hashes(self)

    def __repr__(self) -> str:
        return f"Node(id={self.id}, blocks={ids_list(self.blocks)}, pins={self.pins}, last_access={self.last_access})"


class Root(Node):
    """The root of one (mode, namespace): holds no blocks; knows its tree for ``Node.keys``."""

    __slots__ = ("mode", "namespace", "tree")

    def __init__(self, tree: RadixTree, mode: str, namespace: str) -> None:
        super().__init__(None, None, EMPTY_IDS, None if mode == "keys" else b"", None, 0)
        self.tree, self.mode, self.namespace = tree, mode, namespace


class Walk(NamedTuple):
    """Where a walk down the tree stopped: the deepest node it entered (None: none), how many of that node's
    leading blocks matched, and how many blocks matched in all. The path is that node's ancestors."""

    node: Node | None
    matched: int
    blocks: int


NO_WALK = Walk(None, 0, 0)


def common_prefix(a: bytes, a_off: int, b: memoryview, b_off: int, n: int) -> int:
    """Length in bytes of the common prefix of ``a[a_off:a_off + n]`` and ``b[b_off:b_off + n]`` (both at least
    that long).

    Galloping then bisecting with C-level ``startswith`` on zero-copy views: memcmp-like work, O(log n) calls.
    """
    lo, step = 0, 256
    while True:  # gallop: the mismatch lies in [lo, hi) once a window compares unequal
        hi = min(lo + step, n)
        if hi <= lo:
            return n
        if not a.startswith(b[b_off + lo : b_off + hi], a_off + lo):
            break
        lo, step = hi, step * 2
    while hi - lo > 1:  # bisect: a[:lo] matches, a[:hi] does not
        mid = (lo + hi) // 2
        if a.startswith(b[b_off + lo : b_off + mid], a_off + lo):
            lo = mid
        else:
            hi = mid
    return lo


def _whole_tokens(nbytes: int) -> int:
    return nbytes - nbytes % TOKEN_BYTES


def _first_mismatch(a: Sequence[Any], b: Sequence[Any]) -> int:
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
    """The tree of one cache: one root per (mode, namespace), present only while it has children."""

    def __init__(
        self,
        block_size: int,
        hasher: BlockHasher,
        root_hash: Callable[[str], bytes],
        verify_tokens: bool,
        hash_keys: bool,
    ) -> None:
        """``hash_keys``: key tokens-mode children by chained hash (an injected hasher) instead of by the token
        bytes of their first block (the default, collision-free hasher); see the module docstring."""
        self.block_size = block_size
        self.block_bytes = block_size * TOKEN_BYTES
        self.hasher = hasher
        self.root_hash = root_hash
        self.verify_tokens = verify_tokens
        self.hash_keys = hash_keys
        self.roots: dict[tuple[str, str], Root] = {}
        # bumped by every change of shape (split, add_child, drop_tail, a root dropped): a walk made at one
        # generation gives the same path at that generation again
        self.generation = 0

    # ---- roots -------------------------------------------------------------------------------------
    def root(self, mode: str, namespace: str) -> Root:
        """The root for ("tokens"|"keys", namespace); created empty if absent (the caller gives it a child)."""
        r = self.roots.get((mode, namespace))
        if r is None:
            r = self.roots[(mode, namespace)] = Root(self, mode, namespace)
        return r

    def drop_root_if_empty(self, root: Node) -> None:
        """Forget a root that has no children left (recreated on demand)."""
        if isinstance(root, Root) and not root.children and self.roots.get((root.mode, root.namespace)) is root:
            del self.roots[(root.mode, root.namespace)]
            self.generation += 1

    def clear(self) -> None:
        """Take the tree apart: it forgets its roots and every node its children. Parent and child links are
        reference cycles, so a dropped tree would wait for a full pass of the garbage collector; taken apart,
        its memory returns as soon as nothing else holds its nodes."""
        for node in [*self.roots.values(), *self.nodes()]:
            if node.children:
                node.children = {}
        self.roots = {}
        self.generation += 1

    # ---- hashes (tokens mode; lazy) ----------------------------------------------------------------
    def _last_from_first(self, node: Node) -> bytes:
        first = node.first_hash
        assert first is not None
        n = len(node.blocks)
        if n == 1:
            return first
        return chain_hashes(self.hasher, first, node.token_view(self.block_bytes), self.block_size, 1, n)[-1]

    def last_hash(self, node: Node) -> bytes:
        """The chained hash of ``node``'s last block (a root: its namespace's root value); computed from the
        nearest known hash up the path and cached."""
        h = node.last_hash
        if h is not None:
            return h
        todo: list[Node] = []
        n = node
        while n.last_hash is None and n.first_hash is None and n.parent is not None:
            todo.append(n)
            n = n.parent
        if n.last_hash is None:
            if isinstance(n, Root):
                n.last_hash = self.root_hash(n.namespace)
            else:
                n.last_hash = self._last_from_first(n)
        h = n.last_hash
        bb = self.block_bytes
        for m in reversed(todo):
            assert m.tokens is not None
            m.first_hash = self.hasher(h, m.tokens[m.tok_start : m.tok_start + bb])
            m.last_hash = h = self._last_from_first(m)
        return h

    def first_hash(self, node: Node) -> bytes:
        """The chained hash of ``node``'s first block (cached)."""
        h = node.first_hash
        if h is None:
            assert node.parent is not None and node.tokens is not None
            ts = node.tok_start
            h = node.first_hash = self.hasher(self.last_hash(node.parent), node.tokens[ts : ts + self.block_bytes])
        return h

    def block_hashes(self, node: Node, start: int = 0) -> list[bytes]:
        """Chained hashes of ``node``'s blocks ``start..`` (tokens mode). Caches the node's first and last."""
        first = self.first_hash(node)
        n = len(node.blocks)
        out = [first, *chain_hashes(self.hasher, first, node.token_view(self.block_bytes), self.block_size, 1, n)]
        node.last_hash = out[-1]
        return out[start:]

    def child_key(self, parent: Node, first_block: bytes) -> Hashable:
        """The key under ``parent`` of a tokens-mode child whose first block is ``first_block``."""
        if self.hash_keys:
            return self.hasher(self.last_hash(parent), first_block)
        return first_block

    # ---- matching ----------------------------------------------------------------------------------
    def walk_tokens(self, root: Node | None, data: memoryview, nblocks: int) -> Walk:
        """The longest cached path for the first ``nblocks`` blocks of token bytes ``data`` (a byte-format view).
        Changes nothing (except caching hashes in the injected-hasher mode)."""
        if root is None:
            return NO_WALK
        last = NO_WALK
        bb = self.block_bytes
        end = nblocks * bb
        node: Node = root
        off = 0
        hash_keys = self.hash_keys
        while off < end:
            first = bytes(data[off : off + bb])
            child = node.children.get(self.child_key(node, first) if hash_keys else first)
            if child is None:
                break
            ct = child.tokens
            assert ct is not None
            n = min(len(child.blocks) * bb, end - off)
            if hash_keys and not self.verify_tokens:  # trust the injected hash: compare hashes block by block
                m = self._matched_by_hash(node, child, data, off, n // bb)
            elif ct.startswith(data[off : off + n], child.tok_start):
                m = n // bb
            else:
                m = common_prefix(ct, child.tok_start, data, off, n) // bb
            if m == 0:  # a hash collision on the first block, caught by verification
                break
            off += m * bb
            last = Walk(child, m, off // bb)
            if m < len(child.blocks):
                break
            node = child
        return last

    def _matched_by_hash(self, parent: Node, child: Node, data: memoryview, off: int, take: int) -> int:
        """How many of ``child``'s leading blocks hash like ``data``'s blocks from byte ``off`` (injected
        hasher, verify_tokens off)."""
        mine = chain_hashes(self.hasher, self.last_hash(parent), data[off:], self.block_size, 0, take)
        return _first_mismatch(self.block_hashes(child)[:take], mine)

    def walk_keys(self, root: Node | None, keys: Sequence[Any], nblocks: int) -> Walk:
        """The longest cached path for ``keys[:nblocks]`` (precomputed block ids). Changes nothing."""
        if root is None:
            return NO_WALK
        node, i = root, 0
        while i < nblocks:
            child = node.children.get(keys[i])
            if child is None:
                break
            ck = child._keys
            assert ck is not None
            take = min(len(ck), nblocks - i)
            if take == len(ck) and ck == keys[i : i + take]:
                m = take
            else:
                m = _first_mismatch(ck, keys[i : i + take])
            i += m
            if m < len(ck):
                return Walk(child, m, i)
            node = child
        return NO_WALK if node is root else Walk(node, len(node.blocks), i)

    # ---- structure changes -------------------------------------------------------------------------
    def split(self, node: Node, at: int) -> Node:
        """Cut ``node`` after its first ``at`` blocks; returns the new head (``node`` keeps the tail).

        The head inherits the node's pins and times: every request pinning the node pins both halves.
        """
        assert 0 < at < len(node.blocks)
        parent = node.parent
        assert parent is not None
        self.generation += 1
        bb = self.block_bytes
        tail_first: bytes | None = None
        head_last: bytes | None = None
        if node.tokens is not None:
            if self.hash_keys:  # the tail's key is its first block's hash: chain up to it
                hs = self.block_hashes(node)
                head_last, tail_first = hs[at - 1], hs[at]
            ts = node.tok_start
            head = Node(parent, node.key, compact(node.blocks[:at]), node.tokens, None, 0, ts)
            node.tok_start = ts + at * bb
            tail_key: Hashable = tail_first if self.hash_keys else node.tokens[node.tok_start : node.tok_start + bb]
        else:
            assert node._keys is not None
            head = Node(parent, node.key, compact(node.blocks[:at]), None, node._keys[:at], 0)
            node._keys = node._keys[at:]
            tail_key = node._keys[0]
        head.pins, head.last_access, head.created, head.hits = node.pins, node.last_access, node.created, node.hits
        head.keep_until = node.keep_until
        head.first_hash, head.last_hash = node.first_hash, head_last
        node.first_hash = tail_first
        node.blocks = compact(node.blocks[at:])
        self._compact_tokens(head)
        self._compact_tokens(node)
        parent.children[node.key] = head
        node.key = tail_key
        node.parent = head
        head.children[tail_key] = node
        return head

    def add_child(
        self,
        parent: Node,
        key: Hashable,
        blocks: BlockIds,
        tokens: bytes | None,
        keys: list[Any] | None,
        now: int,
    ) -> Node:
        """Hang a new run of blocks under ``parent`` at ``key`` (see ``child_key``)."""
        child = Node(parent, key, blocks, tokens, keys, now)
        if self.hash_keys and tokens is not None:
            child.first_hash = key  # type: ignore[assignment]
        assert key not in parent.children, "add_child over an existing child"
        parent.children[key] = child
        self.generation += 1
        return child

    def drop_tail(self, node: Node, n: int) -> BlockIds:
        """Remove the last ``n`` blocks of a leaf; unhook it when it empties (its ``parent`` stays set).
        Returns the freed block ids in the leaf's order (a view; never written to): the allocator hands them out
        in that order, so a run that was consecutive in the pool stays ascending for the next request (handed
        out last block first, it read markedly slower: benchmarks/bench_decode_roofline.py, "descending")."""
        assert not node.children and node.parent is not None and 0 < n <= len(node.blocks)
        self.generation += 1
        blocks = node.blocks
        keep = len(blocks) - n
        freed = blocks[keep:]
        if keep == 0:
            del node.parent.children[node.key]
            node.blocks = EMPTY_IDS
        else:
            node.blocks = compact(blocks[:keep])
            if node.tokens is not None:
                node.last_hash = None
                self._compact_tokens(node)
            else:
                assert node._keys is not None
                node._keys = node._keys[:keep]
        return freed

    def _compact_tokens(self, node: Node) -> None:
        """Copy ``node``'s token bytes out of a shared buffer of which it holds less than half."""
        buf = node.tokens
        if buf is not None:
            span = len(node.blocks) * self.block_bytes
            if len(buf) > 2 * span + 64:
                node.tokens = buf[node.tok_start : node.tok_start + span]
                node.tok_start = 0

    def nodes(self) -> Iterator[Node]:
        """Every non-root node, parents before children."""
        stack: list[Node] = list(self.roots.values())
        while stack:
            n = stack.pop()
            if n.parent is not None:
                yield n
            stack.extend(n.children.values())

    # ---- diagnostics -------------------------------------------------------------------------------
    def nearest(self, root: Node | None, data: memoryview, context: int) -> tuple[int, bytes]:
        """(common, following): the length in bytes of the longest common prefix of ``data`` with any cached
        path under ``root``, and up to ``context`` tokens' bytes of that cached path right after it (into the
        most recently used child where paths fork). Token granular, except in the injected-hasher mode with
        verify_tokens off, where matching is by hash and so block granular. Changes nothing."""
        if root is None:
            return 0, b""
        bb = self.block_bytes
        tokenwise = self.verify_tokens or not self.hash_keys
        last = self.walk_tokens(root, data, len(data) // bb)
        off = last.blocks * bb
        if last.node is not None and last.matched < len(last.node.blocks):  # stopped inside a node
            node, at = last.node, last.matched * bb
            more = 0
            if tokenwise:
                assert node.tokens is not None
                n = min(len(node.blocks) * bb - at, len(data) - off)
                more = _whole_tokens(common_prefix(node.tokens, node.tok_start + at, data, off, n))
            return off + more, self._following(node, at + more, context)
        node = last.node if last.node is not None else root
        best: Node | None = None
        best_c = 0
        for child in node.children.values():  # at a node's end: the divergence is in (or before) a child's first block
            c = 0
            if tokenwise:
                assert child.tokens is not None
                n = min(len(child.blocks) * bb, len(data) - off)
                c = _whole_tokens(common_prefix(child.tokens, child.tok_start, data, off, n))
            if best is None or (c, child.last_access, child.id) > (best_c, best.last_access, best.id):
                best, best_c = child, c
        if best is None:
            return off, b""
        return off + best_c, self._following(best, best_c, context)

    def _following(self, node: Node, at: int, context: int) -> bytes:
        """Up to ``context`` tokens' bytes of cached tokens from byte ``at`` of ``node`` on, continuing into the
        most recently used child when the node ends."""
        want = context * TOKEN_BYTES
        out = bytearray()
        while len(out) < want:
            view = node.token_view(self.block_bytes)
            out += view[at : at + want - len(out)]
            if len(out) >= want or not node.children:
                break
            node = max(node.children.values(), key=lambda c: (c.last_access, c.id))
            at = 0
        return bytes(out)
