"""One request's state in the engine, and what the engine tells the request's owner.

A request is a prompt (token ids) and ``SamplingParams`` (generate), or ``None`` there to score only; either
may ask for the log-probabilities of its prompt tokens from ``score_from`` on. Its life: WAITING (queued) -> RUNNING (it has a pinned
cached prefix and blocks of its own; its tokens go through the model chunk by chunk, then one per step) ->
FINISHED; a RUNNING request may be PREEMPTED back to waiting when the pool runs short (its computed blocks are
cached, so it resumes from whatever of them is still there).

Everything here is touched by the engine's thread only, except ``cancel()`` (any thread).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.batching.sampling import SamplingParams
from prefixcache.core.cache import RequestHandle


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class RequestResult:
    """The end of a request: why (``stop``, ``length``, ``cancelled``, ``error``), its token counts, the
    log-probabilities of its scored tokens (``logprobs[i]``: of token ``score_from + i`` given the tokens before
    it; ``greedy[i]``: whether it was the argmax; ``top[i]``: the ``top_logprobs`` most likely tokens there) and,
    with ``sample_logprobs``, of each generated token with its alternatives."""

    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    output: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    greedy: tuple[bool, ...] = ()
    top: tuple[dict[int, float], ...] = ()
    error: BaseException | None = None
    sample_logprobs: tuple[tuple[float, dict[int, float]], ...] = ()


class Sink(Protocol):
    """Where the engine reports a request's progress (called on the engine's thread; must not block)."""

    def tokens(self, ids: list[int]) -> None: ...

    def finished(self, result: RequestResult) -> None: ...


@dataclass(eq=False)
class Request:
    id: str
    prompt: list[int]
    namespace: str  # the cache namespace (``ModelRuntime.namespace``: the model's fingerprint joined with the caller's)
    params: SamplingParams | None  # None: score only, generate nothing
    sink: Sink | None = None
    score_from: int = 0  # first prompt position whose log-probability is wanted (>= 1); 0: none
    commit_scored: bool = False  # score only: cache the scored tokens' blocks too (default: the context's only)
    top_logprobs: int = 0  # also the top-n alternatives at each scored position
    use_logprob_store: bool = False  # match the whole prompt; scored log-probs of cached blocks come from the store
    sample_logprobs: int | None = None  # log-probs of each generated token (and its top-n alternatives)
    stop_check: Callable[[list[int]], bool] | None = None  # a stop rule over the output (stop strings), per token
    arrival: float = field(default_factory=time.monotonic)
    # ---- engine state ----
    status: Status = Status.WAITING
    tokens: list[int] = field(default_factory=list)  # prompt + generated
    handle: RequestHandle | None = None
    table: list[int] = field(default_factory=list)  # pool block of every block of tokens with KV (or to come)
    computed: int = 0  # leading tokens whose K/V is in the pool
    committed: int = 0  # leading full blocks in the tree (by id: table[:committed] are the tree's)
    cached_tokens: int = -1  # served from cache at first admission, the tier's included (-1: not yet admitted)
    tier_tokens: int = 0  # of those served at the last admission, the tier's
    block_keys: list[bytes] = field(default_factory=list, repr=False)  # chained block keys computed so far
    snapshot_hints: tuple[int, ...] = ()  # hybrid models: token positions where prefixes diverge (message ends)
    state_slot: int | None = None  # hybrid models: the live recurrent-state slot while running
    has_state: bool = False  # that slot holds the state after ``computed`` tokens (else the request starts fresh)
    state_points: list[int] = field(default_factory=list)  # block boundaries to keep snapshots at
    state_latest: int = 0  # the boundary of its latest snapshot (superseded ones are dropped unless kept)
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    greedy: list[bool] = field(default_factory=list)
    top: list[dict[int, float]] = field(default_factory=list)
    sampled_lp: list[tuple[float, dict[int, float]]] = field(default_factory=list)
    fresh_from: int = 0  # positions below this have K/V in the table already (recomputed ones write to scratch)
    generator: torch.Generator | None = None
    preemptions: int = 0
    passed_over: int = 0  # steps the scheduler gave this request's prefill no tokens ("shortest" order's aging)
    first_token_at: float | None = None
    _cancelled: bool = False

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt)

    @property
    def scoring(self) -> bool:
        return self.params is None

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        """Ask the engine to stop this request at its next step (thread-safe: a flag)."""
        self._cancelled = True

    @property
    def cache_limit(self) -> int:
        """Tokens of ``tokens`` a match may consider: scored positions need logits, so a request must compute
        ``score_from - 1`` on (unless the log-prob store supplies the cached ones)."""
        if self.score_from and not self.use_logprob_store:
            return min(self.score_from, len(self.tokens))
        return len(self.tokens)

    @property
    def score_end(self) -> int:
        """One past the last scored token: a scoring request scores to its end, a generating one its prompt."""
        if not self.score_from:
            return 0
        return len(self.tokens) if self.scoring else len(self.prompt)

    @property
    def end(self) -> int:
        """Tokens that go through the model: all of a generating request's; a scoring request's last one is only
        scored (its logits would score nothing)."""
        return len(self.tokens) - 1 if self.scoring else len(self.tokens)

    @property
    def remaining(self) -> int:
        """Tokens still to go through the model before this request samples (or finishes scoring)."""
        return self.end - self.computed

    @property
    def commit_limit(self) -> int:
        """Leading tokens whose full blocks this request caches."""
        if self.scoring and not self.commit_scored:
            return self.score_from
        return self.end
