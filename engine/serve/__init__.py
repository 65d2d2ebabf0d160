"""Serving: the OpenAI-compatible app (FastAPI), request batching, and the Ray Serve deployment with its
prefix-aware request router. Needs the ``serve`` extra (and ``ray`` for replicas)."""

from __future__ import annotations

import signal
from dataclasses import dataclass


@dataclass(frozen=True)
class ServeConfig:
    """What ``prefixcache serve`` was asked for (one process or replicas)."""

    model: str = "tiny"
    max_cached_tokens: int | None = None  # None: the wrapper's default
    block_size: int = 16
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch_size: int = 8
    batch_wait_ms: float = 5.0
    default_max_tokens: int = 256
    seed: int = 0
    log_level: str = "info"


def run_local(cfg: ServeConfig) -> int:
    """Serve ``cfg.model`` from this process on uvicorn until SIGINT/SIGTERM; in-flight requests finish first.

    Returns the exit status: 0 after a graceful stop."""
    import uvicorn

    from engine.serve.app import create_app
    from engine.serve.backend import LocalBackend, load_wrapped

    pcm = load_wrapped(cfg.model, max_cached_tokens=cfg.max_cached_tokens, block_size=cfg.block_size, seed=cfg.seed)
    backend = LocalBackend(pcm, cfg.model, max_batch_size=cfg.max_batch_size, batch_wait_ms=cfg.batch_wait_ms)
    app = create_app(backend, default_max_tokens=cfg.default_max_tokens)
    server = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level))
    # uvicorn catches SIGINT/SIGTERM, drains in-flight requests, runs the app's shutdown, then re-raises the
    # signal with the handlers it found: quiet ones make that a normal return (exit status 0).
    quiet = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for sig, handler in quiet.items():
            signal.signal(sig, handler)
    return 0 if server.started else 1
