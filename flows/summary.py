"""What a pipeline run prints at its end (`featcal demo`, `featcal run`, `featcal evaluate`): the
per-task accuracy table (plain text, monospace) and where the full record is."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from featcal_core.report.figures import Figure, headline_lines, summary_figures
from featcal_core.report.tables import cut_rows, evaluated_rows

#: columns in display order: (evaluation row name, header)
COLUMNS = (
    ("expert", "expert"),
    ("merged", "merged"),
    ("calibrated", "calibrated"),
    ("calibrated_heads", "calib+heads"),
)


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}"


def _gap(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f} %"


def accuracy_table(evaluation: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> str:
    """Accuracy (%) per task of the expert, merged and calibrated models (and the calibrated model
    with refit heads when present), normalized accuracy (÷ expert) of the calibrated ones, and
    the share of the merged→expert gap closed; then the average over tasks; then the headline
    (`headline_lines`, the lines the report, the model card, metrics.json and MLflow share)."""
    figures = summary_figures(evaluation)
    present = [(key, head) for key, head in COLUMNS if key in figures.rows]
    normalized = [key for key, _ in present if key not in ("expert", "merged")]
    headers = (
        ["task"] + [h for _, h in present] + [f"norm {h}" for k, h in present if k in normalized]
    )
    headers += [f"gap closed {h}" for k, h in present if k in normalized]
    rows = []
    for task in figures.tasks:
        values = figures.per_task.get(task, {})
        rows.append(
            [task]
            + [_pct((values.get(key) or {}).get("accuracy")) for key, _ in present]
            + [_pct((values.get(key) or {}).get("normalized")) for key in normalized]
            + [_gap((values.get(key) or {}).get("gap_closed")) for key in normalized]
        )
    if rows:
        rows.append(
            ["average"]
            + [_pct(_value(figures.accuracy, key)) for key, _ in present]
            + [_pct(_value(figures.normalized, key)) for key in normalized]
            + [_gap(_value(figures.gap_closed, key)) for key in normalized]
        )
    counted = evaluated_rows(evaluation)  # the rows behind the numbers (max_examples_per_task)
    where = f"the evaluation split ({counted})" if counted else "the evaluation split"
    where = cut_rows(evaluation) or where
    text = f"accuracy (%) on {where}\n" + plain_table(headers, rows)
    headline = headline_lines(figures)
    return text + ("\n\n" + "\n".join(headline) if headline else "")


def _value(found: Mapping[str, Figure], key: str) -> float | None:
    return found[key].value if key in found else None


def plain_table(headers: list[str], rows: list[list[str]], left: int = 1) -> str:
    """A monospace table: the first `left` columns left-aligned, the others right-aligned."""
    widths = [max(len(str(c)) for c in column) for column in zip(headers, *rows, strict=True)]

    def line(cells):
        return "  ".join(
            c.ljust(w) if i < left else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *map(line, rows)])


def selection_summary(record: Mapping[str, Any]) -> str:
    """The select step's choice and every candidate's score (plain text)."""
    from featcal_core.report.selection import selection_lines, selection_table

    headers, rows = selection_table(record)
    text = "\n".join(selection_lines(record))
    return text + ("\n" + plain_table(headers, rows, left=4) if rows else "")


def run_summary(summary: Mapping[str, Any]) -> str:
    """The accuracy table of a `run_pipeline` summary, then where the report, the MLflow run and
    the results are (the full record: `featcal run --json`)."""
    lines = [""]
    if summary.get("selection"):
        lines += [selection_summary(summary["selection"]), ""]
    lines += [accuracy_table(summary.get("evaluation") or {}), ""]
    if summary.get("report"):
        lines.append(f"report:      {shown(summary['report'])}")
    if summary.get("mlflow_run_id"):
        lines.append(f"MLflow run:  {summary['mlflow_run_id']} ({_browse(summary)})")
    lines.append(f"results:     {shown(summary['paths']['root'])}")
    return "\n".join(lines)


def _browse(summary: Mapping[str, Any], code: str = "") -> str:
    """Where to look at the run: `browse: <command>` (featcal.tracking.store.browse_command, each
    of its words as printed, `code` around it), `on <server>`, or the store's URI."""
    from featcal.tracking.store import browse_command

    uri = str(summary.get("mlflow_uri"))
    command = browse_command(uri)
    if command is None:
        return f"{code}{uri}{code}"
    if command == uri:
        return f"on {code}{uri}{code}"
    return f"browse: {code}{command}{code}"


def shown(path: str | Path) -> str:
    """`path` as printed: relative to the working directory (the project) when inside it."""
    path = Path(path)
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def markdown_summary(summary: Mapping[str, Any]) -> str:
    """The Prefect artifact of a pipeline run (markdown): the accuracy table, then links to the
    report and where the MLflow run and the results are."""
    lines = [f"# featcal run {summary.get('name', '')}".rstrip(), ""]
    if summary.get("selection"):
        lines += ["```", selection_summary(summary["selection"]), "```", ""]
    if summary.get("evaluation"):
        lines += ["```", accuracy_table(summary["evaluation"]), "```", ""]
    else:
        lines += ["no evaluation in this run (evaluation.enabled: false)", ""]
    calibration = summary.get("calibration")
    if calibration:
        lines.append(
            f"- calibration: {calibration['blocks']} blocks "
            f"({calibration['restored']} restored from the cache), "
            f"{calibration['wall_seconds']:.1f} s"
        )
    if summary.get("report"):
        report = Path(summary["report"])
        lines.append(f"- report: [{report.name}]({report.as_uri()}) ({report})")
    if summary.get("mlflow_run_id"):
        lines.append(f"- MLflow run: `{summary['mlflow_run_id']}` ({_browse(summary, '`')})")
    lines.append(f"- results: `{summary['paths']['root']}`")
    return "\n".join(lines) + "\n"
