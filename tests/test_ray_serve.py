"""``prefixcache serve --replicas 2``: the app on Ray Serve with PrefixAwareRouter (Ray started here, 2 CPUs).

One deployment for the module (Ray and Serve take most of a minute to come up): a conversation's turns land on
the replica holding its history and are served from it exactly as the index predicted; once that replica has
evicted the history (small pools), the index knows and the router stops preferring it.
"""

from __future__ import annotations

import time
import uuid

import httpx
import openai
import pytest
from serve_testutil import bare_greedy, free_port

from engine.models import build_preset
from engine.serve import ServeConfig
from engine.serve.app import REPLICA_HEADER

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
pytestmark = pytest.mark.timeout(600)  # Ray and Serve come up in the first test's setup: ~90 s on 2 loaded cores

BS = 16
POOL_BLOCKS = 40
MODEL = "tiny"


@pytest.fixture(scope="module")
def cluster():
    from engine.serve.ray_app import RayConfig, build_app, start_index

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        cfg = ServeConfig(model=MODEL, max_cached_tokens=POOL_BLOCKS * BS, block_size=BS, batch_wait_ms=2)
        rcfg = RayConfig(replicas=2, router="prefix_balanced", replica_cpus=0.5)
        index = start_index(cfg, rcfg)
        serve.run(build_app(cfg, rcfg), name=rcfg.app_name, route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        _until_the_router_sees_both_replicas(url, client, index)
        yield url, client, index
    finally:
        serve.shutdown()
        ray.shutdown()


def _until_the_router_sees_both_replicas(url, client, index, timeout_s=120.0):
    """/health answers 200 once both replicas are up; the router logs a decision once it knows two of them."""
    deadline = time.monotonic() + timeout_s
    while httpx.get(f"{url}/health", timeout=30).status_code != 200:
        assert time.monotonic() < deadline, httpx.get(f"{url}/health", timeout=30).text
        time.sleep(0.2)
    for i in range(1000):
        client.completions.create(model=MODEL, prompt=f"warm-up {i}", max_tokens=1, extra_body={"cache_salt": f"w{i}"})
        if len({d["replica"] for d in ray.get(index.decisions.remote())}) == 2:
            return
        assert time.monotonic() < deadline, "the router never saw both replicas"


def _chat(client, messages, salt, max_tokens=6):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, extra_body={"cache_salt": salt}
    )
    return raw.parse(), raw.headers[REPLICA_HEADER]


def _last_decision(index) -> dict:
    return ray.get(index.decisions.remote())[-1]


def _match(index, tok, messages, salt) -> dict:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    return ray.get(index.match.remote(list(ids), f"salt:{salt}"))[0]


def test_turns_follow_their_history_and_an_eviction_turns_the_router_away(cluster):
    url, client, index = cluster
    model, tok = build_preset(MODEL)
    salt_a, salt_b = "conv-a", "conv-b"
    system = "You are the assistant of a routing test. Keep the whole history in mind. " * 2
    conv = [{"role": "system", "content": system}, {"role": "user", "content": "First question?"}]
    home = None
    for turn in range(4):
        ids = list(tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)["input_ids"])
        r, replica = _chat(client, conv, salt_a)
        assert r.choices[0].message.content == tok.decode(bare_greedy(model, ids, 6), skip_special_tokens=True)
        d = _last_decision(index)
        assert d["replica"] == replica == d["chosen"]
        # the router's index predicted exactly what the replica served
        assert d["matched_blocks"] * BS == r.usage.prompt_tokens_details.cached_tokens
        if turn == 0:
            home = replica
            assert d["reason"] == "cold"
            # another tenant's first turn finds nothing and goes to the idle replica
            _, other = _chat(client, [{"role": "user", "content": "Tenant B says hi."}], salt_b)
            assert other != home and _last_decision(index)["reason"] == "cold"
        else:
            assert replica == home and d["reason"] == "prefix"
            assert r.usage.prompt_tokens_details.cached_tokens >= len(tok(system).input_ids) // BS * BS
        conv += [{"role": "assistant", "content": r.choices[0].message.content}]
        conv += [{"role": "user", "content": f"Follow-up number {turn}?"}]
    assert _match(index, tok, conv, salt_a).get(home, 0) > 0

    # flood both replicas with other tenants' long prompts: more than a pool each
    evicted_before = _figures(url)
    for i in range(8):
        _chat(client, [{"role": "user", "content": f"flood {i} " + "x" * 280}], f"flood-{uuid.uuid4().hex[:6]}", 4)
    assert _figures(url)[home] > evicted_before.get(home, 0)  # the history's replica did evict
    assert _match(index, tok, conv, salt_a) == {}  # ... the history too, and the index knows it

    r, replica = _chat(client, conv, salt_a)
    d = _last_decision(index)
    assert d["reason"] == "cold" and d["matched_blocks"] == 0  # no longer drawn to its old replica
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # and indeed nobody held it


