"""The ``serve`` CLI command: an OpenAI-compatible server, one process (uvicorn) or N Ray Serve replicas with
prefix-aware routing. ``register(app)`` adds it to the typer app. The engine, FastAPI and Ray are imported
only inside the command; a missing extra is one line naming what to install, exit status 2."""

import importlib
import os
from collections.abc import MutableMapping

import typer

from prefixcache.cli import console
from prefixcache.core.checks import parse_bytes

EXIT_USAGE = 2
_EXTRAS = {  # module -> the extra that installs it
    "fastapi": "serve",
    "uvicorn": "serve",
    "prometheus_client": "serve",
    "ray.serve": "ray",
}


DTYPES = ("float32", "bfloat16", "float16")  # what --dtype takes (engine.models._dtype's long names)
OPENMP_SPIN = "10000"  # GOMP_SPINCOUNT for serve: ~0.1 ms of spinning between parallel regions, not libgomp's ~3 ms


def bound_openmp_spin(env: MutableMapping[str, str]) -> bool:
    """Set ``GOMP_SPINCOUNT`` in ``env`` to ``OPENMP_SPIN`` unless ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` is
    set already; returns whether it set it. It must run before torch is imported (libgomp reads it once).

    The server's engine thread holds the process's only OpenMP team (``engine.threads``), so libgomp's workers spin
    between parallel regions instead of sleeping; its default spin (~3 ms) makes a step many times slower when
    another process competes for the cores (a spinning worker holds a core the engine thread needs), a short
    spin still bridges the gaps between a step's regions."""
    if "GOMP_SPINCOUNT" in env or "OMP_WAIT_POLICY" in env:
        return False
    env["GOMP_SPINCOUNT"] = OPENMP_SPIN
    return True


