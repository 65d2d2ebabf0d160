"""Prepacked linear layers for the CPU engine: oneDNN's matmul over weights reordered once, ahead of time.

PyTorch's CPU ``nn.Linear`` repacks its weight on every call; for the few rows of a decoding step (one token per
running request) that repacking is most of the cost (measured on the ``small`` preset, 2 cores, fp32: a forward
of 8 tokens 157 ms plain, 77 ms packed; of 512 tokens, 2,155 ms and 2,035 ms). ``PackedLinears(model)`` keeps a
packed copy of every ``nn.Linear`` weight (memory: one more copy of those weights) and ``active()`` routes the
layers' forward through it for the duration of a block, leaving the model as it was on exit. The results agree
with ``nn.Linear`` to float32 rounding (about 1e-6 relative). Weights changed after packing make the copies
stale: call ``repack()`` (the engine does when the wrapper notices a weight change).

Steps of a few rows take a second copy, packed for ``_small_linear.c`` (``SMALL_ROWS``: 2 to 40 rows in float32,
2 to 48 in bfloat16): oneDNN left a decode step's linears at 36-40 GB/s on this machine (2 cores, bf16, 8 rows);
the small-row kernel reads each weight once at 48-53 GB/s, and up to those row counts (a decode step with a short
prefill chunk beside it) it also beat oneDNN's packed matmul over weights streamed from memory
(``benchmarks/bench_decode_roofline.py`` times a decode step's linears both ways, and the model's linears over
24 to 160 rows; measured on an AMD Zen 5 with AVX-512). On a CPU with AVX2 and FMA but no AVX-512 (AMD Zen 2/3,
most Intel client CPUs) the kernel's AVX2 build computes both dtypes (the same sums in the same order as the AVX-512
build: the same bits) at every row count of a step, up to 256 (``SMALL_ROWS_AVX2``): there oneDNN was slower at all
of them in float32. oneDNN's bf16 path needs AVX-512 (``onednn_refuses``): where it has none, the kernel takes every
row count from 2 (no oneDNN copy is made) and the rest go to the model's own ``nn.Linear``. A step of one row
(``active(several_rows=False)``) keeps oneDNN, or that ``nn.Linear``: oneDNN's bits are ``nn.Linear``'s.
Without AVX512-BF16 (AVX2, or AVX-512 on Intel Skylake to Ice Lake servers) the kernel's bf16 widens the weights'
pairs and sums them as ``vdpbf16ps`` does: the same bits as with it; on such an AVX-512 CPU oneDNN's bf16 is emulated
and slower, so the kernel takes 2 to 256 rows there (``SMALL_ROWS_WIDE_BF16``). ``small_rows=False`` (or neither AVX-512 nor
AVX2) keeps oneDNN for all.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from engine.malloc import HUGE_PAGE, advise_huge_pages
from engine.paged import kernel

if TYPE_CHECKING:
    from transformers import PreTrainedModel

PACK_HINT = 16  # the batch size oneDNN picks the packed layout for (any batch size works with it)
# row counts the small-row kernel computes, by dtype (fewer or more: oneDNN); past them oneDNN's matmul was as fast
# or faster (bench_decode_roofline.py's step_linears)
SMALL_ROWS = {torch.float32: (2, 40), torch.bfloat16: (2, 48)}
# the kernel's AVX2 build (a CPU without AVX-512): oneDNN was slower at every row count it takes, up to a step's 256
# (Zen 3, 2 cores, the small preset's 85 linears streamed from memory, float32: 1.2-1.7x at 2 to 40 rows, 1.1-1.3x
# at 48 to 256; /tmp script in issue 35's note); in bf16 oneDNN has no path there (``onednn_refuses``)
SMALL_ROWS_AVX2 = {torch.float32: (2, 256), torch.bfloat16: (2, 256)}
AVX2_BUILD = 4  # small_linear_available()'s bit for that build
# the AVX-512 build on a CPU without AVX512-BF16, whose bf16 widens the pairs: oneDNN's bf16 there is emulated and was
# 2.3-2.5x slower at every row count up to 256 (Zen 4 held to AVX512_CORE_VNNI, the small preset's 85 linears
# streamed from memory: 48 rows 64.9 against 165.2 ms, 256 rows 346.7 against 796.8; /tmp script in issue 35's note)
SMALL_ROWS_WIDE_BF16 = {torch.float32: SMALL_ROWS[torch.float32], torch.bfloat16: (2, 256)}
WIDE_BF16 = 8  # small_linear_available()'s bit for a bf16 that widens the pairs (AVX2, or AVX-512 without BF16)


def small_rows_range(lib: Any, dtype: torch.dtype) -> tuple[int, int]:
    """The row counts the small-row kernel of ``lib`` computes in ``dtype`` (``SMALL_ROWS``; for its AVX2 build
    ``SMALL_ROWS_AVX2``, for its AVX-512 build without AVX512-BF16 ``SMALL_ROWS_WIDE_BF16``); (0, -1): none."""
    if lib is None:
        return (0, -1)
    built = int(lib.small_linear_available())
    table = SMALL_ROWS_AVX2 if built & AVX2_BUILD else SMALL_ROWS_WIDE_BF16 if built & WIDE_BF16 else SMALL_ROWS
    return table.get(dtype, (0, -1))


def available(model: PreTrainedModel) -> str | None:
    """None when the model's linears can be packed here, else why not."""
    if torch.device(model.device).type != "cpu":
        return "not on the CPU"
    if model.dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {model.dtype}"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):  # pragma: no cover - old torch
        return "this torch has no mkldnn._linear_pointwise"
    refused = onednn_refuses(model.dtype)
    if refused is not None and small_rows_range(kernel.load_small_linear(), model.dtype)[1] < 0:
        return refused
    return None  # oneDNN, or (where it refuses the dtype) the small-row kernel alone


