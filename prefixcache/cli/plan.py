"""The ``plan`` CLI command: hit rate at every capacity (one-pass LRU), other policies, the optimal bound,
and the capacity (blocks, tokens, GB) that reaches 50/70/90% of the achievable hit rate.

``register(app)`` adds the command to a typer app (prefixcache/cli.py calls it). It validates options and
hands off to prefixcache.plan (computing) and prefixcache.plan_report (rendering).
"""

from __future__ import annotations

from pathlib import Path

import typer

EXIT_USAGE = 2


def register(app: typer.Typer) -> None:
    """Add the ``plan`` command to ``app`` (changes ``app`` only)."""

    @app.command("plan")
    def plan(
        trace: Path = typer.Argument(
            ..., help="Hash-id trace (Mooncake JSONL, plain or .gz) or a scenario YAML that points to one."
        ),
        policy: list[str] | None = typer.Option(
            None,
            "--policy",
            "-p",
            help="Eviction policy to compare (repeatable; default lru). lru is computed at "
            "every capacity in one pass; others replay once per grid capacity.",
        ),
        model: str | None = typer.Option(
            None,
            "--model",
            help="Model for GB answers: preset (tiny, small) or a transformers config.json (or its folder).",
        ),
        layers: int | None = typer.Option(None, "--layers", min=1, help="Model layers (with --kv-heads, --head-dim)."),
        kv_heads: int | None = typer.Option(None, "--kv-heads", min=1, help="KV heads per layer."),
        head_dim: int | None = typer.Option(None, "--head-dim", min=1, help="Dimension of one head."),
        dtype: str | None = typer.Option(
            None, "--dtype", help="KV dtype: bf16, fp16, fp32, fp8 (default: the model's, else bf16)."
        ),
        warmup: float = typer.Option(
            0.0, "--warmup", min=0.0, max=0.99, help="Fraction of requests that only warm the cache (not measured)."
        ),
        order: str = typer.Option(
            "file", "--order", help="file, or timestamp (stable sort; interleaves kv-tester sessions)."
        ),
        weight: str = typer.Option(
            "tokens",
            "--weight",
            help="tokens (cached prompt tokens / prompt tokens) or blocks (hit blocks / looked-up blocks).",
        ),
        points: int = typer.Option(
            16, "--points", min=2, max=200, help="Capacities in the log grid (table, replayed policies, bound)."
        ),
        bound: bool = typer.Option(True, "--bound/--no-bound", help="Compute the optimal (Belady) bound."),
        keep_for: float | None = typer.Option(
            None,
            "--keep-for",
            min=0.0,
            help="Seconds each request asks the cache to keep its prefix (honoured by --policy priority; trace time).",
        ),
        block_size: int | None = typer.Option(
            None, "--block-size", min=1, help="Tokens per hash id (default: the trace's, else 512)."
        ),
        json_out: Path | None = typer.Option(None, "--json", help="Write the plan as JSON."),
        html_out: Path | None = typer.Option(None, "--html", help="Write a self-contained HTML report."),
        markdown_out: Path | None = typer.Option(None, "--markdown", help="Write Markdown (+ PNG beside it)."),
    ) -> None:
        """Hit rate against cache capacity: the LRU curve at every capacity, other policies side by side, the
        optimal bound, and the capacity (GB with a model) for 50/70/90% of the achievable hit rate."""
        from prefixcache.cli import console
        from prefixcache.core.errors import InputError
        from prefixcache.core.eviction import POLICIES
        from prefixcache.sim.curves import ORDERS, WEIGHTS
        from prefixcache.sim.kv_size import resolve_model
        from prefixcache.workload.scenario import load_scenario
        from prefixcache.workload.trace import is_trace_path, load_trace

        def fail(message: str) -> None:
            console.error(message)
            raise typer.Exit(EXIT_USAGE)

        policies = list(dict.fromkeys(policy or ["lru"]))
        bad = [p for p in policies if p not in POLICIES]
        if bad:
            fail(f"--policy {bad[0]!r}: unknown; known: {', '.join(sorted(POLICIES))}")
        if order not in ORDERS:
            fail(f"--order must be one of {', '.join(ORDERS)}, got {order!r}")
        if weight not in WEIGHTS:
            fail(f"--weight must be one of {', '.join(WEIGHTS)}, got {weight!r}")
        if keep_for is not None and "priority" not in policies:
            console.info("note: --keep-for only changes the 'priority' policy; add --policy priority")
        try:
            shape = resolve_model(model, layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
        except ValueError as exc:
            fail(str(exc))
        try:
            if is_trace_path(trace):
                tr = load_trace(trace, block_size)
            else:
                sc = load_scenario(trace)
                if sc.trace is None:
                    fail(
                        f"{trace}: plan needs a hash-id trace; this scenario has text/chat/token requests "
                        "(use `prefixcache simulate` with several --capacity values instead)"
                    )
                tr = sc.trace
                if block_size is not None and block_size != tr.block_size:
                    tr = load_trace(tr.path, block_size)
        except InputError as exc:
            fail(str(exc))
        from prefixcache.reports.plan_report import answer_table, curve_table, to_html, to_markdown, write_json
        from prefixcache.sim.plan import make_plan

        console.info(
            f"{trace}: {len(tr):,} requests, {tr.num_blocks:,} block references, block size "
            f"{tr.block_size}; policies {', '.join(policies)}{' + optimal bound' if bound else ''}"
        )
        try:
            result = make_plan(
                tr,
                policies=policies,
                weight=weight,
                warmup=warmup,
                order=order,
                points=points,
                bound=bound,
                model=shape,
                keep_for=keep_for,
                progress=console.info,
            )
        except ValueError as exc:
            fail(str(exc))
        console.console.print(curve_table(result))
        console.console.print(answer_table(result))
        secs = ", ".join(f"{k} {v:.2f}s" for k, v in result.seconds.items())
        console.info(f"time: {secs}")
        if json_out is not None:
            console.info(f"JSON written to {write_json(result, json_out)}")
        if html_out is not None:
            console.info(f"HTML report written to {to_html(result, html_out)}")
        if markdown_out is not None:
            md, png = to_markdown(result, markdown_out)
            console.info(f"Markdown written to {md} (plot {png})")
