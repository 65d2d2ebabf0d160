"""The contiguous cached ``generate``: one ``model.generate`` call over a cache whose prompts are ready but for
their last tokens.

Every row's tokens (left padding stripped) -> ``PrefixCache.match`` in its namespace (continued in the tier when
there is one) -> its cached blocks gathered from the ``KVPool`` into row r of a batch buffer, at its padded
position -> (batches) each row's uncached suffix prefilled on its own into the same buffer -> ONE
``model.generate`` on the original ids over a cache of those buffers, so the prompts' last tokens and all decoding
run batched, exactly as on the bare model, with new tokens written into the buffers' room instead of
concatenated -> ``commit`` each output row's full blocks (prompt + generated up to its first EOS) and scatter their
K/V into the pool (and write them through to the tier) -> ``release`` (always, in a ``finally``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

import numpy as np
import torch
from transformers import StoppingCriteriaList
from transformers.cache_utils import DynamicCache

from engine import hf_cache
from engine.hybrid import recurrent
from engine.hybrid.rows import BoundaryCapture, HybridRow, prefill, stack_states
from engine.kv_pool import LayerKV, runs
from engine.media.families import inner
from engine.media.inputs import MediaCall, build
from engine.runtime import ModelRuntime, eos_ids
from prefixcache.core import MatchResult
from prefixcache.core.cache import RequestHandle
from prefixcache.core.hashing import as_token_array
from prefixcache.core.key_material import keyed_tokens
from prefixcache.core.snapshots import snapshot_points
from prefixcache.sim.causes import Fork, LiveRequest


@dataclass(frozen=True)
class RowStats:
    """One batch row of the last ``generate`` call: prompt length, tokens served from cache (pool and tier), blocks
    added (the tier's loaded ones included), and why the other prompt tokens missed (``prefixcache.sim.causes``;
    they sum to prompt - cached): the runtime remembers what it committed, up to ``HISTORY_FACTOR`` times its pool
    in tokens unless ``miss_history_tokens`` says otherwise (older content counts as cold);
    ``shared_tokens``/``shared_with``: the longest prefix it shares with an earlier row (numbered from 0 since
    construction or ``reset_cache``) and which row that was."""

    prompt_tokens: int
    cached_tokens: int
    inserted_blocks: int
    cold_tokens: int | None = None
    evicted_tokens: int | None = None
    diverged_tokens: int | None = None
    partial_block_tokens: int | None = None
    namespace_tokens: int | None = None
    not_cached_tokens: int | None = None
    shared_tokens: int | None = None
    shared_with: int | None = None
    divergence: Fork | None = None  # with diverged tokens: the tokens each side of where it departs
    tier_tokens: int = 0  # of ``cached_tokens``, served by the second tier (disk or shared)
    no_state_tokens: int | None = None  # a hybrid row's cached KV that no recurrent-state snapshot reached


def generate(
    rt: ModelRuntime,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    gc: Any,
    names: Sequence[str],
    kwargs: dict[str, Any],
    hints: Sequence[Sequence[int]] | None = None,
    media: MediaCall | None = None,
) -> tuple[Any, tuple[RowStats, ...]]:
    """``rt.model.generate`` over ``input_ids`` (left padding only, marked by ``attention_mask``; None: no padding)
    with generation config ``gc`` and ``kwargs``, each row served from its longest cached prefix in namespace
    ``names[r]``; returns what generate returns and each input row's ``RowStats``. The caller holds ``rt.lock`` and
    has called ``rt.follow()``. Changes the cache: matched blocks refreshed, new full blocks of prompt + output
    inserted. A hybrid model's rows are served up to their deepest recurrent-state snapshot (``engine.hybrid``);
    ``hints[r]``: token positions of row r (after its padding) where prefixes diverge, to snapshot at. ``media``:
    the call's images (``engine.media``; ``kwargs`` then holds none of their inputs): each row is keyed by its key
    stream (its images' content in the blocks they touch), its suffix prefilled here with the encoder outputs
    of the placeholders it holds, and generate decodes from text over that cache."""
    batch, width = input_ids.shape
    fam = rt.media_family
    if media is None and fam is not None and fam.mrope:  # a text call on an M-RoPE model: its 3-D positions
        media = build(rt.model, fam, input_ids, _mask(input_ids, attention_mask), {}, rt.block_size)
    if attention_mask is None:
        pads = [0] * batch
    else:
        pads = (width - attention_mask.to(torch.long).sum(dim=1)).tolist()
    rows = [input_ids[r, pads[r] :] for r in range(batch)]
    copies = int(gc.num_return_sequences or 1)  # sampling n per prompt: generate's own expansion, done here
    if copies > 1:
        input_ids = input_ids.repeat_interleave(copies, dim=0)
        if attention_mask is not None:
            attention_mask = attention_mask.repeat_interleave(copies, dim=0)
        kwargs = {**kwargs, "num_return_sequences": 1}
    pool, epoch, hy = rt.kv_pool, rt.epoch, rt.hybrid
    handles: list[RequestHandle] = []
    try:
        matches, live, tiered = [], [], []
        plans: list[HybridRow | None] = []
        for r, (row, name) in enumerate(zip(rows, names)):
            ns = rt.namespace(name)
            ids = as_token_array(row.detach().cpu())
            if media is not None:
                ids = keyed_tokens(ids, media.material[r], rt.block_size, rt.cache.config.hash_seed)
            kv_cached: int | None = None  # a hybrid row: its KV match, which may reach past its snapshot
            if hy is None:
                m = rt.cache.match(ids, ns)
                plans.append(None)
            else:  # served up to the deepest snapshot the KV match reaches (the tier's included)
                keys = list[bytes]()
                a = hy.admit(rt.cache, ids, ns, keys, len(ids))
                loaded = a.loaded[: max(0, a.restored - a.match.cached_blocks)]
                m = a.match
                if loaded:
                    n = a.match.cached_blocks + len(loaded)
                    m = MatchResult(m.handle, n * rt.block_size, n, (*m._runs, np.asarray(loaded, dtype=np.int64)))
                points = hy.points(
                    restored=a.restored,
                    matched=max(a.kv, len(a.blocks)),
                    limit=len(ids),
                    prompt_tokens=len(ids),
                    hints=() if hints is None else hints[r],
                )
                plans.append(HybridRow(ns, keys, a.restored, a.slot, points))
                # the KV this row could have been served (the pool's and the tier's, up to what a match may serve)
                kv_cached = min(max(a.kv, len(a.blocks)), (len(ids) - 1) // rt.block_size) * rt.block_size
            handles.append(m.handle)
            got: tuple[int, ...] = () if plans[-1] is None else loaded
            if rt.tier is not None and hy is None:
                got = rt.tier.load_after_match(
                    rt.cache, pool, m.handle, ids, [], m.block_ids, (len(ids) - 1) // rt.block_size
                )
                if got:
                    n = m.cached_blocks + len(got)
                    m = MatchResult(m.handle, n * rt.block_size, n, (*m._runs, np.asarray(got, dtype=np.int64)))
            if media is not None:  # a bidirectional family's match never ends inside an image
                safe = media.safe_blocks(r, m.cached_blocks, rt.block_size)
                if safe < m.cached_blocks:  # the tier's blocks are the match's tail: they go first
                    got = got[: max(0, len(got) - (m.cached_blocks - safe))]
                    m = _cut(rt, m, safe)
            matches.append(m)
            tiered.append(len(got))
            if kv_cached is None and rt.cache.windows is not None and m.handle.kv_blocks > m.cached_blocks:
                # the KV match a window group cut short (no window held there): counted as ``no_state``
                kv_cached = min(m.handle.kv_blocks, (len(ids) - 1) // rt.block_size) * rt.block_size
                kv_cached = max(kv_cached, m.cached_tokens)
            live.append(rt.causes.request(ids, ns, m.cached_tokens, kv_cached=kv_cached))
        # a hybrid row's suffix is always prefilled on its own: its state must see no padding
        ready = matches[0].cached_tokens if batch == 1 and hy is None and media is None else width - 1
        bufs = pool.buffers(batch * copies, width + _new_tokens_bound(rt, gc, kwargs, width))
        row_caches = []
        for r, m in enumerate(matches):
            row_caches.append(_prepare_row(rt, bufs, r * copies, pads[r], rows[r], m, ready, plans[r], media, r))
            for kv in bufs if copies > 1 else ():
                if kv is not None:
                    for side in kv:
                        side[r * copies + 1 : (r + 1) * copies, :, :ready] = side[r * copies, :, :ready]
        cache = hf_cache.buffer_cache(rt.model, bufs, ready)
        capture = None
        if hy is not None:
            stack_states(hy, cache, row_caches, copies, ready)
            capture = BoundaryCapture(hy, cache, [pads[i // copies] for i in range(batch * copies)], eos_ids(gc))
            kwargs = {
                **kwargs,
                "stopping_criteria": StoppingCriteriaList([*(kwargs.get("stopping_criteria") or []), capture]),
            }
        mask = _mask(input_ids, attention_mask)
        if media is not None and media.deltas is not None:  # the decode steps' M-RoPE offset: this batch's
            inner(rt.model).rope_deltas = media.deltas.repeat_interleave(copies, dim=0).to(input_ids.device)
        generate_fn = cast("Callable[..., Any]", rt.model.generate)  # (mypy sees nn.Module.__getattr__)
        with recurrent.stepwise() if hy is not None and hy.tokenwise else contextlib.nullcontext():
            out = generate_fn(
                input_ids=input_ids, attention_mask=mask, **{hf_cache.cache_kwarg(rt.model): cache}, **kwargs
            )
        if not isinstance(out, torch.Tensor) and any(v is cache for v in out.values()):
            pool.surrender_buffers()  # the caller now holds the cache, which lives in them
        inserted = [0] * batch
        if rt.epoch == epoch:  # else a callback reset the cache: these handles and blocks are gone
            material = [{}] * batch if media is None else media.material
            inserted = _commit_or_drop(
                rt,
                out,
                cache,
                _Rows(matches, pads, width, gc, live, plans, capture, material, [len(x) for x in rows], hints),
            )
        stats = tuple(
            RowStats(
                len(row),
                m.cached_tokens,
                n + t,
                *lr.causes[:6],
                *lr.causes[8:],
                lr.fork,
                t * rt.block_size,
                lr.causes.no_state,
            )
            for row, m, n, lr, t in zip(rows, matches, inserted, live, tiered)
        )
        return out, stats
    finally:
        if rt.epoch == epoch:
            _release_all(rt, handles)


@dataclass
class _Rows:
    """What one call knows of its input rows when it commits: their matches, left padding, padded width, the
    generation config, miss-cause records, hybrid plans, and the decode-time state capture (hybrid models)."""

    matches: list[MatchResult]
    pads: list[int]
    width: int
    gc: Any
    live: list[LiveRequest]
    plans: list[HybridRow | None]
    capture: BoundaryCapture | None
    material: list[dict[int, bytes]]  # each row's key material (images), folded into what it commits
    prompt_lens: list[int] = field(default_factory=list)  # each input row's prompt tokens (its padding not counted)
    hints: Sequence[Sequence[int]] | None = None  # each input row's divergence hints (token positions)


def _commit_or_drop(rt: ModelRuntime, out: Any, cache: Any, rows: _Rows) -> list[int]:
    """``_commit_outputs`` under ``_dropped_on_failure``."""
    with _dropped_on_failure(rt):
        return _commit_outputs(rt, out, cache, rows)


@contextlib.contextmanager
def _dropped_on_failure(rt: ModelRuntime) -> Iterator[None]:
    """Commits inside; if they fail, drop the cache (blocks may be in the tree without their KV: never serve them)
    and take their blocks out of the counters again, then re-raise."""
    stats = rt.cache.stats
    counted = stats.blocks_inserted, stats.blocks_not_cached
    try:
        yield
    except BaseException:
        rt.drop()
        stats.blocks_inserted, stats.blocks_not_cached = counted
        raise


def _release_all(rt: ModelRuntime, handles: list[RequestHandle]) -> None:
    """Release every handle. An exception (a Ctrl-C) inside one release does not stop the others: that handle is
    retried once, the rest are released, then the first exception is raised."""
    error: BaseException | None = None
    for h in handles:
        for _attempt in range(2):
            try:
                if not h.released:
                    rt.cache.release(h)
                break
            except BaseException as exc:
                error = error or exc
    if error is not None:
        raise error


def _prepare_row(
    rt: ModelRuntime,
    bufs: list[LayerKV | None],
    r: int,
    pad: int,
    tokens: torch.Tensor,
    m: MatchResult,
    ready: int,
    plan: HybridRow | None,
    media: MediaCall | None = None,
    row: int = 0,
) -> DynamicCache | None:
    """Fill row ``r`` of the batch buffers up to padded position ``ready``: zeros over the padding, the cached
    prefix gathered from the pool, then (batches, hybrid models, images) the uncached suffix computed by the model;
    a hybrid row starts from its snapshot's state and keeps snapshots on the way; input row ``row`` of ``media``
    gives the suffix its placeholders' encoder outputs and (M-RoPE) positions. Returns the row's cache (None when
    ``generate`` computes the suffix itself)."""
    cached = m.cached_tokens
    for kv in bufs:
        if kv is not None:
            kv[0][r, :, :pad].zero_()  # masked out, but must be finite
            kv[1][r, :, :pad].zero_()
    if cached:
        rt.kv_pool.gather_into(
            m.block_ids,
            [None if kv is None else (kv[0][r, :, pad : pad + cached], kv[1][r, :, pad : pad + cached]) for kv in bufs],
        )
    todo = ready - pad - cached
    if todo <= 0 and plan is None:
        return None
    row_bufs: list[LayerKV | None] = [
        None if kv is None else (kv[0][r : r + 1, :, pad:], kv[1][r : r + 1, :, pad:]) for kv in bufs
    ]
    row_cache = hf_cache.buffer_cache(rt.model, row_bufs, cached)
    if plan is not None:
        hy = rt.hybrid
        assert hy is not None
        if plan.slot is not None:
            hy.pool.restore_cache(row_cache, plan.slot, cached)
        if todo > 0:
            kwarg, logits = hf_cache.cache_kwarg(rt.model), hf_cache.last_logits_only(rt.model)
            keyed, more = None, None
            if media is not None:
                keyed = keyed_tokens(
                    as_token_array(tokens.cpu()), media.material[row], rt.block_size, rt.cache.config.hash_seed
                )
                more = partial(_media_inputs, rt, media, row, pad)
            prefill(rt.model, hy, row_cache, tokens, cached, cached + todo, plan, kwarg, logits, keyed, more)
            hf_cache.settle(row_cache, row_bufs, cached + todo)
        return row_cache
    ids = tokens[cached : cached + todo].unsqueeze(0)
    extra = {} if media is None else _media_inputs(rt, media, row, pad, cached, cached + todo)
    with torch.no_grad():
        rt.model(
            input_ids=ids,
            attention_mask=torch.ones((1, cached + todo), dtype=torch.long, device=ids.device),
            use_cache=True,
            **{hf_cache.cache_kwarg(rt.model): row_cache},
            **hf_cache.last_logits_only(rt.model),
            **extra,
        )
    hf_cache.settle(row_cache, row_bufs, cached + todo)
    return row_cache


def _media_inputs(rt: ModelRuntime, media: MediaCall, row: int, pad: int, start: int, stop: int) -> dict[str, Any]:
    """The model inputs besides the ids of positions ``[start, stop)`` of input row ``row`` (after its ``pad``):
    its placeholders' encoder outputs, M-RoPE positions, a bidirectional family's image marks."""
    enc = media.encoder_outputs(rt.model, rt.encoder_cache, row, start, stop)
    pos = media.position_ids(row, pad + start, pad + stop)
    extra = {k: v for k, v in (("mm_encoder_outputs", enc), ("position_ids", pos)) if v is not None}
    extra.update(media.type_ids(row, pad + stop))
    return extra


def _commit_outputs(rt: ModelRuntime, out: Any, cache: Any, rows: _Rows) -> list[int]:
    """Commit every output row's full blocks (prompt + generated up to its first EOS) and scatter their K/V (and
    write them through to the tier; for a hybrid model, keep its request-end state snapshot); returns the blocks
    inserted per input row. Each input row's miss-cause record is told what was committed."""
    matches, pads, width, gc, live = rows.matches, rows.pads, rows.width, rows.gc, rows.live
    seqs = out if isinstance(out, torch.Tensor) else out.sequences
    kv_len = hf_cache.seq_length(cache)  # the last generated token has no KV yet
    per_input = seqs.shape[0] // len(matches)  # num_return_sequences rows follow their input row
    eos = torch.tensor(eos_ids(gc), dtype=seqs.dtype, device=seqs.device)
    inserted = [0] * len(matches)
    for i in range(seqs.shape[0]):
        r = i // per_input
        stop = kv_len
        if len(eos) and kv_len > width:
            hit = torch.isin(seqs[i, width:kv_len], eos).nonzero()
            if len(hit):
                stop = width + int(hit[0]) + 1
        committed = as_token_array(seqs[i, pads[r] : stop].detach().cpu())
        if rows.material[r]:
            committed = keyed_tokens(committed, rows.material[r], rt.block_size, rt.cache.config.hash_seed)
        handle = matches[r].handle
        res = rt.cache.commit(handle, committed)
        rt.causes.committed(live[r], committed, res)
        if res.block_ids:
            start = pads[r] + res.first_block * rt.block_size
            end = start + len(res.block_ids) * rt.block_size
            rt.kv_pool.scatter(res.block_ids, hf_cache.read_kv(cache, start, end, row=i))
            inserted[r] += len(res.block_ids)
        if rt.tier is not None:  # also when nothing is new: the path's recency moves
            rt.tier.save_path(rt.kv_pool, committed, handle.namespace, [], res.first_block, res.block_ids)
        if rt.cache.windows is not None and res.cached_blocks:
            hints = () if rows.hints is None else rows.hints[r]
            _keep_windows(rt, matches[r], res.cached_blocks, rows.prompt_lens[r], hints, cache, i, pads[r])
        plan = rows.plans[r]
        if rows.capture is not None and plan is not None:
            rows.capture.publish(i, res.cached_blocks * rt.block_size, list(plan.keys), committed, plan.namespace)
    return inserted


