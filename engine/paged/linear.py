"""Prepacked linear layers for the CPU engine: oneDNN's matmul over weights reordered once, ahead of time.

PyTorch's CPU ``nn.Linear`` repacks its weight on every call; for the few rows of a decoding step (one token per
running request) that repacking is most of the cost (measured on the ``small`` preset, 2 cores, fp32: a forward
of 8 tokens 157 ms plain, 77 ms packed; of 512 tokens, 2,155 ms and 2,035 ms). ``PackedLinears(model)`` keeps a
packed copy of every ``nn.Linear`` weight (memory: one more copy of those weights) and ``active()`` routes the
layers' forward through it for the duration of a block, leaving the model as it was on exit. The results agree
with ``nn.Linear`` to float32 rounding (about 1e-6 relative). Weights changed after packing make the copies
stale: call ``repack()`` (the engine does when the wrapper notices a weight change).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

PACK_HINT = 16  # the batch size oneDNN picks the packed layout for (any batch size works with it)


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
    return None


def linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The model's ``nn.Linear`` modules (exactly that class: subclasses may compute otherwise)."""
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights ``PackedLinears`` would copy."""
    return sum(m.weight.numel() * m.weight.element_size() for m in linears(model))


class PackedLinears:
    """Packed copies of the weights of every ``nn.Linear`` of ``model`` (see the module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._linears = linears(model)
        self._packed: list[torch.Tensor] = []
        self.repack()

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self._packed)

    def repack(self) -> None:
        """Pack every linear's current weight again."""
        with torch.inference_mode(False), torch.no_grad():
            self._packed = [
                torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), PACK_HINT) for m in self._linears
            ]

    @contextmanager
    def active(self) -> Iterator[None]:
        """Inside, the linears compute through their packed weights."""
        try:
            for m, w in zip(self._linears, self._packed):
                m.forward = _packed_forward(w, m.bias)  # type: ignore[method-assign,assignment]  # instance attr over the method
            yield
        finally:
            for m in self._linears:
                m.__dict__.pop("forward", None)


def rows_bucket(n: int) -> int:
    """The row count a packed linear computes ``n`` rows as: ``n`` up to ``EXACT_ROWS``, else ``n`` rounded up to
    a multiple of ``ROW_STEP``. oneDNN keeps a primitive (and its buffers) per input shape; a serving engine's
    steps have every row count from 1 to its step budget, and one primitive each grew a server's resident memory
    without bound (about 100 MiB a minute in ``benchmarks/soak.py``). Buckets keep the shapes few: at most
    ``ROW_STEP - 1`` padding rows on ``n`` (under 6% at 256)."""
    return n if n <= EXACT_ROWS else -(-n // ROW_STEP) * ROW_STEP


EXACT_ROWS = 16  # decode steps: one row per running request, computed as they are
ROW_STEP = 16


def _packed_forward(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    linear = torch.ops.mkldnn._linear_pointwise

    def forward(x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        n = rows.shape[0]
        m = rows_bucket(n)
        if m != n:  # zero rows up to the bucket, dropped after
            rows = torch.cat([rows, rows.new_zeros(m - n, rows.shape[1])])
        y: torch.Tensor = linear(rows, weight, bias, "none", [], "")[:n]
        return y.view(*shape[:-1], y.shape[-1])

    return forward
