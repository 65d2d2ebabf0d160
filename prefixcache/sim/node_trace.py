"""A hash-id trace as tree nodes: every block reference replaced by a dense node id.

A block is identified by its whole path: (namespace, parent block, hash id), as the radix tree does.
``canonical_blocks`` numbers these nodes densely (a vectorised check that the trace's ids already form a
consistent tree, else a dict walk over every reference). The LRU curve and the optimal bound work on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prefixcache.workload.trace import Trace


@dataclass(frozen=True)
class NodeTrace:
    """A hash-id trace with every block reference replaced by a dense tree-node id.

    ``nodes[offsets[i]:offsets[i+1]]`` are request i's blocks (root first); ``num_nodes`` distinct nodes;
    ``input_length[i]`` its prompt tokens; ``timestamp`` in the trace's unit (ms for Mooncake).
    """

    nodes: np.ndarray
    offsets: np.ndarray
    input_length: np.ndarray
    timestamp: np.ndarray
    block_size: int
    num_nodes: int

    def __len__(self) -> int:
        return len(self.input_length)

    @property
    def num_refs(self) -> int:
        return int(self.offsets[-1])


def canonical_blocks(trace: Trace) -> NodeTrace:
    """Number the trace's blocks as tree nodes: (namespace, path of hash ids). Changes nothing.

    ``trace`` is a ``prefixcache.trace.Trace`` (flat ``ids``/``offsets`` arrays, per-request ``namespace``,
    ``input_length``, ``timestamp``, ``block_size``). Fast path: when every hash id always follows the same
    parent in the same namespace (true of the Mooncake and kv-tester traces), the ids themselves name the
    nodes and are only compacted; otherwise every reference is walked through a dict.
    """
    ids = np.asarray(trace.ids, dtype=np.int64)
    offsets = np.asarray(trace.offsets, dtype=np.int64)
    n_req = len(offsets) - 1
    ns_names = list(dict.fromkeys(trace.namespace))
    ns_code = {ns: k for k, ns in enumerate(ns_names)}
    starts = offsets[:-1]
    lens = np.diff(offsets)
    if (lens <= 0).any():
        raise ValueError(f"request {int(np.argmax(lens <= 0))} has no blocks")
    req_ns = np.fromiter((ns_code[ns] for ns in trace.namespace), dtype=np.int64, count=n_req)
    nodes = _consistent_nodes(ids, starts, req_ns)
    if nodes is None:
        nodes = _walk_nodes(ids, offsets, req_ns)
    num = int(nodes.max()) + 1 if len(nodes) else 0
    return NodeTrace(
        nodes,
        offsets,
        np.asarray(trace.input_length, dtype=np.int64),
        np.asarray(trace.timestamp, dtype=np.float64),
        int(trace.block_size),
        num,
    )


def _consistent_nodes(ids: np.ndarray, starts: np.ndarray, req_ns: np.ndarray) -> np.ndarray | None:
    """Dense node ids when each hash id has one (parent, namespace) everywhere, else None."""
    if len(ids) == 0:
        empty: np.ndarray = ids.copy()
        return empty
    lo, hi = int(ids.min()), int(ids.max())
    if lo >= 0 and hi < 4 * len(ids) + 1024:
        dense, size = ids, hi + 1
    else:
        uniq, dense = np.unique(ids, return_inverse=True)
        size = len(uniq)
    # the expected parent of each reference: the previous block, or -1 - namespace for a request's first block
    parent_of = np.full(size, np.iinfo(np.int64).min, dtype=np.int64)
    chunk = 1 << 22
    for pass_ in range(2):  # pass 0 writes some parent for each id, pass 1 checks all agree with it
        for a in range(0, len(ids), chunk):
            b = min(len(ids), a + chunk)
            exp = np.empty(b - a, dtype=np.int64)
            exp[1:] = dense[a : b - 1]
            exp[0] = dense[a - 1] if a > 0 else 0
            first = starts[(starts >= a) & (starts < b)]
            exp[first - a] = -1 - req_ns[np.searchsorted(starts, first)]
            if pass_ == 0:
                parent_of[dense[a:b]] = exp
            elif not np.array_equal(parent_of[dense[a:b]], exp):
                return None
    # compact to 0..n-1 in order of first appearance is not needed; just drop unused ids
    used = np.zeros(size, dtype=bool)
    used[dense] = True
    if used.all():
        return np.ascontiguousarray(dense, dtype=np.int64)
    remap = np.cumsum(used) - 1
    out: np.ndarray = remap[dense].astype(np.int64)
    return out


def _walk_nodes(ids: np.ndarray, offsets: np.ndarray, req_ns: np.ndarray) -> np.ndarray:
    """Node ids by walking (parent node, hash id) through a dict: exact for any trace, one step per block."""
    table: dict[tuple[int, int], int] = {}
    out = np.empty(len(ids), dtype=np.int64)
    flat = ids.tolist()
    for i in range(len(offsets) - 1):
        parent = -1 - int(req_ns[i])
        for j in range(int(offsets[i]), int(offsets[i + 1])):
            key = (parent, flat[j])
            node = table.get(key)
            if node is None:
                node = table[key] = len(table)
            out[j] = node
            parent = node
    return out
