"""The run-level answer to "why was prefill not saved?": the divergence points ranked by the prefill they cost,
and the fix each miss cause suggests, from a replay's rows (``prefixcache.sim.causes`` says what each cause
means). Model-free; changes nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from prefixcache.sim.causes import CAUSES, CONTEXT, Fork, servable, workload_causes
from prefixcache.sim.requests import CacheRequests
from prefixcache.sim.results import CAUSE_FIELDS, Row, RunResult
from prefixcache.workload.render import ByteRenderer

Decoder = Callable[[Sequence[int]], str]
REUSE_SHARE = 0.9  # the capacity advice keeps at least this share of the evicted tokens


@dataclass(frozen=True)
class DivergenceSite:
    """Where prompts depart from an earlier request although what follows was seen before.

    Requests are grouped by place (the block their first difference falls in, and the shared tokens before
    that block: every difference there costs the same blocks); ``tokens`` is their diverged tokens (the
    prefill this point costs). ``position`` is the group's first difference, and ``example`` a request that
    differs there from ``partner``, the earlier request; ``before`` is the shared text before the position,
    ``this`` / ``other`` each one's text from it."""

    position: int
    requests: int
    tokens: int
    example: int
    partner: int
    before: str
    this: str
    other: str


@dataclass(frozen=True)
class ImageSwap:
    """A request whose image sits where an earlier request, with the same tokens before it, had another image
    behind the same placeholder ids: the cache keys blocks by the image's content, so none of it was served (an
    id-keyed cache would have served the other picture's KV). ``image``/``partner_image``: their scenario ids."""

    request: int
    position: int
    image: str
    partner: int
    partner_image: str


@dataclass(frozen=True)
class Fix:
    """What to do about ``tokens`` uncached tokens of one cause."""

    cause: str
    tokens: int
    advice: str


def show_ids(ids: Sequence[int]) -> str:
    """Token ids as text, for prompts that have no text: "[10 20 30]"."""
    return "[" + " ".join(map(str, ids)) + "]"


def decoder_for(reqs: CacheRequests) -> Decoder:
    """How to show a workload's tokens: text (special tokens by name) for text and chat scenarios, else ids."""
    if reqs.text:
        renderer = ByteRenderer()
        return lambda ids: renderer.decode(ids, specials=True)
    return show_ids


def measured(rows: Iterable[Row]) -> list[Row]:
    return [r for r in rows if not r.warmup]


def divergence_sites(
    rows: Iterable[Row], forks: Mapping[int, Fork], decode: Decoder = show_ids, top: int | None = None
) -> list[DivergenceSite]:
    """The divergence points of the measured ``rows`` (see DivergenceSite), most costly first; ``forks``: the
    workload's (``WorkloadCauses.forks``)."""
    groups: dict[tuple[int, ...], list[tuple[Row, Fork]]] = {}
    for r in measured(rows):
        fork = forks.get(r.index)
        if fork is not None and r.diverged_tokens:
            groups.setdefault(fork.place, []).append((r, fork))
    sites = []
    for members in groups.values():
        row, fork = min(members, key=lambda m: m[1].position)  # the first such request at the first position
        sites.append(
            DivergenceSite(
                fork.position,
                len(members),
                sum(r.diverged_tokens or 0 for r, _ in members),
                row.index,
                fork.partner,
                decode(fork.before),
                decode(fork.this),
                decode(fork.other),
            )
        )
    sites.sort(key=lambda s: (-s.tokens, s.position))
    return sites[:top] if top is not None else sites


def workload_sites(reqs: CacheRequests, rows: Iterable[Row], top: int | None = None) -> list[DivergenceSite]:
    """``divergence_sites`` of a simulated workload, shown as text when it has text; a side that starts in an
    image's blocks is shown as the image (its ids are its key stream, not text)."""
    sites = divergence_sites(rows, workload_causes(reqs).forks, decoder_for(reqs), top)
    if reqs.media is None:
        return sites
    out = []
    for site in sites:
        this, other = _image_at(reqs, site.example, site.position), _image_at(reqs, site.partner, site.position)
        if this is not None or other is not None:
            site = replace(site, this=this or site.this, other=other or site.other)
        out.append(site)
    return out


