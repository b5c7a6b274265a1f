"""report.md: the report rendered as markdown (no raw HTML; cells escaped)."""

from __future__ import annotations

from collections.abc import Sequence

from featcal_core.report.sections import _Section
from featcal_core.report.tables import _COLUMNS, _cells


def _md(text: str) -> str:
    """Text for a markdown table cell or line: no raw HTML, no column breaks, one line."""
    text = " ".join(str(text).splitlines())
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("<", "\\<")


def _md_table(
    header: Sequence[str],
    rows: Sequence[Sequence[str]],
    bold_last: bool = False,
    numeric: bool = False,
) -> str:
    """A markdown table; `numeric`: every column but the first right-aligned."""
    align = "---:" if numeric else ":---"
    lines = [
        "| " + " | ".join(_md(h) for h in header) + " |",
        "|" + "|".join([":---"] + [align] * (len(header) - 1)) + "|",
    ]
    for i, row in enumerate(rows):
        cells = [_md(c) for c in row]
        if bold_last and i == len(rows) - 1:
            cells = [f"**{c}**" for c in cells]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _md_section(section: _Section) -> str:
    parts = [f"## {_md(section.title)}"]
    if section.lines:
        prefix = "- " if section.bullets else ""
        parts.append("\n".join(prefix + _md(line) for line in section.lines))
    parts.extend(_md_table(header, rows) for header, rows in section.tables)
    return "\n\n".join(parts)


def _markdown(run_name, summary, headline, rows, notes, plots, sections, caption) -> str:
    parts = [f"# FeatCal report: {_md(run_name)}", _md(summary)]
    if headline:
        parts.append("\n".join(f"- {_md(line)}" for line in headline))
    parts.append("## Accuracy per task")
    parts.append(_md(caption))
    if rows:
        parts.append(_md_table(_COLUMNS, [_cells(r) for r in rows], bold_last=True, numeric=True))
    if notes:
        parts.append("\n".join(f"- {_md(n)}" for n in notes))
    parts.append("## Plots")
    parts.extend(f"![{alt}]({name})" for name, alt in plots)
    if not any(name == "drift.png" for name, _ in plots):
        parts.append("No drift plot: there is no calibration record with blocks.")
    parts.extend(_md_section(s) for s in sections)
    return "\n\n".join(parts) + "\n"
