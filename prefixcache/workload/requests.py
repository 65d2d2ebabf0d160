"""What a scenario asks for: requests as text, chat messages or token ids (plain values, no I/O)."""

from __future__ import annotations

from dataclasses import dataclass

from prefixcache.core import DEFAULT_NAMESPACE


@dataclass(frozen=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True)
class ScenarioRequest:
    """One request of a scenario: exactly one of ``text``, ``messages``, ``tokens``.

    ``conversation``: requests sharing this id form one multi-turn chat; each turn's ``messages`` are only the
    NEW messages, and the history (earlier turns' messages and the replies generated for them) comes first.
    """

    text: str | None = None
    messages: tuple[Message, ...] | None = None
    tokens: tuple[int, ...] | None = None
    conversation: str | None = None
    namespace: str = DEFAULT_NAMESPACE
    timestamp: float | None = None
    max_new_tokens: int | None = None
    line: int | None = None  # where it was written, for error messages

    @property
    def kind(self) -> str:
        return "text" if self.text is not None else "chat" if self.messages is not None else "tokens"
