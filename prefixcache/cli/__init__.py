"""The ``prefixcache`` command: a thin layer that validates options and hands off, one module per command.

simulate (model-free), explain (why prefill was not saved), plan (capacity planning), replay (through a
model; engine is imported lazily, only there), report, serve, eval (lm-evaluation-harness through the cache), doctor (which paths are exact on this install).
User errors print one clear line and exit with code 2; Ctrl-C stops a run cleanly, writes the partial run
(marked ``"partial": true``) and exits with 130.
"""

from __future__ import annotations

from prefixcache.cli import doctor as doctor_cli
from prefixcache.cli import eval as eval_cli
from prefixcache.cli import explain, plan, replay, report, simulate  # noqa: F401  (each registers its command)
from prefixcache.cli import serve as serve_cli
from prefixcache.cli.app import app

serve_cli.register(app)  # the engine, FastAPI and Ray load only inside the command
eval_cli.register(app)  # lm-eval and the engine load only inside the command
doctor_cli.register(app)  # torch, transformers and the engine load only inside the command


def main() -> None:
    """Console-script entry point."""
    app()


__all__ = ["app", "main"]
