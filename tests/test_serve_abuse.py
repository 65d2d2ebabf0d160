"""``prefixcache serve`` under abuse, one abuse at a time, on the engine and on the batched-generate worker: a full
queue (429 with Retry-After), a request the pool can never hold (400 at admission), a client that goes away
before its first token or mid-stream, a slow reader, a shutdown's drain. After each, the pool's pinned and owned
blocks are back to idle (``/debug/cache``, which also runs ``check_integrity()``) and the next request gets the
bare model's reply."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from serve_testutil import bare_greedy, cli_server, server_thread

from engine.models import build_preset
from engine.runtime import ModelRuntime, RuntimeConfig
from engine.serve.app import create_app
from engine.serve.backend import LocalBackend

MODEL, BS, POOL = "tiny", 16, 1024


@pytest.fixture(scope="module")
def bare():
    return build_preset(MODEL)


@pytest.fixture(scope="module", params=["engine", "batcher"])
def srv(request):
    runtime = ModelRuntime.load(MODEL, RuntimeConfig(max_cached_tokens=POOL, block_size=BS))
    backend = LocalBackend(runtime, MODEL, use_engine=request.param == "engine")
    app = create_app(backend, default_max_tokens=8, max_queued_requests=2, debug=True)
    with server_thread(app) as url:
        yield url, app, request.param, backend


def idle(url: str) -> dict:
    """``/debug/cache`` once nothing is in flight: asserts a consistent pool with no pinned or owned block."""
    deadline = time.monotonic() + 60
    while True:
        got = httpx.get(f"{url}/debug/cache", timeout=30).json()
        local = got["replicas"]["local"]
        if (got["in_flight"] == 0 and local["active_requests"] == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert got["in_flight"] == 0, got
    assert local["integrity"] == "ok" and local["pinned_blocks"] == local["owned_blocks"] == 0, local
    assert local["free_blocks"] + local["cached_blocks"] == local["blocks"]
    return local


def exact(url: str, bare, prompt: str = "the next request is exact", n: int = 6) -> None:
    model, tok = bare
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    want = bare_greedy(model, list(tok(prompt).input_ids), n)
    assert r.json()["choices"][0]["text"] == tok.decode(want, skip_special_tokens=True)


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name) and not ln.startswith("#"))


def test_a_full_queue_gets_429_with_retry_after(srv, bare):
    url, _, _, backend = srv
    rejected = metric(url, "prefixcache_requests_rejected_total")
    release = threading.Event()
    backend.worker.run_exclusive(lambda: release.wait(60))  # the worker is busy: requests wait in flight
    body = {"model": MODEL, "prompt": "hold the line", "max_tokens": 4, "temperature": 0}
    waiting = [
        threading.Thread(target=httpx.post, args=(f"{url}/v1/completions",), kwargs={"json": body, "timeout": 60})
        for _ in range(2)
    ]
    for t in waiting:
        t.start()
    deadline = time.monotonic() + 30
    while metric(url, "prefixcache_requests_in_flight") < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 429 and r.headers["Retry-After"] == "1", r.text
        assert r.json()["error"]["code"] == "queue_full" and "--max-queued-requests 2" in r.text
    finally:
        release.set()
        for t in waiting:
            t.join(60)
    assert metric(url, "prefixcache_requests_rejected_total") == rejected + 1
    idle(url)
    exact(url, bare)


def test_a_request_the_pool_can_never_hold_gets_400_at_admission(srv, bare):
    url, _, worker, _ = srv
    body = {"model": MODEL, "prompt": [65] * (POOL - 10), "max_tokens": 50, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    if worker == "batcher":  # its rows hold their KV beside the pool: it runs
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 400 and r.json()["error"]["code"] == "kv_pool_exceeded", r.text
        assert f"holds {POOL}" in r.text
        fits = {**body, "max_tokens": 11}  # 1,014 + 10 tokens of KV: exactly the pool
        assert httpx.post(f"{url}/v1/completions", json=fits, timeout=120).status_code == 200
    idle(url)
    exact(url, bare)


def test_a_client_that_leaves_before_its_first_token_or_mid_stream(srv, bare):
    url, _, _, _ = srv
    aborted = metric(url, "prefixcache_requests_aborted_total")
    # long enough on a fast host that neither reply can finish before its client is gone (~990 tokens: the pool)
    body = {"model": MODEL, "prompt": "never mind " * 8, "max_tokens": 900, "temperature": 0}
    with pytest.raises(httpx.TimeoutException):  # gone before the reply
        httpx.post(f"{url}/v1/completions", json=body, timeout=0.05)
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        lines = r.iter_lines()
        next(lines), next(lines)  # gone after two chunks
    idle(url)
    assert metric(url, "prefixcache_requests_aborted_total") >= aborted + 2
    exact(url, bare)


def test_a_slow_reader_gets_the_whole_exact_reply(srv, bare):
    url, _, _, _ = srv
    model, tok = bare
    prompt, n = "read me slowly", 40
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
    text = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text.append(json.loads(line[6:])["choices"][0]["text"])
                time.sleep(0.02)
    want = bare_greedy(model, list(tok(prompt).input_ids), n)
    assert "".join(text) == tok.decode(want, skip_special_tokens=True)
    idle(url)


def test_draining_answers_503_and_health_says_so(srv, bare):
    url, app, _, _ = srv
    app.state.serving.draining = True
    try:
        h = httpx.get(f"{url}/health", timeout=30)
        assert h.status_code == 503 and h.json()["status"] == "draining"
        body = {"model": MODEL, "prompt": "late", "max_tokens": 2}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
    finally:
        app.state.serving.draining = False
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    exact(url, bare)


@pytest.mark.timeout(600)  # starts `prefixcache serve` as a subprocess
def test_sigterm_with_a_short_drain_timeout_exits_0_in_time(tmp_path):
    """A request longer than the drain timeout is cut at it (the client's stream ends early); the others that
    finish in time finish; the process exits 0 soon after the timeout."""
    log = tmp_path / "server.log"
    with cli_server(["--model", MODEL, "--drain-timeout", "2", "--debug-endpoints"], log) as (proc, url):
        body = {"model": MODEL, "prompt": "long " * 10, "max_tokens": 1900, "temperature": 0, "stream": True}
        got: list[str] = []

        def read() -> None:
            try:
                with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                    for line in r.iter_lines():
                        got.append(line)
            except httpx.HTTPError:
                got.append("error")

        reader = threading.Thread(target=read)
        reader.start()
        deadline = time.monotonic() + 60
        while len(got) < 3 and reader.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(got) >= 3 and got[0].startswith("data: {"), got
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()
        took = time.monotonic() - t0
        reader.join(60)
    assert took < 2 + 15, took
    assert sum(ln.startswith("data: {") for ln in got) < 1900  # cut before its 1,900 tokens
