"""The optimal (Belady) bound on hits at one capacity, for hash-id traces.

``optimal_hits`` runs Belady's rule adapted to the cache's semantics at one capacity:
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

from prefixcache.sim.node_trace import NodeTrace
from prefixcache.sim.policy import measured_from


# ---- optimal bound --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NextUse:
    """Per request, its blocks split into runs of equal next use: request ``req[k]``'s depths
    ``[lo[k], hi[k])`` are next touched by request ``nxt[k]`` (``len(trace)`` = never again).
    ``first[i]:first[i+1]`` selects request i's runs, shallow first."""

    first: np.ndarray
    lo: list[int]
    hi: list[int]
    nxt: list[int]


def next_uses(nt: NodeTrace) -> NextUse:
    """Next-use runs of every request (one backward pass; next use is non-decreasing with depth)."""
    n_req = len(nt)
    nxt_of = np.full(max(nt.num_nodes, 1), n_req, dtype=np.int64)
    per_req: list[tuple[list[int], list[int], list[int]]] = [([], [], [])] * n_req
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