def kernel_only(model: torch.nn.Module) -> bool:
    """Whether ``PackedLinears(model)`` would have the small-row kernel alone (oneDNN refuses the model's dtype
    here): one copy of the weights instead of two."""
    dtypes = {m.weight.dtype for m in linears(model)}
    return any(onednn_refuses(d) is not None for d in dtypes)


@functools.cache
def onednn_refuses(dtype: torch.dtype) -> str | None:
    """None when oneDNN packs and runs a ``dtype`` linear on this CPU, else its error: its bf16 path needs
    AVX512-BW/VL/DQ or AVX-NE-CONVERT (on an AVX2-only CPU packing raises, and the model keeps ``nn.Linear``).
    Tried once per dtype on a 16 x 16 weight."""
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), PACK_HINT)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(2, 16, dtype=dtype), w, None, "none", [], "")
    except RuntimeError as exc:
        return f"oneDNN cannot pack {dtype} linears on this CPU ({str(exc).splitlines()[0][:160]})"
    return None


def linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The model's ``nn.Linear`` modules (exactly that class: subclasses may compute otherwise)."""
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights ``PackedLinears`` would copy."""
    return sum(m.weight.numel() * m.weight.element_size() for m in linears(model))


class PackedLinears:
    """Packed copies of the weights of every ``nn.Linear`` of ``model`` (see the module docstring): oneDNN's, and
    the small-row kernel's; where oneDNN refuses a linear's dtype (``onednn_refuses``), the kernel's alone."""

    def __init__(self, model: torch.nn.Module, *, small_rows: bool = True) -> None:
        self.model = model
        self._linears = linears(model)
        self._packed: list[torch.Tensor | None] = []  # None: oneDNN refuses that dtype here
        self._small: list[SmallPacked | None] = []
        self._forwards: list[Callable[[torch.Tensor], torch.Tensor]] = []  # made on first use, then kept
        self._use = _Use()  # what those forwards do in the current block
        self._onednn_only = False
        self._small_lib = kernel.load_small_linear() if small_rows else None
        self.huge_pages = False  # whether the small-row weights lie in memory advised for huge pages
        self.repack()

    @property
    def nbytes(self) -> int:
        """Bytes of the packed copies (oneDNN's and the small-row kernel's)."""
        small = sum(s.weight.numel() * s.weight.element_size() for s in self._small if s is not None)
        return small + sum(p.numel() * p.element_size() for p in self._packed if p is not None)

    @property
    def seconds(self) -> float:
        """Time spent inside the packed linears' forwards since this was made (all threads' calls together)."""
        return self._use.seconds

    @property
    def small_rows(self) -> int:
        """How many linears the small-row kernel computes (for steps of ``SMALL_ROWS`` rows)."""
        return sum(s is not None for s in self._small)

    @contextmanager
    def onednn_only(self) -> Iterator[None]:
        """Inside, forwards entered (``active()``) compute every row count on oneDNN (or, where it refuses the
        dtype, the model's ``nn.Linear``): for timing both ways."""
        self._onednn_only = True
        try:
            yield
        finally:
            self._onednn_only = False

    def repack(self) -> None:
        """Pack every linear's current weight again."""
        with torch.inference_mode(False), torch.no_grad():
            self._packed = [
                None
                if onednn_refuses(m.weight.dtype) is not None
                else torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), PACK_HINT)
                for m in self._linears
            ]
            self._small = [small_packed(self._small_lib, m) for m in self._linears]
            self.huge_pages = _into_huge_pages([s for s in self._small if s is not None])
        self._forwards = []

    @contextmanager
    def active(self, *, several_rows: bool = True) -> Iterator[None]:
        """Inside, the linears compute through their packed weights: oneDNN's, or the small-row kernel's for row
        counts in ``SMALL_ROWS`` when ``several_rows`` (a step of several sequences; one alone keeps oneDNN, whose
        bits are ``nn.Linear``'s). Their forwards are made on the first call after a change, then reused: entering
        took 0.16 ms a step on ``small`` when each made 85 closures and nn.Module setattrs."""
        if not self._forwards:
            self._forwards = [
                _packed_forward(w, m, sm, self._use) for m, w, sm in zip(self._linears, self._packed, self._small)
            ]
        before, self._use.small = self._use.small, several_rows and not self._onednn_only
        try:
            for m, forward in zip(self._linears, self._forwards):
                m.__dict__["forward"] = forward  # an instance attr over the method (not nn.Module's slower setattr)
            yield
        finally:
            self._use.small = before
            for m in self._linears:
                m.__dict__.pop("forward", None)


