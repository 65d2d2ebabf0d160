"""The same app on Ray Serve: N model replicas behind a prefix-aware router.

```
HTTP -> Ray Serve proxy -> Ingress (1 replica: the FastAPI app from app.py; tokenizes, validates)
          -> DeploymentHandle.generate(GenerateCall)  [PrefixAwareRouter picks the replica]
          -> ModelReplica x N (each: a ModelRuntime and its worker; after each step its cache events go to the
             IndexHolder actor, which the router asks)
```

The router needs the prompt's tokens to look up the index, so the model replicas sit behind a handle (the
router of an HTTP ingress sees no body): the same split as Ray Serve LLM's OpenAI ingress and its servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import sys
import threading
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from engine.malloc import keep_freed_memory
from engine.runtime import DEFAULT_MAX_CACHED_TOKENS, ModelRuntime
from engine.serve import ServeConfig
from engine.serve.app import create_app
from engine.serve.backend import ModelInfo, debug_figures, describe_model, make_worker
from engine.serve.engine_loop import EngineLoop
from engine.serve.metrics import replica_figures
from engine.serve.protocol import Finished, GenerateCall, StreamItem
from engine.serve.router import INDEX_NAMESPACE, IndexHolder, PrefixAwareRouter
from engine.threads import run_in_thread

logger = logging.getLogger("ray.serve")
APP_NAME = "prefixcache"
RAY_DEFAULT_ROUTER = "ray_default"  # Ray Serve's own power-of-two-choices router


@dataclass(frozen=True)
class RayConfig:
    """Replicas and routing. ``router``: a policy of ``prefixcache.sim.routing.ROUTING_POLICIES`` run by
    ``PrefixAwareRouter``, or "ray_default" for Ray Serve's own router."""

    replicas: int = 2
    address: str | None = None  # None: start a local Ray instance
    router: str = "prefix_balanced"
    abs_threshold: float = 64.0
    rel_threshold: float = 1.5
    min_match: float = 0.3
    replica_cpus: float = 1.0
    app_name: str = APP_NAME


# what /debug/cache shows of a replica's figures
DEBUG_KEYS = (
    "integrity",
    "free_blocks",
    "cached_blocks",
    "pinned_blocks",
    "owned_blocks",
    "active_requests",
    "queue_length",
)
PUBLISH_EVERY_S = 0.25  # a replica publishes at least this often while it has events and nothing finished


class EventPublisher:
    """Collects one replica's cache events and sends them, numbered, to the IndexHolder (``flush``, after engine
    steps, on the engine thread). Unacknowledged batches are resent with the next flush."""

    def __init__(self, runtime: ModelRuntime, index: Any, replica: str) -> None:
        self.runtime = runtime
        self.index = index
        self.replica = replica
        self._events: list[Any] = []
        self._unacked: list[tuple[int, list[Any]]] = []
        self._number = 0
        self.unsubscribe = runtime.cache.subscribe(self._events.append)

    @property
    def pending(self) -> bool:
        """Whether events wait to be sent (or resent)."""
        return bool(self._events or self._unacked)

    def flush(self, figures: dict[str, Any]) -> None:
        if self._events:
            self._number += 1
            self._unacked.append((self._number, list(self._events)))
            self._events.clear()
        try:
            ref = self.index.publish.remote(self.replica, self.runtime.fingerprint, self._unacked, figures)
            acked = ray.get(ref, timeout=30)
        except Exception as exc:  # the index is unreachable: keep the events, resend next time
            logger.warning("prefixcache: could not publish cache events of %s: %r", self.replica, exc)
            return
        self._unacked = [(n, e) for n, e in self._unacked if n > acked]


