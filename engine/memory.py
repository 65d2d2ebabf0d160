"""Checking a KV pool's size against the memory its device has free, before the pool is allocated.

A pool is allocated (and zeroed) in one go, so one that does not fit gets the process killed by the OOM killer
or fails deep inside torch; one that barely fits leaves no room for the model's activations. ``check_pool``
turns both into a message naming the pool's bytes (bytes per token x tokens) and the device's free memory:

* above ``ERROR_SHARE`` of the available memory: ``PoolTooLargeError`` (nothing is allocated);
* above ``WARN_SHARE`` of it: a ``PoolSizeWarning``, and the pool is allocated.

Available memory: on the CPU ``MemAvailable`` of ``/proc/meminfo`` (or psutil's ``available`` where there is no
``/proc``), on CUDA ``torch.cuda.mem_get_info``'s free bytes; elsewhere (mps, ...) it is unknown and nothing is
checked. ``PrefixCachedModel(..., check_memory=False)`` skips the check (a machine with swap, a pool meant to
page).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

ERROR_SHARE = 0.9  # a pool above this share of the available memory is refused
WARN_SHARE = 0.5  # a pool above this share of it warns
MEMINFO = Path("/proc/meminfo")


class PoolTooLargeError(ValueError):
    """A KV pool would not fit in the memory its device has available (nothing was allocated)."""


class PoolSizeWarning(UserWarning):
    """A KV pool takes more than half of the memory its device had available."""


@dataclass(frozen=True)
class Available:
    """Bytes a device has available, and where the figure comes from (for messages)."""

    bytes: int
    source: str


def available_memory(device: torch.device | str) -> Available | None:
    """What ``device`` has available for a new allocation, or None where that is unknown."""
    device = torch.device(device)
    if device.type == "cpu":
        return _cpu_available()
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return Available(int(free), f"free on {device} (torch.cuda.mem_get_info)")
    return None


def _cpu_available() -> Available | None:
    try:
        for line in MEMINFO.read_text(encoding="ascii").splitlines():
            if line.startswith("MemAvailable:"):
                return Available(int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil  # type: ignore[import-untyped]
    except ImportError:
        return None
    return Available(int(psutil.virtual_memory().available), "available memory (psutil)")


def human_bytes(n: float) -> str:
    """``n`` bytes as B, KB, MB, GB or TB (powers of 1000, one decimal above KB)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def pool_size_text(bytes_per_token: int, tokens: int) -> str:
    """A pool's size as ``bytes per token x tokens = total``."""
    return (
        f"{human_bytes(bytes_per_token * tokens)} ({bytes_per_token:,} bytes of K/V per token "
        f"x {tokens:,} tokens = {bytes_per_token * tokens:,} bytes)"
    )


def check_pool(
    bytes_per_token: int, tokens: int, device: torch.device | str, *, what: str = "the KV pool", fix: str | None = None
) -> None:
    """Refuse (``PoolTooLargeError``) or warn about (``PoolSizeWarning``) a pool of ``tokens`` tokens (or slots) of
    ``bytes_per_token`` bytes each on ``device`` (see the module docstring); silent when it fits easily or the
    device's memory is unknown. ``what``/``fix``: the pool's name and the option that sizes it, for the message."""
    avail = available_memory(device)
    if avail is None:
        return
    need = bytes_per_token * tokens
    if need <= WARN_SHARE * avail.bytes:
        return
    if what == "the KV pool":
        size = pool_size_text(bytes_per_token, tokens)
    else:
        size = f"{human_bytes(need)} ({bytes_per_token:,} bytes x {tokens:,} slots = {need:,} bytes)"
    what = f"{what} needs {size}; {device} has {human_bytes(avail.bytes)} available ({avail.source})"
    fix = fix or "lower max_cached_tokens / max_cached_bytes (or --max-cached-tokens)"
    if need > ERROR_SHARE * avail.bytes:
        raise PoolTooLargeError(f"{what}: it would not fit; {fix}, or pass check_memory=False to allocate it anyway")
    warnings.warn(
        f"{what}: {need / avail.bytes:.0%} of it, leaving little for the model; {fix}", PoolSizeWarning, stacklevel=3
    )