def _figures(url: str) -> dict[str, float]:
    """Evicted blocks per replica, from the ingress's /metrics (fed by the replicas through the index)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line.startswith("prefixcache_cache_evicted_blocks_total{"):
            replica = line.split('replica="', 1)[1].split('"', 1)[0]
            out[replica] = float(line.rsplit(" ", 1)[1])
    return out


def test_streaming_errors_and_metrics_through_ray(cluster):
    url, client, index = cluster
    model, tok = build_preset(MODEL)
    prompt = "Streaming through Ray Serve."
    want = tok.decode(bare_greedy(model, list(tok(prompt).input_ids), 10), skip_special_tokens=True)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    r = httpx.post(f"{url}/v1/completions", json={"model": "nope", "prompt": "a"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(f"{url}/v1/completions", content=b"{oops", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    replicas = {ln.split('replica="', 1)[1].split('"', 1)[0] for ln in metrics.splitlines() if 'replica="' in ln}
    assert len(replicas) == 2
    assert client.completions.create(model=MODEL, prompt="still fine", max_tokens=2, temperature=0).usage


def test_outstanding_counts_choices_at_once_and_ends_them_on_completion():
    from engine.serve.router import Outstanding

    now = [0.0]
    out = Outstanding(lapse_s=10, clock=lambda: now[0])
    out.chose("q1", "a")
    out.chose("q2", "a")  # a burst: the second choice already sees the first
    assert out.loads(["a", "b"]) == {"a": 2, "b": 0}
    out.routed("q2", "b")  # Ray used another replica (the chosen one was full)
    assert out.loads(["a", "b"]) == {"a": 1, "b": 1}
    out.completed("q2")
    now[0] = 11  # q1 was never routed: its caller gave up
    assert out.loads(["a", "b"]) == {"a": 0, "b": 0}
    out.chose("q3", "b")
    out.routed("q3", "b")
    now[0] = 100  # a routed request counts until it completes, however long it runs
    assert out.loads(["a", "b"]) == {"a": 0, "b": 1}
    out.completed("q3")
    assert out.loads(["a", "b"]) == {"a": 0, "b": 0}


def test_index_holder_applies_each_event_batch_once():
    """A replica resends what the holder has not acknowledged: a batch numbered at or below the last applied one
    is skipped (applying it twice would contradict the index and make it forget the replica); a lost batch (a
    gap) makes it forget that replica's blocks. References: the prompts' blocks counted by hand."""
    from engine.serve.router import IndexHolder
    from prefixcache import CacheConfig, PrefixCache

    bs, space = 4, "fp:t"
    cache = PrefixCache(CacheConfig(num_blocks=6, block_size=bs))
    events: list = []
    cache.subscribe(events.append)

    def batch(tokens: list[int]) -> tuple:
        m = cache.match(tokens, space)
        cache.commit(m.handle)
        cache.release(m.handle)
        out = tuple(events)
        events.clear()
        return out

    p1 = list(range(1, 14))  # 13 tokens: 3 full blocks, all servable ((13 - 1) // 4)
    p2 = [*range(1, 9), 50, 51, 52, 53, 54]  # shares p1's first 2 blocks, then 1 of its own
    holder = IndexHolder(block_size=bs)
    b1 = batch(p1)
    assert holder.publish("r1", "fp", [(1, b1)], {}) == 1
    assert holder.match(p1, "t") == ({"r1": 3}, 3)
    assert holder.publish("r1", "fp", [(1, b1)], {}) == 1  # re-sent whole: skipped
    b2 = batch(p2)
    assert holder.publish("r1", "fp", [(1, b1), (2, b2)], {}) == 2  # the unacknowledged tail after a re-sent one
    assert holder.match(p1, "t") == ({"r1": 3}, 3) and holder.match(p2, "t") == ({"r1": 3}, 3)
    assert holder.desyncs == 0 and holder.figures()["r1"]["index_blocks"] == 4
    assert holder.match(p1, "other") == ({}, 3)  # another tenant holds nothing
    holder.publish("r1", "fp", [(4, ())], {})  # batch 3 was lost: what r1 holds is unknown now
    assert holder.desyncs == 1 and holder.match(p1, "t") == ({}, 3)
    with pytest.raises(ValueError, match="another model"):
        holder.publish("r2", "fp2", [(1, ())], {})