@serve.deployment(name="ModelReplica")
class ModelReplica:
    """One model replica: a ModelRuntime, its worker (the engine loop, or a Batcher), and an EventPublisher feeding
    the router's index."""

    def __init__(self, cfg: ServeConfig, index_name: str, threads: int | None = None) -> None:
        keep_freed_memory()  # each replica is its own process (engine.malloc)
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
        # torch runs on a thread that ends here, so the engine thread's OpenMP team is the process's only one
        self.runtime = run_in_thread(
            lambda: ModelRuntime.load(cfg.model, cfg.runtime_config(), dtype=cfg.dtype, seed=cfg.seed)
        )
        self.replica = serve.get_replica_context().replica_id.unique_id
        index = ray.get_actor(index_name, namespace=INDEX_NAMESPACE)
        self.publisher = EventPublisher(self.runtime, index, self.replica)
        self.worker = run_in_thread(
            lambda: make_worker(
                self.runtime,
                use_engine=cfg.use_engine,
                max_batch_size=cfg.max_batch_size,
                batch_wait_ms=cfg.batch_wait_ms,
                after=self._publish,
            )
        )
        self._started = False
        self._last_publish = 0.0
        self.debug = cfg.debug_endpoints
        self._publish(True)  # the index learns of this replica (and the model's fingerprint) before any request

    def _publish(self, finished: bool) -> None:
        """After a step: publish now if a request finished (its caller must not hear so before the router knows
        its blocks), else at most every PUBLISH_EVERY_S while events wait."""
        now = time.monotonic()
        if not finished and (not self.publisher.pending or now - self._last_publish < PUBLISH_EVERY_S):
            return
        self._last_publish = now
        figures = replica_figures(self.worker.cache_stats, self.worker.stats())
        figures["engine"] = int(isinstance(self.worker, EngineLoop))
        if self.debug:  # on the worker's thread, between steps: the pool as it is now
            figures.update(debug_figures(self.runtime))
        self.publisher.flush(figures)

    async def generate(self, call: GenerateCall) -> AsyncGenerator[StreamItem, None]:
        """Token ids as they come, then ``Finished`` (naming this replica)."""
        if not self._started:
            self._started = True
            await self.worker.start()
        async with aclosing(self.worker.stream(call)) as items:
            async for item in items:
                yield replace(item, replica=self.replica) if isinstance(item, Finished) else item

    async def __del__(self) -> None:
        if self._started:
            await self.worker.stop()


class RayBackend:
    """The app's backend in the ingress: calls go through the model deployment's handle (and its router)."""

    def __init__(self, handle: DeploymentHandle[Any], info: ModelInfo, index: Any, replicas: int) -> None:
        self.info = info
        self.replicas = replicas
        self._handle = handle.options(stream=True)
        self._index = index
        self._figures: dict[str, dict[str, Any]] = {}

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def stream(self, call: GenerateCall) -> AsyncGenerator[StreamItem, None]:
        gen: Any = self._handle.generate.remote(call)  # a DeploymentResponseGenerator (stream=True)
        finished = False
        try:
            async for item in gen:
                finished = isinstance(item, Finished)
                yield item
        finally:
            if not finished:  # the client went away: stop the replica's row
                gen.cancel()

    async def refresh(self) -> None:
        try:  # an index that does not answer keeps the figures it gave last
            self._figures = await asyncio.wait_for(asyncio.shield(self._index.figures.remote()), 10.0)
        except Exception as exc:
            logger.warning("prefixcache: the prefix index did not answer for figures (%r)", exc)

    async def ready(self) -> str | None:
        await self.refresh()
        up = len(self._figures)  # a replica publishes once its model is loaded
        return None if up >= self.replicas else f"{up} of {self.replicas} model replicas are up"

    async def debug(self) -> dict[str, dict[str, Any]]:
        """Each replica's ``debug_figures`` as it last published them (after its last step)."""
        await self.refresh()
        keys = DEBUG_KEYS
        return {r: {k: f[k] for k in keys if k in f} for r, f in self._figures.items()}

    def figures(self) -> dict[str, dict[str, Any]]:
        return self._figures

    def runs_engine(self) -> bool:
        """Every replica runs the engine (they publish whether they do)."""
        return bool(self._figures) and all(f.get("engine") for f in self._figures.values())


