"""Offline batches on the engine: ``PrefixCachedModel.generate_batch`` and ``PrefixCachedModel.score``.

Both take a list of requests, order them by token sequence (so requests that share a prefix run back to back,
while it is cached), feed them to the engine a window at a time (the waiting queue stays short and the order
holds), and return the results in the caller's order.

Scoring: for (context, continuation) token lists, the log-probability of the continuation given the context,
summed, and whether every continuation token is the greedy one (the evaluation-harness primitive), optionally
per token. At most ``len(context) - 1`` tokens come from cache (the last context position must run to score the
first continuation token). Contexts are cached for the next request; continuations are not unless
``commit_continuations`` (see docs/scoring.md for what each costs). A sequence longer than ``max_length + 1``
tokens is cut from the left, as lm-evaluation-harness does (``(context + continuation)[-(max_length + 1):]``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from engine.batching.engine import Engine
from engine.batching.request import Request, RequestResult
from engine.batching.sampling import SamplingParams

# generation settings the engine does not implement: generate_batch refuses them rather than ignore them
_UNSUPPORTED = (
    ("num_beams", 1),
    ("num_beam_groups", 1),
    ("penalty_alpha", None),
    ("repetition_penalty", 1.0),
    ("encoder_repetition_penalty", 1.0),
    ("no_repeat_ngram_size", 0),
    ("bad_words_ids", None),
    ("force_words_ids", None),
    ("min_length", 0),
    ("min_new_tokens", None),
    ("typical_p", 1.0),
    ("epsilon_cutoff", 0.0),
    ("eta_cutoff", 0.0),
    ("min_p", None),
    ("suppress_tokens", None),
    ("begin_suppress_tokens", None),
    ("sequence_bias", None),
    ("guidance_scale", None),
    ("stop_strings", None),
    ("exponential_decay_length_penalty", None),
)


@dataclass(frozen=True)
class BatchOutput:
    """One request of ``generate_batch``: its prompt, the tokens generated (a stop token included), why it
    stopped (``stop``, ``length``, ``error``), prompt tokens served from cache, and the error if it failed."""

    request_id: str
    prompt_ids: list[int]
    generated_tokens: list[int]
    finish_reason: str
    cached_tokens: int
    error: str | None = None


@dataclass(frozen=True)
class ScoreResult:
    """One (context, continuation) pair: ``logprob`` = log P(continuation | context); ``is_greedy``: every
    continuation token is the argmax; ``token_logprobs`` (when asked) per continuation token; ``cached_tokens``:
    context tokens served from cache; ``truncated``: tokens cut from the left to fit ``max_length``."""

    logprob: float
    is_greedy: bool
    token_logprobs: tuple[float, ...] | None
    cached_tokens: int
    truncated: int = 0


class _Collect:
    """A sink that keeps the request's result."""

    result: RequestResult | None = None

    def tokens(self, ids: list[int]) -> None:
        pass

    def finished(self, result: RequestResult) -> None:
        self.result = result


def token_list(x: Any, what: str) -> list[int]:
    """``x`` (a sequence of ints or a 1-D tensor) as a list of ints; ValueError naming ``what`` otherwise."""
    if isinstance(x, torch.Tensor):
        if x.ndim != 1 or x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise ValueError(f"{what} must be a 1-D integer tensor, got shape {tuple(x.shape)} {x.dtype}")
        return [int(t) for t in x.tolist()]
    if isinstance(x, (str, bytes)) or not isinstance(x, Sequence):
        raise ValueError(f"{what} must be a list of token ids, got {type(x).__name__}")
    out = []
    for i, t in enumerate(x):
        if isinstance(t, bool) or not hasattr(type(t), "__index__"):
            raise ValueError(f"{what}[{i}] is {t!r}, not an integer token id")
        out.append(int(t))
    return out


def sampling_params(generation_config: Any, kwargs: dict[str, Any], prompt_len: int) -> SamplingParams:
    """The engine's settings for a ``GenerationConfig`` updated by ``kwargs``; ValueError for what it lacks."""
    import copy

    gc = copy.deepcopy(generation_config)
    unknown = gc.update(**kwargs)
    if unknown:
        raise ValueError(f"generate_batch: unknown generation settings {sorted(unknown)}")
    for name, default in _UNSUPPORTED:
        value = getattr(gc, name, default)
        if value is not None and value != default:
            raise ValueError(
                f"generate_batch runs greedy search and sampling (temperature, top_k, top_p) only; got {name}={value!r}"
            )
    if gc.max_new_tokens is not None:
        max_tokens = int(gc.max_new_tokens)
    else:
        max_tokens = int(gc.max_length or 20) - prompt_len
    if max_tokens < 1:
        raise ValueError(f"generate_batch: nothing to generate (max_new_tokens={max_tokens}); raise max_new_tokens")
    if not gc.do_sample:
        return SamplingParams(max_tokens=max_tokens)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=float(gc.temperature if gc.temperature is not None else 1.0),
        top_p=float(gc.top_p if gc.top_p is not None else 1.0),
        top_k=int(gc.top_k or 0),
    )


def lexicographic(seqs: Sequence[list[int]]) -> list[int]:
    """Indices of ``seqs`` in token-sequence order (shared prefixes adjacent; ties keep the caller's order)."""
    return sorted(range(len(seqs)), key=lambda i: seqs[i])


def generate_batch(
    engine: Engine,
    prompts: list[list[int]],
    params: list[SamplingParams],
    namespace: str,
    copies: int,
    *,
    seed: int | None = None,
    progress_bar: bool = False,
) -> dict[str, BatchOutput]:
    """Run ``copies`` requests per prompt (``params[i]`` for prompt i; ``seed``: request k's sampler seeded with
    ``seed + k``) on ``engine`` in token-sequence order; their outputs by request id (``req_i`` / ``req_i_j``), in
    input order. The caller holds the runtime's lock. Changes the cache."""
    reqs = generate_requests(prompts, params, namespace, copies)
    if seed is not None:
        for k, (_, r) in enumerate(reqs):
            assert r.params is not None
            r.params = dataclasses.replace(r.params, seed=seed + k)
    order = lexicographic([r.tokens for _, r in reqs])
    with progress_bar_of(len(reqs), "generate_batch", progress_bar) as progress:
        run(engine, [reqs[i][1] for i in order], window=window(engine), progress=progress)
    return collect_outputs(reqs)


def score(
    engine: Engine,
    reqs: list[Request],
    cut: list[int],
    per_token: bool,
    *,
    reorder: bool = True,
    progress_bar: bool = False,
) -> list[ScoreResult]:
    """Run the scoring requests ``reqs`` (``score_requests``) on ``engine``, in token-sequence order when
    ``reorder``; their results in the caller's order. The caller holds the runtime's lock. Changes the cache."""
    order = lexicographic([r.tokens for r in reqs]) if reorder else list(range(len(reqs)))
    with progress_bar_of(len(reqs), "score", progress_bar) as progress:
        run(engine, [reqs[i] for i in order], window=window(engine), progress=progress)
    return score_results(reqs, cut, per_token)


def window(engine: Engine) -> int:
    """Requests kept waiting in the engine by a batch call: enough to fill every step."""
    return max(2 * engine.config.max_running, 8)


def run(engine: Engine, requests: list[Request], *, window: int, progress: Callable[[int], None] | None) -> None:
    """Submit ``requests`` in order, at most ``window`` waiting at a time, and step until all finished."""
    todo = iter(requests)
    more = True
    while more or engine.has_work():
        while more and engine.num_waiting < window:
            req = next(todo, None)
            if req is None:
                more = False
                break
            engine.submit(req)
        engine.step()
        if progress is not None:
            progress(sum(r.status.value == "finished" for r in requests))


@contextmanager
def progress_bar_of(total: int, what: str, enabled: bool) -> Iterator[Callable[[int], None] | None]:
    """A rich progress bar over ``total`` requests (None when not ``enabled``)."""
    if not enabled:
        yield None
        return
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task(what, total=total)
        yield lambda done: bar.update(task, completed=done)


def request_ids(n: int, copies: int) -> list[str]:
    """The ids of ``n`` prompts' requests, ``copies`` each, in order (``req_i`` or ``req_i_j``)."""
    return [f"req_{i}" if copies == 1 else f"req_{i}_{j}" for i in range(n) for j in range(copies)]


