"""``prefixcache serve`` in one process: a real uvicorn server on 127.0.0.1, driven by the ``openai`` client.

Greedy outputs equal the bare model's; ``cached_tokens`` equals an independent record of what was cached;
streams carry the same text; salts isolate; concurrent requests join the running ones with unchanged outputs; bad
input gets an OpenAI error object and leaves no pin; SIGTERM lets an in-flight request finish, then exit 0.

One table of cases runs through both workers a server may run (``srv`` is parametrized): the engine loop, and the
batcher of batched contiguous ``generate`` calls that serves models the engine cannot run (and ``--no-engine``).
What only the engine does runs on the engine and is refused with a 400 by the batcher (``ENGINE_ONLY``).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import signal
import threading
import time
import uuid

import httpx
import openai
import pytest
import torch
from serve_testutil import Committed, bare_greedy, cli_server, server_thread

from engine import ModelRuntime, PrefixCachedModel, RuntimeConfig
from engine.models import build_preset
from engine.serve.app import create_app
from engine.serve.backend import LocalBackend

BS = 16
MODEL = "tiny"


@pytest.fixture(scope="module")
def bare():
    model, tokenizer = build_preset(MODEL)  # the same seeded weights the server loads
    return model, tokenizer


WORKERS = ["engine", "batcher"]


@pytest.fixture(scope="module", params=WORKERS)
def srv(request):
    runtime = ModelRuntime.load(MODEL, RuntimeConfig(max_cached_tokens=32_768, block_size=BS))
    pcm = PrefixCachedModel.over(runtime)
    use_engine = request.param == "engine"
    backend = LocalBackend(runtime, MODEL, max_batch_size=8, batch_wait_ms=5, use_engine=use_engine)
    assert backend.runs_engine() == use_engine
    with server_thread(create_app(backend, default_max_tokens=12)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        yield url, client, pcm, backend


engine_only = pytest.mark.parametrize("srv", ["engine"], indirect=True)


def _idle(backend, pcm) -> None:
    """No pinned block and a consistent cache, checked on the worker thread between batches."""

    def check() -> int:
        pcm.cache.check_integrity()
        return pcm.cache.num_active_requests

    assert backend.worker.run_exclusive(check).result(timeout=60) == 0


def _salt() -> str:
    return uuid.uuid4().hex[:8]


def _chat_ids(tokenizer, messages) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])


def test_completions_and_chat_equal_the_bare_model_and_report_cached_tokens(srv, bare):
    url, client, pcm, backend = srv
    model, tok = bare
    salt = _salt()
    committed = Committed(BS)
    evicted = pcm.cache_stats()["blocks_evicted"]
    shared = "You are a terse assistant for the prefixcache test suite. " * 2
    prompts = [shared + "First question?", shared + "Second question, longer than the first?", shared + "First"]
    hits = 0
    for text in prompts + prompts[:1]:
        ids = list(tok(text).input_ids)
        want = bare_greedy(model, ids, 10)
        r = client.completions.create(
            model=MODEL, prompt=text, max_tokens=10, temperature=0, extra_body={"cache_salt": salt}
        )
        assert r.choices[0].text == tok.decode(want, skip_special_tokens=True)
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want)
        assert r.usage.prompt_tokens_details.cached_tokens == committed.expect(salt, ids)
        hits += r.usage.prompt_tokens_details.cached_tokens > 0
        committed.add(salt, ids, want)
    # token-id prompts go in as they are
    ids = list(tok(shared + "ids").input_ids)
    want = bare_greedy(model, ids, 6)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0, extra_body={"cache_salt": salt})
    assert r.choices[0].text == tok.decode(want, skip_special_tokens=True)
    assert r.usage.prompt_tokens_details.cached_tokens == committed.expect(salt, ids)
    committed.add(salt, ids, want)
    # a chat: the next turn carries the history and hits it
    messages = [{"role": "system", "content": shared}, {"role": "user", "content": "Hello, who are you?"}]
    for turn in range(3):
        ids = _chat_ids(tok, messages)
        want = bare_greedy(model, ids, 8)
        r = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_body={"cache_salt": salt}
        )
        reply = r.choices[0].message.content
        assert reply == tok.decode(want, skip_special_tokens=True)
        assert r.usage.prompt_tokens == len(ids)
        assert r.usage.prompt_tokens_details.cached_tokens == committed.expect(salt, ids)
        hits += r.usage.prompt_tokens_details.cached_tokens > 0
        committed.add(salt, ids, want)
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"And turn {turn}?"}]
    assert hits >= 5  # the shared prefix and the chat history were served from cache
    assert pcm.cache_stats()["blocks_evicted"] == evicted  # the record above assumes nothing was evicted
    _idle(backend, pcm)


def test_streaming_yields_the_same_text_and_usage(srv, bare):
    url, client, pcm, backend = srv
    model, tok = bare
    salt = _salt()
    text = "Streaming test prompt, long enough to cover a few blocks of sixteen tokens each."
    ids = list(tok(text).input_ids)
    want = tok.decode(bare_greedy(model, ids, 24), skip_special_tokens=True)
    for attempt in range(2):  # the second time, the prompt's blocks are cached
        stream = client.completions.create(
            model=MODEL,
            prompt=text,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"cache_salt": salt},
        )
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == 24
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (
            0 if attempt == 0 else (len(ids) - 1) // BS * BS
        )
    messages = [{"role": "user", "content": "Stream a chat reply, please."}]
    chat_ids = _chat_ids(tok, messages)
    want = tok.decode(bare_greedy(model, chat_ids, 20), skip_special_tokens=True)
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True, extra_body={"cache_salt": salt}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    _idle(backend, pcm)


def test_cache_salt_isolates_tenants(srv, bare):
    """Salts never share a block; the ``cache_salt`` field, else the ``X-Cache-Salt`` header, names the tenant.
    Every step asks where only one of the two candidate namespaces holds the prompt, so each can fail."""
    url, client, pcm, backend = srv
    _, tok = bare
    a, b, fresh1, fresh2, fresh3 = (_salt() for _ in range(5))
    prompt = f"The same long prompt {_salt()} sent by tenants who must never share a cached block. " * 2
    full = (len(tok(prompt).input_ids) - 1) // BS * BS

    def cached(**extra) -> int:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, **extra)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens  # OpenAI's rule, hit or not
        return r.usage.prompt_tokens_details.cached_tokens

    assert full >= 2 * BS
    assert cached(extra_body={"cache_salt": a}) == 0
    assert cached(extra_body={"cache_salt": a}) == full
    assert cached(extra_body={"cache_salt": b}) == 0  # b never sees a's blocks
    assert cached(extra_body={"cache_salt": b}) == full
    assert cached() == 0  # no salt: the default namespace, shared with no salted tenant
    assert cached() == full
    # the header alone names a tenant: a fresh one finds nothing (the default namespace holds the prompt)
    assert cached(extra_headers={"X-Cache-Salt": fresh1}) == 0
    assert cached(extra_headers={"X-Cache-Salt": a}) == full
    # the field wins over the header, both ways: a fresh field beside a holding header, and the reverse
    assert cached(extra_headers={"X-Cache-Salt": a}, extra_body={"cache_salt": fresh2}) == 0
    assert cached(extra_headers={"X-Cache-Salt": fresh3}, extra_body={"cache_salt": b}) == full
    assert cached(extra_headers={"X-Cache-Salt": fresh3}) == 0  # the last request cached nothing under fresh3
    _idle(backend, pcm)


@engine_only
def test_requests_at_the_context_boundary(srv):
    """A prompt plus max_tokens exactly filling the context (2,048) runs to its length, the last valid token id is
    served, and max_completion_tokens wins over max_tokens, on the real engine (ignore_eos: every row runs to its
    limit); one token more than the context is refused before anything runs."""
    url, client, pcm, backend = srv
    ctx, vocab = backend.info.context_length, backend.info.vocab_size
    prompt = [(7 * i) % 256 for i in range(ctx - 4)] + [vocab - 1]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) == (ctx - 3, 3, ctx)
    assert r.json()["choices"][0]["finish_reason"] == "length"
    r = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 4}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(f"{url}/v1/completions", json={**body, "prompt": [*prompt, vocab]}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    messages = [{"role": "user", "content": "limits"}]
    chat = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=9,
        temperature=0,
        extra_body={"max_completion_tokens": 4, "ignore_eos": True},
    )
    assert chat.usage.completion_tokens == 4 and chat.choices[0].finish_reason == "length"
    _idle(backend, pcm)


def _concurrent_rows(client, backend, pcm, tok):
    """Four requests of two tenants sent while a long one runs; returns them with their references."""
    salts = [_salt(), _salt()]
    base = "Concurrent batch test: rows of different lengths and tenants. "
    prompts = [base + "x" * 5, base + "a longer tail " * 3, base, base + "y" * 20]
    # give the first tenant a cached prefix, so rows hit different lengths
    client.completions.create(
        model=MODEL, prompt=base, max_tokens=1, temperature=0, extra_body={"cache_salt": salts[0]}
    )
    expected_cached = [
        backend.worker.run_exclusive(
            lambda p=p, i=i: pcm.probe(list(tok(p).input_ids), f"salt:{salts[i % 2]}")
        ).result()
        for i, p in enumerate(prompts)
    ]
    # a long request keeps the worker busy while the four below arrive
    blocker = threading.Thread(
        target=lambda: client.completions.create(model=MODEL, prompt="blocker", max_tokens=400, temperature=0)
    )
    blocker.start()
    deadline = time.monotonic() + 30
    while backend.worker.stats()["running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.005)

    def one(i: int):
        return client.completions.create(
            model=MODEL, prompt=prompts[i], max_tokens=8, temperature=0, extra_body={"cache_salt": salts[i % 2]}
        )

    with cf.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(4)))
    blocker_running = blocker.is_alive()
    blocker.join()
    return prompts, results, expected_cached, blocker_running


def test_concurrent_requests_join_the_running_one_with_unchanged_outputs(srv, bare):
    """Four requests of two tenants arrive while a long one runs. The engine: they join its steps and leave first.
    The batcher: they wait for it, then run as one batch. Either way each reply is the bare model's."""
    url, client, pcm, backend = srv
    model, tok = bare
    before = backend.worker.stats()
    prompts, results, expected_cached, blocker_running = _concurrent_rows(client, backend, pcm, tok)
    after = backend.worker.stats()
    got = [r.usage.prompt_tokens_details.cached_tokens for r in results]
    for p, r in zip(prompts, results):
        assert r.choices[0].text == tok.decode(bare_greedy(model, list(tok(p).input_ids), 8), skip_special_tokens=True)
    # tenant a (rows 0, 2) had the warm-up's prefix cached
    assert got[0] == expected_cached[0] > 0 and got[2] == expected_cached[2] > 0
    assert expected_cached[1] == expected_cached[3] == 0
    metrics = httpx.get(f"{url}/metrics").text
    if backend.runs_engine():
        assert blocker_running  # the four did not wait for the long request: they joined its steps and left first
        assert after["most_requests"] >= 5
        assert after["requests_finished"] - before["requests_finished"] == 6  # the warm-up, the blocker, the four
        # tenant b had nothing: the first of its two rows computed their common prefix, the other found it cached
        ids1, ids3 = (list(tok(prompts[i]).input_ids) for i in (1, 3))
        common = next(i for i, (a, b) in enumerate(zip(ids1, ids3)) if a != b)
        assert sorted([got[1], got[3]]) == [0, common // BS * BS]
        assert 'prefixcache_engine_most_step_requests{replica="local"} ' in metrics
    else:
        assert after["batch_rows"] - before["batch_rows"] == 6
        assert after["batches"] - before["batches"] == 3  # the warm-up, the blocker, then the four together
        assert after["max_batch_size"] >= 4
        assert got == expected_cached  # one batch: each row its own cached prefix, none from its neighbours
        assert 'prefixcache_max_batch_size{replica="local"} ' in metrics
    _idle(backend, pcm)


ENGINE_ONLY = {  # request fields only the engine implements: the batcher refuses them rather than ignore them
    "seed": {"seed": 3},
    "top_k": {"top_k": 5},
    "stop": {"stop": "x"},
    "stop_token_ids": {"stop_token_ids": [3]},
    "ignore_eos": {"ignore_eos": True},
    "logprobs": {"logprobs": 1},
    "echo": {"echo": True},
}


@pytest.mark.parametrize("srv", ["batcher"], indirect=True)
@pytest.mark.parametrize("field", list(ENGINE_ONLY))
def test_the_batcher_refuses_what_only_the_engine_does(srv, field):
    url, client, pcm, backend = srv
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "a", **ENGINE_ONLY[field]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    _idle(backend, pcm)


def _stop_case(model, tok) -> tuple[list[int], str, str, str, int]:
    """A prompt and its bare greedy reply's text with two one-character stop strings in it (ASCII, first seen at
    characters 1 <= p < q); the first, the second, and the tokens generated until the decoded reply first held the
    first."""
    for k in range(16):
        ids = list(tok(f"stop strings {k}").input_ids)
        free = bare_greedy(model, ids, 24)
        text = tok.decode(free, skip_special_tokens=True)
        firsts = [p for p in range(1, len(text)) if text[p].isascii() and text[p].isprintable()]
        firsts = [p for p in firsts if text.find(text[p]) == p]
        if len(firsts) >= 2:
            c = text[firsts[0]]
            n = next(n for n in range(1, len(free) + 1) if c in tok.decode(free[:n], skip_special_tokens=True))
            return ids, text, c, text[firsts[1]], n
    raise AssertionError("no two usable stop strings in 16 greedy replies")


@engine_only
def test_stop_strings_end_the_reply_before_them(srv, bare):
    """OpenAI's ``stop``: the reply is the bare model's greedy text up to (not including) the first stop string,
    finish_reason "stop", completion_tokens counting what was generated until the string appeared; the same in a
    stream; the earliest of several wins; a stop string that never appears changes nothing."""
    url, client, pcm, backend = srv
    model, tok = bare
    ids, full, stop, later, generated = _stop_case(model, tok)
    before = full[: full.find(stop)]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == before
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == generated
    chunks = list(
        client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0, stop=stop, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == before
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0, stop=[later, stop])
    assert r.choices[0].text == before
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0, stop=later)
    assert r.choices[0].text == full[: full.find(later)]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0, stop=["never \u2603 here"])
    assert r.choices[0].text == full
    _idle(backend, pcm)


