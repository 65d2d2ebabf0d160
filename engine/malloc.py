"""glibc's malloc told to keep freed memory: a serving process's temporaries stop costing page faults.

A forward allocates tensors of megabytes and frees them a moment later: a prefill chunk's activations, and the
keys and values a prefill row gathers out of the pool (``engine.paged.attention._gather``: kv_len x heads x
head_dim floats per side and layer, 9 MB at 3k tokens on the ``small`` preset). torch's CPU allocator asks malloc
each time; glibc serves a request above its mmap threshold (128 KiB, raised only when such a block is freed)
with a fresh ``mmap`` and returns memory above its trim threshold to the kernel on ``free``, so the next tensor
of that size faults its pages in again, at a few GB/s. Measured on 2 cores (``python
benchmarks/bench_agent_attention.py``): gathering a 1.5k-token row's K/V took several times longer than with
freed memory kept. vLLM's CPU build avoids it by preloading tcmalloc; ``keep_freed_memory`` does it in-process
with ``mallopt``: blocks up to 32 MiB (glibc's largest mmap threshold) come from the heap, and the heap is not
trimmed below 1 GiB of free memory. The process keeps up to its peak of temporaries resident; the numbers it
computes are unchanged.

``prefixcache serve`` (and each Ray Serve replica), ``prefixcache replay`` and ``prefixcache eval`` call it at start
unless ``PREFIXCACHE_MALLOC=default``; the library's own calls (``generate_batch``, ``score``) leave a user's process
alone.

``advise_huge_pages`` asks for transparent huge pages over memory not touched yet: the KV pool (``engine.kv_pool``)
and the small-row kernel's weights (``engine.paged.linear``) take it, in every process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from collections.abc import Callable

from engine.switches import switched_off

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's HEAP_MAX_SIZE / 2 on 64-bit: the largest value it accepts
TRIM_THRESHOLD = 1024 * 1024 * 1024
ENV = "PREFIXCACHE_MALLOC"


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library (loaded once), or None where it cannot be found or loaded."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (see the module docstring). Returns whether both
    were set: False where ``PREFIXCACHE_MALLOC=default``, the C library is not glibc, or it refused."""
    if os.environ.get(ENV, "").strip().lower() == "default":
        return False
    libc = _libc()
    if libc is None:
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # glibc only: musl and others have no such thresholds
        return False
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


MADV_HUGEPAGE = 14  # linux/mman.h
HUGE_PAGE = 2 * 1024 * 1024
HUGE_ENV = "PREFIXCACHE_HUGE_PAGES"


def advise_huge_pages(address: int, nbytes: int) -> bool:
    """Ask Linux to back the 2 MiB-aligned part of ``[address, address + nbytes)`` with transparent huge pages
    (``madvise(MADV_HUGEPAGE)``), for memory not touched yet: pages fault in as 2 MiB pages where the kernel's THP
    setting is ``madvise`` or ``always``. Changes no byte of the memory. Returns whether the advice was taken: False
    where ``PREFIXCACHE_HUGE_PAGES=off``, not on Linux/glibc, the range holds no aligned 2 MiB, or the kernel refused.

    Why: the KV pool is read in blocks scattered over hundreds of MB (a block of one head is 4 KiB in fp32, a 4 KiB
    page), so with 4 KiB pages nearly every block a decoding row reads misses the TLB."""
    if switched_off(HUGE_ENV):
        return False
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    length = (address + nbytes - start) // HUGE_PAGE * HUGE_PAGE
    if length <= 0 or os.uname().sysname != "Linux":
        return False
    madvise = _madvise()
    return madvise is not None and madvise(start, length, MADV_HUGEPAGE) == 0


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """The C library's ``madvise`` with its argument types set (once), or None without a C library."""
    libc = _libc()
    if libc is None:
        return None
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise
