"""The engine's C libraries, built with the system C compiler on first use and loaded with ctypes: the attention
kernel (``_paged_attention.c``: its decode path, and its prefill paths where the compiler targets AVX-512 or
AVX2 with FMA, bf16 with AVX512-BF16; ``load()``), the fused element-wise ops (``_fused_ops.c``, ``load_fused()``; used by
``engine.paged.fused``) and the linears of a few rows (``_small_linear.c``, ``load_small_linear()``; used by
``engine.paged.linear``).

Each shared object goes to ``$PREFIXCACHE_KERNEL_DIR`` (default ``~/.cache/prefixcache/kernels``), named by a hash
of its source, its flags and this CPU, and is rebuilt only when one of those changes. A loader returns None, and
``unavailable_reason()`` says why, when there is no compiler or the build fails: the engine then runs its torch
path (same results, slower). ``PREFIXCACHE_KERNEL=off`` turns both off.

``PREFIXCACHE_KERNEL_MARCH`` (a gcc ``-march`` value, ``x86-64-v3`` say) builds every library for that target instead
of ``-march=native``: on a CPU with AVX-512 it gives the AVX2 + FMA builds that a CPU without AVX-512 gets, to test
them (``tests/test_kernel_targets.py``) or time them. The target must run on this CPU.
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
from collections.abc import Callable
from pathlib import Path

import torch

from engine.switches import switched_off

SOURCE = Path(__file__).with_name("_paged_attention.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fPIC", "-shared", "-fopenmp")
FUSED_SOURCE = Path(__file__).with_name("_fused_ops.c")
FUSED_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-fopenmp")  # no fma: torch's roundings
SMALL_LINEAR_SOURCE = Path(__file__).with_name("_small_linear.c")
_lock = threading.Lock()
_state: dict[str, tuple[ctypes.CDLL | None, str | None]] = {}  # name: (library, why not)


def target_flags(flags: tuple[str, ...], march: str | None = None) -> tuple[str, ...]:
    """``flags`` for ``march`` (default ``$PREFIXCACHE_KERNEL_MARCH``; unset: ``native``)."""
    march = march or os.environ.get("PREFIXCACHE_KERNEL_MARCH") or "native"  # a bad value: the build fails, saying so
    return tuple(f"-march={march}" if f == "-march=native" else f for f in flags)


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


def _build(source: Path, flags: tuple[str, ...], target: Path) -> str | None:
    """Compile ``source`` into ``target``; returns None, or why it could not."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return "no C compiler (cc, gcc or clang) on PATH"
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        cmd = [cc, *flags, str(source), "-o", str(out), "-lm"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{cc} failed to run: {exc}"
        if done.returncode != 0:
            return f"{' '.join(cmd)} failed: {done.stderr.strip()[-400:]}"
        os.replace(out, target)  # atomic: a concurrent builder sees the whole file or none
    return None


def load() -> ctypes.CDLL | None:
    """The attention kernel's library (built on first use), or None when it cannot be had (see
    ``unavailable_reason``). Import torch first: the library's OpenMP runtime is then torch's own (same soname,
    already loaded)."""
    return _load("paged_attention", SOURCE, target_flags(FLAGS), _declare)


# The prefill path's tunings, each off: the plain build that bench_agent_attention times and the tests compare
# against (the same bits either way; the macros are described in _paged_attention.c).
PREFILL_PLAIN = ("PF_HALF=0", "PF_PREFETCH=0", "PF_GROUP=1", "PF_GROUP_VALUES=0", "PF_CONTIG=0", "PF_PVB=0")
# Both paths asking for their keys and values into L1 (prefetcht0), as the kernel did before KV_HINT's L2 (the same
# bits; bench_engine_steps --ab l1-prefetch, bench_decode_roofline's blocks_read time it).
L1_PREFETCH = ("KV_HINT=3",)


def load_variant(*defines: str, march: str | None = None) -> ctypes.CDLL | None:
    """The attention kernel built with extra ``-D`` macro definitions (``"KV_AHEAD=1"``), or for another ``-march``
    target: a tuning or a build to compare against, cached beside ``load()``'s library (None as ``load()`` gives
    None, or when that target's build fails)."""
    name = "paged_attention_" + "_".join([d.replace("=", "") for d in defines] + ([march] if march else []))
    return _load(name, SOURCE, (*target_flags(FLAGS, march), *(f"-D{d}" for d in defines)), _declare)


def load_fused() -> ctypes.CDLL | None:
    """The fused element-wise ops' library (``_fused_ops.c``), or None (``unavailable_reason("fused_ops")``)."""
    return _load("fused_ops", FUSED_SOURCE, target_flags(FUSED_FLAGS), _declare_fused)


def load_small_linear(march: str | None = None) -> ctypes.CDLL | None:
    """The few-row linears' library (``_small_linear.c``), or None (``unavailable_reason("small_linear")``);
    ``march``: built for that ``-march`` target instead (``unavailable_reason(f"small_linear_{march}")``)."""
    name = f"small_linear_{march}" if march else "small_linear"
    return _load(name, SMALL_LINEAR_SOURCE, target_flags(FLAGS, march), _declare_small_linear)


def unavailable_reason(name: str = "paged_attention") -> str | None:
    """Why library ``name``'s loader gave None (None when it is loaded or was not asked for yet)."""
    return _state.get(name, (None, None))[1]


def _load(
    name: str, source: Path, flags: tuple[str, ...], declare: Callable[[ctypes.CDLL], None]
) -> ctypes.CDLL | None:
    with _lock:
        if name in _state:
            return _state[name][0]
        lib: ctypes.CDLL | None = None
        reason: str | None = None
        if switched_off("PREFIXCACHE_KERNEL"):
            reason = "PREFIXCACHE_KERNEL=off"
        else:
            key = hashlib.sha256(source.read_bytes() + repr(flags).encode() + _cpu_tag().encode()).hexdigest()[:16]
            target = kernel_dir() / f"{name}_{key}.so"
            try:
                if not target.exists():
                    reason = _build(source, flags, target)
                if reason is None:
                    lib = ctypes.CDLL(str(target))
                    declare(lib)
            except OSError as exc:
                reason, lib = f"cannot build or load {target}: {exc}", None
        _state[name] = (lib, reason)
        return lib


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
    targets AVX-512 or AVX2 with FMA, bfloat16 where it targets AVX512-BF16 too."""
    built = int(lib.paged_prefill_available())
    return bool(built & 1) if dtype == torch.float32 else bool(built & 2) if dtype == torch.bfloat16 else False


def builds() -> dict[str, str]:
    """What this CPU gets from the engine's C libraries and oneDNN, by part (``prefixcache doctor`` shows it):
    16-lane (AVX-512) or 8-lane (AVX2 + FMA) builds, the scalar fallback, or why a part is unavailable. Builds the
    libraries if they are not built yet; changes nothing else."""
    from engine.paged import attention, linear  # both import this module

    out: dict[str, str] = {}
    lib = load()
    if lib is None:
        out["attention kernel"] = f"unavailable ({unavailable_reason()}): torch's SDPA"
    else:
        lanes = "8-lane (AVX2)" if prefill_8lane(lib) else "16-lane (AVX-512)"
        out["attention: decoding rows"] = (
            lanes if prefill_available(lib, torch.float32) else "scalar (no AVX2 or AVX-512)"
        )
        for dtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
            if not prefill_available(lib, dtype):
                why = "no AVX512-BF16" if dtype == torch.bfloat16 else "neither AVX-512 nor AVX2 with FMA"
                out[f"attention: {name} prefill rows"] = f"torch's SDPA ({why})"
            elif prefill_8lane(lib):
                least, most = attention.PREFILL_MIN_QUERIES_F32, attention.PREFILL_MAX_QUERIES_8LANE
                out[f"attention: {name} prefill rows"] = f"{lanes}, rows of {least}-{most} new tokens; longer: SDPA"
            else:
                out[f"attention: {name} prefill rows"] = lanes
    small = load_small_linear()
    built = int(small.small_linear_available()) if small is not None else 0
    for dtype, name, bit in ((torch.float32, "float32", 1), (torch.bfloat16, "bfloat16", 2)):
        refused = linear.onednn_refuses(dtype)
        least, most = linear.small_rows_range(small, dtype) if built & bit else (0, -1)
        kind = "8-lane (AVX2)" if built & linear.AVX2_BUILD else "16-lane (AVX-512)"
        if refused is not None:
            out[f"linears: {name}"] = (
                f"the small-row kernel, {kind}, {least} rows or more; one row: the model's nn.Linear ({refused})"
                if most >= least
                else f"the model's nn.Linear ({refused})"
            )
            continue
        out[f"linears: {name}"] = (
            f"oneDNN, packed; {least}-{most} rows: the small-row kernel, {kind}" if most >= least else "oneDNN, packed"
        )
    return out


def prefill_8lane(lib: ctypes.CDLL) -> bool:
    """Whether the library's prefill path is its 8-lane (AVX2) build, not the AVX-512 one."""
    return bool(int(lib.paged_prefill_available()) & 4)


def _declare_fused(lib: ctypes.CDLL) -> None:
    i64, i32, f32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    lib.fused_rms_norm.restype = ctypes.c_int
    lib.fused_rms_norm.argtypes = [
        ptr,
        i64,
        ptr,
        ptr,
        i64,
        i64,
        i32,
        f32,
        i32,
        i32,
    ]  # x, ldx, w, out, ldo, rows, n, eps
    lib.fused_rotary.restype = ctypes.c_int
    # x, its strides, cos, sin, their strides, out, its strides, batch, heads, tokens, dim, bf, threads
    lib.fused_rotary.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, ptr, i32, i32, i32, i32, i32, i32]
    lib.kv_write.restype = ctypes.c_int
    # k, its token and head strides, v, its strides, k and v pools, elements per pool head, slots, tokens, heads,
    # dim, bytes per element
    lib.kv_write.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, ptr, i32, i32, i32, i32]


def _declare_small_linear(lib: ctypes.CDLL) -> None:
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    for fn in (lib.small_linear_f32, lib.small_linear_bf16):
        fn.restype = ctypes.c_int
        fn.argtypes = [ptr, i64, i32, ptr, i32, i32, ptr, ptr, i64, i32]  # x, ldx, rows, packed w, N, K, bias, y, ldy
    lib.small_linear_available.restype = ctypes.c_int
    lib.small_linear_available.argtypes = []