def _image_at(reqs: CacheRequests, i: int, position: int) -> str | None:
    """ "[image NAME]" when ``position`` of request ``i`` falls in the blocks of one of its images, else None."""
    bs = reqs.block_size
    for a, b, name in (reqs.media or [])[i] if reqs.media and i < len(reqs.media) else ():
        if a // bs * bs <= position < b:
            return f"[image {name}]"
    return None


def image_swaps(reqs: CacheRequests) -> list[ImageSwap]:
    """The requests of a workload whose image another image displaced (``ImageSwap``), in order. Changes
    nothing."""
    if reqs.media is None or reqs.prompts is None:
        return []
    bs = reqs.block_size
    seen: dict[tuple[int, int], list[tuple[int, str]]] = {}
    out = []
    for i, spans in enumerate(reqs.media):
        prompt = reqs.prompts[i]
        found = False
        for a, b, name in spans:
            start = a // bs * bs
            same_prefix = [
                (j, other)
                for j, other in seen.get((a, b), [])
                if reqs.namespace[j] == reqs.namespace[i] and bytes(reqs.prompts[j][:start]) == bytes(prompt[:start])
            ]
            if not found and same_prefix and all(other != name for _, other in same_prefix):
                j, other = same_prefix[0]
                out.append(ImageSwap(i, a, name, j, other))
                found = True
        for a, b, name in spans:
            seen.setdefault((a, b), []).append((i, name))
    return out


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def sides(site: DivergenceSite, before: int = 20, after: int = 12) -> tuple[str, str]:
    """The two sides of a divergence point, quoted: up to ``before`` characters of the shared text before it, then
    up to ``after`` of each request's own text."""
    head = site.before
    if len(head) > before or site.position > CONTEXT:  # "…": the prompt goes on before what is shown
        head = "…" + head[-(before - 1) :]
    return repr(head + _clip(site.this, after)), repr(head + _clip(site.other, after))


# ---- fixes ---------------------------------------------------------------------------------------------------------
def cause_totals(rows: Iterable[Row]) -> dict[str, int] | None:
    """Uncached tokens by cause over the measured rows; None when a row was not analysed."""
    rows = measured(rows)
    if any(r.cold_tokens is None for r in rows):
        return None
    return {c: sum(getattr(r, f) for r in rows) for c, f in CAUSE_FIELDS.items()}


def reuse_capacity(rows: Iterable[Row], share: float = REUSE_SHARE) -> int | None:
    """The smallest capacity (blocks) at which an LRU cache serves every evicted token of requests holding at
    least ``share`` of the evicted tokens: a lower bound on what that capacity saves. None: nothing evicted."""
    pairs = sorted((r.reuse_blocks, r.evicted_tokens) for r in measured(rows) if r.evicted_tokens and r.reuse_blocks)
    total = sum(t for _, t in pairs)
    acc = 0
    for blocks, tokens in pairs:
        acc += tokens
        if acc >= share * total:
            return blocks
    return None