def _into_huge_pages(smalls: list[SmallPacked]) -> bool:
    """Move the small-row kernel's weights into one buffer that Linux was asked to back with transparent huge pages
    (``engine.malloc.advise_huge_pages``, before the copies touch it); returns whether it was. A decode step streams
    every weight from memory. Changes no value. (Measured on the bf16 agent shape, engine only: 4.75 and 4.83 req/s
    without, 4.86 and 4.92 with, interleaved.)"""
    if not smalls:
        return False
    sizes = [-(-s.weight.numel() * s.weight.element_size() // 64) * 64 for s in smalls]
    raw = torch.empty(sum(sizes) + HUGE_PAGE, dtype=torch.uint8)
    at = (-raw.data_ptr()) % HUGE_PAGE
    advised = advise_huge_pages(raw.data_ptr() + at, sum(sizes))
    for s, size in zip(smalls, sizes, strict=True):
        n = s.weight.numel() * s.weight.element_size()
        s.weight = raw[at : at + n].view(s.weight.dtype).view(s.weight.shape).copy_(s.weight)
        at += size
    return advised


def rows_bucket(n: int) -> int:
    """The row count a packed linear computes ``n`` rows as: ``n`` up to ``EXACT_ROWS``, else ``n`` rounded up to
    a multiple of ``ROW_STEP``. oneDNN keeps a primitive (and its buffers) per input shape; a serving engine's
    steps have every row count from 1 to its step budget, and one primitive each grew a server's resident memory
    without bound (about 100 MiB a minute in ``benchmarks/soak.py``). Buckets keep the shapes few: at most
    ``ROW_STEP - 1`` padding rows on ``n`` (under 6% at 256)."""
    return n if n <= EXACT_ROWS else -(-n // ROW_STEP) * ROW_STEP


EXACT_ROWS = 16  # decode steps: one row per running request, computed as they are
ROW_STEP = 16


class _Use:
    """What the packed forwards do in the current ``active()`` block (read at each call), and their time."""

    def __init__(self) -> None:
        self.small = True  # the small-row kernel for the row counts it takes
        self.seconds = 0.0  # time inside the packed forwards since the PackedLinears was made


class SmallPacked:
    """One linear's weight packed for ``_small_linear.c`` (16 outputs' weights per 64-byte line), its bias as
    float32, and the kernel for its dtype."""

    def __init__(
        self, fn: Any, weight: torch.Tensor, bias: torch.Tensor | None, n: int, k: int, rows: tuple[int, int]
    ) -> None:
        self.fn, self.weight, self.bias, self.n, self.k = fn, weight, bias, n, k
        self.dtype = torch.bfloat16 if weight.dtype == torch.int32 else torch.float32
        self.rows = rows  # the row counts it computes (``small_rows_range``)

    def __call__(self, rows: torch.Tensor) -> torch.Tensor | None:
        """``rows`` @ W^T + bias, or None when the kernel does not take them (the caller uses oneDNN)."""
        if rows.dtype != self.dtype or rows.stride(-1) != 1 or rows.device.type != "cpu":
            return None
        m = rows.shape[0]
        y = torch.empty((m, self.n), dtype=self.dtype)
        bias = None if self.bias is None else self.bias.data_ptr()
        rc = self.fn(rows.data_ptr(), rows.stride(0), m, self.weight.data_ptr(), self.n, self.k, bias,
                     y.data_ptr(), self.n, torch.get_num_threads())  # fmt: skip
        return y if rc == 0 else None


def small_packed(lib: Any, m: torch.nn.Linear) -> SmallPacked | None:
    """``m``'s weight packed for the small-row kernel of ``lib``, or None where the kernel does not take it (no
    library, another dtype, outputs not a multiple of 16, an odd bf16 input width)."""
    w = m.weight.detach()
    n, k = w.shape
    if lib is None or n % 16 or w.device.type != "cpu":
        return None
    built = int(lib.small_linear_available())
    bias = None if m.bias is None else m.bias.detach().float().contiguous()
    rows = small_rows_range(lib, w.dtype)
    if w.dtype == torch.float32 and built & 1:  # [N/16][K][16]
        packed = w.view(n // 16, 16, k).transpose(1, 2).contiguous()
        return SmallPacked(lib.small_linear_f32, packed, bias, n, k, rows)
    if w.dtype == torch.bfloat16 and built & 2 and k % 2 == 0:  # [N/16][K/2][16][2] bf16, as int32 pairs
        packed = w.contiguous().view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()
        return SmallPacked(lib.small_linear_bf16, packed.view(torch.int32), bias, n, k, rows)
    return None


def _packed_forward(
    weight: torch.Tensor | None, module: torch.nn.Linear, small: SmallPacked | None, use: _Use
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``module``'s forward through oneDNN's packed ``weight`` (None: oneDNN has none; the module's own forward)
    and the small-row kernel's ``small``, as ``use`` says."""
    linear, plain = torch.ops.mkldnn._linear_pointwise, torch.nn.functional.linear
    bias = module.bias
    least, most = small.rows if small is not None else (0, -1)
    if weight is None and small is not None:
        most = 1 << 62  # no oneDNN: the kernel takes every row count it can
    clock = time.perf_counter

    def forward(x: torch.Tensor) -> torch.Tensor:
        t0 = clock()
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        n = rows.shape[0]
        if small is not None and least <= n <= most and use.small:
            out = small(rows)
            if out is not None:
                use.seconds += clock() - t0
                return out.view(*shape[:-1], out.shape[-1])
        if weight is None:  # the model's own linear (its current weight)
            z = plain(x, module.weight, module.bias)
            use.seconds += clock() - t0
            return z
        m = rows_bucket(n)
        if m != n:  # zero rows up to the bucket, dropped after
            rows = torch.cat([rows, rows.new_zeros(m - n, rows.shape[1])])
        y: torch.Tensor = linear(rows, weight, bias, "none", [], "")[:n]
        use.seconds += clock() - t0
        return y.view(*shape[:-1], y.shape[-1])

    def small_for(n: int) -> SmallPacked | None:
        """The kernel this forward computes ``n`` rows with now (None: oneDNN or the model's linear)."""
        return small if small is not None and least <= n <= most and use.small else None

    # for engine.paged.decode_layer, which calls the kernel directly (and adds its time to ``use``)
    forward.__dict__.update(small_for=small_for, use=use)
    return forward
