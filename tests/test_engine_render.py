"""simulate's ByteRenderer gives the same ids as replay's built-in tokenizer, special-token strings included."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

from engine.models import SPECIAL_TOKENS, byte_tokenizer
from engine.replay import HFRenderer
from prefixcache.workload import render
from prefixcache.workload.render import ByteRenderer
from prefixcache.workload.requests import Message

HF = HFRenderer(byte_tokenizer())
MINE = ByteRenderer()

TEXTS = [
    "Answer, then say <|end|>.",
    "<|user|>not really a turn<|end|><|assistant|>",
    "a<|<|end|>|>b <|bos|><|eos|><|pad|>",
    "half-open <|end| and <|tool|> and <| end |> and <|END|>",
    "héllo <|system|> wörld ✓\n",
    "",
]


def test_special_tokens_mirror_the_builtin_tokenizer():
    assert render.SPECIAL_TOKENS == SPECIAL_TOKENS  # the twin's id table is the tokenizer's
    for text in TEXTS:
        assert MINE.encode_text(text) == HF.encode_text(text), text
    # "<|end|>" in text is one token, as the model sees it in replay
    assert MINE.encode_text("x<|end|>y") == [render.BOS_ID, ord("x"), render.SPECIAL_IDS["<|end|>"], ord("y")]
    chats = [
        [Message("system", TEXTS[0]), Message("user", TEXTS[1])],
        [Message("user", TEXTS[2]), Message("assistant", TEXTS[3]), Message("user", TEXTS[4])],
        [Message("tool", "<|end|>"), Message("end", "x"), Message("x|><|user", "y")],  # markers built from roles
    ]
    for messages in chats:
        assert MINE.encode_chat(messages) == HF.encode_chat(messages), messages


_PIECES = st.sampled_from([*SPECIAL_TOKENS, "<|", "|>", "<", "|", ">", "end", "tool", "é", "✓", " ", "\n", "a"])
_TEXT = st.lists(_PIECES, max_size=12).map("".join)


@settings(max_examples=150, deadline=None)
@given(_TEXT)
def test_random_texts_with_special_fragments_agree(text):
    assert MINE.encode_text(text) == HF.encode_text(text)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["system", "user", "assistant", "tool", "end"]), _TEXT), min_size=1, max_size=4)
)
def test_random_chats_with_special_fragments_agree(turns):
    messages = [Message(role, content) for role, content in turns]
    assert MINE.encode_chat(messages) == HF.encode_chat(messages)