def partial_at(rows: Iterable[Row], block_size: int) -> int:
    """partial_block tokens the measured ``rows`` (token prompts) would have at ``block_size``: the block holding
    each prompt's last token, plus shared prefixes ending inside a block where nothing diverged after them."""
    out = 0
    for r in measured(rows):
        n = r.prompt_tokens
        s = servable(n, block_size)
        out += n - s
        t = r.shared_tokens
        if t is not None and not r.diverged_tokens:
            out += max(0, min(t, s) - min(t // block_size * block_size, s))
    return out


@dataclass(frozen=True)
class _Context:
    run: RunResult
    rows: list[Row]
    tokens: int
    prompt: int
    sites: Sequence[DivergenceSite]
    keys: bool  # a hash-id trace


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "0%"


def _cold(c: _Context) -> str:
    return "new content: no earlier request sent these tokens, so there was nothing to reuse"


def _diverged(c: _Context) -> str:
    if not c.sites:
        return (
            "content seen before, after a point where the prompt differs from an earlier one: move what varies "
            "(dates, ids, per-user text) after the shared part"
        )
    s = c.sites[0]
    this, other = sides(s)
    n = sum(site.requests for site in c.sites)
    where = f"at {len(c.sites):,} places, the costliest" if len(c.sites) > 1 else "at"
    return (
        f"move what varies after the shared part (or keep earlier turns byte-identical): {n:,} request(s) differ "
        f"from an earlier one before content it sent, {where} token {s.position:,} ({this} vs {other}: "
        f"{s.requests:,} request(s), {s.tokens:,} tokens)"
    )


def _evicted(c: _Context) -> str:
    bs = c.run.block_size
    x = reuse_capacity(c.rows)
    now = c.run.capacity.label(bs)
    if x is None:
        return f"cached earlier, evicted before reuse at {now}: raise the capacity"
    return (
        f"cached earlier, evicted before reuse at {now}: raise the capacity to {x * bs:,} tokens ({x:,} blocks); "
        f"with LRU that serves every evicted token of the requests holding {REUSE_SHARE:.0%} of them"
    )


def _partial_block(c: _Context) -> str:
    if c.keys:
        return "the trace lists full blocks only: the tail of each prompt after its last full block is never cached"
    bs = c.run.block_size
    tail = sum((r.prompt_tokens - 1) % bs + 1 for r in c.rows)
    text = (
        f"the block holding each prompt's last token is never served ({tail:,} tokens, {_pct(tail, c.prompt)} of "
        f"all prompt tokens at block size {bs})"
    )
    inside = Counter(
        r.shared_tokens
        for r in c.rows
        if not r.diverged_tokens
        and r.shared_tokens
        and r.shared_tokens % bs
        and r.shared_tokens < servable(r.prompt_tokens, bs)
    )
    if inside:
        t = inside.most_common(1)[0][0]
        text += f"; {sum(inside.values()):,} request(s) share a prefix ending inside a block (most often {t:,} tokens"
        b = 1 << (t.bit_length() - 1)  # the largest power of two <= t
        text += f": blocks of {b} would cache {t // b * b:,} of them)" if b < bs else ")"
    if bs > 1:
        smaller = max(1, bs // 2)
        text += f"; at block size {smaller} it would be {partial_at(c.rows, smaller):,} tokens: lower the block size"
    return text


def _namespace(c: _Context) -> str:
    return (
        "the same tokens were cached under another namespace (tenant, cache salt, adapter): let requests that share "
        "a prefix, e.g. a common system prompt, share its namespace where isolation allows"
    )


def _not_cached(c: _Context) -> str:
    largest = max((r.blocks for r in c.rows), default=0)
    return (
        f"not cached when committed: the pool ({c.run.pool_blocks:,} blocks) was full of blocks pinned by running "
        f"requests (the largest request looks up {largest:,} blocks): raise the capacity well above the largest request"
    )


def _no_state(c: _Context) -> str:
    return (
        "the KV of these tokens was cached, but no recurrent-state snapshot of the hybrid model (or no kept window "
        "of its sliding-window layers) reached them, so they were recomputed: keep more snapshots "
        "(PrefixCachedModel(max_cached_states=...)) or windows (window_share=...), mark where prompts part "
        "(snapshot hints: chat messages' ends) or snapshot every few blocks (snapshot_interval)"
    )


ADVICE: dict[str, Callable[[_Context], str]] = {
    "cold": _cold,
    "evicted": _evicted,
    "diverged": _diverged,
    "partial_block": _partial_block,
    "namespace": _namespace,
    "not_cached": _not_cached,
    "no_state": _no_state,
}
assert set(ADVICE) == set(CAUSES)


def fixes(run: RunResult, sites: Sequence[DivergenceSite] = (), *, keys: bool = False) -> list[Fix]:
    """One Fix per cause with uncached tokens in ``run`` (measured rows), most tokens first, cold (nothing to fix)
    last; ``keys``: a hash-id trace. Empty when the rows were not analysed."""
    totals = cause_totals(run.rows)
    if totals is None:
        return []
    rows = measured(run.rows)
    ctx = _Context(run, rows, sum(totals.values()), sum(r.prompt_tokens for r in rows), sites, keys)
    out = [Fix(cause, n, ADVICE[cause](ctx)) for cause, n in totals.items() if n]
    out.sort(key=lambda f: (f.cause == "cold", -f.tokens))
    return out


def main_fix(found: Sequence[Fix]) -> Fix | None:
    """The fix with the most tokens at stake among the avoidable causes (all but cold), or None."""
    return next((f for f in found if f.cause != "cold"), None)
