"""Writing a run record and its reports where the options say, with one status line each."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefixcache.cli import console
from prefixcache.cli.app import interrupted
from prefixcache.cli.options import stdout_taken
from prefixcache.reports import causes_report, cluster_report
from prefixcache.reports.document import Document, rich_table, write_html, write_markdown
from prefixcache.reports.record import RunRecord, save_record
from prefixcache.reports.run_report import document, summary


def write_run(
    record: RunRecord, json_out: Path | None, html: Path | None, markdown: Path | None, *, rendering: bool = False
) -> None:
    """Print the summary and the uncached tokens by cause, and write the requested files. A run this command just made that was interrupted
    exits 130 after writing (``rendering``: the record was loaded, not made, so it never does)."""
    if record.runs:
        to_stderr = stdout_taken(json_out, html, markdown)
        console.show(rich_table(summary(record)), to_stderr=to_stderr)
        if causes_report.analysed(record):
            console.show(rich_table(causes_report.cause_table(record)), to_stderr=to_stderr)
    else:
        console.info(f"{record.source}: the run holds no requests")
    if json_out is not None:
        where = save_record(record, json_out)
        console.info(f"run record written to {where}" + (" (partial)" if record.partial else ""))
    _write_documents(lambda: document(record), html, markdown)
    if record.partial and not rendering:
        raise interrupted()


def _write_documents(make: Any, html: Path | None, markdown: Path | None) -> None:
    """Build the document (only when asked for) and write it as HTML and/or Markdown."""
    if html is None and markdown is None:
        return
    doc: Document = make()
    if html is not None:
        console.info(f"HTML report written to {write_html(doc, html)}")
    if markdown is not None:
        console.info(f"Markdown report written to {write_markdown(doc, markdown)[0]}")


def write_cluster(record: dict[str, Any], json_out: Path | None, html: Path | None, markdown: Path | None) -> None:
    """Print the routers side by side and the per-replica table; write the requested files."""
    to_stderr = stdout_taken(json_out, html, markdown)
    console.show(rich_table(cluster_report.comparison(record)), to_stderr=to_stderr)
    console.show(rich_table(cluster_report.decisions(record)), to_stderr=to_stderr)
    console.show(rich_table(cluster_report.per_replica(record)), to_stderr=to_stderr)
    console.info(cluster_report.LOAD_NOTE)
    if json_out is not None:
        console.info(f"cluster record written to {cluster_report.save(record, json_out)}")
    _write_documents(lambda: cluster_report.document(record), html, markdown)
