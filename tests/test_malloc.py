"""engine.malloc: glibc's thresholds set for a serving process, and the switch that leaves them alone."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from engine import malloc

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt thresholds are glibc's")


# engine.malloc loaded from its file alone: importing the engine package would import torch in every child
LOAD = (
    "import importlib.util\n"
    f"spec = importlib.util.spec_from_file_location('m', {malloc.__file__!r})\n"
    "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
    "keep_freed_memory = m.keep_freed_memory\n"
)


def run(code: str, *args: str, **env: str) -> str:
    """``code`` in a fresh interpreter (mallopt is process-wide), ``keep_freed_memory`` defined; its stdout."""
    full = {k: v for k, v in os.environ.items() if k != malloc.ENV} | env
    argv = [sys.executable, "-c", LOAD + code, *args]
    return subprocess.run(argv, env=full, capture_output=True, text=True, check=True).stdout


def test_keep_freed_memory_applies_unless_switched_off() -> None:
    code = "print(keep_freed_memory())"
    assert run(code).strip() == "True"
    assert run(code, PREFIXCACHE_MALLOC="default").strip() == "False"
    assert run(code, PREFIXCACHE_MALLOC=" Default ").strip() == "False"


def test_freed_blocks_below_the_threshold_stay_in_the_heap() -> None:
    """An 8 MiB block comes from the heap and stays there, free, when freed (mallinfo2), instead of its own mmap."""
    code = (
        "import ctypes\n"
        "class MI(ctypes.Structure):\n"
        "    _fields_ = [(n, ctypes.c_size_t) for n in ('arena ordblks smblks hblks hblkhd usmblks fsmblks '\n"
        "                'uordblks fordblks keepcost').split()]\n"
        "libc = ctypes.CDLL('libc.so.6'); libc.mallinfo2.restype = MI\n"
        "libc.malloc.restype = ctypes.c_void_p; libc.free.argtypes = [ctypes.c_void_p]\n"
        "import sys\n"
        "if sys.argv[-1] == 'kept': keep_freed_memory()\n"
        "p = libc.malloc(8 << 20); mapped = libc.mallinfo2().hblkhd; libc.free(p)\n"
        "print(mapped >= 8 << 20, libc.mallinfo2().fordblks >= 8 << 20)\n"
    )
    assert run(code, "default").split()[0] == "True"  # glibc's default: a mapping of its own, unmapped on free
    assert run(code, "kept").split() == ["False", "True"]  # kept: from the heap, which keeps it free for the next one


THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def _thp_offered() -> bool:
    if not os.path.exists(THP):
        return False
    with open(THP) as f:
        return "[never]" not in f.read()


def test_huge_page_advice_needs_an_aligned_region_and_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    if platform.system() != "Linux":
        pytest.skip("madvise(MADV_HUGEPAGE) is Linux's")
    assert malloc.advise_huge_pages(malloc.HUGE_PAGE + 4096, malloc.HUGE_PAGE - 8192) is False  # no aligned 2 MiB
    monkeypatch.setenv(malloc.HUGEPAGES_ENV, "off")
    assert malloc.advise_huge_pages(0, 1 << 40) is False


@pytest.mark.skipif(not _thp_offered(), reason="no transparent huge pages")
def test_the_kv_pool_lies_on_huge_pages_unless_switched_off() -> None:
    """A CPU pool of 96 MiB: its mapping holds huge pages (smaps' AnonHugePages), none with PREFIXCACHE_HUGEPAGES=off."""
    code = (
        "import torch\n"
        "from engine.kv_pool import KVPool, LayerSpec\n"
        "pool = KVPool([LayerSpec((8, 64), (8, 64))] * 2, 3072, 16, dtype=torch.float32, device='cpu')\n"
        "t = pool.layer(0)[0]\n"
        "start, stop = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()\n"
        "huge, inside = 0, False\n"
        "for line in open('/proc/self/smaps'):  # the mappings over the pool side (madvise splits its own)\n"
        "    head = line.split()[0]\n"
        "    if '-' in head and ':' not in head:\n"
        "        lo, hi = (int(x, 16) for x in head.split('-'))\n"
        "        inside = lo < stop and start < hi\n"
        "    elif inside and head == 'AnonHugePages:':\n"
        "        huge += int(line.split()[1])\n"
        "print(huge)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != malloc.HUGEPAGES_ENV}
    cwd = os.path.dirname(os.path.dirname(malloc.__file__))

    def huge_kib(**extra: str) -> int:
        out = subprocess.run([sys.executable, "-c", code], env=env | extra, cwd=cwd, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-2000:]
        return int(out.stdout.split()[-1])

    assert huge_kib() >= 2048
    assert huge_kib(PREFIXCACHE_HUGEPAGES="off") == 0
