"""The second tier (engine.tier) against the bare model and by hand: blocks evicted from a small pool come back
from disk (LMDB) or a shared Redis with the same outputs; restarts, foreign, torn and corrupt entries, full and
read-only disks, concurrent and killed writers, a Redis server that goes away."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import engine as engine_pkg
from engine.models import load_model
from engine.tier import EntryError, KVTier, LmdbStore, TierWarning
from engine.tier.entry import HEADER, decode, encode
from engine.wrapper import PrefixCachedModel
from prefixcache.core import block_keys
from tests.serve_testutil import wait_healthy
from tests.tier_testutil import free_port, redis_server

BS = 16
POOL = 96  # tokens: the pool holds 6 blocks, one prompt's worth
NEW = 6
pytestmark = pytest.mark.filterwarnings("ignore::engine.wrapper.UncachedCallWarning")


@pytest.fixture(scope="module")
def tiny():
    model, tok = load_model("tiny")
    return model


@pytest.fixture(scope="module")
def other_weights():
    model, tok = load_model("tiny", seed=1)
    return model


def _prompts(n: int, length: int = 100, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 200, (1, length), generator=g) for _ in range(n)]


def _bare(model, ids: torch.Tensor) -> torch.Tensor:
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)


def _gen(pcm: PrefixCachedModel, ids: torch.Tensor) -> torch.Tensor:
    return pcm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)


def _wrap(model, tmp: Path | None = None, **kw) -> PrefixCachedModel:
    if tmp is not None:
        kw.setdefault("disk_cache", tmp)
    kw.setdefault("max_cached_tokens", POOL)
    return PrefixCachedModel(model, block_size=BS, **kw)


def _cycle(pcm, model, prompts, rounds: int = 2) -> list[int]:
    """Serve every prompt ``rounds`` times (each evicts the last from the pool): outputs must equal the bare
    model's; returns each call's tier tokens."""
    tiers = []
    for _ in range(rounds):
        for ids in prompts:
            assert torch.equal(_gen(pcm, ids), _bare(model, ids))
            tiers.append(pcm.last_request_stats[0].tier_tokens)
            pcm.cache.check_integrity()
            if pcm.tier is not None:
                pcm.tier.flush()
    return tiers


# ---- entries ---------------------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_torn_or_flipped_byte_of_an_entry_is_refused(data):
    tokens = bytes(range(64))
    kv = data.draw(st.binary(min_size=8, max_size=64))
    entry = bytearray(encode(b"B" * 16, b"K" * 16, tokens, kv))
    assert bytes(decode(entry, b"B" * 16, b"K" * 16, tokens, len(kv))) == kv
    how = data.draw(st.sampled_from(["flip", "truncate", "extend"]))
    if how == "flip":
        at = data.draw(st.integers(0, len(entry) - 1))
        if HEADER.size - 8 <= at < HEADER.size:
            return  # the write stamp is informational, not checked
        entry[at] ^= 1 << data.draw(st.integers(0, 7))
    elif how == "truncate":
        entry = entry[: data.draw(st.integers(0, len(entry) - 1))]
    else:
        entry += b"\0"
    with pytest.raises(EntryError):
        decode(entry, b"B" * 16, b"K" * 16, tokens, len(kv))


def test_an_entry_of_another_binding_key_or_tokens_is_refused():
    tokens, kv = bytes(64), bytes(32)
    entry = encode(b"A" * 16, b"K" * 16, tokens, kv)
    with pytest.raises(EntryError, match="another model"):
        decode(entry, b"B" * 16, b"K" * 16, tokens, 32)
    with pytest.raises(EntryError, match="another block"):
        decode(entry, b"A" * 16, b"J" * 16, tokens, 32)
    with pytest.raises(EntryError, match="other token ids"):
        decode(entry, b"A" * 16, b"K" * 16, bytes([1]) + bytes(63), 32)


# ---- the disk tier ---------------------------------------------------------------------------------------------
def test_blocks_evicted_from_the_pool_come_back_from_disk_with_the_same_outputs(tiny, tmp_path):
    prompts = _prompts(3)
    pcm = _wrap(tiny, tmp_path)
    tiers = _cycle(pcm, tiny, prompts)
    # first round: cold; second round: each prompt was evicted by the others and comes from disk
    assert tiers[:3] == [0, 0, 0]
    assert tiers[3:] == [(99 // BS) * BS] * 3
    st_ = pcm.cache_stats()
    assert st_["tier_hit_blocks"] == 3 * (99 // BS)
    assert st_["tier_corrupt_blocks"] == st_["tier_write_errors"] == st_["tier_write_skipped"] == 0
    # every block the pool ever inserted went to the tier exactly once (the tier-loaded ones are already there)
    assert st_["tier_written_blocks"] == st_["tier_stored_blocks"] == st_["tier_blocks"]
    pcm.close()


def test_the_engine_loads_from_the_tier_too(tiny, tmp_path):
    prompts = [p[0].tolist() for p in _prompts(3, seed=5)]
    pcm = _wrap(tiny, tmp_path, max_cached_tokens=128)  # the engine holds a prompt and its reply
    bare = [_bare(tiny, torch.tensor([p]))[0, len(p) :].tolist() for p in prompts]
    for rnd in range(2):
        for p, want in zip(prompts, bare):
            out = pcm.generate_batch([p], max_new_tokens=NEW)["req_0"]
            assert out.generated_tokens == want[: len(out.generated_tokens)] and out.finish_reason in ("length", "stop")
            assert out.cached_tokens == (0 if rnd == 0 else (len(p) - 1) // BS * BS)
            pcm.tier.flush()
            pcm.cache.check_integrity()
    assert pcm.cache_stats()["tier_hit_blocks"] == 3 * ((len(prompts[0]) - 1) // BS)
    pcm.close()


def test_a_restart_on_the_same_directory_serves_what_the_last_process_stored(tiny, tmp_path):
    ids = _prompts(1, 200)[0]
    pcm = PrefixCachedModel(tiny, max_cached_tokens=4096, block_size=BS, disk_cache=tmp_path)
    _gen(pcm, ids)
    pcm.close()
    again = PrefixCachedModel(tiny, max_cached_tokens=4096, block_size=BS, disk_cache=tmp_path)
    assert again.tier is not None and again.tier.restored_blocks == len(again.tier.index)
    assert torch.equal(_gen(again, ids), _bare(tiny, ids))
    assert again.last_request_stats[0].tier_tokens == (199 // BS) * BS
    again.close()


def test_another_model_dtype_or_block_size_never_reads_the_entries(tiny, other_weights, tmp_path):
    ids = _prompts(1, 120)[0]
    first = _wrap(tiny, tmp_path)
    _gen(first, ids)
    first.close()
    cases = [
        ("weights", lambda: _wrap(other_weights, tmp_path), other_weights),
        (
            "block size",
            lambda: PrefixCachedModel(tiny, max_cached_tokens=POOL, block_size=8, disk_cache=tmp_path),
            tiny,
        ),
    ]
    for what, make, model in cases:
        pcm = make()
        assert pcm.tier.restored_blocks == 0, what
        assert torch.equal(_gen(pcm, ids), _bare(model, ids)), what
        assert pcm.last_request_stats[0].tier_tokens == 0, what
        pcm.close()
    half = load_model("tiny", dtype="bfloat16")[0]
    pcm = _wrap(half, tmp_path)
    assert pcm.tier.restored_blocks == 0
    assert torch.equal(_gen(pcm, ids), _bare(half, ids))
    pcm.close()


def _entries(tier: KVTier) -> dict[bytes, bytes]:
    return dict(tier.store.iter_entries(tier.prefix))


def _put_raw(path: Path, tier: KVTier, key: bytes, value: bytes) -> None:
    tier.store.write([(tier.prefix + key, value)], [])


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_a_corrupt_truncated_or_foreign_entry_is_dropped_and_recomputed(tiny, tmp_path, damage):
    prompts = _prompts(3, seed=2)
    pcm = _wrap(tiny, tmp_path)
    _cycle(pcm, tiny, prompts, rounds=1)
    tier = pcm.tier
    keys = block_keys(prompts[0][0].numpy(), pcm.runtime.namespace("default"), block_size=BS)
    victim = keys[2]  # the third block of the first prompt: blocks 0-1 still come from disk
    raw = bytearray(_entries(tier)[victim])
    if damage == "flip":
        raw[-5] ^= 0xFF
    elif damage == "truncate":
        raw = raw[: len(raw) // 2]
    else:  # another prompt's entry stored under this key
        raw = bytearray(
            _entries(tier)[block_keys(prompts[1][0].numpy(), pcm.runtime.namespace("default"), block_size=BS)[2]]
        )
    _put_raw(tmp_path, tier, victim, bytes(raw))
    with pytest.warns(TierWarning, match=f"disk cache {tmp_path}.*dropped the entry of block {victim.hex()}"):
        out = _gen(pcm, prompts[0])
    assert torch.equal(out, _bare(tiny, prompts[0]))
    assert pcm.last_request_stats[0].tier_tokens == 2 * BS
    assert pcm.cache_stats()["tier_corrupt_blocks"] == 1
    pcm.tier.flush()
    # the bad entry is gone from the store; the recomputed block was written anew and verifies
    fixed = _entries(tier)[victim]
    decode(fixed, tier.prefix, victim, prompts[0][0, 2 * BS : 3 * BS].to(torch.int32).numpy().tobytes(), tier.kv_bytes)
    pcm.close()


def test_a_full_disk_is_reported_and_requests_go_on(tiny, tmp_path):
    prompts = _prompts(3, seed=3)
    pcm = _wrap(tiny, tmp_path)
    pcm.tier.store.env.set_mapsize(1 << 16)  # a real LMDB "map full": the store cannot grow
    with pytest.warns(TierWarning, match=f"disk cache {tmp_path}: a write failed"):
        _cycle(pcm, tiny, prompts, rounds=2)
    s = pcm.cache_stats()
    assert s["tier_write_errors"] > 0 and s["tier_written_blocks"] == 0
    assert s["tier_blocks"] == 0 and "MapFullError" in s["tier_last_error"]
    pcm.close()


def test_enospc_from_the_filesystem_is_reported_and_requests_go_on(tiny, tmp_path, monkeypatch):
    pcm = _wrap(tiny, tmp_path)

    def full(puts, deletes):
        raise OSError(28, "No space left on device", str(tmp_path))

    monkeypatch.setattr(pcm.tier.store, "write", full)
    with pytest.warns(TierWarning, match="No space left on device"):
        _cycle(pcm, tiny, _prompts(2, seed=4), rounds=2)
    assert pcm.cache_stats()["tier_write_errors"] > 0
    pcm.close()


def test_a_read_only_directory_serves_its_entries_and_writes_none(tiny, tmp_path, monkeypatch):
    prompts = _prompts(2, seed=6)
    pcm = _wrap(tiny, tmp_path)
    _cycle(pcm, tiny, prompts[:1], rounds=1)
    pcm.close()
    os.chmod(tmp_path, 0o555)
    try:
        if os.geteuid() == 0:  # root ignores permission bits: make the store see what a user would
            monkeypatch.setattr("engine.tier.lmdb_store.os.access", lambda path, mode: False)
        with pytest.warns(TierWarning, match="read-only"):
            ro = _wrap(tiny, tmp_path)
        assert ro.tier.store.readonly
        tiers = _cycle(ro, tiny, prompts, rounds=1)
        assert tiers == [(99 // BS) * BS, 0]
        assert ro.cache_stats()["tier_written_blocks"] == 0
        ro.close()
    finally:
        os.chmod(tmp_path, 0o755)


def test_a_tier_larger_than_the_disk_is_capped_with_a_warning(tiny, tmp_path):
    import shutil

    total = shutil.disk_usage(tmp_path).total
    with pytest.warns(TierWarning, match="exceeds the disk's free space; capped"):
        pcm = _wrap(tiny, tmp_path, max_disk_bytes=total * 100)
    assert pcm.tier.store.max_bytes < total
    assert pcm.tier.index.capacity_blocks == pcm.tier.store.max_bytes // pcm.tier.binding.entry_bytes
    pcm.close()


def test_the_tier_budget_evicts_least_recently_used_blocks_from_the_store(tiny, tmp_path):
    prompts = _prompts(3, seed=7)
    probe = _wrap(tiny, tmp_path / "probe")
    entry = probe.tier.binding.entry_bytes
    probe.close()
    pcm = _wrap(tiny, tmp_path / "t", max_disk_bytes=10 * entry)  # 10 blocks: one prompt and a half
    _cycle(pcm, tiny, prompts, rounds=1)
    tier = pcm.tier
    assert len(tier.index) == 10 and len(_entries(tier)) == 10
    assert tier.index.stats.evicted_blocks == tier.index.stats.stored_blocks - 10
    # the most recent prompt's blocks are the ones kept
    last = block_keys(prompts[2][0].numpy(), pcm.runtime.namespace("default"), block_size=BS)
    assert set(last) <= set(_entries(tier))
    pcm.close()


def test_a_full_write_queue_skips_writes_without_blocking(tiny, tmp_path):
    pcm = _wrap(tiny, tmp_path)
    pcm.tier.max_queue_bytes = 0
    _cycle(pcm, tiny, _prompts(2, seed=8), rounds=2)
    s = pcm.cache_stats()
    assert s["tier_write_skipped"] > 0 and s["tier_written_blocks"] == 0 and s["tier_hit_blocks"] == 0
    pcm.close()


def test_bad_tier_options_get_clear_errors(tiny, tmp_path):
    with pytest.raises(ValueError, match="not both"):
        _wrap(tiny, tmp_path, shared_cache="redis://127.0.0.1:1")
    with pytest.raises(ValueError, match="max_disk_bytes needs disk_cache"):
        _wrap(tiny, max_disk_bytes="1G")
    with pytest.raises(ValueError, match="max_disk_bytes.*such as 50G"):
        _wrap(tiny, tmp_path, max_disk_bytes="lots")
    with pytest.raises(ValueError, match="holds no block"):
        _wrap(tiny, tmp_path, max_disk_bytes=100)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(RuntimeError, match=f"disk cache {blocker / 'sub'}: cannot create"):
        _wrap(tiny, blocker / "sub")


# ---- several processes on one directory --------------------------------------------------------------------------
_WRITER = textwrap.dedent(
    """
    import sys, types
    for name in ("engine", "engine.tier"):  # the store alone: no torch to import
        pkg = types.ModuleType(name)
        pkg.__path__ = [sys.argv[3] + name.replace("engine", "", 1).replace(".", "/")]
        sys.modules[name] = pkg
    from engine.tier.lmdb_store import LmdbStore
    from engine.tier.entry import encode
    store = LmdbStore(sys.argv[1], 1 << 28)
    rounds = int(sys.argv[2])
    for r in range(rounds):
        puts = []
        for i in range(50):
            key = i.to_bytes(16, "little")
            puts.append((b"P" * 16 + key, encode(b"P" * 16, key, bytes(64), bytes([i % 251]) * 4096)))
        store.write(puts, [])
        print(r, flush=True)
    """
)


def _check_store(path: Path) -> int:
    store = LmdbStore(path, 1 << 28)
    n = 0
    for key, raw in store.iter_entries(b"P" * 16):
        i = int.from_bytes(key, "little")
        assert bytes(decode(raw, b"P" * 16, key, bytes(64), 4096)) == bytes([i % 251]) * 4096
        n += 1
    assert store.scan(b"P" * 16) and len(store.scan(b"P" * 16)) == n
    store.close()
    return n


def _writer(path: Path, rounds: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    return subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(path), str(rounds), str(Path(engine_pkg.__file__).parent)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_two_processes_writing_the_same_blocks_at_once_leave_valid_entries(tmp_path):
    procs = [_writer(tmp_path, 20) for _ in range(2)]
    for p in procs:
        assert p.wait(120) == 0
    assert _check_store(tmp_path) == 50


def test_a_writer_killed_mid_write_leaves_only_whole_entries(tmp_path):
    p = _writer(tmp_path, 100_000)
    assert p.stdout is not None
    p.stdout.readline()  # it has committed at least one transaction
    time.sleep(0.2)
    p.send_signal(signal.SIGKILL)
    p.wait(30)
    assert _check_store(tmp_path) == 50


# ---- the shared tier (Redis) -------------------------------------------------------------------------------------
def test_two_wrappers_share_blocks_through_redis_and_survive_it_stopping(tiny, tmp_path):
    ids, later = _prompts(2, 100, seed=9)
    with redis_server(tmp_path) as redis:
        a = _wrap(tiny, shared_cache=redis.url)
        b = _wrap(tiny, shared_cache=redis.url)
        assert torch.equal(_gen(a, ids), _bare(tiny, ids))
        a.tier.flush()
        assert torch.equal(_gen(b, ids), _bare(tiny, ids))
        assert b.last_request_stats[0].tier_tokens == (99 // BS) * BS  # prefilled by a, served to b
        redis.stop()
        started = time.monotonic()
        with pytest.warns(TierWarning, match=f"shared cache {redis.url}"):
            assert torch.equal(_gen(b, later), _bare(tiny, later))
            b.tier.flush()
        assert time.monotonic() - started < 30  # short socket timeouts: nothing hangs
        s = b.cache_stats()
        assert s["tier_read_errors"] + s["tier_write_errors"] + s["tier_write_skipped"] > 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TierWarning)
            assert torch.equal(_gen(a, later), _bare(tiny, later))  # the other one too
        a.close()
        b.close()


@contextmanager
def _servers(args: list[str], logs: list[Path], timeout_s: float = 180.0) -> Iterator[list[str]]:
    """``prefixcache serve ARGS`` processes started together (one per log), each at a free port; yields their
    URLs once every /health answers; kills them after."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    procs, urls = [], []
    try:
        for log in logs:
            port = free_port()
            cmd = [
                sys.executable,
                "-c",
                "from prefixcache.cli import main; main()",
                "serve",
                *args,
                "--port",
                str(port),
            ]
            with open(log, "w") as out:
                procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env))
            urls.append(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + timeout_s
        for proc, url, log in zip(procs, urls, logs):
            wait_healthy(proc, url, log, deadline)
        yield urls
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_two_serve_processes_share_a_prefix_through_redis(tmp_path, tiny):
    prompt = _prompts(1, 120, seed=10)[0][0].tolist()
    with redis_server(tmp_path) as redis:
        args = ["--model", "tiny", "--shared-cache", redis.url, "--max-cached-tokens", "4096"]
        with _servers(args, [tmp_path / "a.log", tmp_path / "b.log"]) as (url_a, url_b):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": NEW, "temperature": 0}
            first = httpx.post(f"{url_a}/v1/completions", json=body, timeout=120).json()
            assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # a's writer puts the blocks on the server after the request
                written = _metric(
                    httpx.get(f"{url_a}/metrics", timeout=30).text, "prefixcache_tier_written_blocks_total"
                )
                queued = _metric(httpx.get(f"{url_a}/metrics", timeout=30).text, "prefixcache_tier_queued_bytes")
                if written >= len(prompt) // BS and queued == 0:
                    break
                time.sleep(0.2)
            second = httpx.post(f"{url_b}/v1/completions", json=body, timeout=120).json()
            cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached == (len(prompt) - 1) // BS * BS
            assert second["choices"][0]["text"] == first["choices"][0]["text"]
            metrics = httpx.get(f"{url_b}/metrics", timeout=30).text
            assert "prefixcache_tier_hit_blocks_total" in metrics


def _metric(text: str, name: str) -> float:
    """The value of metric ``name`` (its first series) in a Prometheus text page."""
    line = next(ln for ln in text.splitlines() if ln.startswith(name + " ") or ln.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])
