"""The ``eval`` CLI command: lm-evaluation-harness on the ``prefixcache`` model. Every argument goes to lm-eval's own
command line unchanged (``prefixcache eval --help`` is lm-eval's help), except that ``--model`` defaults to
``prefixcache`` (lm-eval's own default, ``hf``, would run uncached without a word) and another model is refused with
the reason. ``register(app)`` adds it to the typer app. lm-eval and the engine are imported only inside the command; without lm-eval it prints one line
naming the extra to install and exits 2, as it does for a ValueError (an unknown task, a bad model path)."""

import importlib

import typer

from prefixcache.cli import console

EXIT_USAGE = 2
MODEL = "prefixcache"


def with_model(args: list[str]) -> list[str]:
    """lm-eval's arguments with ``--model prefixcache`` added when no ``--model`` is given; ValueError naming the
    model when another one is (it would not use the cache: run ``lm_eval`` for that)."""
    for i, arg in enumerate(args):
        if arg == "--model" or arg.startswith("--model="):
            name = arg.partition("=")[2] if "=" in arg else (args[i + 1] if i + 1 < len(args) else "")
            if name != MODEL:
                raise ValueError(
                    f"prefixcache eval runs lm-eval's --model {MODEL} (the prefix cache); got --model {name or '(none)'}"
                    f". For another lm-eval model, which would not use the cache, run lm_eval itself"
                )
            return args
    if any(a in ("-h", "--help") for a in args):
        return args
    return ["--model", MODEL, *args]


def register(app: typer.Typer) -> None:
    """Add the ``eval`` command to ``app`` (changes ``app`` only)."""

    @app.command(
        "eval",
        add_help_option=False,  # --help is lm-eval's
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )
    def eval_(ctx: typer.Context) -> None:
        """Run lm-evaluation-harness on --model prefixcache (the default here; every other argument is lm-eval's,
        --help shows its options): scores and generations as --model hf gives them, shared prefixes computed once.

        Examples:

          prefixcache eval --model_args pretrained=DIR,max_cached_tokens=65536 --tasks arc_easy

          prefixcache eval --model_args pretrained=small --tasks mytask --include_path TASKDIR
        """
        try:
            importlib.import_module("lm_eval")
        except ImportError:
            console.error("prefixcache eval needs lm-eval: pip install 'prefixcache[eval]'")
            raise typer.Exit(EXIT_USAGE) from None
        try:
            args = with_model(list(ctx.args))
        except ValueError as exc:
            console.error(str(exc))
            raise typer.Exit(EXIT_USAGE) from None
        from engine.lm_eval_model import cli_main

        try:
            status = cli_main(args)
        except ValueError as exc:  # lm-eval's and the model's user errors: an unknown task, a bad model path
            console.error(str(exc))
            raise typer.Exit(EXIT_USAGE) from None
        raise typer.Exit(status)
