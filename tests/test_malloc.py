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