@serve.deployment(name="Ingress")
@serve.ingress()
class Ingress:
    """The OpenAI-compatible app (app.py) in front of the model replicas."""

    def __init__(self, model: DeploymentHandle[Any], cfg: ServeConfig, index_name: str, replicas: int) -> None:
        index = ray.get_actor(index_name, namespace=INDEX_NAMESPACE)
        info = describe_model(cfg.model)
        if cfg.use_engine:  # the replicas' pools, as their runtimes size them: a request needing more never fits
            tokens = DEFAULT_MAX_CACHED_TOKENS if cfg.max_cached_tokens is None else cfg.max_cached_tokens
            info = dataclasses.replace(info, pool_tokens=tokens // cfg.block_size * cfg.block_size)
        self.backend = RayBackend(model, info, index, replicas)
        self.cfg = cfg

    def __serve_build_asgi_app__(self) -> Any:
        cfg = self.cfg
        return create_app(
            self.backend,
            default_max_tokens=cfg.default_max_tokens,
            max_image_bytes=cfg.max_image_bytes,
            max_queued_requests=cfg.max_queued_requests,
            debug=cfg.debug_endpoints,
        )


def index_name(app_name: str) -> str:
    return f"prefixcache-index-{app_name}"


def start_index(cfg: ServeConfig, rcfg: RayConfig) -> Any:
    """A fresh IndexHolder actor for the app (an old one of the same name is killed first). It lives as long as
    the returned handle: keep it."""
    name = index_name(rcfg.app_name)
    with contextlib.suppress(ValueError):  # none yet
        ray.kill(ray.get_actor(name, namespace=INDEX_NAMESPACE))
    holder: Any = ray.remote(num_cpus=0)(IndexHolder)
    index = holder.options(name=name, namespace=INDEX_NAMESPACE).remote(cfg.block_size)
    ray.get(index.figures.remote())  # up and registered under its name before any replica looks for it
    return index


def build_app(cfg: ServeConfig, rcfg: RayConfig) -> Any:
    """The Ray Serve application (start the index first: ``start_index``)."""
    if rcfg.replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {rcfg.replicas}")
    name = index_name(rcfg.app_name)
    options: dict[str, Any] = {
        "num_replicas": rcfg.replicas,
        "ray_actor_options": {"num_cpus": rcfg.replica_cpus},
        "max_ongoing_requests": max(16, 4 * cfg.max_batch_size),
    }
    if rcfg.router != RAY_DEFAULT_ROUTER:
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=PrefixAwareRouter,  # type: ignore[arg-type]  # a class is accepted too
            request_router_kwargs={
                "index_name": name,
                "policy": rcfg.router,
                "abs_threshold": rcfg.abs_threshold,
                "rel_threshold": rcfg.rel_threshold,
                "min_match": rcfg.min_match,
            },
        )
    threads = max(1, int(rcfg.replica_cpus))
    model = ModelReplica.options(**options).bind(cfg, name, threads)  # type: ignore[attr-defined]
    ingress = Ingress.options(num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024)  # type: ignore[attr-defined]
    return ingress.bind(model, cfg, name, rcfg.replicas)


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_ray(cfg: ServeConfig, rcfg: RayConfig, announce: Callable[[str], None] = _to_stderr) -> int:
    """Serve on Ray until SIGINT/SIGTERM (a local Ray instance unless ``rcfg.address``); returns 0 after a
    graceful stop (Ray Serve lets in-flight requests finish). ``announce`` gets the "serving ..." line once the
    app is up (default: standard error; the CLI passes its console)."""
    started = not ray.is_initialized()
    if started:
        ray.init(address=rcfg.address, include_dashboard=False)
    stop = threading.Event()
    old = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        serve.start(http_options={"host": cfg.host, "port": cfg.port})
        index = start_index(cfg, rcfg)  # noqa: F841  (held: the actor lives while its handle does)
        serve.run(build_app(cfg, rcfg), name=rcfg.app_name, route_prefix="/")
        announce(f"serving {cfg.model} on http://{cfg.host}:{cfg.port} with {rcfg.replicas} Ray Serve replicas")
        stop.wait()
        serve.delete(rcfg.app_name)
        serve.shutdown()  # type: ignore[no-untyped-call]
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        if started:
            ray.shutdown()
    return 0
