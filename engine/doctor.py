"""``prefixcache doctor``'s findings: the installed versions, which builds of the engine's kernels this CPU gets, and
for a model which paths are cached exactly on this install, which run uncached, and why.

A model is wrapped as a user's would be (``ModelRuntime``, so the check at load runs: ``engine.path_check``) and
its paged engine is made (its own probe runs); each path's status comes from what those checks decided, never from
a list of versions: on a release nobody here has tried, this is what tells a user where they stand.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any

from engine.versions import installed

EXACT = "cached, exact"
UNCACHED = "uncached"


@dataclass(frozen=True)
class PathStatus:
    """One path of one model: ``status`` (``EXACT`` or ``UNCACHED``) and the reason when uncached."""

    path: str
    status: str
    reason: str | None = None


def diagnose(name_or_path: str, *, device: Any = None, dtype: Any = None) -> dict[str, Any]:
    """Load ``name_or_path`` (a preset or a local model folder), wrap it, make its engine, and report each path's
    status, the check at load's seconds and the warnings the wrapping raised. Changes nothing outside the model
    it loads."""
    from engine.models import load_model
    from engine.runtime import ModelRuntime

    model, _ = load_model(name_or_path, device=device, dtype=dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        rt = ModelRuntime(model, on_unsupported="passthrough")
        load_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        engine = rt.engine()
        engine_s = time.perf_counter() - t1
    reason = rt.unsupported_reason
    paths = [PathStatus("generate (contiguous)", EXACT if reason is None else UNCACHED, reason)]
    if engine is None:
        why = rt.engine_unsupported_reason
        paths.append(PathStatus("generate_batch, score, serve (paged engine)", UNCACHED, why))
    else:
        paths.append(PathStatus("generate_batch, score, serve (paged engine)", EXACT))
    if rt.hybrid is not None:
        how = "token by token over a state" if rt.hybrid.tokenwise else "chunks over a state"
        paths.append(PathStatus(f"recurrent-state snapshots ({how})", EXACT))
    return {
        "model": name_or_path,
        "class": type(model).__name__,
        "model_type": getattr(model.config, "model_type", None),
        "dtype": str(model.dtype).removeprefix("torch."),
        "device": str(model.device),
        "hybrid": rt.hybrid is not None,
        "wrap_seconds": round(load_s, 3),
        "load_check_seconds": round(rt.load_check_seconds, 3),
        "engine_seconds": round(engine_s, 3),
        "paths": [asdict(p) for p in paths],
        "warnings": sorted({str(w.message) for w in caught if str(w.message).startswith("PrefixCachedModel")}),
    }


def report(models: list[str], *, device: Any = None, dtype: Any = None) -> dict[str, Any]:
    """The versions, what this CPU gets from the engine's kernels (``kernel.builds``) and ``diagnose`` of each of
    ``models``. Changes nothing."""
    from engine.paged.kernel import builds

    return {
        "versions": installed(),
        "cpu_kernels": builds(),
        "models": [diagnose(m, device=device, dtype=dtype) for m in models],
    }