def _bare_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log-softmax of the bare model's logits at every position of ``ids`` (float32)."""
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)


@engine_only
def test_echo_logprobs_are_the_bare_models_and_served_from_cache(srv, bare):
    url, client, pcm, backend = srv
    model, tok = bare
    salt = _salt()
    context = list(tok("Echo scoring test: the context every choice shares, long enough for blocks. ").input_ids)
    choices = [list(tok(c).input_ids)[1:] for c in (" Paris.", " Rome, of course.", " Paris")]  # no BOS
    cached = []
    for cont in [*choices, choices[0]]:
        ids = context + cont
        body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
        r = httpx.post(f"{url}/v1/completions", json={**body, "cache_salt": salt}, timeout=60).json()
        lp = r["choices"][0]["logprobs"]
        ref = _bare_logprobs(model, ids)
        assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        want = ref[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        got = torch.tensor(lp["token_logprobs"][1 : len(ids)])
        assert (got - want).abs().max().item() < 1e-4
        # the one generated token: greedy, with its log-prob; each position's top-1 is the argmax
        nxt = int(ref[-1].argmax())
        assert r["choices"][0]["text"] == tok.decode(ids, skip_special_tokens=True) + tok.decode([nxt])
        assert abs(lp["token_logprobs"][-1] - float(ref[-1, nxt])) < 1e-4
        for i in range(1, len(ids)):
            (top,) = lp["top_logprobs"][i].values()
            assert abs(top - float(ref[i - 1].max())) < 1e-4
        assert lp["text_offset"] == sorted(lp["text_offset"])
        cached.append(r["usage"]["prompt_tokens_details"]["cached_tokens"])
    # the first computes the context; the others find it (and its tokens' log-probs) cached
    assert cached[0] == 0 and all(c >= (len(context) - 1) // BS * BS for c in cached[1:])
    assert cached[3] >= (len(context) + len(choices[0]) - 1) // BS * BS
    # echo with max_tokens 0 scores the prompt only
    body = {"model": MODEL, "prompt": context, "max_tokens": 0, "logprobs": 0, "echo": True, "cache_salt": salt}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    assert r["usage"]["completion_tokens"] == 0 and len(r["choices"][0]["logprobs"]["token_logprobs"]) == len(context)
    _idle(backend, pcm)


@engine_only
def test_chat_logprobs_seed_and_stop_token_ids(srv, bare):
    url, client, pcm, backend = srv
    model, tok = bare
    messages = [{"role": "user", "content": "Give me log-probs, please."}]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    ids = _chat_ids(tok, messages)
    want = bare_greedy(model, ids, 6)
    content = r.choices[0].logprobs.content
    assert len(content) == len(want)
    ref = _bare_logprobs(model, ids + want)
    for i, item in enumerate(content):
        row = ref[len(ids) - 1 + i]
        assert abs(item.logprob - float(row[want[i]])) < 1e-4 and len(item.top_logprobs) <= 2
        assert abs(item.top_logprobs[0].logprob - float(row.max())) < 1e-4

    # a per-request seed: the same seed draws the same tokens, whatever runs beside it
    def sampled(seed: int) -> str:
        out = client.completions.create(model=MODEL, prompt="seeded", max_tokens=12, temperature=1.0, seed=seed)
        return out.choices[0].text

    assert sampled(7) == sampled(7)
    assert len({sampled(s) for s in range(4)}) > 1
    # stop_token_ids: generation stops after the first of them
    ids = list(tok("stop here").input_ids)
    free = bare_greedy(model, ids, 8)
    stop = free[3]
    r = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=8, temperature=0, extra_body={"stop_token_ids": [stop]}
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == free.index(stop) + 1
    _idle(backend, pcm)


BAD_REQUESTS = {
    "malformed json": ("completions", b'{"model": "tiny", "prompt": "a",', 400, None, None),
    "not an object": ("completions", b"[1, 2, 3]", 400, None, None),
    "max_tokens a string": ("completions", {"model": MODEL, "prompt": "a", "max_tokens": "5"}, 400, "max_tokens", None),
    "temperature a string": (
        "chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "temperature": "hot"},
        400,
        "temperature",
        None,
    ),
    "prompt a number": ("completions", {"model": MODEL, "prompt": 5}, 400, "prompt", None),
    "messages not a list": ("chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages", None),
    "unknown role": (
        "chat/completions",
        {"model": MODEL, "messages": [{"role": "wizard", "content": "a"}]},
        400,
        None,
        None,
    ),
    "stream not a bool": ("completions", {"model": MODEL, "prompt": "a", "stream": "yes"}, 400, "stream", None),
    "missing prompt": ("completions", {"model": MODEL}, 400, "prompt", None),
    "unknown model": ("completions", {"model": "gpt-9", "prompt": "a"}, 404, "model", "model_not_found"),
    "prompt longer than the context": (
        "completions",
        {"model": MODEL, "prompt": "z" * 2100},
        400,
        "prompt",
        "context_length_exceeded",
    ),
    "prompt + max_tokens beyond the context": (
        "completions",
        {"model": MODEL, "prompt": "z" * 2000, "max_tokens": 100},
        400,
        "max_tokens",
        "context_length_exceeded",
    ),
    "token id outside the vocabulary": ("completions", {"model": MODEL, "prompt": [1, 2, 99999]}, 400, "prompt", None),
    "empty salt": ("completions", {"model": MODEL, "prompt": "a", "cache_salt": ""}, 400, "cache_salt", None),
    "n > 1": ("completions", {"model": MODEL, "prompt": "a", "n": 2}, 400, "n", None),
    "an empty stop string": ("completions", {"model": MODEL, "prompt": "a", "stop": ["x", ""]}, 400, "stop", None),
    "logprobs above 5": ("completions", {"model": MODEL, "prompt": "a", "logprobs": 6}, 400, "logprobs", None),
    "echo with stream": (
        "completions",
        {"model": MODEL, "prompt": "ab", "echo": True, "stream": True},
        400,
        "echo",
        None,
    ),
    "max_tokens 0 without echo": (
        "completions",
        {"model": MODEL, "prompt": "a", "max_tokens": 0},
        400,
        "max_tokens",
        None,
    ),
    "top_logprobs without logprobs": (
        "chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "top_logprobs": 2},
        400,
        "top_logprobs",
        None,
    ),
    "stop id outside the vocabulary": (
        "completions",
        {"model": MODEL, "prompt": "a", "stop_token_ids": [100000]},
        400,
        "stop_token_ids",
        None,
    ),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_input_gets_an_error_object_and_the_server_keeps_serving(srv, case):
    url, client, pcm, backend = srv
    path, body, status, param, code = BAD_REQUESTS[case]
    kwargs = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    r = httpx.post(f"{url}/v1/{path}", timeout=60, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param
    assert err["code"] == code
    _idle(backend, pcm)
    ok = client.completions.create(model=MODEL, prompt="still serving", max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens == 3


def test_unknown_route_and_models_health_metrics(srv):
    url, client, pcm, backend = srv
    r = httpx.get(f"{url}/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    before = httpx.get(f"{url}/metrics").text
    r = client.completions.create(model=MODEL, prompt="metrics " * 10, max_tokens=4, temperature=0)
    after = httpx.get(f"{url}/metrics").text

    def value(text: str, name: str) -> float:
        line = next(ln for ln in text.splitlines() if ln.startswith(name + " ") or ln.startswith(name + "{"))
        return float(line.rsplit(" ", 1)[1])

    assert (
        value(after, "prefixcache_prompt_tokens_total") - value(before, "prefixcache_prompt_tokens_total")
        == r.usage.prompt_tokens
    )
    assert (
        value(after, "prefixcache_completion_tokens_total") - value(before, "prefixcache_completion_tokens_total") == 4
    )
    assert value(after, "prefixcache_time_to_first_token_seconds_count") > value(
        before, "prefixcache_time_to_first_token_seconds_count"
    )
    stats = pcm.cache_stats()
    assert value(after, "prefixcache_cache_blocks_used") == stats["blocks_used"]
    assert value(after, "prefixcache_cache_token_hit_rate") == pytest.approx(stats["token_hit_rate"])
    for name in (
        "prefixcache_cache_evicted_blocks_total",
        "prefixcache_cache_pool_occupancy",
        "prefixcache_queue_length",
    ):
        value(after, name)


def test_client_disconnecting_mid_stream_stops_its_row_and_leaves_no_pin(srv):
    url, client, pcm, backend = srv
    inserted = pcm.cache_stats()["blocks_inserted"]
    body = {"model": MODEL, "prompt": "disconnect me", "max_tokens": 1500, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [json.loads(ln[6:]) for ln in (next(lines) for _ in range(3)) if ln.startswith("data: {")]
        assert got  # the stream was running
    deadline = time.monotonic() + 60
    while backend.worker.stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    _idle(backend, pcm)
    # the row stopped soon after the client left: far fewer than 1500 tokens' blocks were cached
    assert pcm.cache_stats()["blocks_inserted"] - inserted < 1500 // BS // 2
    ok = client.completions.create(model=MODEL, prompt="after the disconnect", max_tokens=3, temperature=0)
    assert ok.choices[0].finish_reason == "length"


def test_sampling_requests_run_batched_too(srv):
    url, client, pcm, backend = srv
    r = client.completions.create(model=MODEL, prompt="sample", max_tokens=5, temperature=0.8, top_p=0.9)
    assert r.usage.completion_tokens <= 5 and r.choices[0].finish_reason in ("stop", "length")
    _idle(backend, pcm)


@pytest.mark.timeout(600)  # starts `prefixcache serve` as a subprocess: ~90 s on 2 loaded cores
def test_sigterm_lets_the_running_request_finish_then_exits_0(tmp_path, bare):
    model, tok = bare
    want = bare_greedy(model, list(tok("finish me").input_ids), 300)
    log = tmp_path / "server.log"
    with cli_server(["--model", MODEL, "--block-size", str(BS)], log) as (proc, url):
        body = {
            "model": MODEL,
            "prompt": "finish me",
            "max_tokens": 300,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        chunks = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    if len(chunks) == 2:
                        proc.send_signal(signal.SIGTERM)  # mid-request
                elif line == "data: [DONE]":
                    break
        # it ran to its own end: all of the bare model's tokens, the same text
        assert chunks[-1]["usage"]["completion_tokens"] == len(want) > 2
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        assert text == tok.decode(want, skip_special_tokens=True)
        assert proc.wait(timeout=60) == 0, log.read_text()


def test_cli_dtype_bfloat16_serves_the_bare_bfloat16_models_replies(tmp_path):
    """``--dtype bfloat16``: weights and K/V in bf16; every reply, the cached re-send's too, is the bare bf16
    model's greedy text (not the float32 model's: the test checks the two differ somewhere)."""
    model16, tok = build_preset(MODEL, dtype=torch.bfloat16)
    model32, _ = build_preset(MODEL)
    prompts = [f"{'shared system text ' * 6}question {i}" for i in range(3)]
    want = [bare_greedy(model16, list(tok(p).input_ids), 16) for p in prompts]
    assert any(w != bare_greedy(model32, list(tok(p).input_ids), 16) for w, p in zip(want, prompts))
    log = tmp_path / "server.log"
    with cli_server(["--model", MODEL, "--dtype", "bfloat16", "--block-size", str(BS)], log) as (_, url):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        for round_ in range(2):  # the second round is served from the cache
            for p, w in zip(prompts, want):
                r = client.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0)
                assert r.choices[0].text == tok.decode(w, skip_special_tokens=True), (round_, p)
                if round_:
                    assert r.usage.prompt_tokens_details.cached_tokens >= BS


# ---- the command's own user errors (no server comes up) ------------------------------------------------------
def _cli(*args: str):
    from typer.testing import CliRunner

    from prefixcache import cli

    return CliRunner().invoke(cli.app, ["serve", *args])


def test_cli_names_the_missing_extra_and_exits_2(monkeypatch):
    import importlib

    real = importlib.import_module

    def without_fastapi(name, *a, **k):
        if name == "fastapi":
            raise ImportError("No module named 'fastapi'", name="fastapi")
        return real(name, *a, **k)

    monkeypatch.setattr(importlib, "import_module", without_fastapi)
    r = _cli("--model", MODEL)
    assert r.exit_code == 2 and "pip install 'prefixcache[serve]'" in r.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "no-such-model"], "neither a preset"),
        (["--replicas", "2", "--router", "random"], "unknown policy 'random'"),
        (["--address", "ray://x:10001"], "--address joins a Ray cluster"),
        (["--dtype", "float8"], "--dtype: unknown dtype 'float8'"),
        (["--prefill-order", "random"], "prefill_order must be one of ('shortest', 'arrival'), got 'random'"),
    ],
)
def test_cli_user_errors_exit_2(args, message):
    r = _cli(*args)
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output
