"""``prefixcache serve`` on a model with sliding-window layers (the ``tiny-swa`` preset, Gemma-3-shaped, window 32):
the window group on the engine and on the batcher. A chat longer than the window, a second user of the same system
prompt: replies equal the bare model's, later turns are served their history, and nothing stays pinned."""

from __future__ import annotations

import openai
import pytest
from serve_testutil import bare_greedy, server_thread

from engine import ModelRuntime, PrefixCachedModel, RuntimeConfig
from engine.models import build_preset
from engine.serve.app import create_app
from engine.serve.backend import LocalBackend

MODEL = "tiny-swa"


@pytest.fixture(scope="module")
def bare():
    return build_preset(MODEL)


@pytest.fixture(scope="module", params=["engine", "batcher"])
def srv(request):
    runtime = ModelRuntime.load(MODEL, RuntimeConfig(max_cached_tokens=8192, block_size=16))
    assert runtime.window is not None
    pcm = PrefixCachedModel.over(runtime)
    backend = LocalBackend(runtime, MODEL, max_batch_size=4, batch_wait_ms=5, use_engine=request.param == "engine")
    assert backend.runs_engine() == (request.param == "engine")
    with server_thread(create_app(backend, default_max_tokens=8)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60), pcm, backend


def test_a_chat_longer_than_the_window_equals_the_bare_model_and_hits(srv, bare) -> None:
    client, pcm, backend = srv
    model, tok = bare
    system = "You answer questions about the prefixcache test suite, briefly and exactly. " * 3
    for user in ("first", "second"):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": f"Hello from the {user} user"}]
        cached = []
        for turn in range(3):
            ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])
            want = bare_greedy(model, ids, 8)
            r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
            reply = r.choices[0].message.content
            assert reply == tok.decode(want, skip_special_tokens=True)
            cached.append(r.usage.prompt_tokens_details.cached_tokens)
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"And turn {turn}?"}]
        assert cached[1] > 0 and cached[2] > cached[1], cached  # each turn is served the history before it
        if user == "second":
            assert cached[0] > 0  # the system prompt the first user's chat kept (its message end is a hint)

    def check() -> int:
        pcm.cache.check_integrity()
        return pcm.cache.num_active_requests

    assert backend.worker.run_exclusive(check).result(timeout=60) == 0
    assert pcm.cache_stats()["window_points"] > 0
