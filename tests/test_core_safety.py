"""Namespaces, hash collisions, exceptions inside lookup, bad input, token containers, import hygiene."""

from __future__ import annotations

import gc
import random
import subprocess
import sys

import numpy as np
import pytest

from prefixcache import CacheConfig, PrefixCache

CONSTANT_HASH = b"x" * 16


def weak_hasher(parent: bytes, block: bytes) -> bytes:
    """Every block of every prefix collides."""
    return CONSTANT_HASH


# ---- namespaces ------------------------------------------------------------------------------------------
def test_namespaces_never_share_blocks(serve):
    cache = PrefixCache(CacheConfig(num_blocks=16, block_size=2))
    tokens = [1, 2, 3, 4, 5]
    for ns in ("tenant-a", "tenant-b"):
        m = cache.match(tokens, namespace=ns)
        assert m.cached_tokens == 0
        r = cache.commit(m.handle)
        assert r.block_ids and r.first_block == 0
        cache.release(m.handle)
    assert cache.num_cached_blocks == 4  # two copies of two blocks
    with cache.lookup(tokens, namespace="tenant-a") as a, cache.lookup(tokens, namespace="tenant-b") as b:
        assert a.cached_tokens == b.cached_tokens == 4
        assert not set(a.block_ids) & set(b.block_ids)
    assert cache.probe(tokens, namespace="other") == 0 and cache.probe(tokens) == 0
    m = cache.match_keys([10, 11, 12], namespace="tenant-a")
    assert m.cached_tokens == 0
    cache.commit_keys(m.handle)
    cache.release(m.handle)
    m = cache.match_keys([10, 11, 12], namespace="tenant-b")
    assert m.cached_tokens == 0
    cache.release(m.handle)
    cache.check_integrity()


# ---- forced hash collisions ----------------------------------------------------------------------------
def test_constant_hash_with_verification_never_serves_wrong_kv():
    """Brute force: every served block must hold exactly the prompt's tokens at that position."""
    bs = 2
    cache = PrefixCache(CacheConfig(num_blocks=8, block_size=bs), hasher=weak_hasher)
    content: dict[int, tuple] = {}  # pool block id -> the tokens the caller wrote into it
    rng = random.Random(0)
    hits = 0
    for _ in range(400):
        prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 9))]
        m = cache.match(prompt)
        assert m.cached_tokens <= (len(prompt) - 1) // bs * bs
        for i, b in enumerate(m.block_ids):
            assert content[b] == tuple(prompt[i * bs : (i + 1) * bs]), "a collision served another prompt's KV"
        hits += m.cached_blocks
        seq = prompt + [rng.randrange(3) for _ in range(rng.randrange(4))]
        r = cache.commit(m.handle, seq)
        for j, b in enumerate(r.block_ids):
            k = r.first_block + j
            content[b] = tuple(seq[k * bs : (k + 1) * bs])
        cache.release(m.handle)
        cache.check_integrity()
    assert hits >= 20  # the check above ran on real hits


def test_constant_hash_without_verification_gives_wrong_hits(serve):
    """Why verify_tokens is the default: with it off, a hash collision serves another prompt's blocks."""
    cache = PrefixCache(CacheConfig(num_blocks=8, block_size=2, verify_tokens=False), hasher=weak_hasher)
    _, r = serve(cache, [1, 2, 3, 4, 5])
    m = cache.match([6, 7, 8, 9, 1])  # shares no token with the cached prompt
    assert m.cached_tokens == 4 and m.block_ids == r.block_ids
    cache.release(m.handle)
    checked = PrefixCache(CacheConfig(num_blocks=8, block_size=2), hasher=weak_hasher)
    serve(checked, [1, 2, 3, 4, 5])
    assert checked.probe([6, 7, 8, 9, 1]) == 0 and checked.probe([1, 2, 3, 4, 5]) == 4


