"""The C attention kernel (``_paged_attention.c``: its decode path, and its prefill paths where the compiler targets
AVX-512, bf16 with AVX512-BF16): built with the system C compiler on first use, loaded with ctypes.

The shared object goes to ``$PREFIXCACHE_KERNEL_DIR`` (default ``~/.cache/prefixcache/kernels``), named by a hash
of the source, the flags and this CPU, and is rebuilt only when one of those changes. ``load()`` returns None,
and ``unavailable_reason()`` says why, when there is no compiler or the build fails: the engine then runs its
torch path (same results, slower). ``PREFIXCACHE_KERNEL=off`` turns the kernel off.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("_paged_attention.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fPIC", "-shared", "-fopenmp")
_lock = threading.Lock()
_state: dict[str, object] = {}


def kernel_dir() -> Path:
    env = os.environ.get("PREFIXCACHE_KERNEL_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "prefixcache" / "kernels"


def _cpu_tag() -> str:
    """What -march=native depends on: the CPU's model and flags."""
    try:
        info = Path("/proc/cpuinfo").read_text(errors="replace")
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return platform.machine() + "|" + "|".join(lines)


def _build(target: Path) -> str | None:
    """Compile the kernel into ``target``; returns None, or why it could not."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return "no C compiler (cc, gcc or clang) on PATH"
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        cmd = [cc, *FLAGS, str(SOURCE), "-o", str(out), "-lm"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{cc} failed to run: {exc}"
        if done.returncode != 0:
            return f"{' '.join(cmd)} failed: {done.stderr.strip()[-400:]}"
        os.replace(out, target)  # atomic: a concurrent builder sees the whole file or none
    return None


def load() -> ctypes.CDLL | None:
    """The kernel library (built on first use), or None when it cannot be had (see ``unavailable_reason``).
    Import torch first: the library's OpenMP runtime is then torch's own (same soname, already loaded)."""
    with _lock:
        if "lib" in _state:
            return _state["lib"]  # type: ignore[return-value]
        lib: ctypes.CDLL | None = None
        reason: str | None = None
        if os.environ.get("PREFIXCACHE_KERNEL", "").lower() in ("0", "off", "no", "false"):
            reason = "PREFIXCACHE_KERNEL=off"
        else:
            key = hashlib.sha256(SOURCE.read_bytes() + repr(FLAGS).encode() + _cpu_tag().encode()).hexdigest()[:16]
            target = kernel_dir() / f"paged_attention_{key}.so"
            try:
                if not target.exists():
                    reason = _build(target)
                if reason is None:
                    lib = ctypes.CDLL(str(target))
                    _declare(lib)
            except OSError as exc:
                reason, lib = f"cannot build or load {target}: {exc}", None
        _state["lib"], _state["reason"] = lib, reason
        return lib


def unavailable_reason() -> str | None:
    """Why ``load()`` gave None (None when the kernel is loaded or was not asked for yet)."""
    return _state.get("reason")  # type: ignore[return-value]


def _declare(lib: ctypes.CDLL) -> None:
    i64, i32, f32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    for fn in (lib.paged_attention_f32, lib.paged_attention_bf16):
        fn.restype = ctypes.c_int
        # q, q strides, k and v pools, pool blocks, block size, dim, Hkv, Hq, tables, table stride, q_start, q_len,
        # kv_len, rows, scale, softcap, window, split, out, threads
        fn.argtypes = [ptr, i64, i64, ptr, ptr, i64, i32, i32, i32, i32, ptr, i64, ptr, ptr, ptr, i32, f32, f32, i32]
        fn.argtypes += [i32, ptr, i32]
    for fn in (lib.paged_prefill_f32, lib.paged_prefill_bf16):
        fn.restype = ctypes.c_int
        fn.argtypes = [*lib.paged_attention_bf16.argtypes, ptr, i64]  # ..., scratch, its bytes
    lib.paged_prefill_scratch.restype = i64
    lib.paged_prefill_scratch.argtypes = [i32, i32]  # head dim, split: bytes per thread
    lib.paged_prefill_available.restype = ctypes.c_int
    lib.paged_prefill_available.argtypes = []


def prefill_available(lib: ctypes.CDLL, dtype: torch.dtype) -> bool:
    """Whether the library was built with its prefill path for pools of ``dtype``: float32 where the compiler
    targets AVX-512, bfloat16 where it targets AVX512-BF16 too."""
    built = int(lib.paged_prefill_available())
    return bool(built & 1) if dtype == torch.float32 else bool(built & 2) if dtype == torch.bfloat16 else False
