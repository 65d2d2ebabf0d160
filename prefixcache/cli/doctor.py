"""The ``doctor`` CLI command: the installed versions, and for each model given (a preset or a local folder) which
paths are cached exactly on this install, which run uncached and why (``engine.doctor``), as tables and as JSON.
``register(app)`` adds it to the typer app; torch, transformers and the engine are imported only inside it."""

import importlib.util
import json
from typing import Any

import typer

from prefixcache.cli import console
from prefixcache.reports.output import check_output, write_output

EXIT_USAGE = 2
DEFAULT_MODELS = ("tiny", "tiny-hybrid")


def _tables(found: dict[str, Any]) -> list[Any]:
    from rich.table import Table

    versions = Table("package", "version", title="installed")
    for name, version in found["versions"].items():
        versions.add_row(name, version)
    out: list[Any] = [versions]
    if found.get("cpu_kernels"):
        kernels = Table("part", "on this CPU", title="the engine's kernels")
        for part, how in found["cpu_kernels"].items():
            kernels.add_row(part, how)
        out.append(kernels)
    for m in found["models"]:
        t = Table(
            "path",
            "status",
            "why",
            title=f"{m['model']} ({m['class']}, {m['dtype']} on {m['device']}; wrapped in {m['wrap_seconds']:.2f} s, "
            f"of which the check at load {m['load_check_seconds']:.2f} s; engine made in {m['engine_seconds']:.2f} s)",
        )
        for p in m["paths"]:
            t.add_row(p["path"], p["status"], p["reason"] or "")
        out.append(t)
    return out


def register(app: typer.Typer) -> None:
    """Add the ``doctor`` command to ``app`` (changes ``app`` only)."""

    @app.command("doctor")
    def doctor(
        model: list[str] = typer.Option(
            list(DEFAULT_MODELS),
            "--model",
            help="A preset (tiny, small, tiny-hybrid, small-hybrid) or a local Hugging Face model folder; repeat for "
            "several (default: tiny and tiny-hybrid).",
        ),
        device: str | None = typer.Option(None, "--device", help="Where to put the model (default: cuda if any)."),
        dtype: str | None = typer.Option(None, "--dtype", help="float32, bfloat16 or float16 (default: the model's)."),
        json_out: str | None = typer.Option(None, "--json", help="Also write the findings as JSON here ('-': stdout)."),
    ) -> None:
        """Which paths are cached exactly with the installed torch and transformers, per model, and why any is not:
        each model is wrapped as a user's is, so the check at load and the engine's probe decide, not a version
        list.

        Examples:

          prefixcache doctor

          prefixcache doctor --model small-hybrid --model ./my-model --json doctor.json
        """
        if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
            console.error("prefixcache doctor needs the model side: pip install 'prefixcache[hf]' torch==2.13.0")
            raise typer.Exit(EXIT_USAGE) from None
        try:
            if json_out is not None and json_out != "-":
                check_output(json_out)
            from engine.doctor import report

            found = report(list(model), device=device, dtype=dtype)
        except (ValueError, OSError) as exc:
            console.error(str(exc))
            raise typer.Exit(EXIT_USAGE) from None
        if json_out != "-":
            for table in _tables(found):
                console.show(table)
        if json_out is not None:
            write_output(json_out, json.dumps(found, indent=2) + "\n")
