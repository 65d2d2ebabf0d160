"""Log-probabilities in OpenAI's response shapes.

* ``/v1/completions`` (the legacy format evaluation harnesses read): ``{"tokens", "token_logprobs",
  "top_logprobs", "text_offset"}``, one entry per token of the choice's text; with ``echo`` the prompt's tokens
  come first, its first token with ``None`` (nothing predicts it).
* ``/v1/chat/completions``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}``.

A token's text is the tokenizer's decoding of that token alone (as vLLM gives it); alternatives whose texts
coincide keep the most likely one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.serve.protocol import Finished


def _piece(tokenizer: Any, token: int) -> str:
    text: str = tokenizer.decode([token])
    return text


def _top(tokenizer: Any, alternatives: dict[int, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for tok, lp in sorted(alternatives.items(), key=lambda kv: -kv[1]):
        out.setdefault(_piece(tokenizer, tok), float(lp))
    return out


def completion_logprobs(
    tokenizer: Any, echoed: Sequence[int], finished: Finished, generated: Sequence[int]
) -> dict[str, Any]:
    """The legacy ``logprobs`` object of one choice: ``echoed`` prompt tokens (empty without echo) with
    ``finished.prompt_logprobs``, then the ``generated`` tokens with ``finished.sample_logprobs``."""
    tokens: list[str] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    if echoed:
        plp = finished.prompt_logprobs
        assert plp is not None and len(plp.logprobs) == len(echoed) - 1, "prompt log-probs missing"
        for i, tok in enumerate(echoed):
            tokens.append(_piece(tokenizer, tok))
            if i == 0:
                token_lps.append(None)
                tops.append(None)
                continue
            token_lps.append(float(plp.logprobs[i - 1]))
            tops.append(_top(tokenizer, plp.top[i - 1]) if plp.top else {})
    for tok, (lp, alt) in zip(generated, finished.sample_logprobs):
        tokens.append(_piece(tokenizer, tok))
        token_lps.append(float(lp))
        tops.append(_top(tokenizer, alt))
    offsets, at = [], 0
    for piece in tokens:
        offsets.append(at)
        at += len(piece)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(
    tokenizer: Any, generated: Sequence[int], sampled: Sequence[tuple[float, dict[int, float]]]
) -> dict[str, Any]:
    """The chat ``logprobs`` object of one choice."""
    content = []
    for tok, (lp, alt) in zip(generated, sampled):
        piece = _piece(tokenizer, tok)
        top = [{"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))} for t, v in _top(tokenizer, alt).items()]
        content.append(
            {"token": piece, "logprob": float(lp), "bytes": list(piece.encode("utf-8")), "top_logprobs": top}
        )
    return {"content": content}
