"""Why prefill was not saved: every uncached prompt token of every request gets exactly one cause.

Request i has n prompt tokens, of which the cache served c (its ``cached_tokens``). Let S be the most any
cache could serve it (``servable``): ``((n - 1) // B) * B`` for token prompts (only full blocks are cached
and at least one token goes through the model), ``min(len(hash_ids) * B, n)`` for a hash-id trace (every id
may hit, a partial last one included). *History* is every sequence an earlier request committed (prompt plus
reply), whatever the capacity: what an unlimited cache would hold. From it:

* ``A_same``: the leading full blocks of the prompt that an earlier request committed in the same
  namespace (tokens, at most S): what an unlimited cache would have served. ``c <= A_same``.
* ``A_any``: the same over every namespace (``>= A_same``).
* ``t`` (``shared_tokens``): the longest token-granular common prefix with any earlier sequence, in any
  namespace (``>= A_any``); the earlier request is ``shared_with``. It is a *fork* when that request went
  on past t with another token (the prompt departs from it), an *extension* when its sequence ended at t.

The n - c uncached tokens split, in order along the prompt, into::

    [c, K)            no_state                (hybrid models and window groups, live caches only) the KV of
                                              these tokens was cached (K: the KV match) but no recurrent-state
                                              snapshot (or no kept window of the sliding-window layers) reached
                                              them, so they were recomputed; K = c otherwise
    [K, A_same)       evicted or not_cached   committed earlier in this namespace, gone now: ``not_cached`` for
                                              blocks whose latest commit did not fit (the pool was full of
                                              pinned blocks), ``evicted`` for the others (they were cached,
                                              then evicted)
    [A_same, A_any)   namespace               the same tokens were committed under another namespace
    [S, n)            partial_block           the block holding the prompt's last token: never served
    [A_any, S)        diverged / cold / partial_block:
        * after t, the positions covered by a run of >= ``max(B, MIN_RUN)`` tokens that also occurs in
          ``shared_with``'s sequence after t (forks only) are ``diverged``: content seen before, lost only
          because something earlier in the prompt differs (a date at the top of a system prompt, reasoning
          dropped from a chat history, documents in another order). Moving the varying part after the shared
          part would let it hit.
        * the other positions after t are ``cold``: content no earlier request sent there (a new question
          after a shared system prompt is cold, not diverged: there is nothing to fix).
        * [A_any, t), shared tokens in the block where the prompt leaves history: ``diverged`` when the fork
          has diverged tokens after t (the divergence costs that block too), else ``partial_block`` (a shared
          prefix that ends inside a block, e.g. a system prompt shorter than one block: a smaller block size
          would cache it).

Hash-id traces carry no tokens and their ids are chained (an id names its whole prefix), so after the first
new block nothing can be compared with earlier requests: there t = A_any and everything in [A_any, S) is
``cold``; ``diverged`` is always 0 and ``partial_block`` is the tail of lines that list only full blocks.

With a second tier below the pool (``prefixcache.core.tier``), ``c`` counts what the pool and the tier served
together: a block evicted from the pool but served by the tier is a hit, and ``evicted`` means gone from both
(``not_cached``: its latest commit did not fit in the pool, and the tier does not hold it either).

``evicted`` blocks also get a reuse distance: ``reuse_blocks`` is the LRU stack distance of the request's
deepest evicted block plus one, i.e. the smallest LRU capacity (blocks) of a pool alone that would have served
every evicted token of the request (``prefixcache.sim.lru_stack``; exact for ``--eviction lru``, a guide for the others).

Everything but the evicted / not_cached split depends only on the workload, so it is computed once per
workload (:func:`workload_causes`, kept in ``CacheRequests.memo``) and shared by every capacity of a sweep;
:class:`CauseTracker` splits the rest during one replay. The counts add up exactly to ``n - c``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import repeat
from typing import NamedTuple

import numpy as np

from prefixcache.core.cache import CommitResult
from prefixcache.sim.history import History, Shared, covered_by_runs, history_keys, window_hashes
from prefixcache.sim.lru_stack import LruStack
from prefixcache.sim.requests import CacheRequests
from prefixcache.sim.results import CAUSE_FIELDS

CAUSES = tuple(CAUSE_FIELDS)  # cold, evicted, diverged, partial_block, namespace, not_cached, no_state
MIN_RUN = 16  # diverged content must recur in runs of at least max(block_size, MIN_RUN) tokens
CONTEXT = 24  # tokens kept on each side of a divergence point, to show what differs


class Causes(NamedTuple):
    """One request's uncached tokens by cause (they sum to prompt - cached), and where it left history."""

    cold: int
    evicted: int
    diverged: int
    partial_block: int
    namespace: int
    not_cached: int
    no_state: int  # a hybrid model's cached KV that no recurrent-state snapshot reached (live caches only)
    reuse_blocks: int | None  # LRU capacity (blocks) that would have kept every evicted block; None: none evicted
    shared_tokens: int  # t: the longest common prefix with any earlier sequence
    shared_with: int | None  # the earlier request of that sequence


