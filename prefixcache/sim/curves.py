"""Hit rate against capacity: the one-pass LRU curve and the optimal (Belady) bound, for hash-id traces.

Both answer "what would a PrefixCache of C blocks, fed these requests through match_keys / commit_keys /
release, have hit?" without replaying the trace once per capacity.

**Blocks as tree nodes.** A block is identified by its whole path: (namespace, parent block, hash id), as
the radix tree does. ``canonical_blocks`` numbers these nodes densely (a vectorised check that the trace's
ids already form a consistent tree, else a dict walk over every reference).

**LRU, one pass.** In the core's LRU every block a request touches gets the request's timestamp; among equal
timestamps deeper blocks go first (a leaf's tail is evicted first, and a parent is never older than its
child). So the blocks form one recency *stack* ordered by (last request desc, depth asc), and a cache of C
blocks holds exactly its top C entries at every capacity (it is prefix-closed: a parent sits above its
children). A request's hit at capacity C is therefore the number of its blocks whose stack distance
(0-based position before the request) is < C. Two facts make this cheap: along a request's path the last
request that touched each block is non-increasing, and the blocks still "owned" by an earlier request t
(touched last by t) are a contiguous depth range [start_t, len_t) of t's path. So a request's blocks split
into a few *runs*, one per earlier request, and the distances inside a run are consecutive: the run's first
block sits at ``sum(owned blocks of requests after t)``, read from a Fenwick tree over request indices.
The work per request is a handful of numpy calls plus O(runs * log requests) Python steps, whatever its
length.

**Optimal bound.** ``optimal_hits`` runs Belady's rule adapted to the cache's semantics at one capacity:
after each request its first min(L, C) blocks are cached (commit always caches what fits), and when room
is needed the cached block whose next use is furthest in the future goes first (never-used-again first;
among equal next uses the deeper block). See its docstring for why this is the exact optimum of hits
counted in blocks, and for the bounds used with warm-up and token weighting.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

ORDERS = ("file", "timestamp")
WEIGHTS = ("blocks", "tokens")


# ---- the trace, as tree nodes ---------------------------------------------------------------------------
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


def ordered(trace, order: str = "file"):
    """The trace in ``order``: "file" (as given) or "timestamp" (stable sort). Changes nothing."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
    return trace if order == "file" else trace.by_timestamp()


def canonical_blocks(trace) -> NodeTrace:
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
        return ids.copy()
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
    return remap[dense].astype(np.int64)


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


def _token_weights(n_tokens: int, n_blocks: int, bs: int) -> list[tuple[int, int]]:
    """(block index, weight - bs) for the blocks of a request that carry fewer than bs prompt tokens.

    Block j of an n-token prompt contributes ``clip(n - j*bs, 0, bs)`` tokens to ``min(hits*bs, n)``.
    """
    first_short = n_tokens // bs
    return [(j, max(0, n_tokens - j * bs) - bs) for j in range(first_short, n_blocks)]


def measured_from(n_requests: int, warmup: float) -> int:
    """Index of the first measured request when the first ``warmup`` fraction only warms the cache."""
    if not 0.0 <= warmup < 1.0:
        raise ValueError(f"warmup must be a fraction in [0, 1), got {warmup!r}")
    return int(np.floor(warmup * n_requests))


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


class _Fenwick:
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


def lru_curve(nt: NodeTrace, warmup: float = 0.0) -> HitCurve:
    """LRU hits at every capacity from 1 block to the working set, in one pass. Changes nothing.

    Equal, capacity by capacity, to replaying ``nt``'s trace through ``PrefixCache(eviction="lru")`` with
    match_keys(hash_ids, num_tokens=input_length) / commit_keys / release (see the module docstring).
    """
    n_req = len(nt)
    start_measure = measured_from(n_req, warmup)
    bs = nt.block_size
    last = np.full(max(nt.num_nodes, 1), -1, dtype=np.int64)  # last request that touched each node
    owned_start = [0] * n_req  # request t still owns depths [owned_start[t], len_t)
    fen = _Fenwick(n_req)
    run_d: list[int] = []  # measured runs: first distance, length
    run_n: list[int] = []
    corr_d: list[int] = []  # token corrections: distance, weight - bs
    corr_w: list[int] = []
    total_blocks = total_tokens = 0
    nodes, offsets, lengths = nt.nodes, nt.offsets.tolist(), nt.input_length.tolist()
    for i in range(n_req):
        a, b = offsets[i], offsets[i + 1]
        blk = nodes[a:b]
        L = b - a
        prev = last[blk]
        seen = int(np.count_nonzero(prev >= 0))  # a prefix: a seen block's parent was seen
        runs: list[tuple[int, int, int]] = []  # (earlier request, first depth, stop depth)
        if seen:
            cuts = np.flatnonzero(prev[1:seen] != prev[: seen - 1]) + 1
            bounds = [0, *cuts.tolist(), seen]
            owners = prev[bounds[:-1]].tolist()
            runs = [(owners[k], bounds[k], bounds[k + 1]) for k in range(len(owners))]
        measure = i >= start_measure
        if measure:
            total_blocks += L
            total_tokens += lengths[i]
            dists = []
            for t, d0, d1 in runs:
                dist = fen.total - fen.prefix(t) + (d0 - owned_start[t])
                dists.append(dist)
                run_d.append(dist)
                run_n.append(d1 - d0)
            for j, w in _token_weights(lengths[i], L, bs):
                if j >= seen or w == 0:
                    continue
                for (_t, d0, d1), dist in zip(runs, dists):
                    if d0 <= j < d1:
                        corr_d.append(dist + (j - d0))
                        corr_w.append(w)
        for t, d0, d1 in runs:
            fen.add(t, -(d1 - d0))
            owned_start[t] = d1
        fen.add(i, L)
        last[blk] = i
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