def _require(*modules: str) -> None:
    """Exit 2 with one line naming the extra to install when one of ``modules`` is missing."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            extra = _EXTRAS[name]
            console.error(f"prefixcache serve needs {name}: pip install 'prefixcache[{extra}]'")
            raise typer.Exit(EXIT_USAGE) from None


def register(app: typer.Typer) -> None:
    """Add the ``serve`` command to ``app`` (changes ``app`` only)."""

    @app.command("serve")
    def serve(
        model: str = typer.Option(
            "tiny",
            "--model",
            help="Built-in preset (tiny, small, tiny-hybrid, small-hybrid, tiny-vlm, small-vlm) or a local model "
            "directory.",
        ),
        max_cached_tokens: int | None = typer.Option(
            None,
            "--max-cached-tokens",
            min=1,
            help="KV pool size per process, in tokens (default 32768); it costs the model's K/V bytes per token "
            "x tokens, checked against the available memory before it is allocated.",
        ),
        block_size: int = typer.Option(16, "--block-size", min=1, help="Tokens per cached block."),
        max_cached_states: int | None = typer.Option(
            None,
            "--max-cached-states",
            min=1,
            help="Hybrid models: recurrent-state snapshots kept per process (default 64), besides one live state per "
            "running request; each costs the model's state bytes.",
        ),
        snapshot_interval: int = typer.Option(
            0,
            "--snapshot-interval",
            min=0,
            help="Hybrid models: also keep a state snapshot every N blocks of a prompt (0: only where the policy "
            "says: re-send points, shared prefixes' ends, chat messages' ends, request ends).",
        ),
        host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
        port: int = typer.Option(8000, "--port", min=1, max=65535, help="Port to listen on."),
        engine: bool = typer.Option(
            True,
            "--engine/--no-engine",
            help="Continuous batching on the paged engine (default); --no-engine: batched generate calls (what a "
            "model the engine cannot run gets anyway).",
        ),
        max_step_tokens: int | None = typer.Option(
            None, "--max-step-tokens", min=1, help="Engine: tokens in one step (decodes + prefill chunks; default 256)."
        ),
        max_chunk_tokens: int | None = typer.Option(
            None, "--max-chunk-tokens", min=1, help="Engine: prefill tokens one request gets per step (default 256)."
        ),
        max_running: int | None = typer.Option(
            None, "--max-running", min=1, help="Engine: requests running at once (default 32)."
        ),
        prefill_order: str | None = typer.Option(
            None,
            "--prefill-order",
            help="Engine: who gets the prefill budget first: shortest (fewest uncached tokens, aged; default) or "
            "arrival.",
        ),
        max_batch_size: int = typer.Option(
            8, "--max-batch-size", min=1, help="Without the engine: requests per batched generate."
        ),
        batch_wait_ms: float = typer.Option(
            5.0,
            "--batch-wait-ms",
            min=0.0,
            help="Without the engine: how long a batch waits for more requests to join, from its oldest request's "
            "arrival or the previous batch's end (the later).",
        ),
        max_tokens: int = typer.Option(
            256, "--default-max-tokens", min=1, help="Tokens a chat completion may generate when it names no limit."
        ),
        max_image_bytes: int = typer.Option(
            8 * 2**20,
            "--max-image-bytes",
            min=1,
            help="Image-text models: the largest image (encoded bytes of its data: URL) a chat message may carry.",
        ),
        max_queued_requests: int | None = typer.Option(
            None,
            "--max-queued-requests",
            min=1,
            help="Requests in flight (running and waiting) past which a new one gets 429 with Retry-After (default: "
            "no limit).",
        ),
        drain_timeout: int = typer.Option(
            30,
            "--drain-timeout",
            min=0,
            help="Seconds SIGTERM lets the requests in flight finish (new ones get 503, /health says draining) "
            "before it cancels the rest and exits 0.",
        ),
        debug_endpoints: bool = typer.Option(
            False,
            "--debug-endpoints",
            help="Serve GET /debug/cache: each replica's pool (free, cached, pinned blocks) and check_integrity(), "
            "for soak tests. Off by default.",
        ),
        seed: int = typer.Option(0, "--seed", help="Weight seed of a built-in preset."),
        dtype: str = typer.Option(
            "float32", "--dtype", help="The weights' and the cached K/V's dtype: float32, bfloat16 or float16."
        ),
        disk_cache: str | None = typer.Option(
            None, "--disk-cache", help="Directory of a disk tier below the pool (LMDB): evicted blocks stay there."
        ),
        disk_cache_size: str | None = typer.Option(
            None, "--disk-cache-size", help="The disk tier's budget, e.g. 50G (K/M/G/T: powers of 1024; default 8G)."
        ),
        shared_cache: str | None = typer.Option(
            None, "--shared-cache", help="Redis URL of a tier shared by every process pointing at it (redis://...)."
        ),
        replicas: int = typer.Option(
            1, "--replicas", min=1, help="N >= 2: N Ray Serve replicas, prefix-aware routing."
        ),
        address: str | None = typer.Option(
            None, "--address", help="Ray cluster to join (default: start a local Ray instance)."
        ),
        router: str = typer.Option(
            "prefix_balanced",
            "--router",
            help="Routing across replicas: round_robin, least_loaded, prefix, prefix_balanced (prefixcache.sim."
            "routing, run by PrefixAwareRouter) or ray_default (Ray Serve's power-of-two-choices router).",
        ),
        router_abs_threshold: float = typer.Option(
            64, "--router-abs-threshold", min=0.0, help="Load guard: queue difference that counts as imbalance."
        ),
        router_rel_threshold: float = typer.Option(
            1.5, "--router-rel-threshold", min=1.0, help="Load guard: queue ratio that counts as imbalance."
        ),
        router_min_match: float = typer.Option(
            0.3,
            "--router-min-match",
            min=0.0,
            max=1.0,
            help="prefix_balanced follows a cached prefix only if it covers this fraction of the prompt.",
        ),
    ) -> None:
        """Serve a model over an OpenAI-compatible HTTP API (completions, chat, streaming, /metrics).

        Examples:

          prefixcache serve --model tiny --port 8000

          prefixcache serve --model small --replicas 2 --max-cached-tokens 65536
        """
        if replicas > 1:
            from prefixcache.sim.routing import ROUTING_POLICIES

            known = [*ROUTING_POLICIES, "ray_default"]
            if router not in known:
                console.error(f"--router: unknown policy {router!r}; known: {', '.join(known)}")
                raise typer.Exit(EXIT_USAGE)
        if address is not None and replicas < 2:
            console.error("--address joins a Ray cluster: it needs --replicas N with N >= 2")
            raise typer.Exit(EXIT_USAGE)
        if dtype not in DTYPES:
            console.error(f"--dtype: unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
            raise typer.Exit(EXIT_USAGE)
        bound_openmp_spin(os.environ)  # before the engine (torch) is imported
        _require("fastapi", "uvicorn", "prometheus_client")
        from engine.serve import ServeConfig, run_local

        cfg = ServeConfig(
            model=model,
            max_cached_tokens=max_cached_tokens,
            block_size=block_size,
            host=host,
            port=port,
            max_batch_size=max_batch_size,
            batch_wait_ms=batch_wait_ms,
            default_max_tokens=max_tokens,
            max_image_bytes=max_image_bytes,
            max_queued_requests=max_queued_requests,
            drain_timeout=drain_timeout,
            debug_endpoints=debug_endpoints,
            seed=seed,
            dtype=dtype,
            use_engine=engine,
            max_step_tokens=max_step_tokens,
            max_chunk_tokens=max_chunk_tokens,
            max_running=max_running,
            prefill_order=prefill_order,
            disk_cache=disk_cache,
            disk_cache_size=disk_cache_size,
            shared_cache=shared_cache,
            max_cached_states=max_cached_states,
            snapshot_interval=snapshot_interval,
        )
        try:
            cfg.runtime_config()  # the engine's settings checked now, before a model loads
        except ValueError as exc:
            console.error(f"serve: {exc}")
            raise typer.Exit(EXIT_USAGE) from None
        if disk_cache is not None and shared_cache is not None:
            console.error("--disk-cache and --shared-cache: give one (one tier below the pool)")
            raise typer.Exit(EXIT_USAGE)
        if disk_cache_size is not None:
            try:
                parse_bytes(disk_cache_size, "--disk-cache-size")
            except ValueError as exc:
                console.error(str(exc))
                raise typer.Exit(EXIT_USAGE) from None
            if disk_cache is None:
                console.error("--disk-cache-size needs --disk-cache DIR")
                raise typer.Exit(EXIT_USAGE)
        try:
            if replicas == 1:
                status = run_local(cfg)
            else:
                _require("ray.serve")
                from engine.serve.ray_app import RayConfig, run_ray

                rcfg = RayConfig(
                    replicas, address, router, router_abs_threshold, router_rel_threshold, router_min_match
                )
                status = run_ray(cfg, rcfg, announce=console.info)
        except ValueError as exc:  # a bad model name or size, found while loading
            console.error(str(exc))
            raise typer.Exit(EXIT_USAGE) from None
        except RuntimeError as exc:  # a tier store that cannot be opened (engine.tier.StoreError)
            if type(exc).__name__ != "StoreError":
                raise
            console.error(str(exc))
            raise typer.Exit(EXIT_USAGE) from None
        raise typer.Exit(status)
