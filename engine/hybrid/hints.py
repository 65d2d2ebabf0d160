"""Where chats that share a beginning part: the token positions of their messages' ends (snapshot hints).

Two tenants' chats with one system prompt part where the system message ends; few-shot turns part where their
last exemplar ends. A hybrid model keeps its recurrent state at such a position (floored to a block) the first
time it passes it, so the second chat that shares it is served it (``prefixcache.core.snapshots``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

MOST_MESSAGES = 16  # message ends looked for at most (a chat's earlier turns are its replies' snapshots anyway)


def message_ends(tokenizer: Any, messages: Sequence[Mapping[str, Any]], full: Sequence[int]) -> tuple[int, ...]:
    """Positions in ``full`` (``messages`` rendered by ``tokenizer``'s chat template) where each of the first
    messages but the last ends: the length of the first k messages rendered alone, kept only where that rendering
    is a prefix of ``full`` (a template may render a message differently when more follow). Changes nothing."""
    ends: list[int] = []
    for k in range(1, min(len(messages), MOST_MESSAGES + 1)):
        try:
            out = tokenizer.apply_chat_template(list(messages[:k]), add_generation_prompt=False, tokenize=True)
        except Exception:  # a template that refuses a partial chat (e.g. roles out of order): no hint there
            continue
        ids = list(out["input_ids"] if hasattr(out, "keys") else out)
        if 0 < len(ids) < len(full) and list(full[: len(ids)]) == ids:
            ends.append(len(ids))
    return tuple(ends)
