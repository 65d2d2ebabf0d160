"""One report model rendered three ways: a terminal table (rich), self-contained HTML, Markdown + PNGs.

A :class:`Document` is a title, an optional warning and sections; a section holds paragraphs, tables and
figures (PNG bytes). The run report and the plan report both build one and hand it to :func:`write_html`
or :func:`write_markdown`, so the two look alike and share one stylesheet.
"""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass, field
from pathlib import Path

from rich.table import Table as RichTable
from rich.text import Text

from prefixcache.reports.output import check_output, write_output

CSS = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:62em;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:.3em .7em}
td:not(:first-child){text-align:right}th{background:#f3f3f3}img{max-width:100%}.warning{color:#b00}
p.note{color:#555;font-size:.9em}"""


@dataclass(frozen=True)
class Table:
    """A table of strings; the first column is a label, the others are right-aligned numbers, unless ``align``
    gives each column's alignment ("l" or "r", e.g. "lrrl")."""

    header: list[str]
    rows: list[list[str]]
    title: str = ""
    align: str | None = None

    def aligns(self) -> str:
        """Each column's alignment, "l" or "r"."""
        return self.align or "l" + "r" * (len(self.header) - 1)


@dataclass(frozen=True)
class Figure:
    """A plot: ``stem`` names its PNG file beside a Markdown report."""

    stem: str
    caption: str
    png: bytes


Block = str | Table | Figure  # a str is a paragraph of plain text


@dataclass
class Section:
    title: str
    blocks: list[Block] = field(default_factory=list)


@dataclass
class Document:
    title: str
    sections: list[Section] = field(default_factory=list)
    warning: str | None = None
    footer: str = ""

    def figures(self) -> list[Figure]:
        return [b for s in self.sections for b in s.blocks if isinstance(b, Figure)]


def rich_table(table: Table) -> RichTable:
    """A rich Table for the terminal."""
    t = RichTable(title=table.title or None, title_justify="left")
    for i, (h, a) in enumerate(zip(table.header, table.aligns())):
        t.add_column(h, justify="left" if a == "l" else "right", no_wrap=i == 0)
    for r in table.rows:
        t.add_row(*(Text(c) for c in r))  # plain text: a "[doc 7]" in a cell is not rich markup
    return t


def _html_table(t: Table) -> str:
    e = html.escape
    style = ["" if i and a == "r" else " style='text-align:left'" if i else "" for i, a in enumerate(t.aligns())]
    head = "<tr>" + "".join(f"<th>{e(h)}</th>" for h in t.header) + "</tr>"
    body = "".join("<tr>" + "".join(f"<td{st}>{e(c)}</td>" for c, st in zip(r, style)) + "</tr>" for r in t.rows)
    return f"<table>{head}{body}</table>"


def html_text(doc: Document) -> str:
    """The document as one self-contained HTML page (figures embedded as base64 PNG)."""
    e = html.escape
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{e(doc.title)}</title>",
        f"<style>{CSS}</style></head><body>",
        f"<h1>{e(doc.title)}</h1>",
    ]
    if doc.warning:
        parts.append(f"<p class='warning'>{e(doc.warning)}</p>")
    for s in doc.sections:
        if s.title:
            parts.append(f"<h2>{e(s.title)}</h2>")
        for b in s.blocks:
            if isinstance(b, Table):
                parts.append((f"<h3>{e(b.title)}</h3>" if b.title else "") + _html_table(b))
            elif isinstance(b, Figure):
                data = base64.b64encode(b.png).decode("ascii")
                parts.append(f"<img alt='{e(b.caption)}' src='data:image/png;base64,{data}'>")
            else:
                parts.append(f"<p class='note'>{e(b)}</p>")
    if doc.footer:
        parts.append(f"<p class='note'>{e(doc.footer)}</p>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_text(doc: Document, image_names: dict[str, str]) -> str:
    """The document as Markdown; ``image_names[stem]`` is the file each figure is linked to."""
    lines = [f"# {doc.title}", ""]
    if doc.warning:
        lines += [f"**{doc.warning}**", ""]
    for s in doc.sections:
        if s.title:
            lines += [f"## {s.title}", ""]
        for b in s.blocks:
            if isinstance(b, Table):
                if b.title:
                    lines += [f"### {b.title}", ""]
                align = "|" + "|".join("---:" if a == "r" else "---" for a in b.aligns()) + "|"
                lines += ["| " + " | ".join(_md_cell(h) for h in b.header) + " |", align]
                lines += ["| " + " | ".join(_md_cell(c) for c in r) + " |" for r in b.rows]
                lines.append("")
            elif isinstance(b, Figure):
                lines += [f"![{b.caption}]({image_names[b.stem]})", ""]
            else:
                lines += [b, ""]
    if doc.footer:
        lines += [doc.footer, ""]
    return "\n".join(lines)


def write_html(doc: Document, path: str | Path) -> str:
    """Write the document as self-contained HTML to ``path`` ("-": stdout). Returns where it went."""
    return write_output(path, html_text(doc))


def write_markdown(doc: Document, path: str | Path) -> list[str]:
    """Write the document as Markdown to ``path`` and its figures as PNG files beside it (``STEM_<figure>.png``).

    Returns the files written, the Markdown first. Refuses ("-" and devices included) with InputError a path
    that cannot take files beside it, before writing anything."""
    check_output(path, files_beside=True)
    path = Path(path)
    names = {f.stem: f"{path.stem}_{f.stem}.png" for f in doc.figures()}
    images = [write_output(path.with_name(names[f.stem]), f.png) for f in doc.figures()]
    return [write_output(path, markdown_text(doc, names)), *images]
