"""``prefixcache report``: render a saved run record."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from prefixcache.cli import options as opt
from prefixcache.cli.app import app, user_errors
from prefixcache.cli.outputs import write_cluster, write_run
from prefixcache.reports import cluster_report
from prefixcache.reports.record import read_json, record_from_json


@app.command()
@user_errors
def report(
    run: Annotated[Path, typer.Argument(help="A run record (or a cluster record) written with --json.")],
    html: opt.HtmlOpt = None,
    markdown: opt.MarkdownOpt = None,
    json_out: opt.JsonOpt = None,
) -> None:
    """Render a saved run: a terminal summary, and optionally HTML and Markdown with plots."""
    opt.check_outputs(json_out, html, markdown)
    raw = read_json(run)
    if cluster_report.is_cluster_record(raw):
        write_cluster(cluster_report.check(raw, run), json_out, html, markdown)
    else:
        write_run(record_from_json(raw, run), json_out, html, markdown, rendering=True)
