"""Per-request sampling: greedy, or temperature / top-k / top-p with a per-request seed; stop conditions.

Each request carries its own ``SamplingParams``; a step's rows are sampled together where they agree (greedy rows
in one argmax), and one by one where they sample, each from its own ``torch.Generator`` (seeded by the request's
``seed``, else from the process's entropy), so a seeded request draws the same tokens whatever else runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    ``temperature`` 0 is greedy. ``top_k`` 0 and ``top_p`` 1 keep every token. Generation stops after a token of
    ``stop_token_ids`` or, unless ``ignore_eos``, of the model's EOS ids (the stop token is kept in the output, as
    ``generate`` keeps EOS), or after ``max_tokens`` tokens.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not (
            isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0
        ):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device: torch.device) -> torch.Generator | None:
        """A fresh generator for one request (None when greedy)."""
        if self.greedy:
            return None
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> list[int]:
    """One token per row of ``logits`` [n, vocab] (float32 math), row i by ``params[i]``."""
    n = logits.shape[0]
    out = [0] * n
    greedy = [i for i in range(n) if params[i].greedy]
    if greedy:
        picked = logits[greedy].argmax(dim=-1).tolist()
        for i, tok in zip(greedy, picked):
            out[i] = int(tok)
    for i in range(n):
        p = params[i]
        if p.greedy:
            continue
        row = logits[i].float() / p.temperature
        if p.top_k and p.top_k < row.shape[0]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the tokens ranked above
            sorted_probs = sorted_probs.masked_fill(before >= p.top_p, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        out[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return out