def _cut(rt: ModelRuntime, m: MatchResult, blocks: int) -> MatchResult:
    """``m`` served only its first ``blocks`` blocks, or fewer: as deep as the window group (if any) holds the window
    of its end. Changes nothing (the request keeps its pins)."""
    ids = m.block_ids[:blocks]
    if rt.cache.windows is not None:
        blocks = rt.cache.windows.served(ids, blocks)
        ids = ids[:blocks]
    return MatchResult(m.handle, blocks * rt.block_size, blocks, (np.asarray(ids, np.int64),))


def _keep_windows(
    rt: ModelRuntime,
    m: MatchResult,
    cached_blocks: int,
    prompt_tokens: int,
    hints: Sequence[int],
    cache: Any,
    row: int,
    pad: int,
) -> None:
    """After a row committed ``cached_blocks`` blocks of its path: keep the window group's points where later matches
    may end (``snapshot_points``: divergence, re-send, hints, and the request end) and write the window K/V of the
    blocks that got a slot from ``cache`` (batch row ``row``, after ``pad``). Changes the window slots and pool."""
    ws, bs = rt.cache.windows, rt.block_size
    assert ws is not None
    served = m.cached_blocks
    path = rt.cache.path_blocks(m.handle)[:cached_blocks]
    points = snapshot_points(
        block_size=bs,
        restored=served,
        matched=m.handle.kv_blocks,
        limit=prompt_tokens,
        prompt_blocks=min(prompt_tokens // bs, cached_blocks),
        hints=hints,
    )
    new: list[int] = []
    for p in [*points, cached_blocks]:
        new.extend(ws.keep_point(path, p, known_from=served) or ())
    new.extend(ws.offer(path[served:cached_blocks]))  # the rest it computed, while free or idle slots last
    if not new:
        return
    where = {b: i for i, b in enumerate(path)}
    for first, _at, count in runs(sorted(where[b] for b in new)):
        kv = hf_cache.read_kv(cache, pad + first * bs, pad + (first + count) * bs, row=row)
        rt.kv_pool.scatter_window(path[first : first + count], kv)


def _mask(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    return attention_mask if attention_mask is not None else torch.ones_like(input_ids)


def _new_tokens_bound(rt: ModelRuntime, gc: Any, kwargs: dict[str, Any], prompt_len: int) -> int:
    """Tokens generate may append after the prompt, as far as worth reserving room for."""
    if gc.max_new_tokens is not None:
        new = gc.max_new_tokens
    else:
        new = (kwargs.get("max_length") or gc.max_length or 0) - prompt_len
    limit = getattr(rt.model.config, "max_position_embeddings", None) or 8192
    return max(0, min(int(new), int(limit)))


def score(
    rt: ModelRuntime, tokens: torch.Tensor, name: str, media: MediaCall, score_from: int, commit: int
) -> tuple[torch.Tensor, int]:
    """Log-probabilities of ``tokens[score_from:]`` (one unpadded row whose images ``media`` describes) given the
    tokens before them, its longest cached prefix in namespace ``name`` served from the pool (at most
    ``score_from - 1`` tokens: the first scored token needs the logits before it); returns them (one per scored
    token) and the tokens served from cache. The caller holds ``rt.lock`` and has called ``rt.follow()``. Changes
    the cache: the matched blocks are refreshed and the first ``commit`` tokens' full blocks inserted."""
    ns, bs = rt.namespace(name), rt.block_size
    keyed = keyed_tokens(as_token_array(tokens.detach().cpu()), media.material[0], bs, rt.cache.config.hash_seed)
    epoch = rt.epoch
    m = rt.cache.match(keyed, ns, max_blocks=(score_from - 1) // bs)
    try:
        safe = media.safe_blocks(0, m.cached_blocks, bs)
        if safe < m.cached_blocks:
            m = _cut(rt, m, safe)
        cached, width = m.cached_tokens, len(tokens)
        bufs = rt.kv_pool.buffers(1, width)
        _prepare_row(rt, bufs, 0, 0, tokens, m, cached, None)
        row_cache = hf_cache.buffer_cache(rt.model, bufs, cached)
        ids = tokens[cached:].unsqueeze(0)
        with torch.no_grad():
            logits = rt.model(
                input_ids=ids,
                attention_mask=torch.ones((1, width), dtype=torch.long, device=ids.device),
                use_cache=True,
                **{hf_cache.cache_kwarg(rt.model): row_cache},
                **_media_inputs(rt, media, 0, 0, cached, width),
            ).logits[0, score_from - 1 - cached : width - 1 - cached]
        hf_cache.settle(row_cache, bufs, width)
        logp = torch.log_softmax(logits.float(), dim=-1)
        if rt.epoch == epoch:
            with _dropped_on_failure(rt):
                res = rt.cache.commit(m.handle, keyed[:commit])
                if res.block_ids:
                    start, stop = res.first_block * bs, (res.first_block + len(res.block_ids)) * bs
                    rt.kv_pool.scatter(res.block_ids, hf_cache.read_kv(row_cache, start, stop))
                if rt.cache.windows is not None and res.cached_blocks:
                    _keep_windows(rt, m, res.cached_blocks, score_from, (), row_cache, 0, 0)
                if rt.tier is not None:
                    rt.tier.save_path(
                        rt.kv_pool, keyed[:commit], m.handle.namespace, [], res.first_block, res.block_ids
                    )
        return logp, cached
    finally:
        if rt.epoch == epoch:
            _release_all(rt, [m.handle])