# ---- optimal bound --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NextUse:
    """Per request, its blocks split into runs of equal next use: request ``req[k]``'s depths
    ``[lo[k], hi[k])`` are next touched by request ``nxt[k]`` (``len(trace)`` = never again).
    ``first[i]:first[i+1]`` selects request i's runs, shallow first."""

    first: np.ndarray
    lo: list
    hi: list
    nxt: list


def next_uses(nt: NodeTrace) -> NextUse:
    """Next-use runs of every request (one backward pass; next use is non-decreasing with depth)."""
    n_req = len(nt)
    nxt_of = np.full(max(nt.num_nodes, 1), n_req, dtype=np.int64)
    per_req: list[tuple[list, list, list]] = [None] * n_req  # type: ignore[list-item]
    nodes, offsets = nt.nodes, nt.offsets.tolist()
    for i in range(n_req - 1, -1, -1):
        blk = nodes[offsets[i] : offsets[i + 1]]
        nu = nxt_of[blk]
        cuts = np.flatnonzero(nu[1:] != nu[:-1]) + 1
        bounds = [0, *cuts.tolist(), len(blk)]
        per_req[i] = (bounds[:-1], bounds[1:], nu[bounds[:-1]].tolist())
        nxt_of[blk] = i
    first = np.zeros(n_req + 1, dtype=np.int64)
    lo: list[int] = []
    hi: list[int] = []
    nxt: list[int] = []
    for i, (lows, h, n) in enumerate(per_req):
        lo.extend(lows)
        hi.extend(h)
        nxt.extend(n)
        first[i + 1] = len(lo)
    return NextUse(first, lo, hi, nxt)


@dataclass(frozen=True)
class OptimalHits:
    """The optimal bound at one capacity (measured requests only).

    ``hit_blocks``: the most blocks any eviction policy can hit (exact; an upper bound with warm-up).
    ``hit_tokens``: ``min(hit_blocks * block_size, unlimited token hits)``, an upper bound on token hits.
    ``schedule_tokens``: the tokens that Belady's own schedule hits (a lower bound on the token optimum).
    """

    capacity: int
    hit_blocks: int
    hit_tokens: int
    schedule_tokens: int


