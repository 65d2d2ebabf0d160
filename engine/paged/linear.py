"""Prepacked linear layers for the CPU engine: oneDNN's matmul over weights reordered once, ahead of time.

PyTorch's CPU ``nn.Linear`` repacks its weight on every call; for the few rows of a decoding step (one token per
running request) that repacking is most of the cost (measured on the ``small`` preset, 2 cores, fp32: a forward
of 8 tokens 157 ms plain, 77 ms packed; of 512 tokens, 2,155 ms and 2,035 ms). ``PackedLinears(model)`` keeps a
packed copy of every ``nn.Linear`` weight (memory: one more copy of those weights) and ``active()`` routes the
layers' forward through it for the duration of a block, leaving the model as it was on exit. The results agree
with ``nn.Linear`` to float32 rounding (about 1e-6 relative). Sibling projections applied to one input (q/k/v,
gate/up: ``GROUPS``) share one packed weight and one matmul (a forward of 32 tokens 0.93x the time of separate
packed linears). Weights changed after packing make the copies stale: call ``repack()`` (the engine does when the
wrapper notices a weight change).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

PACK_HINT = 16  # the batch size oneDNN picks the packed layout for (any batch size works with it)


def available(model) -> str | None:
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


def linears(model) -> list[torch.nn.Linear]:
    """The model's ``nn.Linear`` modules (exactly that class: subclasses may compute otherwise)."""
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


def weight_bytes(model) -> int:
    """Bytes of the weights ``PackedLinears`` would copy."""
    return sum(m.weight.numel() * m.weight.element_size() for m in linears(model))


GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # siblings HF's code calls on one input


class _Group:
    """Sibling linears of one module that HF's modeling code applies to the same input one after the other (a
    layer's q/k/v projections, an MLP's gate and up): one matmul over their weights stacked computes all of them,
    and each member returns its columns of it. The first member called with an input computes the whole; the
    others, called with that same tensor, take their slice. A member called with another input (any order, any
    caller) computes the whole again, so results never depend on the call order."""

    def __init__(self, members: list[torch.nn.Linear]) -> None:
        self.members = members
        edges = [0]
        for m in members:
            edges.append(edges[-1] + m.out_features)
        self.edges = edges
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self._x: torch.Tensor | None = None
        self._y: torch.Tensor | None = None

    @staticmethod
    def fits(members: list) -> bool:
        first = members[0]
        return all(
            type(m) is torch.nn.Linear
            and m.in_features == first.in_features
            and (m.bias is None) == (first.bias is None)
            and m.weight.dtype == first.weight.dtype
            and m.weight.device == first.weight.device
            for m in members
        )

    def pack(self) -> None:
        weight = torch.cat([m.weight.detach() for m in self.members])
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_HINT)
        has_bias = self.members[0].bias is not None
        self.bias = torch.cat([m.bias.detach() for m in self.members]) if has_bias else None  # type: ignore[union-attr]

    def forward_of(self, i: int):
        lo, hi = self.edges[i], self.edges[i + 1]
        linear = torch.ops.mkldnn._linear_pointwise

        def forward(x: torch.Tensor) -> torch.Tensor:
            if x is not self._x:
                shape = x.shape
                y = linear(x.reshape(-1, shape[-1]), self.weight, self.bias, "none", [], "")
                self._x, self._y = x, y.view(*shape[:-1], y.shape[-1])
            assert self._y is not None
            return self._y[..., lo:hi]

        return forward

    def clear(self) -> None:
        self._x = self._y = None


class PackedLinears:
    """Packed copies of the weights of every ``nn.Linear`` of ``model`` (see the module docstring); sibling
    projections applied to one input (``GROUPS``) share one packed weight and one matmul (``_Group``)."""

    def __init__(self, model) -> None:
        self.model = model
        self._groups: list[_Group] = []
        grouped: set[int] = set()
        for module in model.modules():
            for names in GROUPS:
                members = [getattr(module, n, None) for n in names]
                if all(m is not None for m in members) and _Group.fits(members):
                    self._groups.append(_Group(members))  # type: ignore[arg-type]
                    grouped.update(id(m) for m in members)
        self._linears = [m for m in linears(model) if id(m) not in grouped]
        self._packed: list[torch.Tensor] = []
        self.repack()

    @property
    def nbytes(self) -> int:
        own = sum(p.numel() * p.element_size() for p in self._packed)
        return own + sum(g.weight.numel() * g.weight.element_size() for g in self._groups if g.weight is not None)

    @property
    def num_groups(self) -> int:
        return len(self._groups)

    def repack(self) -> None:
        """Pack every linear's current weight again."""
        with torch.inference_mode(False), torch.no_grad():
            self._packed = [
                torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), PACK_HINT) for m in self._linears
            ]
            for g in self._groups:
                g.pack()

    @contextmanager
    def active(self) -> Iterator[None]:
        """Inside, the linears compute through their packed weights."""
        try:
            for m, w in zip(self._linears, self._packed):
                m.forward = _packed_forward(w, m.bias)  # type: ignore[method-assign]
            for g in self._groups:
                for i, m in enumerate(g.members):
                    m.forward = g.forward_of(i)  # type: ignore[method-assign]
            yield
        finally:
            for m in self._linears:
                m.__dict__.pop("forward", None)
            for g in self._groups:
                g.clear()
                for m in g.members:
                    m.__dict__.pop("forward", None)


def _packed_forward(weight: torch.Tensor, bias: torch.Tensor | None):
    linear = torch.ops.mkldnn._linear_pointwise

    def forward(x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = linear(x.reshape(-1, shape[-1]), weight, bias, "none", [], "")
        return y.view(*shape[:-1], y.shape[-1])

    return forward
