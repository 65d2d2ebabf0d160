"""Writing a run record and its reports where the options say, with one status line each."""

from __future__ import annotations

from pathlib import Path

from prefixcache.cli import console
from prefixcache.cli.app import interrupted
from prefixcache.cli.options import stdout_taken
from prefixcache.reports.document import rich_table, write_html, write_markdown
from prefixcache.reports.record import RunRecord, save_record
from prefixcache.reports.run_report import document, summary


def write_run(
    record: RunRecord, json_out: Path | None, html: Path | None, markdown: Path | None, *, rendering: bool = False
) -> None:
    """Print the summary and write the requested files. A run this command just made that was interrupted
    exits 130 after writing (``rendering``: the record was loaded, not made, so it never does)."""
    if record.runs:
        console.show(rich_table(summary(record)), to_stderr=stdout_taken(json_out, html, markdown))
    else:
        console.info(f"{record.source}: the run holds no requests")
    if json_out is not None:
        where = save_record(record, json_out)
        console.info(f"run record written to {where}" + (" (partial)" if record.partial else ""))
    if html is not None or markdown is not None:
        doc = document(record)
        if html is not None:
            console.info(f"HTML report written to {write_html(doc, html)}")
        if markdown is not None:
            console.info(f"Markdown report written to {write_markdown(doc, markdown)[0]}")
    if record.partial and not rendering:
        raise interrupted()
