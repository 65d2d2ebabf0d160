"""LRU hits at every capacity in one pass (a stack-distance curve), for hash-id traces.

It answers "what would a PrefixCache of C blocks, fed these requests through match_keys / commit_keys /
release, have hit?" for every C at once, without replaying the trace once per capacity.

**LRU, one pass.** The blocks form one recency stack (``prefixcache.sim.lru_stack``): a cache of C blocks
holds exactly its top C entries at every capacity, so a request's hit at capacity C is the number of its
blocks whose stack distance (0-based position before the request) is < C. One pass over the trace gives
every block's distance, hence the hits at every capacity.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prefixcache.sim.lru_stack import LruStack
from prefixcache.sim.node_trace import NodeTrace
from prefixcache.sim.policy import measured_from

WEIGHTS = ("blocks", "tokens")


def _token_weights(n_tokens: int, n_blocks: int, bs: int) -> list[tuple[int, int]]:
    """(block index, weight - bs) for the blocks of a request that carry fewer than bs prompt tokens.

    Block j of an n-token prompt contributes ``clip(n - j*bs, 0, bs)`` tokens to ``min(hits*bs, n)``.
    """
    first_short = n_tokens // bs
    return [(j, max(0, n_tokens - j * bs) - bs) for j in range(first_short, n_blocks)]


# ---- LRU ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HitCurve:
    """Hits against capacity: ``hit_blocks[c - 1]``/``hit_tokens[c - 1]`` are the hits with c blocks.

    Totals count only measured requests (after warm-up). ``hit_*[-1]`` (c = num_nodes) is the unlimited
    hit count: with that many blocks nothing is ever evicted.
    """

    hit_blocks: np.ndarray
    hit_tokens: np.ndarray
    total_blocks: int
    total_tokens: int
    block_size: int
    measured_requests: int

    @property
    def max_capacity(self) -> int:
        return len(self.hit_blocks)

    def hits(self, capacity: int, weight: str = "blocks") -> int:
        """Hits (blocks or tokens) at ``capacity`` blocks; capacities past the working set hit as unlimited."""
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 block, got {capacity}")
        arr = self.hit_blocks if weight == "blocks" else self.hit_tokens
        if len(arr) == 0:
            return 0
        return int(arr[min(capacity, len(arr)) - 1])

    def hit_rate(self, capacity: int, weight: str = "blocks") -> float:
        """Hit rate at ``capacity`` blocks, weighted by ``weight`` ("blocks" or "tokens")."""
        total = self.total_blocks if weight == "blocks" else self.total_tokens
        return self.hits(capacity, weight) / total if total else 0.0

    def rates(self, weight: str = "blocks") -> np.ndarray:
        """Hit rate at every capacity 1..max_capacity."""
        arr = self.hit_blocks if weight == "blocks" else self.hit_tokens
        total = self.total_blocks if weight == "blocks" else self.total_tokens
        return arr / total if total else np.zeros(len(arr))


def lru_curve(nt: NodeTrace, warmup: float = 0.0) -> HitCurve:
    """LRU hits at every capacity from 1 block to the working set, in one pass. Changes nothing.

    Equal, capacity by capacity, to replaying ``nt``'s trace through ``PrefixCache(eviction="lru")`` with
    match_keys(hash_ids, num_tokens=input_length) / commit_keys / release (see the module docstring).
    """
    n_req = len(nt)
    start_measure = measured_from(n_req, warmup)
    bs = nt.block_size
    stack = LruStack(nt.num_nodes, n_req)
    run_d: list[int] = []  # measured runs: first distance, length
    run_n: list[int] = []
    corr_d: list[int] = []  # token corrections: distance, weight - bs
    corr_w: list[int] = []
    total_blocks = total_tokens = 0
    nodes, offsets, lengths = nt.nodes, nt.offsets.tolist(), nt.input_length.tolist()
    for i in range(n_req):
        a, b = offsets[i], offsets[i + 1]
        L = b - a
        runs = stack.access(i, nodes[a:b])
        if i >= start_measure:
            total_blocks += L
            total_tokens += lengths[i]
            seen = runs[-1][1] if runs else 0
            for d0, d1, dist in runs:
                run_d.append(dist)
                run_n.append(d1 - d0)
            for j, w in _token_weights(lengths[i], L, bs):
                if j >= seen or w == 0:
                    continue
                for d0, d1, dist in runs:
                    if d0 <= j < d1:
                        corr_d.append(dist + (j - d0))
                        corr_w.append(w)
    W = nt.num_nodes
    diff = np.zeros(W + 1, dtype=np.int64)
    if run_d:
        d = np.asarray(run_d, dtype=np.int64)
        n = np.asarray(run_n, dtype=np.int64)
        np.add.at(diff, d, 1)
        np.add.at(diff, d + n, -1)
    per_dist = np.cumsum(diff[:W])  # blocks hit at exactly this stack distance
    tok = per_dist * bs
    if corr_d:
        np.add.at(tok, np.asarray(corr_d, dtype=np.int64), np.asarray(corr_w, dtype=np.int64))
    return HitCurve(np.cumsum(per_dist), np.cumsum(tok), total_blocks, total_tokens, bs, n_req - start_measure)
