"""Looking into a runtime's cache without changing it: how much of a prompt would be served now, and why the rest
would miss."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.runtime import ModelRuntime
from prefixcache.core.hashing import as_token_array
from prefixcache.sim.results import CAUSE_FIELDS


@dataclass(frozen=True)
class Explanation:
    """What ``explain`` found for one prompt (nothing changed): ``cached_tokens`` a ``generate`` would serve now;
    ``common_tokens`` the longest common prefix with anything cached (may end inside a block); the prompt's
    next tokens there and the nearest cached path's (``prompt_next`` / ``cached_next``, as ``*_text`` when the
    runtime has a tokenizer); ``causes``: why its other tokens would miss now (cause -> tokens)."""

    prompt_tokens: int
    cached_tokens: int
    common_tokens: int
    prompt_next: tuple[int, ...]
    cached_next: tuple[int, ...]
    prompt_text: str | None
    cached_text: str | None
    causes: dict[str, int]


def probe(rt: ModelRuntime, tokens: Any, name: str = "default") -> int:
    """Leading tokens of ``tokens`` (1-D ids) a ``generate`` in namespace ``name`` would serve from the pool now (0
    when the model's weights, dtype or device changed since: that call would drop the cache first)."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu()
    with rt.lock:
        if not rt.is_current():
            return 0
        return served(rt, tokens, rt.namespace(name), rt.cache.probe(tokens, rt.namespace(name)))


def served(rt: ModelRuntime, tokens: Any, namespace: str, kv_tokens: int) -> int:
    """Of ``kv_tokens`` leading tokens whose KV the pool holds, those a call would be served: a hybrid model's up to
    its deepest snapshot there. Changes nothing."""
    hy = rt.hybrid
    if hy is None or kv_tokens == 0:
        return kv_tokens
    keys = hy.keys([], tokens, namespace, kv_tokens // rt.block_size)
    return hy.index.deepest(keys, kv_tokens // rt.block_size, touch=False)[0] * rt.block_size


def explain(rt: ModelRuntime, input_ids: Any, name: str = "default", *, context: int = 16) -> Explanation:
    """Why ``input_ids`` (one prompt: 1-D ids, or a batch of one) would miss in namespace ``name`` now: the longest
    cached prefix, where it departs from the nearest cached path and what differs there (up to ``context`` tokens
    each side), and its uncached tokens by cause."""
    if isinstance(input_ids, torch.Tensor):
        input_ids = input_ids.detach().cpu()
        if input_ids.ndim == 2 and input_ids.shape[0] == 1:
            input_ids = input_ids[0]
    ids = as_token_array(input_ids, "input_ids")
    if len(ids) == 0:
        raise ValueError("input_ids is empty: explain needs a prompt of at least one token")
    ns = rt.namespace(name)
    with rt.lock:
        d = rt.cache.divergence(ids, ns, context=context)
        cached = served(rt, ids, ns, d.cached_tokens)
        why = rt.causes.request(ids, ns, cached, count=False, kv_cached=d.cached_tokens).causes
    prompt_next = tuple(ids[d.common_tokens : d.common_tokens + context].tolist())
    decode = getattr(rt.tokenizer, "decode", None)
    return Explanation(
        len(ids),
        cached,
        d.common_tokens,
        prompt_next,
        d.cached_next,
        None if decode is None else decode(list(prompt_next)),
        None if decode is None else decode(list(d.cached_next)),
        {c: getattr(why, c) for c in CAUSE_FIELDS},
    )