def optimal_hits(
    nt: NodeTrace, capacity: int, warmup: float = 0.0, *, nu: NextUse | None = None, unlimited_tokens: int | None = None
) -> OptimalHits:
    """The best hits any eviction policy can reach with ``capacity`` blocks (Belady, adapted). Changes nothing.

    Model (the PrefixCache's): before request t the cache holds a prefix-closed set S, |S| <= C; t hits
    |S ∩ K_t| blocks (its cached blocks are a leading run since S is prefix-closed); afterwards the cache is
    F_t ∪ R with F_t = the first min(L_t, C) blocks of t (commit caches what fits and pins the request's
    path) and R ⊆ S \\ K_t, dropping only as many blocks as needed (eviction is lazy). A policy only
    chooses R.

    Claim: keeping the blocks of S \\ K_t with the EARLIEST next use (dropping never-used-again blocks first,
    and among equal next uses the deeper one) maximises total block hits. Proof sketch (exchange): let OPT
    agree with this rule before t and keep x instead of y at t, where next(y) <= next(x). Let OPT' keep y
    instead of x and then copy OPT's choices, with y standing in for x. Until next(y) both hold the same
    number of blocks; at next(y) OPT' hits y where OPT misses it (or both requests hit one each when x and y
    are used together). From then on OPT' holds everything OPT holds except possibly x, i.e. it has one
    free slot; OPT can gain at most the single hit on x over it before OPT' reloads x at x's next use (x is
    then in F, or OPT must drop it too when F fills the cache). So OPT' hits at least as often as OPT, and by
    induction the rule is optimal. The rule is also admissible in the real cache: the dropped block has
    the furthest next use, and its descendants have next uses at least as late and are deeper, so it is a
    leaf — evicting it never breaks a path. Hence ``hit_blocks`` is the exact optimum over eviction
    policies (``tests/test_curves_optimal.py`` checks it against a brute force over all eviction choices).

    With warm-up, hits before the measured requests do not count, and the exchange above can move a hit
    from after the warm-up into it; so the rule is run with unlimited capacity during warm-up and the cache
    is then trimmed to C blocks by the same rule. Any policy's state at that point is some C blocks
    seen so far, and the rule's choice from all of them is at least as good: an UPPER bound (exact
    without warm-up). Tokens: each hit block carries at most ``block_size`` prompt tokens, so token hits of
    any policy are <= ``block_size * hit_blocks`` and <= the unlimited token hits: an upper bound too.
    """
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1 block, got {capacity}")
    n_req = len(nt)
    start_measure = measured_from(n_req, warmup)
    nu = nu or next_uses(nt)
    first, los, his, nxts = nu.first.tolist(), nu.lo, nu.hi, nu.nxt
    bs = nt.block_size
    lengths = nt.input_length.tolist()
    offsets = nt.offsets.tolist()
    # cached segments: seg -> cached size; by_next[t] lists segments next used by request t;
    # heap holds (-next use, -first depth, seg) for eviction, stale entries skipped
    size: dict[int, int] = {}
    by_next: dict[int, list[int]] = {}
    heap: list[tuple[int, int, int]] = []
    total = 0
    hit_blocks = sched_tokens = 0
    seg_id = 0

    def evict(excess: int) -> int:
        nonlocal total
        while excess > 0:
            _neg_nu, _neg_lo, s = heap[0]
            have = size.get(s, 0)
            if have == 0:
                heapq.heappop(heap)
                continue
            take = min(have, excess)
            size[s] = have - take
            if take == have:
                heapq.heappop(heap)
                del size[s]
            excess -= take
            total -= take
        return total

    for t in range(n_req):
        L = offsets[t + 1] - offsets[t]
        cap = capacity if t >= start_measure else None
        if t == start_measure and total > capacity:  # end of warm-up: trim to C by the rule
            evict(total - capacity)
        h = 0
        for s in by_next.pop(t, ()):
            k = size.pop(s, 0)
            h += k
        total -= h
        if t >= start_measure:
            hit_blocks += h
            sched_tokens += min(h * bs, lengths[t])
        f = L if cap is None else min(L, cap)
        if cap is not None and total + f > cap:
            evict(total + f - cap)
        for k in range(first[t], first[t + 1]):
            lo, hi = los[k], his[k]
            if lo >= f:
                break
            hi = min(hi, f)
            n = nxts[k]
            if n >= n_req:
                # never used again: keep it (lazy eviction) as the first victim
                n = n_req
            size[seg_id] = hi - lo
            by_next.setdefault(n, []).append(seg_id)
            heapq.heappush(heap, (-n, -lo, seg_id))
            seg_id += 1
            total += hi - lo
    tokens_cap = hit_blocks * bs
    if unlimited_tokens is not None:
        tokens_cap = min(tokens_cap, unlimited_tokens)
    return OptimalHits(capacity, hit_blocks, tokens_cap, sched_tokens)


def optimal_curve(
    nt: NodeTrace, capacities: Sequence[int], warmup: float = 0.0, unlimited_tokens: int | None = None
) -> list[OptimalHits]:
    """``optimal_hits`` at each capacity (the next-use runs computed once)."""
    nu = next_uses(nt)
    return [optimal_hits(nt, c, warmup, nu=nu, unlimited_tokens=unlimited_tokens) for c in capacities]


def log_grid(max_capacity: int, points: int = 24, min_capacity: int = 1) -> list[int]:
    """About ``points`` log-spaced capacities from ``min_capacity`` to ``max_capacity`` (both included)."""
    if max_capacity < 1:
        return [1]
    lo = max(1, min(min_capacity, max_capacity))
    grid = np.unique(np.round(np.geomspace(lo, max_capacity, num=max(2, points))).astype(np.int64))
    return [int(c) for c in grid]


def trace_from_lists(
    hash_ids: Sequence[Sequence[int]],
    *,
    block_size: int = 16,
    input_length: Sequence[int] | None = None,
    timestamp: Sequence[float] | None = None,
    namespace: Sequence[str] | None = None,
    path: str = "<memory>",
):
    """A ``prefixcache.trace.Trace`` built in code (tests, notebooks). ``input_length`` defaults to
    ``len(hash_ids[i]) * block_size``, ``timestamp`` to the request index (ms), ``namespace`` to "default"."""
    from prefixcache.core import DEFAULT_NAMESPACE
    from prefixcache.workload.trace import Trace

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
