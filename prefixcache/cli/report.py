"""``prefixcache report``: render a saved run record."""

from pathlib import Path
from typing import Annotated, Any

import typer

from prefixcache.cli import options as opt
from prefixcache.cli.app import app, user_errors
from prefixcache.cli.outputs import write_cluster, write_run
from prefixcache.reports import cluster_report
from prefixcache.reports.record import RunRecord, read_json, record_from_json


@app.command()
@user_errors
def report(
    run: Annotated[Path, typer.Argument(metavar="RUN", help="A run record (or a cluster record) written with --json.")],
    html: opt.HtmlOpt = None,
    markdown: opt.MarkdownOpt = None,
    json_out: opt.JsonOpt = None,
) -> None:
    """Render a saved run: a terminal summary, and optionally HTML and Markdown with plots."""
    opt.check_outputs(json_out, html, markdown)
    record = _load_any(run)
    if isinstance(record, RunRecord):
        write_run(record, json_out, html, markdown, rendering=True)
    else:
        write_cluster(record, json_out, html, markdown)


def _load_any(path: Path) -> RunRecord | dict[str, Any]:
    """The run record at ``path``, or the cluster record (``simulate --replicas``). Raises InputError."""
    raw = read_json(path)
    if cluster_report.is_cluster_record(raw):
        return cluster_report.check(raw, path)
    return record_from_json(raw, path)
