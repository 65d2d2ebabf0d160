"""Stop strings: a generation ends once its text contains one of them, and its text is cut before it.

The engine stops a request when its ``stop_check`` says so (called after each new token, on the engine's thread);
``StopStrings`` is that check for text: it decodes the output so far (``skip_special_tokens``, as the server's
replies are decoded) and looks for each string in it. The server renders the reply with ``cut`` (the text before
the earliest stop string, which is not returned, as OpenAI and vLLM do) and streams with ``visible`` (holding
back the tail that could still turn into a stop string). The tokens that spelled a stop string count as completion
tokens, as generated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class StopStrings:
    """Whether a list of output ids decodes to text containing one of ``stops``."""

    def __init__(self, stops: Sequence[str], decode: Callable[[list[int]], str]) -> None:
        if not stops or any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stops)!r}")
        self.stops = tuple(stops)
        self.decode = decode

    def __call__(self, output: list[int]) -> bool:
        return find(self.decode(output), self.stops) is not None


def find(text: str, stops: Sequence[str]) -> int | None:
    """Where the earliest of ``stops`` starts in ``text``, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def cut(text: str, stops: Sequence[str]) -> str:
    """``text`` up to (not including) the earliest stop string; all of it when none occurs."""
    at = find(text, stops)
    return text if at is None else text[:at]


def visible(text: str, stops: Sequence[str]) -> str:
    """What of a growing ``text`` may be shown before it ends: cut at a stop string; otherwise without the longest
    tail that is the start of a stop string (the next tokens may complete it). The end is shown with ``cut``."""
    at = find(text, stops)
    if at is not None:
        return text[:at]
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:n]):
                hold = n
                break
    return text[: len(text) - hold]
