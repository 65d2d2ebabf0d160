"""The LRU recency stack of a prefix cache, request by request: the stack distance of every block a request
finds on it, i.e. the smallest LRU capacity (in blocks) that would still hold that block.

In the core's LRU every block a request touches (its whole committed path) gets the request's timestamp;
among equal timestamps deeper blocks go first (a leaf's tail is evicted first, and a parent is never older
than its child). So the blocks form one recency *stack* ordered by (last request desc, depth asc), and a
cache of C blocks holds exactly its top C entries at every capacity (it is prefix-closed: a parent sits
above its children). A block at (0-based) stack distance d is a hit at every capacity > d.

Two facts make this cheap: along a request's path the last request that touched each block is
non-increasing, and the blocks still "owned" by an earlier request t (touched last by t) are a contiguous
depth range [start_t, len_t) of t's path. So a request's blocks split into a few *runs*, one per earlier
request, and the distances inside a run are consecutive: the run's first block sits at
``sum(owned blocks of requests after t)``, read from a Fenwick tree over request indices. The work per
request is a handful of numpy calls plus O(runs * log requests) Python steps, whatever its length.
"""

from __future__ import annotations

import numpy as np

Run = tuple[int, int, int]  # (first depth, stop depth, stack distance of the first block)
SHORT = 128  # paths up to this many blocks find their runs in a Python loop


class Fenwick:
    """Prefix sums over request indices (a Fenwick tree in a Python list)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.tree = [0] * (n + 1)
        self.total = 0

    def add(self, i: int, delta: int) -> None:
        self.total += delta
        i += 1
        tree, n = self.tree, self.n
        while i <= n:
            tree[i] += delta
            i += i & -i

    def prefix(self, i: int) -> int:
        """Sum of entries 0..i."""
        s = 0
        i += 1
        tree = self.tree
        while i > 0:
            s += tree[i]
            i -= i & -i
        return s


class LruStack:
    """The stack of ``num_nodes`` possible blocks (dense node ids) touched by up to ``num_requests`` requests."""

    def __init__(self, num_nodes: int, num_requests: int) -> None:
        self.last = np.full(max(num_nodes, 1), -1, dtype=np.int64)  # last request that touched each node
        self.owned_start = [0] * num_requests  # request t still owns depths [owned_start[t], len_t)
        # blocks owned by the requests after t = (blocks they touched) - (blocks they lost since): the first
        # term is a running sum taken as each request arrives, the second a Fenwick tree that changes only
        # when a request loses blocks (far rarer than a request arriving)
        self.added = 0  # blocks touched by the requests so far, each counted once per request
        self.through = [0] * num_requests  # ``added`` right after request t
        self.lost = Fenwick(num_requests)  # blocks request t no longer owns (a later request touched them)

    def access(self, i: int, path: np.ndarray) -> list[Run]:
        """Request ``i`` touches ``path`` (node ids, root first; requests come in increasing ``i``).

        Returns the runs of the path's leading blocks that were on the stack before, each as (first depth,
        stop depth, stack distance of its first block); inside a run the distances are consecutive. Changes
        the stack: every block of ``path`` is now touched by ``i``.
        """
        prev = self.last[path]
        if len(prev) <= SHORT:  # list operations beat a handful of numpy calls on short paths
            lst = prev.tolist()
            seen = lst.index(-1) if -1 in lst else len(lst)  # a prefix: a seen block's parent was seen
            if not seen:
                bounds, owners = [0], []
            elif lst[0] == lst[seen - 1]:  # one owner (non-increasing along the path): the common case
                bounds, owners = [0, seen], [lst[0]]
            else:
                bounds, owners = [], []
                last = -2
                for d in range(seen):
                    t = lst[d]
                    if t != last:
                        bounds.append(d)
                        owners.append(t)
                        last = t
                bounds.append(seen)
        else:
            seen = int(np.count_nonzero(prev >= 0))
            if seen:
                cuts = np.flatnonzero(prev[1:seen] != prev[: seen - 1]) + 1
                bounds = [0, *cuts.tolist(), seen]
                owners = prev[bounds[:-1]].tolist()
        runs: list[Run] = []
        if seen:
            lost, owned, through = self.lost, self.owned_start, self.through
            added, lost_total = self.added, lost.total
            for k, t in enumerate(owners):
                d0 = bounds[k]
                above = added - through[t] - (lost_total - lost.prefix(t))  # owned by the requests after t
                runs.append((d0, bounds[k + 1], above + (d0 - owned[t])))
            for k, t in enumerate(owners):
                d0, d1 = bounds[k], bounds[k + 1]
                lost.add(t, d1 - d0)
                owned[t] = d1
        self.added += len(path)
        self.through[i] = self.added
        self.last[path] = i
        return runs
