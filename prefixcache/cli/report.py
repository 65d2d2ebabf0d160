"""``prefixcache report``: render a saved run record."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from prefixcache.cli import options as opt
from prefixcache.cli.app import app, user_errors
from prefixcache.cli.outputs import write_run
from prefixcache.reports.record import load_record


@app.command()
@user_errors
def report(
    run: Annotated[Path, typer.Argument(help="A run record written with --json.")],
    html: opt.HtmlOpt = None,
    markdown: opt.MarkdownOpt = None,
    json_out: opt.JsonOpt = None,
) -> None:
    """Render a saved run: a terminal summary, and optionally HTML and Markdown with plots."""
    opt.check_outputs(json_out, html, markdown)
    record = load_record(run)
    write_run(record, json_out, html, markdown, rendering=True)