def test_collision_in_the_middle_of_a_run_is_caught(serve):
    cache = PrefixCache(CacheConfig(num_blocks=8, block_size=2), hasher=weak_hasher)
    serve(cache, [1, 2, 3, 4, 5, 6, 0])
    m, r = serve(cache, [1, 2, 9, 9, 5, 6, 0])  # first block shared, second collides
    assert m.cached_tokens == 2 and r.first_block == 1 and r.not_cached == 2 and r.block_ids == ()
    assert cache.probe([1, 2, 9, 9, 5, 6, 0]) == 2 and cache.probe([1, 2, 3, 4, 5, 6, 0]) == 6


# ---- exceptions between lookup and release ---------------------------------------------------------------
def test_exception_inside_lookup_unpins_everything(serve):
    cache = PrefixCache(CacheConfig(num_blocks=4, block_size=2))
    serve(cache, [1, 1, 2, 2, 3])
    with pytest.raises(RuntimeError, match="model crashed"), cache.lookup([1, 1, 2, 2, 3, 3, 4, 4, 5]) as m:
        assert m.cached_tokens == 4
        cache.commit(m.handle)
        raise RuntimeError("model crashed")
    assert cache.num_active_requests == 0
    cache.check_integrity()
    assert cache.num_cached_blocks == 4 and cache.num_free_blocks == 0
    # Nothing stays pinned: a disjoint request can take over the whole pool.
    _, r = serve(cache, [7, 7, 8, 8, 9, 9, 6, 6, 5])
    assert len(r.block_ids) == 4 and r.not_cached == 0
    assert cache.probe([1, 1, 2, 2, 3]) == 0 and cache.stats.blocks_evicted == 4


def test_keyboard_interrupt_inside_lookup_unpins():
    cache = PrefixCache(CacheConfig(num_blocks=4, block_size=1))
    with pytest.raises(KeyboardInterrupt), cache.lookup([1, 2, 3]) as m:
        cache.commit(m.handle)
        raise KeyboardInterrupt
    assert cache.num_active_requests == 0
    cache.check_integrity()


def test_release_inside_lookup_is_not_repeated():
    cache = PrefixCache(CacheConfig(num_blocks=4, block_size=1))
    with cache.lookup([1, 2, 3]) as m:
        cache.commit(m.handle)
        cache.release(m.handle)
    assert cache.num_active_requests == 0
    cache.check_integrity()


# ---- bad input -------------------------------------------------------------------------------------------
BAD_CALLS = [
    ("float ids", lambda c, h: c.match([1.5, 2.0]), TypeError, "integer token ids.*float64"),
    ("string id", lambda c, h: c.match(["a", 1]), TypeError, r"tokens\[0\] is 'a'"),
    ("None inside", lambda c, h: c.match([1, None, 2]), TypeError, r"tokens\[1\] is None"),
    ("a str prompt", lambda c, h: c.match("hello"), TypeError, "1-D sequence of integer token ids, got str"),
    ("negative id", lambda c, h: c.match([3, 4, -1]), ValueError, r"tokens\[2\] is -1; token ids must be >= 0"),
    ("huge id", lambda c, h: c.match([1, 2**40]), ValueError, r"tokens\[1\].*2\*\*31"),
    ("huge python int", lambda c, h: c.match([1, 2**70]), ValueError, r"tokens\[1\].*2\*\*31"),
    ("2-D list", lambda c, h: c.match([[1, 2], [3, 4]]), ValueError, r"must be 1-D, got shape \(2, 2\)"),
    ("2-D array", lambda c, h: c.match(np.ones((1, 3), np.int64)), ValueError, "must be 1-D"),
    ("ragged", lambda c, h: c.match([[1, 2], [3]]), TypeError, "1-D sequence"),
    ("empty prompt", lambda c, h: c.match([]), ValueError, "empty"),
    ("empty keys", lambda c, h: c.match_keys([]), ValueError, "empty"),
    ("namespace int", lambda c, h: c.match([1, 2], namespace=3), TypeError, "namespace must be a str, got int"),
    ("probe namespace", lambda c, h: c.probe([1, 2], namespace=None), TypeError, "namespace must be a str"),
    ("commit bad tokens", lambda c, h: c.commit(h, [1, 2, 0.5]), TypeError, "float64"),
    ("commit_keys on tokens", lambda c, h: c.commit_keys(h), ValueError, "use commit"),
    ("not a handle", lambda c, h: c.release("request-1"), TypeError, "expected the handle.*got str"),
]