def renumbered(out: dict[str, BatchOutput], positions: Sequence[int], copies: int) -> dict[str, BatchOutput]:
    """``out`` (the results of a batch of some prompts) with prompt k's requests renamed as prompt
    ``positions[k]``'s."""
    old = request_ids(len(positions), copies)
    new = [rid for i in positions for rid in request_ids(i + 1, copies)[i * copies :]]
    return {n: dataclasses.replace(out[o], request_id=n) for o, n in zip(old, new)}


def generate_requests(
    prompts: list[list[int]], params: list[SamplingParams], namespace: str, copies: int
) -> list[tuple[str, Request]]:
    """The engine requests of a batch: ``copies`` per prompt (ids ``req_i`` or ``req_i_j``)."""
    out = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        for j in range(copies):
            rid = f"req_{i}" if copies == 1 else f"req_{i}_{j}"
            out.append((rid, Request(rid, list(p), namespace, sp, sink=_Collect())))
    return out


def collect_outputs(reqs: list[tuple[str, Request]]) -> dict[str, BatchOutput]:
    out: dict[str, BatchOutput] = {}
    for rid, req in reqs:
        res = req.sink.result  # type: ignore[union-attr]
        assert res is not None
        err = None if res.error is None else str(res.error)
        out[rid] = BatchOutput(rid, list(req.prompt), list(res.output), res.finish_reason, res.cached_tokens, err)
    return out


def score_requests(
    pairs: Sequence[tuple[Any, Any]], namespace: str, *, max_length: int | None, commit: bool, top: int
) -> tuple[list[Request], list[int]]:
    """Engine requests for (context, continuation) pairs (left-truncated to ``max_length + 1`` tokens) and the
    tokens cut from each."""
    reqs, cut = [], []
    for i, pair in enumerate(pairs):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"requests[{i}] must be a (context, continuation) pair of token lists")
        ctx = token_list(pair[0], f"requests[{i}] context")
        cont = token_list(pair[1], f"requests[{i}] continuation")
        if not ctx:
            raise ValueError(f"requests[{i}] has an empty context: give at least one token (e.g. BOS) to condition on")
        if not cont:
            raise ValueError(f"requests[{i}] has an empty continuation: nothing to score")
        full = ctx + cont
        drop = 0
        if max_length is not None and len(full) > max_length + 1:
            if len(cont) > max_length:
                raise ValueError(
                    f"requests[{i}]: the continuation alone ({len(cont)} tokens) is longer than max_length={max_length}"
                )
            drop = len(full) - (max_length + 1)
            full = full[drop:]
        req = Request(f"score_{i}", full, namespace, None, sink=_Collect(), score_from=len(full) - len(cont))
        req.commit_scored = commit
        req.top_logprobs = top
        reqs.append(req)
        cut.append(drop)
    return reqs, cut


def score_results(reqs: list[Request], cut: list[int], per_token: bool) -> list[ScoreResult]:
    out = []
    for req, drop in zip(reqs, cut):
        res = req.sink.result  # type: ignore[union-attr]
        assert res is not None
        if res.error is not None:
            raise RuntimeError(f"scoring request {req.id} failed: {res.error}") from res.error
        out.append(
            ScoreResult(
                float(sum(res.logprobs)),
                bool(all(res.greedy)),
                tuple(res.logprobs) if per_token else None,
                res.cached_tokens,
                drop,
            )
        )
    return out


def score_uncached(model: Any, reqs: list[Request], cut: list[int], per_token: bool) -> list[ScoreResult]:
    """The same results from the bare model, one plain forward per request (for models the engine cannot run)."""
    out = []
    for req, drop in zip(reqs, cut):
        ids = torch.tensor([req.tokens[:-1]], device=model.device)
        with torch.inference_mode():
            logits = model(input_ids=ids).logits[0, req.score_from - 1 :].float()
        logp = torch.log_softmax(logits, dim=-1)
        target = torch.tensor(req.tokens[req.score_from :], device=logp.device)
        lp = logp.gather(1, target[:, None])[:, 0]
        greedy = bool((logp.argmax(dim=-1) == target).all())
        out.append(ScoreResult(float(lp.sum()), greedy, tuple(lp.tolist()) if per_token else None, 0, drop))
    return out
