"""report.html: the report rendered as one self-contained HTML page (inline CSS; text
escaped)."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

from featcal_core.report.sections import _Section
from featcal_core.report.tables import _COLUMNS, _cells

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; max-width: 72rem;
       margin: 2rem auto; padding: 0 1rem; color: #222; line-height: 1.45; }
h1 { font-size: 1.6rem; } h2 { font-size: 1.25rem; margin-top: 2rem;
     border-bottom: 1px solid #ddd; padding-bottom: .2rem; }
table { border-collapse: collapse; margin: .8rem 0; font-size: .92rem; }
th, td { border: 1px solid #ccc; padding: .3rem .6rem; }
th { background: #f3f3f3; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.avg td { font-weight: bold; background: #fafafa; }
img { max-width: 100%; height: auto; display: block; margin: .8rem 0; }
.summary { font-size: 1.05rem; }
.note { color: #555; font-size: .9rem; }
code { font-size: .88rem; }
""".strip()


def _h(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _html_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], numeric_from: int = 1, avg_last=False
) -> str:
    out = [
        "<table>",
        "<thead><tr>" + "".join(f"<th>{_h(c)}</th>" for c in header) + "</tr></thead>",
    ]
    out.append("<tbody>")
    for i, row in enumerate(rows):
        cls = ' class="avg"' if avg_last and i == len(rows) - 1 else ""
        cells = "".join(
            f'<td class="num">{_h(c)}</td>' if j >= numeric_from else f"<td>{_h(c)}</td>"
            for j, c in enumerate(row)
        )
        out.append(f"<tr{cls}>{cells}</tr>")
    out.append("</tbody></table>")
    return "\n".join(out)


def _html_section(section: _Section) -> str:
    parts = [f"<h2>{_h(section.title)}</h2>"]
    if section.lines:
        if section.bullets:
            parts.append("<ul>" + "".join(f"<li>{_h(x)}</li>" for x in section.lines) + "</ul>")
        else:
            parts.extend(f"<p>{_h(x)}</p>" for x in section.lines)
    parts.extend(_html_table(header, rows, numeric_from=99) for header, rows in section.tables)
    return "\n".join(parts)


def _html(run_name, summary, headline, rows, notes, plots, sections, caption) -> str:
    title = f"FeatCal report: {run_name}"
    body = [f"<h1>{_h(title)}</h1>", f'<p class="summary">{_h(summary)}</p>']
    if headline:
        body.append(
            '<ul class="summary">' + "".join(f"<li>{_h(x)}</li>" for x in headline) + "</ul>"
        )
    body.append("<h2>Accuracy per task</h2>")
    body.append(f'<p class="note">{_h(caption)}</p>')
    if rows:
        body.append(_html_table(_COLUMNS, [_cells(r) for r in rows], avg_last=True))
    if notes:
        body.append('<ul class="note">' + "".join(f"<li>{_h(n)}</li>" for n in notes) + "</ul>")
    body.append("<h2>Plots</h2>")
    body.extend(f'<img src="{_h(name)}" alt="{_h(alt)}">' for name, alt in plots)
    if not any(name == "drift.png" for name, _ in plots):
        body.append("<p>No drift plot: there is no calibration record with blocks.</p>")
    body.extend(_html_section(s) for s in sections)
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{_h(title)}</title>\n<style>\n{_CSS}\n</style>\n</head>\n<body>\n"
        + "\n".join(body)
        + "\n</body>\n</html>\n"
    )
