"""engine.malloc: glibc's thresholds set for a serving process, and the switch that leaves them alone."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

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


def test_the_commands_that_run_a_model_keep_freed_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """`replay` and `eval` run the model in their own process, as `serve` does, so they set the thresholds too (the
    call is recorded here, not made: mallopt would outlive the test in this process)."""
    from pathlib import Path

    from typer.testing import CliRunner

    from prefixcache import cli

    calls: list[str] = []
    monkeypatch.setattr(malloc, "keep_freed_memory", lambda: calls.append("kept") or True)
    scenario = Path(__file__).resolve().parents[1] / "scenarios" / "shared_prompt.yaml"
    args = ["replay", str(scenario), "--max-requests", "1", "--no-baseline", "--no-progress"]
    r = CliRunner().invoke(cli.app, args)
    assert r.exit_code == 0, r.output
    assert calls == ["kept"]

    pytest.importorskip("lm_eval")
    import lm_eval.__main__

    from engine.lm_eval_model import cli_main

    ran: list[list[str]] = []
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: ran.append(list(sys.argv)))
    assert cli_main(["--tasks", "none"]) == 0
    assert calls == ["kept", "kept"] and ran == [["lm-eval", "--tasks", "none"]]


def _thp_mode() -> str | None:
    """The kernel's transparent-huge-page mode (``always``, ``madvise``, ``never``), or None where there is none."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text.split("[")[1].split("]")[0] if "[" in text else None


def _huge_kib_at(address: int) -> int:
    """AnonHugePages (KiB) of this process's mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="no transparent huge pages to ask for")
def test_the_pool_and_the_small_row_weights_lie_in_huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """The KV pool's tensors and the small-row kernel's weights are asked for huge pages before they are touched,
    and the kernel backs them so (smaps); ``PREFIXCACHE_HUGE_PAGES=off`` asks for nothing; the values are the same."""
    import torch

    from engine.kv_pool import KVPool, LayerSpec
    from engine.paged.linear import PackedLinears

    # tensors over glibc's largest mmap threshold (32 MiB): fresh mappings, never touched heap memory
    pool = KVPool([LayerSpec((4, 64), (4, 64))], 10240, 16, dtype=torch.float32, device="cpu")  # 40 MiB a side
    k, _ = pool.layer(0)
    assert pool.huge_pages and _huge_kib_at(k.data_ptr() + k.numel() * 2) >= 2048
    assert not k.any()  # zeroed after the advice

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.Linear(4096, 2048))  # 64 MiB of weights
    packed = PackedLinears(model)
    if packed.small_rows:
        assert packed.huge_pages
        w = packed._small[0].weight
        assert _huge_kib_at(w.data_ptr() + w.numel() * 2) >= 2048
        x = torch.randn(8, 2048)
        with torch.no_grad():
            want = model(x)
            with packed.active():
                got = model(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    monkeypatch.setenv(malloc.HUGE_ENV, "off")
    assert not KVPool([LayerSpec((4, 64), (4, 64))], 64, 16, dtype=torch.float32, device="cpu").huge_pages
    assert not malloc.advise_huge_pages(k.data_ptr(), 1 << 22)


def test_advise_huge_pages_needs_an_aligned_huge_page() -> None:
    """A range that holds no whole 2 MiB-aligned page is not advised (nothing to back), and says so."""
    assert not malloc.advise_huge_pages(malloc.HUGE_PAGE + 4096, malloc.HUGE_PAGE)
    assert not malloc.advise_huge_pages(0, 4096)
