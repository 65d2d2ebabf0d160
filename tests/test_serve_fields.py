"""Validation of every request field ``prefixcache serve`` takes, written from the OpenAI API's rules (and vLLM's for
its extra fields), as a table: for each endpoint and field, a good value (200) and a bad one (the status and the
error's ``param``).

Validation is the app's job, done before any model runs, so the app here sits over a recording backend with the
real tiny preset's tokenizer, context length (2,048) and vocabulary (272 ids): it answers every call with canned
tokens and keeps the ``GenerateCall`` the app made, so the tests also check what a good request turned into (the
token limit, the namespace, the sampling settings) and the usage arithmetic, against values computed here by hand.
One recording app runs the engine's feature set, one the batched-generate fallback's (``--no-engine``).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from serve_testutil import server_thread

from engine.serve.app import create_app
from engine.serve.backend import describe_model
from engine.serve.protocol import Finished, GenerateCall, PromptLogprobs, StreamItem

MODEL = "tiny"
CTX = 2048  # the tiny preset's max_position_embeddings
VOCAB = 272  # its vocab_size (ids 0..271)
CHAT_DEFAULT = 12  # the app's default_max_tokens for a chat that names no limit
CANNED = ord("a")  # the token every recorded call "generates" (byte 97)
CACHED = 2  # the cached_tokens every recorded call reports


class Recorder:
    """A Backend that records each call and answers it with ``max_tokens`` canned tokens (log-probs when asked)."""

    def __init__(self, engine: bool) -> None:
        self.info = describe_model(MODEL)
        self.engine = engine
        self.calls: list[GenerateCall] = []

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def stream(self, call: GenerateCall) -> AsyncGenerator[StreamItem, None]:
        self.calls.append(call)
        n = call.max_tokens
        if n:
            yield [CANNED] * n
        prompt_lp = None
        if call.prompt_logprobs is not None:
            prompt_lp = PromptLogprobs((-1.0,) * (len(call.prompt) - 1), ({CANNED: -1.0},) * (len(call.prompt) - 1))
        sampled = ((-0.5, {CANNED: -0.5}),) * n if call.logprobs is not None else ()
        yield Finished("length", len(call.prompt), CACHED, n, prompt_logprobs=prompt_lp, sample_logprobs=sampled)

    async def refresh(self) -> None:
        return None

    async def ready(self) -> str | None:
        return None

    def runs_engine(self) -> bool:
        return self.engine

    def figures(self) -> dict[str, dict[str, Any]]:
        return {}


@pytest.fixture(scope="module")
def apps():
    """(client, recorder) of the engine's app and of the fallback's (one kept-alive connection each)."""
    eng, fallback = Recorder(True), Recorder(False)
    with (
        server_thread(create_app(eng, default_max_tokens=CHAT_DEFAULT)) as u1,
        server_thread(create_app(fallback, default_max_tokens=CHAT_DEFAULT)) as u2,
        httpx.Client(base_url=f"{u1}/v1", timeout=30) as c1,
        httpx.Client(base_url=f"{u2}/v1", timeout=30) as c2,
    ):
        yield {"engine": (c1, eng), "fallback": (c2, fallback)}


def _post(
    client: httpx.Client, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> httpx.Response:
    return client.post(f"/{path}", json=body, headers=headers)


CMPL = "completions"
CHAT = "chat/completions"
BASE = {CMPL: {"model": MODEL, "prompt": "hi"}, CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}}
BOTH = (CMPL, CHAT)


@dataclass(frozen=True)
class Field:
    """One row: ``good`` and ``bad`` are the fields merged into the endpoint's minimal body (``with_`` into both),
    ``on``: the backends the row applies to."""

    endpoints: tuple[str, ...]
    field: str
    good: dict[str, Any]
    bad: dict[str, Any]
    status: int = 400
    param: str | None = None  # None: the field's own name
    code: str | None = None
    with_: tuple[tuple[str, Any], ...] = ()
    on: tuple[str, ...] = ("engine", "fallback")


def ids(n: int) -> list[int]:
    """A token prompt of ``n`` ids (bytes)."""
    return [i % 256 for i in range(n)]


IDS_FILL = ids(CTX - 8)  # a token prompt leaving room for exactly 8 tokens
ROWS = [
    # the model (OpenAI: required string; an unknown one is 404 model_not_found)
    Field(BOTH, "model", {"model": MODEL}, {"model": "gpt-9"}, 404, code="model_not_found"),
    Field(BOTH, "model", {"model": MODEL}, {"model": 5}),
    # completions' prompt: a string, a token list, a list of strings, a list of token lists; never empty
    Field((CMPL,), "prompt", {"prompt": "text"}, {"prompt": 5}),
    Field((CMPL,), "prompt", {"prompt": ["a", "b"]}, {"prompt": []}),
    Field((CMPL,), "prompt", {"prompt": [[1, 2], [3]]}, {"prompt": [[1, 2], [3, VOCAB]]}, param="prompt[1]"),
    Field((CMPL,), "prompt", {"prompt": [0, VOCAB - 1]}, {"prompt": [0, VOCAB]}),  # the last id, one past it
    Field((CMPL,), "prompt", {"prompt": [0]}, {"prompt": [-1]}),
    # the context: a prompt of CTX - 1 tokens leaves one to generate; CTX tokens leave none
    Field((CMPL,), "prompt", {"prompt": ids(CTX - 1)}, {"prompt": ids(CTX)}, code="context_length_exceeded"),
    # max_tokens (OpenAI: integer >= 0): prompt + max_tokens may fill the context exactly, not one more
    Field(BOTH, "max_tokens", {"max_tokens": 1}, {"max_tokens": "5"}),
    Field(BOTH, "max_tokens", {"max_tokens": 3}, {"max_tokens": -1}),
    Field(BOTH, "max_tokens", {"max_tokens": 1}, {"max_tokens": 0}),  # 0 only with echo (below)
    Field((CMPL,), "max_tokens", {"max_tokens": 2}, {"max_tokens": 1.0}),  # strict: an int, not a float (even 1.0)
    Field(
        (CMPL,),
        "max_tokens",
        {"prompt": IDS_FILL, "max_tokens": 8},
        {"prompt": IDS_FILL, "max_tokens": 9},
        code="context_length_exceeded",
    ),
    # chat's max_completion_tokens (>= 1), filling the context like max_tokens
    Field((CHAT,), "max_completion_tokens", {"max_completion_tokens": 1}, {"max_completion_tokens": 0}),
    Field(
        (CHAT,),
        "max_completion_tokens",
        {"max_completion_tokens": CTX - 6},  # the chat template makes "hi" 6 tokens: bos, <|user|>, h, i, ...
        {"max_completion_tokens": CTX - 5},
        param="max_tokens",
        code="context_length_exceeded",
    ),
    # sampling: temperature in [0, 2], top_p in (0, 1]
    Field(BOTH, "temperature", {"temperature": 2}, {"temperature": 2.01}),
    Field(BOTH, "temperature", {"temperature": 0}, {"temperature": -0.1}),
    Field(BOTH, "temperature", {"temperature": 0.5}, {"temperature": "hot"}),
    Field(BOTH, "top_p", {"top_p": 1}, {"top_p": 0}),
    Field(BOTH, "top_p", {"top_p": 0.01}, {"top_p": 1.01}),
    # n: one choice per request only
    Field(BOTH, "n", {"n": 1}, {"n": 2}),
    Field(BOTH, "n", {"n": 1}, {"n": 0}),
    # stream and stream_options (only with stream: true)
    Field(BOTH, "stream", {"stream": True}, {"stream": "yes"}),
    Field(
        BOTH,
        "stream_options",
        {"stream": True, "stream_options": {"include_usage": True}},
        {"stream_options": {"include_usage": True}},
    ),
    Field(BOTH, "stream_options", {"stream": True, "stream_options": {}}, {"stream": True, "stream_options": 1}),
    Field((CMPL,), "prompt", {"stream": True, "prompt": ["one"]}, {"stream": True, "prompt": ["one", "two"]}),
    # stop: a string or a list of strings; on the engine only, and never an empty one
    Field(BOTH, "stop", {"stop": ["x", "y"]}, {"stop": ["x", ""]}, on=("engine",)),
    Field(BOTH, "stop", {"stop": "x"}, {"stop": 5}, on=("engine",)),
    Field(BOTH, "stop", {"stop": []}, {"stop": "x"}, on=("fallback",)),
    Field(BOTH, "stop", {"stop": None}, {"stop": ["x"]}, on=("fallback",)),
    # vLLM's extras, on the engine only: top_k >= -1, stop_token_ids in the vocabulary, ignore_eos a bool
    Field(BOTH, "top_k", {"top_k": -1}, {"top_k": -2}, on=("engine",)),
    Field(BOTH, "top_k", {"top_k": None}, {"top_k": 5}, on=("fallback",)),
    Field(BOTH, "stop_token_ids", {"stop_token_ids": [VOCAB - 1]}, {"stop_token_ids": [VOCAB]}, on=("engine",)),
    Field(BOTH, "stop_token_ids", {"stop_token_ids": [0]}, {"stop_token_ids": [-1]}, on=("engine",)),
    Field(BOTH, "stop_token_ids", {"stop_token_ids": None}, {"stop_token_ids": [1]}, on=("fallback",)),
    Field(BOTH, "ignore_eos", {"ignore_eos": True}, {"ignore_eos": 1}, on=("engine",)),
    Field(BOTH, "ignore_eos", {"ignore_eos": False}, {"ignore_eos": True}, on=("fallback",)),
    # seed: an integer, on the engine only
    Field(BOTH, "seed", {"seed": 7}, {"seed": "7"}, on=("engine",)),
    Field(BOTH, "seed", {"seed": None}, {"seed": 7}, on=("fallback",)),
    # user: a string; cache_salt: a non-empty string
    Field(BOTH, "user", {"user": "u-1"}, {"user": 5}),
    Field(BOTH, "cache_salt", {"cache_salt": "t"}, {"cache_salt": ""}),
    Field(BOTH, "cache_salt", {"cache_salt": "t"}, {"cache_salt": 5}),
    # penalties (OpenAI: -2..2) and logit_bias: only their neutral values are served, the rest refused, not ignored
    Field(BOTH, "frequency_penalty", {"frequency_penalty": 0}, {"frequency_penalty": 0.5}),
    Field(BOTH, "frequency_penalty", {"frequency_penalty": None}, {"frequency_penalty": 2.5}),
    Field(BOTH, "presence_penalty", {"presence_penalty": 0.0}, {"presence_penalty": -1}),
    Field(BOTH, "presence_penalty", {"presence_penalty": 0}, {"presence_penalty": "high"}),
    Field(BOTH, "logit_bias", {"logit_bias": {}}, {"logit_bias": {"50256": -100}}),
    Field(BOTH, "logit_bias", {"logit_bias": None}, {"logit_bias": [1, 2]}),
    # completions' logprobs: an integer 0..5, on the engine, not with stream
    Field((CMPL,), "logprobs", {"logprobs": 5}, {"logprobs": 6}, on=("engine",)),
    Field((CMPL,), "logprobs", {"logprobs": 0}, {"logprobs": -1}, on=("engine",)),
    Field((CMPL,), "logprobs", {"logprobs": 1}, {"logprobs": True}, on=("engine",)),
    Field((CMPL,), "logprobs", {"logprobs": 2}, {"logprobs": 2, "stream": True}, on=("engine",)),
    Field((CMPL,), "logprobs", {"logprobs": None}, {"logprobs": 1}, on=("fallback",)),
    # echo: a bool, on the engine, not with stream; max_tokens 0 scores a prompt of 2 tokens or more, which may
    # then fill the context
    Field((CMPL,), "echo", {"echo": True}, {"echo": "yes"}, on=("engine",)),
    Field((CMPL,), "echo", {"echo": True}, {"echo": True, "stream": True}, on=("engine",)),
    Field((CMPL,), "echo", {"echo": False}, {"echo": True}, on=("fallback",)),
    Field(
        (CMPL,),
        "prompt",
        {"echo": True, "max_tokens": 0, "prompt": ids(CTX)},
        {"echo": True, "max_tokens": 0, "prompt": [7]},
        on=("engine",),
    ),
    # completions' suffix and best_of: not supported beyond their neutral values
    Field((CMPL,), "suffix", {"suffix": ""}, {"suffix": "tail"}),
    Field((CMPL,), "best_of", {"best_of": 1}, {"best_of": 2}),
    # chat's messages: a non-empty list of {role, content} with OpenAI's roles, content a string or text parts
    Field((CHAT,), "messages", {"messages": [{"role": "user", "content": "a"}]}, {"messages": []}),
    Field((CHAT,), "messages", {"messages": [{"role": "developer", "content": "a"}]}, {"messages": "hi"}),
    Field(
        (CHAT,),
        "messages",
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}]},
        {"messages": [{"role": "wizard", "content": "a"}]},
    ),
    Field(
        (CHAT,),
        "messages",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    ),
    Field((CHAT,), "messages", {"messages": [{"role": "user", "content": None}]}, {"messages": [{"role": "user"}, 5]}),
    # chat's logprobs: a bool (false is fine everywhere); true on the engine only and not with stream
    Field((CHAT,), "logprobs", {"logprobs": False}, {"logprobs": "yes"}),
    Field((CHAT,), "logprobs", {"logprobs": False}, {"logprobs": True}, on=("fallback",)),
    Field((CHAT,), "logprobs", {"logprobs": True}, {"logprobs": True, "stream": True}, on=("engine",)),
    # top_logprobs: 0..5 here (OpenAI allows 20), only with logprobs: true
    Field(
        (CHAT,), "top_logprobs", {"top_logprobs": 5}, {"top_logprobs": 6}, with_=(("logprobs", True),), on=("engine",)
    ),
    Field((CHAT,), "top_logprobs", {"logprobs": True, "top_logprobs": 0}, {"top_logprobs": 2}, on=("engine",)),
    # tools and response_format: not supported beyond their neutral values
    Field((CHAT,), "tools", {"tools": []}, {"tools": [{"type": "function", "function": {"name": "f"}}]}),
    Field(
        (CHAT,), "response_format", {"response_format": {"type": "text"}}, {"response_format": {"type": "json_object"}}
    ),
]
CASES = [
    pytest.param(endpoint, backend, row, id=f"{endpoint.split('/')[0]}-{backend}-{row.field}-{i}")
    for i, row in enumerate(ROWS)
    for endpoint in row.endpoints
    for backend in row.on
]


@pytest.mark.parametrize(("endpoint", "backend", "row"), CASES)
def test_field_good_and_bad_values(apps, endpoint, backend, row):
    client, rec = apps[backend]
    extra = dict(row.with_)
    good = _post(client, endpoint, {**BASE[endpoint], **extra, **row.good})
    assert good.status_code == 200, good.text
    before = len(rec.calls)
    bad = _post(client, endpoint, {**BASE[endpoint], **extra, **row.bad})
    assert bad.status_code == row.status, bad.text
    err = bad.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == (row.field if row.param is None else row.param)
    assert err["code"] == row.code
    assert len(rec.calls) == before  # a refused request reaches no backend


def test_malformed_bodies_are_400_with_no_param(apps):
    client, rec = apps["engine"]
    for raw in (b'{"model": "tiny", "prompt": "a",', b"[1, 2, 3]", b""):
        r = client.post("/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["message"]


def _last_call(rec: Recorder) -> GenerateCall:
    return rec.calls[-1]


def test_what_a_good_request_becomes(apps):
    """The token limit (OpenAI: max_completion_tokens wins over the deprecated max_tokens; completions default to
    16, a chat here to the app's default; both at most what the context leaves), the sampling settings and the
    cache namespace (the cache_salt field wins over the X-Cache-Salt header) of the call the app makes."""
    client, rec = apps["engine"]
    chat = BASE[CHAT]
    assert _post(client, CHAT, {**chat, "max_completion_tokens": 3, "max_tokens": 7}).status_code == 200
    assert _last_call(rec).max_tokens == 3
    assert _post(client, CHAT, {**chat, "max_tokens": 7}).status_code == 200
    assert _last_call(rec).max_tokens == 7
    assert _post(client, CHAT, chat).status_code == 200
    assert _last_call(rec).max_tokens == CHAT_DEFAULT
    assert _post(client, CMPL, BASE[CMPL]).status_code == 200
    assert _last_call(rec).max_tokens == 16
    assert _post(client, CMPL, {**BASE[CMPL], "prompt": ids(CTX - 3)}).status_code == 200
    assert _last_call(rec).max_tokens == 3  # the default, lowered to what the context leaves
    assert _post(client, CMPL, {**BASE[CMPL], "prompt": IDS_FILL, "max_tokens": 8}).status_code == 200
    assert _last_call(rec).max_tokens == 8 and len(_last_call(rec).prompt) == CTX - 8
    body = {**BASE[CMPL], "temperature": 0.7, "top_p": 0.3, "top_k": 4, "seed": 9, "stop_token_ids": [3]}
    assert _post(client, CMPL, body).status_code == 200
    c = _last_call(rec)
    assert (c.temperature, c.top_p, c.top_k, c.seed, c.stop_token_ids) == (0.7, 0.3, 4, 9, (3,))
    assert _post(client, CMPL, {**BASE[CMPL], "top_k": -1}).status_code == 200
    assert _last_call(rec).top_k == 0  # vLLM's -1: no top-k (0 here)
    # the namespace: the field, else the header, else the shared default
    for headers, field, want in (
        ({"X-Cache-Salt": "hdr"}, "fld", "salt:fld"),
        ({"X-Cache-Salt": "hdr"}, None, "salt:hdr"),
        (None, "fld", "salt:fld"),
        (None, None, "default"),
    ):
        body = {**BASE[CMPL], **({"cache_salt": field} if field else {})}
        assert _post(client, CMPL, body, headers).status_code == 200
        assert _last_call(rec).namespace == want, (headers, field)
    r = _post(client, CMPL, BASE[CMPL], {"X-Cache-Salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_usage_adds_up_on_a_hit(apps):
    """OpenAI's usage: total_tokens = prompt_tokens + completion_tokens, cached tokens reported apart (a hit
    lowers neither); a list of prompts sums its choices."""
    client, rec = apps["engine"]
    r = _post(client, CMPL, {**BASE[CMPL], "prompt": [5, 6, 7, 8], "max_tokens": 3}).json()
    assert r["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 3,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": CACHED},
    }
    assert r["choices"][0]["text"] == "aaa" and r["choices"][0]["finish_reason"] == "length"
    r = _post(client, CMPL, {**BASE[CMPL], "prompt": [[5, 6], [7, 8, 9]], "max_tokens": 2}).json()
    assert [c["index"] for c in r["choices"]] == [0, 1]
    assert r["usage"]["prompt_tokens"] == 5 and r["usage"]["completion_tokens"] == 4
    assert r["usage"]["total_tokens"] == 9 and r["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * CACHED
    body = {**BASE[CHAT], "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}
    chunks = _post(client, CHAT, body).text
    usage_line = [ln for ln in chunks.splitlines() if '"usage"' in ln][-1]
    assert '"total_tokens": 8' in usage_line and '"prompt_tokens": 6' in usage_line  # 6 prompt + 2
