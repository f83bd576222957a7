"""The rank table as text (for print and repr) and as HTML (what a notebook shows)."""

from __future__ import annotations

import html


def text_table(columns, rows: list[list[str]], title: str | None = None) -> str:
    cells = [list(columns)] + rows
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(([title] if title else []) + lines)


def html_table(columns, rows: list[list[str]], title: str) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><caption>{html.escape(title)}</caption><tr>{head}</tr>{body}</table>"
