"""Serving: the OpenAI-compatible app (FastAPI) on the continuous-batching engine (or, for models the engine cannot
run, batched generate calls), and the Ray Serve deployment with its prefix-aware request router. Needs the
``serve`` extra (and ``ray`` for replicas)."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.runtime import RuntimeConfig


@dataclass(frozen=True)
class ServeConfig:
    """What ``prefixcache serve`` was asked for (one process or replicas)."""

    model: str = "tiny"
    max_cached_tokens: int | None = None  # None: the runtime's default (32,768)
    block_size: int = 16
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch_size: int = 8  # the batched-generate fallback only
    batch_wait_ms: float = 5.0  # the batched-generate fallback only
    default_max_tokens: int = 256
    max_image_bytes: int = 8 * 2**20  # image-text models: the largest image a chat message may carry
    max_queued_requests: int | None = None  # requests in flight past which new ones get 429 (None: no limit)
    drain_timeout: int = 30  # seconds SIGTERM waits for requests in flight before it cancels them
    debug_endpoints: bool = False  # GET /debug/cache: pools, pins and check_integrity() (for soak tests)
    seed: int = 0
    dtype: str | None = None  # the weights' and K/V's dtype: float32 (None), bfloat16, float16
    log_level: str = "info"
    use_engine: bool = True
    max_step_tokens: int | None = None  # None: SchedulerConfig's defaults
    max_chunk_tokens: int | None = None
    max_running: int | None = None
    prefill_order: str | None = None  # None: SchedulerConfig's default ("shortest")
    disk_cache: str | None = None  # the directory of a disk tier below the pool (None: none)
    disk_cache_size: str | None = None  # its budget, e.g. "50G" (None: the default)
    shared_cache: str | None = None  # a Redis URL: a tier shared by every process pointing at it
    max_cached_states: int | None = None  # hybrid models: recurrent-state snapshots kept (None: the default)
    snapshot_interval: int = 0  # hybrid models: also a snapshot every so many blocks of a prompt

    def runtime_config(self) -> RuntimeConfig:
        """The model runtime's settings: pool, block size, the engine's step budget, the tier."""
        from engine.batching.scheduler import SchedulerConfig
        from engine.runtime import RuntimeConfig

        given: dict[str, Any] = {
            k: v
            for k, v in (
                ("max_step_tokens", self.max_step_tokens),
                ("max_chunk_tokens", self.max_chunk_tokens),
                ("max_running", self.max_running),
                ("prefill_order", self.prefill_order),
            )
            if v is not None
        }
        return RuntimeConfig(
            max_cached_tokens=self.max_cached_tokens,
            block_size=self.block_size,
            engine=SchedulerConfig(**given),
            disk_cache=self.disk_cache,
            max_disk_bytes=self.disk_cache_size,
            shared_cache=self.shared_cache,
            max_cached_states=self.max_cached_states,
            snapshot_interval=self.snapshot_interval,
        )


def run_local(cfg: ServeConfig) -> int:
    """Serve ``cfg.model`` from this process on uvicorn until SIGINT/SIGTERM; in-flight requests finish first.

    Returns the exit status: 0 after a graceful stop."""
    import uvicorn

    from engine.malloc import keep_freed_memory
    from engine.runtime import ModelRuntime
    from engine.serve.app import create_app
    from engine.serve.backend import LocalBackend
    from engine.threads import run_in_thread

    keep_freed_memory()  # before the first tensor: freed temporaries stay in the heap (engine.malloc)

    def load() -> LocalBackend:
        runtime = ModelRuntime.load(cfg.model, cfg.runtime_config(), dtype=cfg.dtype, seed=cfg.seed)
        return LocalBackend(
            runtime,
            cfg.model,
            max_batch_size=cfg.max_batch_size,
            batch_wait_ms=cfg.batch_wait_ms,
            use_engine=cfg.use_engine,
        )

    # torch runs on a thread that ends here, so the engine thread's OpenMP team is the process's only one
    backend = run_in_thread(load)
    app = create_app(
        backend,
        default_max_tokens=cfg.default_max_tokens,
        max_image_bytes=cfg.max_image_bytes,
        max_queued_requests=cfg.max_queued_requests,
        debug=cfg.debug_endpoints,
    )

    class Draining(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            app.state.serving.draining = True  # /health says so; a request on a kept-alive connection gets 503
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app, host=cfg.host, port=cfg.port, log_level=cfg.log_level, timeout_graceful_shutdown=cfg.drain_timeout
    )
    server = Draining(config)
    # uvicorn catches SIGINT/SIGTERM, stops accepting, drains in-flight requests (cancelling what still runs after
    # drain_timeout: the engine aborts those rows), runs the app's shutdown, then re-raises the signal with the
    # handlers it found: quiet ones make that a normal return (exit status 0).
    quiet = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for sig, handler in quiet.items():
            signal.signal(sig, handler)
    return 0 if server.started else 1
