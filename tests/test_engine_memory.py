"""The KV pool's size is checked against the device's available memory before it is allocated."""

from __future__ import annotations

import warnings

import pytest
import torch
from cli_testutil import one_line_error
from typer.testing import CliRunner

from engine import PoolSizeWarning, PoolTooLargeError, PrefixCachedModel, memory
from engine.kv_pool import KVPool
from engine.models import load_model
from prefixcache import cli

# the `tiny` preset: 2 layers x 2 KV heads x head dim 16 (64 / 4 heads), K and V, fp32 = 2*2*2*16*4 bytes
TINY_BYTES_PER_TOKEN = 512


@pytest.fixture(scope="module")
def tiny():
    model, _ = load_model("tiny")
    return model


def available(monkeypatch, nbytes: int) -> None:
    monkeypatch.setattr(memory, "available_memory", lambda device: memory.Available(nbytes, "test figure"))


def no_allocation(monkeypatch) -> None:
    def refuse(self):
        raise AssertionError("the pool was allocated")

    monkeypatch.setattr(KVPool, "_allocate", refuse)


def test_an_over_large_pool_is_refused_before_allocation_naming_bytes_and_memory(tiny, monkeypatch):
    available(monkeypatch, 1_000_000)
    no_allocation(monkeypatch)
    with pytest.raises(PoolTooLargeError) as exc:
        PrefixCachedModel(tiny, max_cached_tokens=200_000)
    msg = str(exc.value)
    assert f"{TINY_BYTES_PER_TOKEN * 200_000:,} bytes" in msg  # 102,400,000: bytes per token x tokens
    assert f"{TINY_BYTES_PER_TOKEN:,} bytes of K/V per token x 200,000 tokens" in msg
    assert "102.4 MB" in msg and "1.0 MB available (test figure)" in msg
    assert "max_cached_tokens" in msg and "check_memory=False" in msg


def test_the_byte_figure_is_the_pools_own(tiny, monkeypatch):
    """The figure the check names is what the pool then holds (nbytes), not an estimate."""
    available(monkeypatch, 10**12)
    pcm = PrefixCachedModel(tiny, max_cached_tokens=4096)
    assert pcm.pool.nbytes == TINY_BYTES_PER_TOKEN * 4096


def test_a_pool_close_to_the_limit_warns_and_is_allocated(tiny, monkeypatch):
    need = TINY_BYTES_PER_TOKEN * 1024
    available(monkeypatch, int(need / 0.7))  # 70% of what is available: between WARN_SHARE and ERROR_SHARE
    with pytest.warns(PoolSizeWarning, match=r"70% of it"):
        pcm = PrefixCachedModel(tiny, max_cached_tokens=1024)
    assert pcm.pool.nbytes == need


def test_a_pool_that_fits_easily_is_silent(tiny, monkeypatch):
    available(monkeypatch, TINY_BYTES_PER_TOKEN * 1024 * 3)  # a third
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PrefixCachedModel(tiny, max_cached_tokens=1024)


def test_max_cached_bytes_is_checked_too(tiny, monkeypatch):
    available(monkeypatch, 1_000_000)
    no_allocation(monkeypatch)
    with pytest.raises(PoolTooLargeError, match="1.0 MB available"):
        PrefixCachedModel(tiny, max_cached_bytes=50_000_000)


def test_check_memory_false_allocates_anyway(tiny, monkeypatch):
    available(monkeypatch, 1_000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pcm = PrefixCachedModel(tiny, max_cached_tokens=256, check_memory=False)
    assert pcm.pool.nbytes == TINY_BYTES_PER_TOKEN * 256


def test_a_pool_remade_on_a_dtype_change_is_checked(monkeypatch):
    model, _ = load_model("tiny")
    pcm = PrefixCachedModel(model, max_cached_tokens=1024)
    available(monkeypatch, 1_000)
    no_allocation(monkeypatch)
    pcm.double()  # the next cached call remakes the pool in float64: twice the bytes
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with pytest.raises(PoolTooLargeError, match=f"{2 * TINY_BYTES_PER_TOKEN * 1024:,} bytes"):
        pcm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)


def test_cpu_memory_is_read_from_proc_meminfo(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemFree:         1000000 kB\nMemAvailable:    7654321 kB\n")
    monkeypatch.setattr(memory, "MEMINFO", meminfo)
    got = memory.available_memory("cpu")
    assert got == memory.Available(7_654_321 * 1024, "MemAvailable in /proc/meminfo")


def test_unknown_devices_are_not_checked(monkeypatch):
    assert memory.available_memory("meta") is None
    memory.check_pool(10**9, 10**9, "meta")  # nothing to compare with: silent


def test_serve_refuses_an_over_large_pool_in_one_line(monkeypatch):
    pytest.importorskip("fastapi")
    available(monkeypatch, 1_000_000)
    r = CliRunner().invoke(cli.app, ["serve", "--model", "tiny", "--max-cached-tokens", "200000"])
    one_line_error(r, "the KV pool needs 102.4 MB", "1.0 MB available", "--max-cached-tokens")


def test_replay_refuses_an_over_large_pool_in_one_line(tmp_path, monkeypatch):
    available(monkeypatch, 1_000)
    scenario = tmp_path / "s.yaml"
    scenario.write_text("requests:\n  - text: hello there, this is a prompt\n")
    r = CliRunner().invoke(cli.app, ["replay", str(scenario), "--capacity", "4096", "--no-progress"])
    one_line_error(r, "the KV pool needs", "available (test figure)")


def test_cuda_memory_is_the_free_bytes_of_that_device(monkeypatch):
    """On CUDA the figure is torch.cuda.mem_get_info's free bytes of the pool's device (no GPU needed here)."""
    asked = []

    def mem_get_info(device):
        asked.append(device)
        return 3_000_000, 80_000_000_000

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    got = memory.available_memory("cuda:1")
    assert got == memory.Available(3_000_000, "free on cuda:1 (torch.cuda.mem_get_info)")
    assert asked == [torch.device("cuda:1")]
    with pytest.raises(PoolTooLargeError, match=r"cuda:1 has 3.0 MB available"):
        memory.check_pool(512, 10_000, "cuda:1")  # 5,120,000 bytes
