"""Checking a torch device name before anything is loaded onto it."""

from __future__ import annotations

import torch


def usable_device(name: str | None) -> str:
    """The device ``name`` (default "cpu") after checking that torch can compute on it and copy back.

    Raises ValueError with a one-line reason: an unknown name, a device this machine or this torch build
    lacks (e.g. "cuda" without CUDA), or one that holds no data (``meta``)."""
    name = name or "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"unknown device {name!r}; torch devices are e.g. cpu, cuda, cuda:1, mps") from None
    try:
        (torch.ones(2, device=device) + 1).sum().item()  # allocate, compute, copy back
    except Exception as exc:  # any failure means "not usable"; torch raises many kinds here
        raise ValueError(f"device {name!r} is not usable here: {_first_sentence(exc)}") from None
    return str(device)


def _first_sentence(exc: BaseException, limit: int = 160) -> str:
    """The start of an exception's message, on one line."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    text = text.split(". ")[0]
    return text if len(text) <= limit else text[: limit - 1] + "…"