@pytest.mark.parametrize(("call", "exc", "message"), [b[1:] for b in BAD_CALLS], ids=[b[0] for b in BAD_CALLS])
def test_bad_input_is_a_clear_error_and_changes_nothing(serve, call, exc, message):
    cache = PrefixCache(CacheConfig(num_blocks=8, block_size=2))
    serve(cache, [5, 5, 6, 6, 7])
    m = cache.match([5, 5, 6, 6, 7])
    before = (cache.num_cached_blocks, cache.num_active_requests, cache.stats.as_dict())
    with pytest.raises(exc, match=message):
        call(cache, m.handle)
    cache.check_integrity()
    assert (cache.num_cached_blocks, cache.num_active_requests, cache.stats.as_dict()) == before
    r = cache.commit(m.handle)  # the live request still works
    assert r.first_block == 2 and r.block_ids == ()
    cache.release(m.handle)
    m2, _ = serve(cache, [5, 5, 6, 6, 7])
    assert m2.cached_tokens == 4


def test_handle_lifecycle_errors(serve):
    cache = PrefixCache(CacheConfig(num_blocks=8, block_size=2))
    other = PrefixCache(CacheConfig(num_blocks=8, block_size=2))
    m = cache.match([1, 2, 3])
    foreign = other.match([1, 2, 3])  # same request id (1) in another cache
    with pytest.raises(ValueError, match="does not belong to this cache"):
        cache.commit(foreign.handle)
    with pytest.raises(ValueError, match="does not belong to this cache"):
        cache.release(foreign.handle)
    cache.release(m.handle)
    with pytest.raises(ValueError, match=f"request {m.handle.id} was already released"):
        cache.release(m.handle)
    with pytest.raises(ValueError, match="already released"):
        cache.commit(m.handle)
    k = cache.match_keys([1, 2])
    with pytest.raises(ValueError, match="use commit_keys"):
        cache.commit(k.handle)
    cache.release(k.handle)
    old = cache.match([1, 2, 3])
    cache.reset()
    with pytest.raises(ValueError, match="does not belong to this cache"):
        cache.release(old.handle)
    for c in (cache, other):
        c.check_integrity()
    other.release(foreign.handle)
    other.check_integrity()


@pytest.mark.parametrize(
    ("kwargs", "exc", "message"),
    [
        ({"num_blocks": 0}, ValueError, "num_blocks must be > 0, got 0"),
        ({"num_blocks": -3}, ValueError, "num_blocks must be > 0"),
        ({"num_blocks": 2.5}, TypeError, "num_blocks must be an int, got float"),
        ({"num_blocks": "8"}, TypeError, "num_blocks must be an int, got str"),
        ({"num_blocks": 8, "block_size": 0}, ValueError, "block_size must be > 0"),
        ({"num_blocks": 8, "block_size": True}, TypeError, "block_size must be an int, got bool"),
        ({"num_blocks": 8, "block_size": 16.0}, TypeError, "block_size must be an int"),
        ({"num_blocks": 8, "eviction": "random"}, ValueError, "unknown policy 'random'; known: .*lru"),
        ({"num_blocks": 8, "hash_seed": -1}, ValueError, "hash_seed"),
    ],
)
def test_bad_config(kwargs, exc, message):
    with pytest.raises(exc, match=message):
        CacheConfig(**kwargs)


# ---- token containers ------------------------------------------------------------------------------------
def _trace(convert) -> list:
    cache = PrefixCache(CacheConfig(num_blocks=6, block_size=2))
    prompts = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 9, 9, 1], [7, 7, 7], [1, 2, 3, 4, 9, 9, 1, 0], [8, 8, 8, 8, 8, 8, 8]]
    out = []
    for p in prompts:
        m = cache.match(convert(p))
        r = cache.commit(m.handle, convert(p + [6, 6, 6]))
        cache.release(m.handle)
        cache.check_integrity()
        out.append((m.cached_tokens, m.block_ids, r.block_ids, r.first_block, r.not_cached, cache.probe(convert(p))))
    return out


