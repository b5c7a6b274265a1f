"""What a pipeline run prints at its end (`featcal demo`, `featcal run`, `featcal evaluate`): the
per-task accuracy table (plain text, monospace) and where the full record is."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from featcal_core.report import gap_closed
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


def accuracy_table(evaluation: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> str:
    """Accuracy (%) per task of the expert, merged and calibrated models (and the calibrated model
    with refit heads when present), normalized accuracy (÷ expert) of the calibrated ones, and
    the share of the merged→expert gap closed; then the average over tasks."""
    present = [
        (key, head) for key, head in COLUMNS if any(key in row for row in evaluation.values())
    ]
    normalized = [key for key, _ in present if key not in ("expert", "merged")]
    headers = (
        ["task"] + [h for _, h in present] + [f"norm {h}" for k, h in present if k in normalized]
    )
    headers += [f"gap closed {h}" for k, h in present if k in normalized]
    rows, sums = [], {key: [] for key, _ in present}
    for task, models in evaluation.items():
        acc = {key: (models.get(key) or {}).get("accuracy") for key, _ in present}
        for key in acc:
            sums[key].append(acc[key])
        rows.append(_cells(task, acc, present, normalized))
    if rows:
        mean = {k: (sum(v) / len(v) if v and None not in v else None) for k, v in sums.items()}
        rows.append(_cells("average", mean, present, normalized))
    counted = evaluated_rows(evaluation)  # the rows behind the numbers (max_examples_per_task)
    where = f"the evaluation split ({counted})" if counted else "the evaluation split"
    where = cut_rows(evaluation) or where
    return f"accuracy (%) on {where}\n" + plain_table(headers, rows)


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


def _cells(label, acc, present, normalized) -> list[str]:
    expert, merged = acc.get("expert"), acc.get("merged")
    cells = [str(label)] + [_pct(acc[key]) for key, _ in present]
    for key in normalized:
        value = acc[key] / expert if acc[key] is not None and expert else None
        cells.append(_pct(value))
    for key in normalized:
        gap = gap_closed(merged, acc[key], expert)
        cells.append("—" if gap is None else f"{gap:.0f} %")
    return cells


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
        lines.append(
            f"MLflow run:  {summary['mlflow_run_id']} ({summary.get('mlflow_uri')}; "
            "browse with `mlflow ui --backend-store-uri <uri>`)"
        )
    lines.append(f"results:     {shown(summary['paths']['root'])}")
    return "\n".join(lines)


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
        lines.append(f"- MLflow run: `{summary['mlflow_run_id']}` ({summary.get('mlflow_uri')})")
    lines.append(f"- results: `{summary['paths']['root']}`")
    return "\n".join(lines) + "\n"
