"""Queueing delays of the replicas' prefill queues, in time (the cluster simulation's load model).

Each replica prefills at one fixed rate (tokens per second); a request brings its uncached prompt tokens at
its arrival. Two queue disciplines (:class:`PrefillQueue`), both work-conserving (a replica is never idle while
work is queued, so the work it has not finished at any moment, which is what the router sees as its load, is
the same under both):

* ``fcfs``: one prompt at a time, in arrival order: a long prompt holds up every prompt behind it. This is
  what an engine does that hands each step's token budget to its requests in arrival order with no cap on
  what one prompt takes (vLLM's and SGLang's defaults): a long prompt, even prefilled in chunks, takes the
  whole budget of every step until it is done;
* ``chunked``: vLLM's scheduler with a per-prompt cap, step by step. A step prefills at most ``step_tokens``
  (``--max-num-batched-tokens``) and takes ``tokens / rate`` seconds: first the prompts already started, in
  the order they started, each given at most ``chunk_tokens`` (``--long-prefill-token-threshold``), then the
  waiting prompts in arrival order, each as much, while the step has room. A prompt that arrives during a
  step waits for the next one, and a prompt is done when the step that prefills its last token ends. With a
  cap, a short prompt behind long ones is prefilled within a step or so of its arrival.

A request's queueing delay is the time it spends on the replica beyond its own prefill: finish - arrival -
tokens / rate (under ``fcfs``, the wait before it starts). Decoding, which shares the steps in a real engine, is
not modelled (prefix caching changes only prefill), nor is a limit on the number of running requests.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

QUEUE_DISCIPLINES = ("fcfs", "chunked")
DEFAULT_STEP_TOKENS = 8_192  # vLLM's --max-num-batched-tokens for `vllm serve` on an H100-class GPU (2,048 on smaller)
DEFAULT_CHUNK_TOKENS = 2_048  # --long-prefill-token-threshold (vLLM sets 4% of the context when unset and
# --max-num-partial-prefills > 1: 5,242 for 128k; else no cap)


@dataclass(frozen=True)
class PrefillQueue:
    """How a replica works through its queued prompts: ``discipline`` one of ``QUEUE_DISCIPLINES``; under
    ``chunked``, ``step_tokens`` per step and at most ``chunk_tokens`` of them for one prompt (None: no cap)."""

    discipline: str = "fcfs"
    step_tokens: int = DEFAULT_STEP_TOKENS
    chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS

    def __post_init__(self) -> None:
        if self.discipline not in QUEUE_DISCIPLINES:
            raise ValueError(f"queue must be one of {', '.join(QUEUE_DISCIPLINES)}, got {self.discipline!r}")
        for name in ("step_tokens", "chunk_tokens"):
            v = getattr(self, name)
            if name == "chunk_tokens" and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")

    @property
    def label(self) -> str:
        """The queue in words, for reports: ``fcfs`` or ``chunked (2,048 of 8,192 tokens a step)``."""
        if self.discipline == "fcfs":
            return "fcfs"
        if self.chunk_tokens is None:
            return f"chunked ({self.step_tokens:,} tokens a step, no cap)"
        return f"chunked ({self.chunk_tokens:,} of {self.step_tokens:,} tokens a step)"

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> PrefillQueue:
        """The queue a record's settings describe (the inverse of :meth:`settings`; no queue: ``fcfs``).
        Raises ValueError for a queue this version does not know."""
        name = settings.get("prefill_queue", "fcfs")
        if name == "chunked":
            return cls(name, settings["prefill_step_tokens"], settings["prefill_chunk_tokens"])
        return cls(name)

    def settings(self) -> dict[str, object]:
        """The queue as a record's fields (the step and cap only where they apply)."""
        if self.discipline == "fcfs":
            return {"prefill_queue": "fcfs"}
        return {
            "prefill_queue": self.discipline,
            "prefill_step_tokens": self.step_tokens,
            "prefill_chunk_tokens": self.chunk_tokens,
        }


def queue_delays(arrival: Sequence[float], tokens: Sequence[int], rate: float, queue: PrefillQueue) -> list[float]:
    """The queueing delay (seconds) of each request of ONE replica, given in arrival order (``arrival``
    non-decreasing, seconds; ``tokens`` >= 0, the prompt tokens it prefills; ``rate`` tokens per second)."""
    if queue.discipline == "fcfs":
        return _fcfs(arrival, tokens, rate)
    return _chunked(arrival, tokens, rate, queue.step_tokens, queue.chunk_tokens or queue.step_tokens)


def replica_delays(
    arrival: Sequence[float], tokens: Sequence[int], replica: Sequence[int], rate: float, queue: PrefillQueue
) -> list[float]:
    """:func:`queue_delays` of a cluster's requests (in arrival order), each queued on its ``replica``."""
    by_replica: dict[int, list[int]] = {}
    for k, r in enumerate(replica):
        by_replica.setdefault(r, []).append(k)
    out = [0.0] * len(replica)
    for ks in by_replica.values():
        mine = queue_delays([arrival[k] for k in ks], [tokens[k] for k in ks], rate, queue)
        for k, d in zip(ks, mine):
            out[k] = d
    return out


def _fcfs(arrival: Sequence[float], tokens: Sequence[int], rate: float) -> list[float]:
    free_at = 0.0  # when the replica finishes the work queued so far
    out = []
    for a, n in zip(arrival, tokens):
        start = max(a, free_at)
        out.append(float(start - a))
        free_at = start + n / rate
    return out


def _chunked(arrival: Sequence[float], tokens: Sequence[int], rate: float, step: int, cap: int) -> list[float]:
    """Step by step (module docstring). Tokens are counted as integers, so a prompt ends in the step that
    prefills its last token and not one later for a rounding error."""
    n = len(arrival)
    out = [0.0] * n
    left = list(tokens)
    running: list[int] = []  # started, in the order they started
    waiting: deque[int] = deque()  # arrived, not started, in arrival order
    t = 0.0
    nxt = 0
    while nxt < n or running or waiting:
        if not running and not waiting:
            t = max(t, arrival[nxt])  # idle until the next arrival
        while nxt < n and arrival[nxt] <= t:
            waiting.append(nxt)
            nxt += 1
        room = step
        for j in running:
            if room == 0:
                break
            give = min(left[j], cap, room)
            left[j] -= give
            room -= give
        while waiting and room > 0:
            j = waiting.popleft()
            running.append(j)
            give = min(left[j], cap, room)
            left[j] -= give
            room -= give
        t += (step - room) / rate
        still = []
        for j in running:
            if left[j]:
                still.append(j)
            else:
                out[j] = max(0.0, t - arrival[j] - tokens[j] / rate)
        running = still
    return out