def test_list_numpy_and_torch_tokens_behave_the_same():
    torch = pytest.importorskip("torch")
    expected = _trace(list)
    assert any(row[0] for row in expected) and any(row[4] == 0 and row[2] for row in expected)
    for convert in (
        tuple,
        lambda p: np.asarray(p, dtype=np.int64),
        lambda p: np.asarray(p, dtype=np.int32),
        lambda p: np.asarray(p, dtype=np.uint16),
        lambda p: np.asarray([0] + p, dtype=np.int64)[1:],  # a view with an offset
        lambda p: torch.tensor(p, dtype=torch.int64),
        lambda p: torch.tensor(p, dtype=torch.int32),
        lambda p: torch.tensor([p, p])[1],  # a row of a 2-D tensor
    ):
        assert _trace(convert) == expected


def test_torch_float_and_2d_tensors_are_refused():
    torch = pytest.importorskip("torch")
    cache = PrefixCache(CacheConfig(num_blocks=4, block_size=2))
    with pytest.raises(TypeError, match="float32"):
        cache.match(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"1-D, got shape \(1, 3\)"):
        cache.match(torch.tensor([[1, 2, 3]]))
    cache.check_integrity()


def test_import_does_not_pull_torch_or_transformers():
    code = (
        "import sys, prefixcache, prefixcache.core.cache, prefixcache.core.eviction, prefixcache.core.hashing;"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---- argument types (issue 10) ---------------------------------------------------------------------------
@pytest.mark.parametrize("num_tokens", [-100, 0, 1.5, "300", True, [3], np.float64(3)])
def test_match_keys_refuses_a_bad_num_tokens_and_changes_nothing(num_tokens):
    cache = PrefixCache(CacheConfig(num_blocks=8, block_size=4))
    with pytest.raises(ValueError, match="num_tokens must be an int"):
        cache.match_keys([1, 2], num_tokens=num_tokens)
    assert cache.stats.prompt_tokens == 0 and cache.stats.lookups == 0 and cache.num_active_requests == 0
    cache.check_integrity()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"verify_tokens": "no"}, "verify_tokens must be a bool, got str"),
        ({"verify_tokens": 0}, "verify_tokens must be a bool, got int"),
        ({"eviction": 3}, "eviction must be a str, got int"),
        ({"eviction": None}, "eviction must be a str, got NoneType"),
        ({"hash_seed": "7"}, "hash_seed must be an int, got str"),
        ({"hash_seed": 1.0}, "hash_seed must be an int, got float"),
        ({"hash_seed": True}, "hash_seed must be an int, got bool"),
        ({"block_size": np.bool_(True)}, "block_size must be an int, got bool"),
    ],
)
def test_every_config_field_is_type_checked(kwargs, message):
    with pytest.raises(TypeError, match=message):
        CacheConfig(**{"num_blocks": 8, **kwargs})


def test_a_pool_past_int64_block_ids_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"num_blocks must be < 2\*\*63"):
        CacheConfig(num_blocks=2**63)


def test_numpy_integers_are_ints_everywhere(serve):
    cfg = CacheConfig(num_blocks=np.int64(64), block_size=np.int32(2), hash_seed=np.uint64(7))
    assert (cfg.num_blocks, cfg.block_size, cfg.hash_seed) == (64, 2, 7)
    assert all(type(v) is int for v in (cfg.num_blocks, cfg.block_size, cfg.hash_seed))
    assert cfg == CacheConfig(num_blocks=64, block_size=2, hash_seed=7)
    clock = [0.0]
    cache = PrefixCache(CacheConfig(num_blocks=np.int16(8), block_size=2, eviction="priority"), clock=lambda: clock[0])
    m = cache.match([1, 2, 3, 4, 5])
    r = cache.commit(m.handle, keep_for=np.float32(10), keep_tokens=np.int64(2))
    assert r.cached_blocks == 2
    cache.release(m.handle)
    k = cache.match_keys([7, 8, 9], max_blocks=np.int8(1), num_tokens=np.int64(10))
    assert k.cached_tokens == 0
    cache.commit_keys(k.handle, keep_for=np.int64(5), keep_blocks=np.uint8(1))
    cache.release(k.handle)
    k = cache.match_keys([7, 8, 9], max_blocks=np.int64(1), num_tokens=np.int32(10))
    assert k.cached_tokens == 2 and cache.stats.prompt_tokens == 10 + 10 + 5
    cache.release(k.handle)
    cache.check_integrity()