@dataclass(frozen=True)
class Fork:
    """A fork with diverged tokens: the prompt and ``partner``'s sequence agree up to ``position``.

    ``before``: the shared tokens just before it; ``this`` / ``other``: the next tokens of the prompt and of the
    partner's sequence (up to CONTEXT each). ``place``: the block the position falls in and the tokens before
    that block: forks at one place cost the same blocks, whichever token of the block differs first (the
    digits of a timestamp)."""

    position: int
    partner: int
    before: tuple[int, ...]
    this: tuple[int, ...]
    other: tuple[int, ...]
    place: tuple[int, ...]


class Unseen(NamedTuple):
    """The capacity-independent part of a request's split (see the module docstring)."""

    seen_same: int  # A_same, tokens
    namespace: int
    diverged: int
    partial_block: int
    cold: int


def servable(prompt_tokens: int, block_size: int) -> int:
    """The most tokens any cache could serve a token prompt (S in the module docstring: full blocks, and at
    least one token left for the model)."""
    return ((prompt_tokens - 1) // block_size) * block_size


def split_unseen(n: int, s: int, same: int, any_: int, t: int, seen_after: int) -> Unseen:
    """Split [A_same, n) of a prompt of ``n`` tokens: ``s`` servable, ``same``/``any_`` the block-aligned A_same and
    A_any (<= s), ``t`` the common prefix, ``seen_after`` the diverged positions in [t, s)."""
    shared_in_block = min(t, s) - any_
    cold = max(0, s - t) - seen_after
    if seen_after:
        return Unseen(same, any_ - same, seen_after + shared_in_block, n - s, cold)
    return Unseen(same, any_ - same, 0, n - s + shared_in_block, cold)


def analyse_prompt(
    history: History, prompt: np.ndarray, namespace: str, keys: list[bytes] | None = None, cached: int = 0
) -> tuple[Unseen, Shared, Fork | None]:
    """How ``prompt`` (int32 tokens) relates to ``history`` (tokens mode). ``cached``: tokens the cache served
    it, which history must cover (a live history that forgot older sequences is raised to it). Changes nothing."""
    bs = history.block_size
    n = len(prompt)
    s = servable(n, bs)
    sh = history.query(prompt.tobytes(), namespace, keys)
    same = max(min(sh.blocks_same * bs, s), cached)
    any_ = max(min(sh.blocks_any * bs, s), same)
    t = max(sh.tokens, any_)
    seen_after = 0
    div = None
    if sh.fork and t < s and sh.partner is not None:
        k = max(bs, MIN_RUN)
        after = prompt[t:s]
        hashes = window_hashes(after, k)
        partner, other = sh.partner, history.sequence(sh.partner)
        seen_after = covered_by_runs(after, other[t:], k, hashes)
        for rival in sh.rivals:  # as near as the partner: keep the one that shares the most after t
            seq = history.sequence(rival)
            n_seen = covered_by_runs(after, seq[t:], k, hashes)
            if n_seen > seen_after:
                partner, other, seen_after = rival, seq, n_seen
        if seen_after:
            start = t // bs * bs
            div = Fork(
                t,
                partner,
                tuple(prompt[max(0, t - CONTEXT) : t].tolist()),
                tuple(prompt[t : t + CONTEXT].tolist()),
                tuple(other[t : t + CONTEXT].tolist()),
                (start, *prompt[max(0, start - CONTEXT) : start].tolist()),
            )
    if div is not None and div.partner != sh.partner:
        sh = replace(sh, partner=div.partner)
    return split_unseen(n, s, same, any_, t, seen_after), sh, div


# ---- the workload's part, once ---------------------------------------------------------------------------------
@dataclass
class WorkloadCauses:
    """The capacity-independent causes of every request of a workload, and its committed block paths.

    ``paths[offsets[i]:offsets[i+1]]`` are the namespace-specific block ids request i commits (root first), as
    the cache sees them; the LRU stack over them (for reuse distances) is built on first use.
    """

    block_size: int
    unseen: list[Unseen]
    shared_tokens: list[int]
    shared_with: list[int | None]
    forks: dict[int, Fork]  # requests whose fork has diverged tokens
    paths: np.ndarray
    offsets: list[int]
    num_ids: int
    _runs: tuple[list[int], list[int], list[int], list[int]] | None = field(default=None, repr=False)
    _intact: tuple[list[int], list[Causes]] | None = field(default=None, repr=False)

    def intact(self) -> tuple[list[int], list[Causes]]:
        """Per request: A_same (``seen_same``), and its causes when nothing it had was lost (made once)."""
        if self._intact is None:
            n = len(self.unseen)
            same, namespace, diverged, partial, cold = zip(*self.unseen) if n else ((),) * 5
            rows = zip(
                cold,
                repeat(0),
                diverged,
                partial,
                namespace,
                repeat(0),
                repeat(0),
                repeat(None),
                self.shared_tokens,
                self.shared_with,
            )
            self._intact = list(same), list(map(Causes._make, rows))
        return self._intact

    def path(self, i: int) -> list[int]:
        return self.paths[self.offsets[i] : self.offsets[i + 1]].tolist()  # type: ignore[no-any-return]

    def reuse_blocks(self, i: int, depth: int) -> int:
        """The LRU stack distance + 1 of request i's block at ``depth`` when request i arrived (the block must
        have been committed before)."""
        if self._runs is None:
            self._runs = self._stack_runs()
        off, d0s, d1s, dists = self._runs
        for k in range(off[i], off[i + 1]):
            if d0s[k] <= depth < d1s[k]:
                return dists[k] + (depth - d0s[k]) + 1
        raise AssertionError(f"request {i}: block {depth} was never committed before")

    def _stack_runs(self) -> tuple[list[int], list[int], list[int], list[int]]:
        n_req = len(self.offsets) - 1
        stack = LruStack(self.num_ids, n_req)
        off, d0s, d1s, dists = [0], [], [], []
        paths, offsets = self.paths, self.offsets
        for i in range(n_req):
            for d0, d1, dist in stack.access(i, paths[offsets[i] : offsets[i + 1]]):
                d0s.append(d0)
                d1s.append(d1)
                dists.append(dist)
            off.append(len(d0s))
        return off, d0s, d1s, dists


def workload_causes(reqs: CacheRequests) -> WorkloadCauses:
    """The capacity-independent causes of ``reqs`` (made once, then kept in ``reqs.memo``)."""
    wc = reqs.memo.get("causes")
    if wc is None:
        wc = reqs.memo["causes"] = (_keys_causes if reqs.mode == "keys" else _token_causes)(reqs)
    return wc


def _leading_seen(labels: np.ndarray, offsets: np.ndarray, size: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Per request: how many leading blocks an earlier request referenced, and the first request that referenced
    the deepest of them (-1: none). ``labels`` name the blocks: dense ids below ``size``, or any ids (None)."""
    lens = np.diff(offsets)
    req_of = np.repeat(np.arange(len(lens)), lens)
    if size is not None:  # the first request referencing each label, without sorting
        first_req = np.full(max(size, 1), len(lens), dtype=np.int64)
        np.minimum.at(first_req, labels, req_of)
        by_ref = first_req[labels]
    else:
        _, first_ref, inverse = np.unique(labels, return_index=True, return_inverse=True)
        by_ref = req_of[first_ref][inverse]
    seen = by_ref < req_of
    pos = np.where(seen, len(labels), np.arange(len(labels)))
    lead = np.minimum(np.minimum.reduceat(pos, offsets[:-1]), offsets[1:]) - offsets[:-1]
    owner = np.where(lead > 0, by_ref[offsets[:-1] + np.maximum(lead - 1, 0)], -1)
    return lead, owner


def _keys_causes(reqs: CacheRequests) -> WorkloadCauses:
    nt = reqs.node_trace()
    assert reqs.keys is not None
    bs = reqs.block_size
    offsets = nt.offsets
    lead_same, owner_same = _leading_seen(nt.nodes, offsets, nt.num_nodes)
    if len(set(reqs.namespace)) > 1:  # a hash id names its whole prefix: the same id is the same tokens anywhere
        lead_any, owner_any = _leading_seen(reqs.keys, offsets, None)
    else:
        lead_any, owner_any = lead_same, owner_same
    n = np.asarray(reqs.prompt_tokens, dtype=np.int64)
    s = np.minimum(np.diff(offsets) * bs, n)
    same = np.minimum(lead_same * bs, s)
    any_ = np.minimum(lead_any * bs, s)
    unseen = list(
        map(Unseen._make, zip(same.tolist(), (any_ - same).tolist(), repeat(0), (n - s).tolist(), (s - any_).tolist()))
    )
    return WorkloadCauses(
        bs,
        unseen,
        np.minimum(lead_any * bs, n).tolist(),
        [None if o < 0 else o for o in owner_any.tolist()],
        {},
        nt.nodes,
        offsets.tolist(),
        nt.num_nodes,
    )


def _token_causes(reqs: CacheRequests) -> WorkloadCauses:
    assert reqs.prompts is not None and reqs.commits is not None
    bs = reqs.block_size
    history = History(bs)
    several = len(set(reqs.namespace)) > 1
    ids: dict[tuple[str, int], int] = {}
    unseen: list[Unseen] = []
    shared_tokens: list[int] = []
    shared_with: list[int | None] = []
    forks: dict[int, Fork] = {}
    paths: list[int] = []
    offsets = [0]
    for i, (prompt, commit, ns) in enumerate(zip(reqs.prompts, reqs.commits, reqs.namespace)):
        keys = history_keys(commit.tobytes(), bs)
        u, sh, div = analyse_prompt(history, prompt, ns, keys)
        unseen.append(u)
        shared_tokens.append(sh.tokens)
        shared_with.append(sh.partner)
        if div is not None:
            forks[i] = div
        path = history.add(i, commit, ns, keys)
        paths.extend([ids.setdefault((ns, nid), len(ids)) for nid in path] if several else path)
        offsets.append(len(paths))
    num_ids = len(ids) if several else history.num_nodes
    return WorkloadCauses(
        bs, unseen, shared_tokens, shared_with, forks, np.asarray(paths, dtype=np.int64), offsets, num_ids
    )


# ---- one replay ------------------------------------------------------------------------------------------------
class CauseTracker:
    """Splits one replay's uncached tokens by cause, request by request (see the module docstring).

    It follows the cache through ``observe`` in request order 0, 1, 2, ... (as ``prefixcache.sim.replay``
    serves them); a request observed out of order gets no causes, nor does any after it (never wrong ones).
    """

    def __init__(self, wc: WorkloadCauses) -> None:
        self.wc = wc
        # each request's causes when nothing it had was lost (the common case, returned as is)
        self.seen_same, self.intact = wc.intact()
        self.failed: set[int] = set()  # blocks whose latest commit did not fit
        self.next = 0

    def observe(self, i: int, cached: int, commit: CommitResult, loaded: CommitResult | None = None) -> Causes | None:
        """The causes of request ``i``, served with ``cached`` tokens (pool and second tier together) and committed
        as ``commit``; ``loaded``: the commit that loaded the tier's blocks into the pool before it, if any."""
        if i != self.next:
            self.next = -1
            return None
        self.next = i + 1
        seen = self.seen_same[i]
        failed = self.failed
        if failed and loaded is not None and loaded.block_ids:
            failed.difference_update(self.wc.path(i)[loaded.first_block : loaded.cached_blocks])
        if seen == cached and not commit.not_cached and not failed:
            return self.intact[i]
        lost = seen - cached
        assert lost >= 0, f"request {i}: served {cached} tokens, more than history holds ({seen})"
        wc = self.wc
        bs = wc.block_size
        evicted = not_cached = 0
        reuse = None
        path: list[int] | None = None
        if lost:
            first, stop = cached // bs, -(-seen // bs)
            deepest = stop - 1
            if failed:
                path = wc.path(i)
                deepest = -1
                for b in range(first, stop):
                    if path[b] in failed:
                        not_cached += min(bs, seen - b * bs)
                    else:
                        deepest = b
            evicted = lost - not_cached
            if evicted:
                reuse = wc.reuse_blocks(i, deepest)
        if commit.not_cached or (failed and commit.block_ids):
            path = path or wc.path(i)
            if failed and commit.block_ids:
                failed.difference_update(path[commit.first_block : commit.cached_blocks])
            if commit.not_cached:
                failed.update(path[commit.cached_blocks : commit.cached_blocks + commit.not_cached])
        u = self.intact[i]
        return Causes(u[0], evicted, u[2], u[3], u[4], not_cached, 0, reuse, u[8], u[9])


# ---- a live cache (the model wrapper) ----------------------------------------------------------------------------
@dataclass(frozen=True)
class LiveRequest:
    """A prompt a live cache just matched: its id in the history, namespace, causes, and fork (if any)."""

    id: int
    namespace: str
    causes: Causes
    fork: Fork | None


class LiveCauses:
    """Miss causes for a cache whose requests are not known in advance (``engine``'s wrapper).

    It keeps its own :class:`History` of what was committed, bounded to ``max_tokens`` tokens: past that it
    starts over (content seen only before then counts as cold; what the cache still serves counts as seen).
    No reuse distances. Per request: ``request`` right after the cache's match (for every row of a batch
    before any commit), then ``committed`` for each sequence committed for it.
    """

    def __init__(self, block_size: int, max_tokens: int | None = None) -> None:
        self.block_size = block_size
        self.max_tokens = max_tokens
        self.requests = 0
        self._forget()

    def _forget(self) -> None:
        self.history = History(self.block_size)
        self.failed: set[tuple[str, bytes]] = set()  # (namespace, block key) whose latest commit did not fit

    def reset(self) -> None:
        """Forget everything (the cache was emptied)."""
        self.requests = 0
        self._forget()

    def request(
        self, prompt: np.ndarray, namespace: str, cached: int, *, count: bool = True, kv_cached: int | None = None
    ) -> LiveRequest:
        """The causes of ``prompt`` (int32 tokens), which the cache just served ``cached`` tokens of. ``kv_cached``
        (hybrid models): the tokens its KV match covered (``cached <= kv_cached <= servable``; None: ``cached``);
        the tokens between the two count as ``no_state``: their KV was cached, but no recurrent-state snapshot
        reached them. Changes only the request count (not even that without ``count``: a question about a prompt
        not served)."""
        bs = self.block_size
        kv = cached if kv_cached is None else kv_cached
        if kv_cached is not None and not cached <= kv <= max(cached, servable(len(prompt), bs)):
            raise ValueError(
                f"kv_cached ({kv_cached}) must lie between cached ({cached}) and the servable prompt tokens "
                f"({servable(len(prompt), bs)})"
            )
        keys = history_keys(prompt.tobytes(), bs)
        u, sh, fork = analyse_prompt(self.history, prompt, namespace, keys, kv)
        not_cached = 0
        if self.failed:
            for b in range(kv // bs, u.seen_same // bs):
                if (namespace, keys[b]) in self.failed:
                    not_cached += bs
        causes = Causes(
            u.cold,
            u.seen_same - kv - not_cached,
            u.diverged,
            u.partial_block,
            u.namespace,
            not_cached,
            kv - cached,
            None,
            max(sh.tokens, u.seen_same),
            sh.partner,
        )
        rid = self.requests
        self.requests += count
        return LiveRequest(rid, namespace, causes, fork)

    def committed(self, req: LiveRequest, tokens: np.ndarray, commit: CommitResult) -> None:
        """Record that ``tokens`` (int32) were committed for ``req`` as ``commit``."""
        if self.max_tokens is not None and self.history.tokens + len(tokens) > self.max_tokens:
            self._forget()
        keys = history_keys(tokens.tobytes(), self.block_size)
        self.history.add(req.id, tokens, req.namespace, keys)
        ns, failed = req.namespace, self.failed
        if failed and commit.block_ids:
            failed.difference_update((ns, k) for k in keys[commit.first_block : commit.cached_blocks])
        if commit.not_cached:
            failed.update((ns, k) for k in keys[commit.cached_blocks : commit.cached_blocks + commit.not_cached])
