"""The installed versions that decide whether a cached path is exact (named in every refusal made at load)."""

from __future__ import annotations

import platform
from importlib import metadata

PACKAGES = ("transformers", "torch", "tokenizers", "prefixcache")


def installed() -> dict[str, str]:
    """Python's version and each of ``PACKAGES``' installed version ("not installed" where absent)."""
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def label() -> str:
    """``"transformers X, torch Y"``: the two versions a refusal names."""
    v = installed()
    return f"transformers {v['transformers']}, torch {v['torch']}"