@pytest.mark.parametrize(
    ("tokens", "given"),
    [
        (None, "NoneType"),
        ({1, 2, 3}, "set"),
        (frozenset({1, 2}), "frozenset"),
        ({1: 2, 3: 4}, "dict"),
        (iter([1, 2, 3]), "list_iterator"),
        ((t for t in [1, 2, 3]), "generator"),
        (map(int, "123"), "map"),
        (5, "int"),
        (np.int64(5), "int64"),
        (b"\x01\x02", "bytes"),
    ],
)
def test_tokens_of_the_wrong_kind_name_what_was_given(serve, tokens, given):
    cache = PrefixCache(CacheConfig(num_blocks=8, block_size=2))
    serve(cache, [1, 2, 3])
    m = cache.match([1, 2, 3])
    before = (cache.num_cached_blocks, cache.stats.as_dict())
    calls = [cache.match, cache.probe, cache.divergence]
    if tokens is not None:  # commit(handle, None) is the default commit: the prompt given to match
        calls.append(lambda t: cache.commit(m.handle, t))
    for call in calls:
        with pytest.raises(TypeError, match=f"1-D sequence of integer token ids, got {given}\\b") as e:
            call(tokens)
        assert "shape" not in str(e.value)
    assert (cache.num_cached_blocks, cache.stats.as_dict()) == before
    cache.release(m.handle)
    cache.check_integrity()


def test_commit_checks_the_ids_it_is_given():
    cache = PrefixCache(CacheConfig(num_blocks=8, block_size=2))
    seq = np.asarray([1, 2, 3, 4, 5, -6, 7], dtype=np.int32)
    m = cache.match(seq[:4])
    with pytest.raises(ValueError, match=r"tokens\[5\] is -6"):
        cache.commit(m.handle, seq)
    other = seq.copy()
    other[1] = -2  # the same ids elsewhere in memory: checked again
    with pytest.raises(ValueError, match=r"tokens\[1\] is -2"):
        cache.commit(m.handle, other)
    with pytest.raises(ValueError, match=r"tokens\[0\] is -1"):
        cache.commit(m.handle, np.asarray([-1, 2, 3, 4, 5], dtype=np.int32)[0:])
    seq[5] = 6
    r = cache.commit(m.handle, seq)
    assert r.cached_blocks == 3 and cache.num_active_requests == 1
    cache.release(m.handle)
    cache.check_integrity()


def test_reset_takes_the_old_tree_apart_for_reference_counting():
    """Nodes link to parents and children (cycles): reset frees the old tree at once, leaving the collector
    nothing to find, and the cache works as new."""
    cache = PrefixCache(CacheConfig(num_blocks=64, block_size=4))

    def fill() -> None:  # a function, so that no local outlives it holding a node
        for i in range(40):
            prompt = list(range(i % 5, i % 5 + 30)) + [i]
            with cache.lookup(prompt, namespace=f"ns{i % 3}") as m:
                cache.commit(m.handle, prompt)
            k = cache.match_keys([i % 4, i % 7, i])
            cache.commit_keys(k.handle, [i % 4, i % 7, i])
            cache.release(k.handle)

    fill()
    assert cache.num_cached_blocks > 0
    gc.collect()
    gc.disable()
    try:
        cache.reset()
        assert gc.collect() == 0
    finally:
        gc.enable()
    assert cache.num_cached_blocks == 0 and cache.probe(list(range(30))) == 0
    cache.check_integrity()
